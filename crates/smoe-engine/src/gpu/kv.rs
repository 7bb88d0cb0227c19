//! A sequence's KV cache in GPU memory (f32, one K and one V buffer per layer, preallocated for
//! the context), with the dispatches bound to it: per batch size and layer, the fused
//! QK-norm + RoPE + KV append and the attention. Built when the sequence first runs, so a
//! session costs its bind groups once and the token loop none.

use super::acts::Acts;
use super::layer::rope_inputs;
use super::record::{Dispatch, Recorder};
use super::weights::Weights;
use super::{batch_sizes, gpu_err};
use crate::error::EngineError;
use smoe_compute::gpu::{
    wgpu, AttnDesc, BufRef, DecodeAttention, GpuContext, PrefillAttention, QkNormRope,
    QkNormRopeDesc,
};
use smoe_vault::ModelConfig;

pub struct GpuKv {
    /// The model whose buffers the dispatches bind (a cache serves only that model).
    pub(crate) owner: u64,
    _k: Vec<wgpu::Buffer>,
    _v: Vec<wgpu::Buffer>,
    /// `[batch size index][layer]`.
    ops: Vec<Vec<(QkNormRope, Attention)>>,
}

/// Batches of at least `PREFILL_MIN` tokens take the flash-attention-style prefill kernel (each
/// K/V tile loaded once for a block of queries and the heads sharing it); fewer tokens take the
/// decode kernel (one workgroup per query token and head).
const PREFILL_MIN: usize = 16;

enum Attention {
    Decode(DecodeAttention),
    Prefill(PrefillAttention),
}

impl Dispatch for Attention {
    fn record_into(&self, pass: &mut wgpu::ComputePass<'_>) {
        match self {
            Attention::Decode(a) => a.record(pass),
            Attention::Prefill(a) => a.record(pass),
        }
    }
}

/// What the attention dispatches need besides the cache.
pub(crate) struct AttnCtx<'a> {
    pub ctx: &'a GpuContext,
    pub cfg: &'a ModelConfig,
    pub w: &'a Weights,
    pub a: &'a Acts,
    /// The step uniform: the position of the batch's first token.
    pub step: &'a wgpu::Buffer,
    pub rope_scale: f32,
}

impl GpuKv {
    pub(crate) fn new(x: &AttnCtx, capacity: usize, owner: u64) -> Result<Self, EngineError> {
        let c = x.cfg;
        let (hd, kw) = (c.head_dim, c.num_kv_heads * c.head_dim);
        let bytes = 4 * (capacity * kw) as u64;
        let max = x.ctx.limits().max_buffer_size;
        if bytes > max {
            return Err(EngineError::Backend(format!(
                "GPU: a KV cache of {capacity} positions needs {bytes}-byte buffers per layer, the \
                 adapter's largest is {max} (lower --ctx)"
            )));
        }
        let k: Vec<_> = (0..c.num_layers)
            .map(|l| x.ctx.storage_buffer(&format!("k cache {l}"), bytes))
            .collect();
        let v: Vec<_> = (0..c.num_layers)
            .map(|l| x.ctx.storage_buffer(&format!("v cache {l}"), bytes))
            .collect();
        let mut ops = vec![];
        for n in batch_sizes() {
            let mut per_layer = vec![];
            // The decode kernel's partial results: one buffer for all layers of this batch
            // size (their attention dispatches run one after another), created on first need.
            let mut scratch: Option<wgpu::Buffer> = None;
            for (l, lw) in x.w.layers.iter().enumerate() {
                let r = rope_inputs(lw, x.a, c, n);
                let rope = QkNormRope::new(
                    x.ctx,
                    &QkNormRopeDesc {
                        q: r.q,
                        k: r.k,
                        v: r.v,
                        k_cache: BufRef::new(&k[l]),
                        v_cache: BufRef::new(&v[l]),
                        norms: r.norms,
                        inv_freq: BufRef::new(&x.w.inv_freq),
                        rot_dim: hd,
                        rope_scale: x.rope_scale,
                        eps: c.rms_norm_eps as f32,
                        step: x.step,
                        n_heads: c.num_heads,
                        n_kv_heads: c.num_kv_heads,
                        head_dim: hd,
                        n_tokens: n,
                        capacity,
                    },
                )
                .map_err(gpu_err)?;
                let desc = AttnDesc {
                    q: r.q,
                    k_cache: BufRef::new(&k[l]),
                    v_cache: BufRef::new(&v[l]),
                    out: BufRef::new(&x.a.attn),
                    step: x.step,
                    n_heads: c.num_heads,
                    n_kv_heads: c.num_kv_heads,
                    head_dim: hd,
                    n_tokens: n,
                    capacity,
                    scale: (hd as f32).powf(-0.5),
                    window: c.sliding_window,
                };
                let attn = match n >= PREFILL_MIN {
                    true => {
                        Attention::Prefill(PrefillAttention::new(x.ctx, &desc).map_err(gpu_err)?)
                    }
                    false => {
                        let bytes = DecodeAttention::scratch_bytes(&desc).max(16);
                        let buf = scratch.get_or_insert_with(|| {
                            x.ctx.storage_buffer("attention partials", bytes)
                        });
                        let a = DecodeAttention::with_scratch(x.ctx, &desc, buf);
                        Attention::Decode(a.map_err(gpu_err)?)
                    }
                };
                per_layer.push((rope, attn));
            }
            ops.push(per_layer);
        }
        Ok(GpuKv {
            owner,
            _k: k,
            _v: v,
            ops,
        })
    }

    /// Records layer `l`'s RoPE/append and attention for batch size index `bi`.
    pub(crate) fn record(&self, bi: usize, l: usize, r: &mut Recorder) {
        let (rope, attn) = &self.ops[bi][l];
        r.step("qk-norm rope kv-append", rope);
        r.step("attention", attn);
    }
}
