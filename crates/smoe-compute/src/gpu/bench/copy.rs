//! The copy kernel as `gpu::bench` uses it: the device's copy bandwidth, which every row's
//! GB/s is a ratio of (DESIGN.md "Performance method"), and the floor of a chain of dependent
//! dispatches that do no work, which bounds every decode step from below.

use super::timer::Timer;
use super::ROTATE_BYTES;
use crate::gpu::buffers::Binding;
use crate::gpu::context::{GpuContext, GpuError};
use crate::gpu::ops::Dispatch;
use std::fmt;

/// The copy kernel's uniform: `n`, the vec4s to copy from `src` to `dst`.
#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct CopyParams {
    n: u32,
    _pad: [u32; 3],
}

/// GB/s (read + write) of the plain copy kernel on this device, over a buffer far larger than
/// any cache: the reference for ratios.
pub fn copy_gbps(ctx: &GpuContext, iters: usize) -> Result<f64, GpuError> {
    bench_copy(ctx, &Timer::new(ctx), iters)
}

/// `copy_gbps` timed with the caller's `timer`, so that a run's rows and its copy share one.
pub(super) fn bench_copy(ctx: &GpuContext, timer: &Timer, iters: usize) -> Result<f64, GpuError> {
    let max = ctx.limits().max_storage_buffer_binding_size;
    let bytes = (ROTATE_BYTES).min(max / 16 * 16);
    let src = ctx.storage_buffer("copy src", bytes);
    let dst = ctx.storage_buffer("copy dst", bytes);
    let n = (bytes / 16) as usize;
    let groups = n
        .div_ceil(256)
        .min(ctx.limits().max_compute_workgroups_per_dimension as usize);
    let p = CopyParams {
        n: n as u32,
        _pad: [0; 3],
    };
    let d = Dispatch::new(
        ctx,
        "copy",
        &[],
        &p,
        &[Binding::whole(&src), Binding::whole(&dst)],
        [groups, 1, 1],
    )?;
    let secs = timer.time(&|pass| (0..iters).for_each(|_| d.record(pass)))?;
    Ok(2.0 * bytes as f64 * iters as f64 / secs / 1e9)
}

/// The cost of a dispatch in a chain of dependent ones when it has no work: what every step of
/// a decode pays at least, whatever its kernel does (a Qwen3-MoE decode layer is 6 dependent
/// dispatches).
#[derive(Clone, Copy, Debug)]
pub struct DispatchFloor {
    /// µs per dispatch of one workgroup.
    pub one_us: f64,
    /// µs per dispatch of `wide_groups` workgroups (of 256 invocations) that find nothing to do.
    pub wide_us: f64,
    pub wide_groups: usize,
}

impl fmt::Display for DispatchFloor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "dependent dispatch, nothing to do: {:.2} µs (1 workgroup), {:.2} µs ({} workgroups)",
            self.one_us, self.wide_us, self.wide_groups
        )
    }
}

/// `DispatchFloor` on this device: a chain of `iters` copies of 4 KiB, each reading what the
/// one before wrote (buffers a → b, then b → a, ...), so that every two are ordered by a
/// barrier; timed as one pass like every `bench_kernels` row.
pub fn dispatch_floor(ctx: &GpuContext, iters: usize) -> Result<DispatchFloor, GpuError> {
    let timer = Timer::new(ctx);
    const WIDE: usize = 1024;
    let n = 256; // vec4s: one per invocation of the first workgroup
    let a = ctx.storage_buffer("floor a", 16 * n as u64);
    let b = ctx.storage_buffer("floor b", 16 * n as u64);
    let p = CopyParams {
        n: n as u32,
        _pad: [0; 3],
    };
    let copy = |src: &wgpu::Buffer, dst: &wgpu::Buffer, groups: usize| {
        let bind = [Binding::whole(src), Binding::whole(dst)];
        Dispatch::new(ctx, "copy", &[], &p, &bind, [groups, 1, 1])
    };
    let mut us = [0.0; 2];
    for (u, groups) in us.iter_mut().zip([1, WIDE]) {
        let (ab, ba) = (copy(&a, &b, groups)?, copy(&b, &a, groups)?);
        let secs = timer.time(&|pass| {
            for i in 0..iters {
                [&ab, &ba][i % 2].record(pass);
            }
        })?;
        *u = secs / iters as f64 * 1e6;
    }
    Ok(DispatchFloor {
        one_us: us[0],
        wide_us: us[1],
        wide_groups: WIDE,
    })
}
