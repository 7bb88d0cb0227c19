//! Wrapper of `kernels/prefetch.wgsl`: warm a byte range (or the ranges of the experts a router
//! chose) in the GPU's L2 cache beside another kernel, for the kernel after it.

use super::buffers::{Binding, BufRef};
use super::context::{GpuContext, GpuError};
use super::ops::{recordable, Dispatch};

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct Params {
    words: u32,
    base: u32,
    mat_stride: u32,
    ids_off: u32,
    n_mats: u32,
    magic: u32,
    _pad: [u32; 2],
}

/// Invocations per workgroup and 32-byte sectors each touches (the kernel's `WG` and `PER`).
const SECTORS_PER_GROUP: u64 = 256 * 8;
/// The value whose xor would be written out: any constant will do (a match only writes to the
/// wrapper's own sink).
const MAGIC: u32 = 0x9e37_79b9;

/// Stacked matrices chosen by ids on the GPU (`Grouped` of a matvec): slot `s` touches the range
/// `ids[s] · mat_stride` bytes after the first one; ids ≥ `n_mats` are skipped.
#[derive(Clone, Copy, Debug)]
pub struct PrefetchGroups<'a> {
    pub ids: BufRef<'a>,
    pub n_slots: usize,
    pub n_mats: usize,
    pub mat_stride: u64,
}

/// A prepared prefetch. It binds the range read-only and writes only a buffer of its own, so
/// recorded after a kernel that does not write the range, wgpu puts no barrier between the two
/// and they run together; the dispatch after the prefetch waits for both.
pub struct Prefetch {
    d: Dispatch,
    _sink: wgpu::Buffer,
}

impl Prefetch {
    /// `bytes` of `buffer` from `offset` (a multiple of 4); with `groups`, one such range per
    /// slot, each `mat_stride · ids[slot]` bytes further on.
    pub fn new(
        ctx: &GpuContext,
        buffer: &wgpu::Buffer,
        offset: u64,
        bytes: u64,
        groups: Option<PrefetchGroups>,
    ) -> Result<Self, GpuError> {
        let err = |m: String| GpuError::Shape(format!("prefetch of {bytes} bytes: {m}"));
        if offset % 4 != 0 || bytes == 0 || bytes % 4 != 0 {
            return Err(err(
                "offset and length must be multiples of 4, length > 0".into()
            ));
        }
        let (span, slots, n_mats, stride) = match groups {
            Some(g) => {
                if g.mat_stride % 4 != 0 || g.n_slots == 0 || g.n_mats == 0 {
                    return Err(err(
                        "a stride of a multiple of 4, slots and matrices > 0".into()
                    ));
                }
                let span = (g.n_mats as u64 - 1) * g.mat_stride + bytes;
                (span, g.n_slots, g.n_mats, g.mat_stride)
            }
            None => (bytes, 1, 1, 0),
        };
        let (wb, base) = BufRef::at(buffer, offset)
            .bind(ctx, "prefetch range", (span / 4) as usize, 4)
            .map_err(|e| err(e.to_string()))?;
        let sink = ctx.storage_buffer("prefetch sink", 4 * 256);
        let ids_fallback;
        let (ib, ids_off) = match groups {
            Some(g) => g.ids.bind(ctx, "prefetch ids", g.n_slots, 4)?,
            None => {
                ids_fallback = ctx.storage_buffer("prefetch ids (unused)", 16);
                (Binding::whole(&ids_fallback), 0)
            }
        };
        let p = Params {
            words: (bytes / 4) as u32,
            base,
            mat_stride: (stride / 4) as u32,
            ids_off,
            n_mats: n_mats as u32,
            magic: MAGIC,
            _pad: [0; 2],
        };
        let sectors = bytes.div_ceil(32);
        let groups_x = sectors.div_ceil(SECTORS_PER_GROUP) as usize;
        let grouped = groups.is_some() as u8 as f64;
        let bufs = [wb, ib, Binding::whole(&sink)];
        let d = Dispatch::new(
            ctx,
            "prefetch",
            &[("GROUPED", grouped)],
            &p,
            &bufs,
            [groups_x, slots, 1],
        )?;
        Ok(Prefetch { d, _sink: sink })
    }
}
recordable!(Prefetch, "prefetch", d);
