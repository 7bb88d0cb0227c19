//! `model::decoder` on the GPU (wgpu): the same math, with every kernel recorded at load.
//!
//! A forward pass over n tokens (n a power of two ≤ `T_MAX`; longer runs are split) is one
//! command buffer and one submission: the host writes the tokens' embedding rows and the position
//! (a few KiB), records the prepared dispatches (per layer: RMSNorm, q/k/v, QK-norm + RoPE + KV
//! append, attention, o + residual, RMSNorm, router matvec, softmax top-k, grouped gate_up and
//! down over the router's ids, weighted sum — the router's choice never leaves the GPU), then the
//! final norm and LM head only if a token is generated or scored. It reads back only what the
//! caller asked for: a greedy token id (4 bytes, argmax on the GPU), the last row of logits
//! (sampling) or every row (log-probs). So decoding is one submission and one wait per token.

use super::{mat, Logits};
use crate::error::EngineError;
use crate::gpu::{self, Acts, GpuKv, Head, LayerOps, Readback, Weights, T_MAX};
use crate::kv_cache::KvCache;
use crate::rope::RopeTable;
use crate::store::{CacheBudget, Experts, StoreOptions};
use smoe_compute::gpu::{wgpu, GpuContext};
use smoe_vault::{ModelConfig, TensorData, Vault};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

pub struct GpuDecoder {
    pub cfg: ModelConfig,
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
    /// A memory-mapped view of the experts for `Model::experts` (the GPU holds its own copy).
    pub experts: Experts,
}

/// How a forward pass ends.
#[derive(Clone, Copy, PartialEq)]
enum End {
    Logits(Logits),
    Greedy,
}

impl GpuDecoder {
    pub fn load(vault: &Vault, store: &StoreOptions) -> Result<Self, EngineError> {
        let ctx = gpu::context()?;
        if store.budget != CacheBudget::Resident {
            tracing::info!("GPU backend: every expert is held in GPU memory; the expert cache budget applies to the CPU backend");
        }
        let cfg = vault.header.config.clone();
        // Out-of-memory while uploading becomes an error (a fallback under --backend auto)
        // rather than wgpu's default panic.
        let scope = ctx.device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        let built = Self::build(&ctx, vault, cfg);
        if let Some(e) = pollster::block_on(scope.pop()) {
            return Err(EngineError::Backend(format!("GPU: {e}")));
        }
        let m = built?;
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
        Ok(m)
    }

    fn build(ctx: &Arc<GpuContext>, vault: &Vault, cfg: ModelConfig) -> Result<Self, EngineError> {
        static IDS: AtomicU64 = AtomicU64::new(1);
        let rope = RopeTable::new(&cfg.rope, cfg.head_dim);
        let weights = Weights::upload(ctx, vault, &rope)?;
        let acts = Acts::new(ctx, &cfg);
        let eps = cfg.rms_norm_eps as f32;
        let mut batches = vec![];
        for n in gpu::batch_sizes() {
            let layers = weights
                .layers
                .iter()
                .map(|w| LayerOps::new(ctx, w, &acts, &cfg, n))
                .collect::<Result<Vec<_>, _>>()?;
            batches.push((layers, Head::new(ctx, &weights, &acts, eps, n)?));
        }
        let no_profile = StoreOptions {
            profile: false,
            ..StoreOptions::default()
        };
        Ok(GpuDecoder {
            id: IDS.fetch_add(1, Ordering::Relaxed),
            embed: vault.tensor("model.embed_tokens.weight")?,
            step: ctx.step_buffer(),
            rope_scale: rope.scale(),
            readback: Readback::new(ctx, 4 * (T_MAX * cfg.vocab_size) as u64),
            running: Mutex::new(Vec::with_capacity(T_MAX * cfg.hidden_size)),
            experts: Experts::open(vault, &no_profile)?,
            ctx: ctx.clone(),
            weights,
            acts,
            batches,
            cfg,
        })
    }

    /// A KV cache in GPU memory with the dispatches bound to it.
    fn kv(&self, capacity: usize) -> Result<GpuKv, EngineError> {
        let x = gpu::AttnCtx {
            ctx: &self.ctx,
            cfg: &self.cfg,
            w: &self.weights,
            a: &self.acts,
            step: &self.step,
            rope_scale: self.rope_scale,
        };
        let scope = self
            .ctx
            .device
            .push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        let kv = GpuKv::new(&x, capacity, self.id);
        if let Some(e) = pollster::block_on(scope.pop()) {
            return Err(EngineError::Backend(format!("GPU: KV cache: {e}")));
        }
        kv
    }

