//! `model::decoder` on the GPU (wgpu): the same math, with every kernel recorded at load.
//!
//! A forward pass over n tokens (n a power of two ≤ `T_MAX`; longer runs are split) writes the
//! tokens' embedding rows and the position (a few KiB), records the prepared dispatches (per
//! layer: q/k/v with the input norm fused, QK-norm + RoPE + KV append, attention, o + residual,
//! router matvec with the post-attention norm fused, softmax top-k, grouped gate_up and down over
//! the router's ids with the weighted sum and residual fused — the router's choice never leaves
//! the GPU), then the final norm and LM head only if a token is generated or scored, submitting
//! every `SUBMIT_LAYERS` layers (a greedy chain's pass: once). It reads back only what the caller asked for: a greedy token id
//! (4 bytes, argmax on the GPU), the last row of logits (sampling) or every row (log-probs).
//! Greedy decoding (`decode_greedy`) chains passes: each gathers its input from the previous
//! pass's argmax on the device and is queued before the host reads that id.
//!
//! With `--expert-cache` other than resident, experts stream (`Streaming`): each MoE layer has a
//! few VRAM expert slots, and a prompt pass is split after every MoE layer's router so the host
//! can read the chosen ids (and the next MoE layer's predicted ones, whose reads it starts), fill
//! missing slots from the streaming store, and hand the grouped products slot indices — one
//! submission and wait per MoE layer. Decode batches run through the layers whose experts sit in
//! VRAM and halt only where one must be read (`through`).

use super::{mat, Logits};
use crate::error::EngineError;
use crate::gpu::{
    self, Acts, AtRoutes, FfnW, GpuKv, Head, KvPool, LayerOps, Readback, Recorder, SlotPlan,
    Weights, GEMM_MIN, LOGIT_ROWS, T_MAX,
};
use crate::rope::RopeTable;
use crate::state::SeqState;
use crate::store::{CacheBudget, Experts, StoreOptions};
use smoe_compute::gpu::{
    wgpu, BufRef, ClockHold, EmbedGather, GpuContext, MatrixUnits, Timestamps,
};
use smoe_vault::{ModelConfig, TensorData, Vault};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

mod build;
mod profile;
mod runner;
mod slot_stats;
mod streaming;
mod through;
mod vram;

pub use profile::GpuProfile;
use profile::Profiling;
use runner::{add_idle, nanos, record_head, End};
pub use slot_stats::{DiskIdle, SlotStats};
use streaming::Streaming;
use through::Through;

pub struct GpuDecoder {
    pub cfg: ModelConfig,
    /// The model's description (`families::describe`).
    pub spec: crate::spec::ModelSpec,
    ctx: Arc<GpuContext>,
    /// Tells this model's KV caches from another's.
    id: u64,
    /// Embedding rows are gathered on the host (the vault is mapped) and written per batch.
    embed: TensorData,
    weights: Weights,
    acts: Acts,
    /// The uniform holding the batch's first position.
    step: wgpu::Buffer,
    rope_scale: f32,
    /// Per batch size (index log2 n): every layer's dispatches, and the head.
    batches: Vec<(Vec<LayerOps>, Head)>,
    readback: Readback,
    /// One forward pass at a time (they share the activations); holds the embedding rows.
    running: Mutex<Vec<f32>>,
    /// Resident: a memory-mapped view of the experts for `Model::experts` (the GPU holds its
    /// own copy). Streaming: the store the GPU's expert slots are filled from (O_DIRECT reads,
    /// verified, cached in host RAM under the same budget).
    pub experts: Experts,
    /// `--expert-cache` other than resident: each MoE layer has a few expert slots in VRAM.
    streaming: Option<Streaming>,
    /// While profiling: timestamps after every step, accumulated per step label.
    profiling: Mutex<Option<Profiling>>,
    /// Greedy chains (`decode_greedy`): when the embedding is on the GPU.
    chain: Option<Chain>,
    /// Dropped sequences' KV caches, reused by the next sequence of the same capacity.
    kv_pool: Arc<KvPool>,
}

/// What a greedy chain adds: the embedding gather from the argmax, and two read-back buffers
/// (pass i + 1 copies its id while the host reads pass i's).
pub(super) struct Chain {
    gather: EmbedGather,
    ids: [Readback; 2],
}

