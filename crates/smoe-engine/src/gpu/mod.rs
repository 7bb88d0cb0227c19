//! The engine side of the GPU backend: weights in GPU memory, activation buffers, and every
//! kernel of a forward pass recorded at load time (`smoe_compute::gpu` wrappers), so the token
//! loop only writes a few bytes, records prepared dispatches and submits once.
//!
//! - `weights`: the model uploaded once (scout tensors in their vault bytes, each MoE layer's
//!   expert blobs in one buffer at the vault's blob stride; when streaming, a few empty blob
//!   slots that the decoder fills on demand).
//! - `acts`: activation buffers sized for the largest token batch (`T_MAX`).
//! - `layer`: one layer's dispatches for a batch of n tokens, except those bound to a KV cache.
//! - `kv`: a sequence's KV cache and the attention dispatches bound to it.
//! - `head`: final norm, LM head, argmax and the read-back of logits or token ids.
//!
//! `model::gpu_decoder` puts them together. Batches of n tokens are powers of two up to `T_MAX`
//! (a prompt chunk of 37 tokens runs as 32 + 4 + 1): each size has its own recorded dispatches,
//! since the kernels' bind groups fix n.

mod acts;
mod head;
mod kv;
mod layer;
mod lowering;
mod record;
mod slots;
mod weights;

pub(crate) use acts::{Acts, AHEAD_MAX};
pub(crate) use head::{extend_f32, Head, Readback};
pub use kv::GpuKv;
pub(crate) use kv::{AttnCtx, KvPool};
pub(crate) use layer::{AtRoutes, LayerOps, Op, GEMM_MIN};
pub(crate) use record::Recorder;
pub(crate) use slots::SlotWriter;
pub(crate) use weights::{FfnW, Packed, SlotPlan, Weights};

use crate::error::EngineError;
use smoe_compute::gpu::{GpuContext, GpuTuning};
use std::sync::{Arc, OnceLock};

/// Largest batch of tokens one submission processes; longer prompt chunks are split. Large,
/// so that a prompt chunk's experts are read once for many tokens (512 tokens × top-8 of 128
/// experts ≈ 32 tokens per expert).
pub(crate) const T_MAX: usize = 512;

/// Most rows of logits one pass writes (scoring every position of a long prompt runs in
/// pieces of this many tokens: the logits buffer is rows × vocabulary f32s).
pub(crate) const LOGIT_ROWS: usize = 64;

/// The batch sizes with recorded dispatches: 1, 2, 4, …, `T_MAX`.
pub(crate) fn batch_sizes() -> Vec<usize> {
    (0..=T_MAX.trailing_zeros()).map(|i| 1 << i).collect()
}

/// The largest recorded batch size that fits `remaining` tokens.
pub(crate) fn piece_len(remaining: usize) -> usize {
    let n = remaining.min(T_MAX);
    1 << (usize::BITS - 1 - n.leading_zeros())
}

/// The settings the process's GPU device opens with (`configure`, else the defaults), fixed
/// by the first of `configure` and `context`.
static TUNING: OnceLock<GpuTuning> = OnceLock::new();

/// Sets the `GpuTuning` the process's GPU device (`context`) opens with. Call it before
/// anything uses the GPU: the device is opened once per process. Fails where the device was
/// already opened, or configured, with other settings; the same settings again are fine.
pub fn configure(tuning: GpuTuning) -> Result<(), EngineError> {
    match TUNING.get_or_init(|| tuning.clone()) {
        set if *set == tuning => Ok(()),
        set => Err(EngineError::Invalid(format!(
            "the GPU device is already set up with other settings ({set:?}); its settings \
             are chosen once per process, before its first use"
        ))),
    }
}

/// The process's GPU device, opened once with `configure`'s settings: opening one costs
/// ~0.1–1 s, and every model of a process (tests load dozens) can share it.
pub fn context() -> Result<Arc<GpuContext>, EngineError> {
    static CTX: OnceLock<Result<Arc<GpuContext>, String>> = OnceLock::new();
    CTX.get_or_init(|| {
        let tuning = TUNING.get_or_init(GpuTuning::default).clone();
        GpuContext::with_tuning(tuning)
            .map(Arc::new)
            .map_err(|e| e.to_string())
    })
    .clone()
    .map_err(EngineError::Backend)
}

/// Whether `--backend auto` should take the GPU: a device, and not a software rasterizer
/// (lavapipe/llvmpipe runs the kernels correctly but far slower than the CPU backend).
pub fn auto_adapter() -> Result<(), EngineError> {
    let ctx = context()?;
    let a = &ctx.info().adapter;
    if a.device_type == smoe_compute::gpu::wgpu::DeviceType::Cpu {
        return Err(EngineError::Backend(format!(
            "the only GPU adapter, {}, is a software one",
            a.name
        )));
    }
    Ok(())
}

pub(crate) fn gpu_err(e: smoe_compute::gpu::GpuError) -> EngineError {
    EngineError::Backend(format!("GPU: {e}"))
}

#[cfg(test)]
mod tests {
    #[test]
    fn pieces_are_recorded_sizes() {
        let sizes = super::batch_sizes();
        assert_eq!(sizes.last(), Some(&super::T_MAX));
        for r in 1..300 {
            let n = super::piece_len(r);
            assert!(sizes.contains(&n) && n <= r && 2 * n > r.min(super::T_MAX));
        }
    }
}
