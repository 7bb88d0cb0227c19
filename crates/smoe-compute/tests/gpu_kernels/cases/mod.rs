//! The table's ops: for each, a case type that draws its inputs, runs the CPU twin
//! (`smoe_compute::cpu`) and the GPU kernel (`smoe_compute::gpu`) on them, and returns what to
//! compare. Inputs and outputs sit at offsets inside their buffers, between other data, and
//! outputs are poisoned with NaN, so that a kernel which ignores an offset, skips an output or
//! writes past one fails.

pub mod attention;
pub mod matmul;
pub mod matvec;
pub mod ops;
pub mod tails;

use smoe_compute::gpu::{wgpu, GpuContext};

/// Values of other data around each input and output (before its offset and after its end):
/// finite, so that an in-place op writing there changes them too.
pub const GUARD: usize = 16;
const GUARD_VALUE: f32 = -777.25;

/// A buffer of `values` at byte offset `AT`, with `GUARD` values of other data before and after
/// them.
pub fn guarded(ctx: &GpuContext, label: &str, values: &[f32]) -> wgpu::Buffer {
    let guard = [GUARD_VALUE; GUARD];
    ctx.upload_f32(label, &[&guard[..], values, &guard[..]].concat())
}

/// An output of `n` values in a `guarded` buffer, poisoned with NaN (an unwritten output then
/// fails any comparison).
pub fn poisoned(ctx: &GpuContext, label: &str, n: usize) -> wgpu::Buffer {
    guarded(ctx, label, &vec![f32::NAN; n])
}

/// The byte offset of the values of a `guarded` buffer.
pub const AT: u64 = 4 * GUARD as u64;

/// The `n` values of a `guarded` buffer, and whether its guards are as they were.
pub fn read_guarded(ctx: &GpuContext, buf: &wgpu::Buffer, n: usize) -> (Vec<f32>, bool) {
    (read_span(ctx, buf, 0, n), guards_kept(ctx, buf, n))
}

/// Values `from..from + n` of a `guarded` buffer.
pub fn read_span(ctx: &GpuContext, buf: &wgpu::Buffer, from: usize, n: usize) -> Vec<f32> {
    ctx.read_f32(buf, AT + 4 * from as u64, n).unwrap()
}

/// Whether the guards around the `n` values of a `guarded` buffer are as they were.
pub fn guards_kept(ctx: &GpuContext, buf: &wgpu::Buffer, n: usize) -> bool {
    let before = ctx.read_f32(buf, 0, GUARD).unwrap();
    let after = read_span(ctx, buf, n, GUARD);
    (before.iter().chain(&after)).all(|v| v.to_bits() == GUARD_VALUE.to_bits())
}

/// `bytes` at byte offset `pad` of a buffer, with garbage before and after.
pub fn upload_at(ctx: &GpuContext, label: &str, bytes: &[u8], pad: usize) -> wgpu::Buffer {
    let mut all = vec![0xA5u8; pad];
    all.extend_from_slice(bytes);
    all.extend_from_slice(&[0x5Au8; 48]);
    ctx.upload(label, &all)
}

const GUARD_WORD: u32 = 0xdead_beef;

/// u32s at byte offset `AT`, with `GUARD` words of other data before and after them.
pub fn upload_u32_at(ctx: &GpuContext, label: &str, words: &[u32]) -> wgpu::Buffer {
    let guard = [GUARD_WORD; GUARD];
    let all = [&guard[..], words, &guard[..]].concat();
    ctx.upload(label, bytemuck::cast_slice(&all))
}

/// The `n` words of an `upload_u32_at` buffer, and whether its guards are as they were.
pub fn read_u32_guarded(ctx: &GpuContext, buf: &wgpu::Buffer, n: usize) -> (Vec<u32>, bool) {
    let all = ctx.read_u32(buf, 0, n + 2 * GUARD).unwrap();
    let kept = (all[..GUARD].iter())
        .chain(&all[GUARD + n..])
        .all(|&w| w == GUARD_WORD);
    (all[GUARD..GUARD + n].to_vec(), kept)
}

/// Runs what `ctx` recorded with `record` in one submission.
pub fn submit(ctx: &GpuContext, record: impl FnOnce(&mut wgpu::CommandEncoder)) {
    let mut enc = ctx.encoder();
    record(&mut enc);
    ctx.submit_wait(enc);
}
