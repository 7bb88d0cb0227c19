//! GPU backend on wgpu: Vulkan on Linux and Windows, Metal on macOS, DX12 on Windows.
//!
//! [`GpuContext`] owns the device, the queue and a pipeline cache. Every kernel has a wrapper that
//! is built once, at load time, from the buffers it reads and writes (creating its bind groups and
//! parameter buffers then), and that afterwards only *records* into a caller-provided
//! `wgpu::CommandEncoder` or `wgpu::ComputePass`: nothing is allocated or submitted in the token
//! loop. The caller submits once per layer or once per token.
//!
//! Each kernel's CPU twin lives in `crate::cpu`; `tests/gpu_kernels.rs` holds them to it.
//!
//! Activations, norm weights and the KV cache are f32; weights are in their vault storage type
//! (`smoe_vault::quant`), decoded inside the kernels from exactly the vault's bytes.

mod attention;
mod attn_prefill;
pub mod bench;
mod buffers;
mod clocks;
mod context;
mod embed;
mod expert_sort;
mod kernels;
mod launch;
mod matmul;
mod matvec;
mod memory;
mod ops;
mod parts;
mod router;
mod slot_map;
mod spirv;
mod timestamps;
mod tuning;

pub use attention::{AttnDesc, DecodeAttention, FusedRope, QkNormRope, QkNormRopeDesc};
pub use attn_prefill::{PrefillAttention, PrefillAttnTuning, PREFILL_MAX_HEAD_DIM};
pub use buffers::{BufRef, StepParams};
pub use clocks::{nvidia_memory, ClockHold};
pub use context::{GpuContext, GpuError, GpuInfo, MatrixUnits};
pub use embed::EmbedGather;
pub use expert_sort::{ExpertSort, SORT_MAX_EXPERTS, SORT_MAX_SLOTS};
pub use kernels::{kernel_names, kernel_source};
pub use launch::{IndirectArgs, Launch};
pub use matmul::{MatMul, MatMulDesc, MatMulGrouped, MatMulTuning};
pub use matvec::{
    Fuse, Grouped, MatVec, MatVecDesc, MatVecTuning, NextRoute, Q4Decode, RouteTail, SumTail,
    WeightRef, NT_MAX,
};
pub use memory::{MemoryRoom, MemorySource};
pub use ops::{Argmax, EltOp, Eltwise, RmsNorm, WeightedSum};
pub use router::Router;
pub use slot_map::{SlotGuess, SlotMap, SlotMapBufs, NO_SLOT};
pub use spirv::{kernel_spirv, KernelBinding};
pub use timestamps::Timestamps;
pub use tuning::{ExecBarriers, GpuTuning};
/// The wgpu this backend is built on, for callers that create buffers and encoders.
pub use wgpu;

/// Records `f` into one compute pass of `enc`: the convenience behind every wrapper's `encode`.
pub(crate) fn in_pass(
    enc: &mut wgpu::CommandEncoder,
    label: &str,
    f: impl FnOnce(&mut wgpu::ComputePass<'_>),
) {
    let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
        label: Some(label),
        timestamp_writes: None,
    });
    f(&mut pass);
}