impl GpuDecoder {
    pub fn load(vault: &Vault, store: &StoreOptions) -> Result<Self, EngineError> {
        let ctx = gpu::context()?;
        let cfg = vault.header.config.clone();
        // The GPU's free memory, asked once (where the driver answers; a model with experts).
        let room = vault.expert_section().and_then(|_| vram::room(&ctx, vault));
        // Resident experts go to VRAM whole; those that cannot (or a VRAM budget alone) stream.
        let streamed = vram::stream_instead(vault, store, room);
        let store = streamed.as_ref().unwrap_or(store);
        // Streaming expert slots that do not fit are retried with half as many, down to top-k,
        // unless the VRAM budget was given (then the error says to give a smaller one).
        let retry = vram::given(store).is_none();
        let k = cfg.num_experts_per_tok.max(1);
        let mut cap = None;
        let m = loop {
            // Out-of-memory while uploading becomes an error (a fallback under --backend auto)
            // rather than wgpu's default panic.
            let scope = ctx.device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
            let built = Self::build(&ctx, vault, cfg.clone(), store, (cap, room));
            if let Some(e) = pollster::block_on(scope.pop()) {
                return Err(EngineError::Backend(format!("GPU: {e}")));
            }
            match built {
                Err(EngineError::SlotsOutOfMemory { slots, bytes })
                    if retry && slots > k =>
                {
                    let fewer = (slots / 2).max(k);
                    vram::retrying(slots, bytes, fewer);
                    // Let wgpu free what the failed attempt allocated before the next one.
                    let _ = ctx.device.poll(wgpu::PollType::wait_indefinitely());
                    cap = Some(fewer);
                }
                // (Down to top-k, nothing fewer would do: say so rather than ask for less.)
                Err(EngineError::SlotsOutOfMemory { bytes, .. }) if retry => {
                    return Err(EngineError::Backend(format!(
                        "GPU: out of memory even for the {k} expert slots per MoE layer a token needs ({:.1} GiB in all): run this model with --backend cpu, or free GPU memory",
                        bytes as f64 / (1u64 << 30) as f64
                    )))
                }
                built => break built?,
            }
        };
        // Build one tiny KV cache now, so that shapes the attention kernels refuse fail the load
        // (and `auto` falls back) instead of the first request.
        m.kv(1)?;
        let info = ctx.info();
        tracing::info!(
            "GPU backend: {} ({:?}), shader bounds checks {}",
            info.adapter.name,
            info.adapter.backend,
            if info.bounds_checks { "on" } else { "off" }
        );
        // The prefill GEMMs were built above: say whether they run on the matrix units, and
        // warn if those were there but their kernel failed.
        match (ctx.matrix_units(), &info.matrix_units) {
            (MatrixUnits::Used, _) => tracing::info!("GPU prefill GEMMs on the matrix units"),
            (MatrixUnits::Unused(why), MatrixUnits::Used) => {
                tracing::warn!("GPU prefill GEMMs on the f32 ALUs: {why}")
            }
            (MatrixUnits::Unused(why), _) => {
                tracing::info!("GPU prefill GEMMs on the f32 ALUs ({why})")
            }
        }
        Ok(m)
    }

    /// A KV cache in GPU memory with the dispatches bound to it.
    fn kv(&self, capacity: usize) -> Result<GpuKv, EngineError> {
        let x = gpu::AttnCtx {
            ctx: &self.ctx,
            spec: &self.spec,
            w: &self.weights,
            a: &self.acts,
            step: &self.step,
            rope_scale: self.rope_scale,
        };
        if let Some(kv) = self.kv_pool.take(capacity) {
            return Ok(kv);
        }
        loop {
            let scope = self
                .ctx
                .device
                .push_error_scope(wgpu::ErrorFilter::OutOfMemory);
            let kv = GpuKv::new(&x, capacity, self.id, Arc::downgrade(&self.kv_pool));
            let Some(e) = pollster::block_on(scope.pop()) else {
                return kv;
            };
            // Out of memory: this cache is unusable (never pooled); the kept ones of finished
            // sequences are freed and the allocation tried once more.
            kv.map(GpuKv::discard).ok();
            if self.kv_pool.clear() == 0 {
                return Err(EngineError::Backend(format!(
                    "GPU: KV cache of {capacity} positions: {e} (lower --ctx or --max-concurrent)"
                )));
            }
        }
    }

    /// A sequence whose state will live in GPU memory (allocated at its first pass).
    pub fn new_state(&self, capacity: usize) -> SeqState {
        SeqState::on_gpu(self.spec.states(), capacity)
    }

    /// Streaming: whether decode batches run through the MoE layers whose experts sit in VRAM
    /// (`through`, the default; `Tuning::run_through` false starts with it off) or stop at every
    /// router as prompt batches do. For tests and measurements.
    pub fn set_run_through(&self, on: bool) {
        if let Some(th) = self.streaming.as_ref().and_then(|s| s.through.as_ref()) {
            th.on.store(on, Ordering::Relaxed);
        }
    }

    /// Streaming: whether decode copies into later MoE layers' slots, ahead of them, the
    /// experts they are expected to choose whose blobs are in host memory (`through`, the default;
    /// `Tuning::fill_ahead` false starts with it off). For tests and measurements.
    pub fn set_fill_ahead(&self, on: bool) {
        if let Some(th) = self.streaming.as_ref().and_then(|s| s.through.as_ref()) {
            th.fill_ahead.store(on, Ordering::Relaxed);
        }
    }

    /// Streaming: how many MoE layers after a halted decode layer a speculative pass looks
    /// ahead while that layer's misses are read (`through`; 0 turns it off; the default is 2 on
    /// a discrete GPU, 0 on unified memory; `Tuning::speculate` sets it at load). For tests
    /// and measurements.
    pub fn set_speculate(&self, depth: usize) {
        if let Some(th) = self.streaming.as_ref().and_then(|s| s.through.as_ref()) {
            th.depth.store(depth, Ordering::Relaxed);
        }
    }

    /// Whether `decode_greedy` runs chains (resident, embedding on the GPU).
    pub fn chains_greedy(&self) -> bool {
        self.chain().is_some()
    }

    /// The chain's parts, where chains run: resident only (streaming needs the host at every
    /// router).
    fn chain(&self) -> Option<&Chain> {
        self.chain.as_ref().filter(|_| self.streaming.is_none())
    }

    /// GPU KV caches kept for reuse (dropped sequences' caches; see `gpu::KvPool`).
    pub fn kept_kv_caches(&self) -> usize {
        self.kv_pool.len()
    }
}
