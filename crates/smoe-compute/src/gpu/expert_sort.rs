//! Wrapper of `kernels/expert_sort.wgsl`: groups a prefill chunk's routed slots by expert, for
//! the grouped `MatMul`.

use super::buffers::{Binding, BufRef};
use super::context::{GpuContext, GpuError};
use super::ops::{recordable, Dispatch};

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct Params {
    n_slots: u32,
    n_mats: u32,
    ids_off: u32,
    max_units: u32,
}

/// Most experts a sort handles (an expert id takes 12 bits of a work unit, and the bucket of
/// skipped slots, `n_mats`, must fit them too); workgroup memory limits them further (a counter
/// per expert: about 3,500 at 16 KiB).
pub const SORT_MAX_EXPERTS: usize = 4095;
/// Most slots a sort handles (20 bits of a work unit's tile index).
pub const SORT_MAX_SLOTS: usize = 1 << 20;

/// From `ids` (`[n_slots]` u32: slot `t·k + j` holds the expert of token `t`'s j-th choice, each
/// `< n_mats`) writes, in buffers it owns:
/// - `starts`: `[n_mats + 1]` u32, where expert `e`'s slots begin in `perm` (`starts[n_mats]` is
///   `n_slots`);
/// - `perm`: `[n_slots]` u32, the slot indices grouped by expert (within an expert in no fixed
///   order: the grouped GEMMs compute each slot's row alone, the same wherever it sits);
/// - `units`: the grouped `MatMul`'s work list for token tiles of `tile` slots: word 0 the
///   count of units, word `1 + u` unit `u` = `(e << 20) | i`, the `i`-th tile of expert `e`
///   (`perm[starts[e] + i·tile ..]`, at most `tile` slots), ordered by `(e, i)`: every expert
///   with `c > 0` slots has `ceil(c / tile)` units. The GEMM runs one workgroup per unit, so a
///   popular expert's tiles run side by side instead of one after another.
///
/// What the GEMMs compute from it is deterministic. A slot whose id is `≥ n_mats` is skipped: it sorts
/// after all others (`perm[starts[n_mats]..]`; `starts[n_mats]` is then the count of the other
/// slots) and gets no work unit, so a grouped `MatMul` leaves its output rows as they were.
/// The streaming GPU decoder uses that to run a batch's experts in rounds when they do not all
/// fit its VRAM slots at once.
pub struct ExpertSort {
    d: Dispatch,
    starts: wgpu::Buffer,
    perm: wgpu::Buffer,
    units: wgpu::Buffer,
    n_slots: usize,
    n_mats: usize,
    tile: usize,
}

impl ExpertSort {
    /// `tile`: the token tile (`MatMulTuning::bn`) of the grouped GEMMs that will use this
    /// sort; `MatMulTuning::grouped_bn` is `MatMul::new`'s choice.
    pub fn new(
        ctx: &GpuContext,
        ids: BufRef,
        n_slots: usize,
        n_mats: usize,
        tile: usize,
    ) -> Result<Self, GpuError> {
        let limits = ctx.limits();
        if n_slots == 0 || n_mats == 0 || n_mats > SORT_MAX_EXPERTS || n_slots > SORT_MAX_SLOTS {
            return Err(GpuError::Shape(format!(
                "expert sort: {n_slots} slots over {n_mats} experts \
                 (1..={SORT_MAX_SLOTS} slots, 1..={SORT_MAX_EXPERTS} experts)"
            )));
        }
        if tile == 0 || tile > SORT_MAX_SLOTS {
            return Err(GpuError::Shape(format!(
                "expert sort: tile of {tile} slots (1..={SORT_MAX_SLOTS})"
            )));
        }
        // A counter per bucket and two scan words per invocation in workgroup memory.
        let wg = 256.min(
            (limits.max_compute_invocations_per_workgroup as usize)
                .min(limits.max_compute_workgroup_size_x as usize),
        );
        let words = n_mats + 1 + 2 * wg;
        if 4 * words > limits.max_compute_workgroup_storage_size as usize {
            return Err(GpuError::Shape(format!(
                "expert sort: {n_mats} experts need {} bytes of workgroup memory, the device has {}",
                4 * words,
                limits.max_compute_workgroup_storage_size
            )));
        }
        let (ib, ids_off) = ids.bind(ctx, "expert sort ids", n_slots, 4)?;
        let starts = ctx.storage_buffer("expert sort starts", 4 * (n_mats as u64 + 1));
        let perm = ctx.storage_buffer("expert sort perm", 4 * n_slots as u64);
        let max_units = Self::units_bound(n_slots, n_mats, tile);
        let units = ctx.storage_buffer("expert sort units", 4 * (1 + max_units as u64));
        let p = Params {
            n_slots: n_slots as u32,
            n_mats: n_mats as u32,
            ids_off,
            max_units: max_units as u32,
        };
        let d = Dispatch::new(
            ctx,
            "expert_sort",
            &[
                ("NB", (n_mats + 1) as f64),
                ("WG", wg as f64),
                ("TILE", tile as f64),
            ],
            &p,
            &[
                ib,
                Binding::whole(&starts),
                Binding::whole(&perm),
                Binding::whole(&units),
            ],
            [1, 1, 1],
        )?;
        Ok(ExpertSort {
            d,
            starts,
            perm,
            units,
            n_slots,
            n_mats,
            tile,
        })
    }

    /// Most units any routing can make: each non-empty expert has at most one partial tile,
    /// and each unit at least one slot.
    fn units_bound(n_slots: usize, n_mats: usize, tile: usize) -> usize {
        (n_slots.div_ceil(tile) + n_mats).min(n_slots)
    }

    /// `[n_mats + 1]` u32: expert `e`'s slots are `perm[starts[e]..starts[e + 1]]`.
    pub fn starts(&self) -> &wgpu::Buffer {
        &self.starts
    }

    /// `[n_slots]` u32: slot indices grouped by expert (in no fixed order within one).
    pub fn perm(&self) -> &wgpu::Buffer {
        &self.perm
    }

    pub fn n_slots(&self) -> usize {
        self.n_slots
    }

    pub fn n_mats(&self) -> usize {
        self.n_mats
    }

    /// `[1 + max_units]` u32: the unit count, then the units `(e << 20) | tile index`.
    pub fn units(&self) -> &wgpu::Buffer {
        &self.units
    }

    /// Slots per token tile of the work list.
    pub fn tile(&self) -> usize {
        self.tile
    }

    /// Most units the work list can hold, whatever the routing: the grouped GEMM dispatches
    /// this many workgroups per row tile, and those past the count return at once.
    pub fn max_units(&self) -> usize {
        Self::units_bound(self.n_slots, self.n_mats, self.tile)
    }
}
recordable!(ExpertSort, "expert_sort", d);