    /// A cache whose keys and values will live in GPU memory (allocated at the first pass).
    pub fn new_cache(&self, capacity: usize) -> KvCache {
        KvCache::on_gpu(self.cfg.num_kv_heads * self.cfg.head_dim, capacity)
    }

    /// As `Decoder::forward`: logits (`[rows, vocab]`) for the positions `want` asks for.
    pub fn forward(
        &self,
        kv: &mut KvCache,
        tokens: &[u32],
        want: Logits,
    ) -> Result<Vec<f32>, EngineError> {
        let mut out = vec![];
        self.run(kv, tokens, End::Logits(want), &mut out)?;
        Ok(out)
    }

    /// Runs `tokens` and returns the most likely next token (ties to the lowest id, as
    /// `sampler::argmax`), chosen on the GPU: only its id is read back.
    pub fn forward_greedy(&self, kv: &mut KvCache, tokens: &[u32]) -> Result<u32, EngineError> {
        let mut out = vec![];
        self.run(kv, tokens, End::Greedy, &mut out)?
            .ok_or_else(|| EngineError::Invalid("no tokens to run".into()))
    }

    fn run(
        &self,
        kv: &mut KvCache,
        tokens: &[u32],
        end: End,
        out: &mut Vec<f32>,
    ) -> Result<Option<u32>, EngineError> {
        let c = &self.cfg;
        kv.check_room(tokens.len())?;
        if let Some(&id) = tokens.iter().find(|&&id| id as usize >= c.vocab_size) {
            return Err(EngineError::TokenOutOfRange {
                id,
                vocab: c.vocab_size,
            });
        }
        match &kv.gpu {
            Some(g) if g.owner == self.id => {}
            Some(_) => {
                return Err(EngineError::Backend(
                    "this KV cache belongs to another model".into(),
                ))
            }
            None if kv.len > 0 => {
                return Err(EngineError::Backend(
                    "this KV cache holds CPU state; create sessions from the GPU model".into(),
                ))
            }
            None => kv.gpu = Some(Box::new(self.kv(kv.capacity())?)),
        }
        let gkv = kv.gpu.as_deref().expect("created above");
        let mut rows = self.running.lock().unwrap_or_else(|e| e.into_inner());
        let (h, vocab) = (c.hidden_size, c.vocab_size);
        let embed = mat(&self.embed);
        let mut greedy = None;
        let mut done = 0;
        while done < tokens.len() {
            let n = gpu::piece_len(tokens.len() - done);
            let last = done + n == tokens.len();
            rows.resize(n * h, 0.0);
            for (row, &id) in rows.chunks_exact_mut(h).zip(&tokens[done..done + n]) {
                smoe_vault::quant::dequantize_row(embed.dtype, embed.row(id as usize), row);
            }
            let q = &self.ctx.queue;
            q.write_buffer(&self.acts.x, 0, bytemuck::cast_slice(&rows[..]));
            self.ctx.write_step(&self.step, (kv.len + done) as u32);
            let (layers, head) = &self.batches[n.trailing_zeros() as usize];
            let mut enc = self.ctx.encoder();
            {
                let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                    label: Some("forward"),
                    timestamp_writes: None,
                });
                for (l, ops) in layers.iter().enumerate() {
                    ops.pre.iter().for_each(|op| op.record(&mut pass));
                    gkv.record(n.trailing_zeros() as usize, l, &mut pass);
                    ops.post.iter().for_each(|op| op.record(&mut pass));
                }
                match end {
                    End::Logits(Logits::All) => head.record_all(&mut pass),
                    End::Logits(Logits::Last) if last => head.record_last(&mut pass, false),
                    End::Greedy if last => head.record_last(&mut pass, true),
                    _ => {}
                }
            }
            let (src, bytes) = match end {
                End::Logits(Logits::All) => (&self.acts.logits, 4 * (n * vocab) as u64),
                End::Logits(Logits::Last) if last => (&self.acts.logits, 4 * vocab as u64),
                End::Greedy if last => (&self.acts.argmax, 4),
                _ => (&self.acts.logits, 0),
            };
            if bytes > 0 {
                self.readback.copy(&mut enc, src, bytes);
            }
            q.submit([enc.finish()]);
            if bytes > 0 {
                if end == End::Greedy {
                    greedy = Some(self.readback.read(&self.ctx, 4, |b| {
                        u32::from_le_bytes([b[0], b[1], b[2], b[3]])
                    })?);
                } else {
                    self.readback
                        .read(&self.ctx, bytes, |b| gpu::extend_f32(out, b))?;
                }
            }
            done += n;
        }
        kv.len += tokens.len();
        Ok(greedy)
    }
}
