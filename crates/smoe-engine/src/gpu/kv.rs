//! A sequence's KV cache in GPU memory (f32, one K and one V buffer per layer, preallocated for
//! the context), with the dispatches bound to it: per batch size and layer, the fused
//! QK-norm + RoPE + KV append and the attention. Built when the sequence first runs, so a
//! session costs its bind groups once and the token loop none — and dropped caches go back to
//! their model's `KvPool`, so the next sequence of the same capacity skips even that (on an
//! H200, a new 4,096-position cache of Qwen3-30B-A3B shapes made the first pass of a session
//! take 139 ms instead of 4).

use super::acts::Acts;
use super::layer::rope_inputs;
use super::record::{Dispatch, Recorder};
use super::weights::Weights;
use super::{batch_sizes, gpu_err};
use crate::error::EngineError;
use crate::spec::{Mixer, ModelSpec};
use smoe_compute::gpu::{
    wgpu, AttnDesc, BufRef, DecodeAttention, FusedRope, GpuContext, Launch, PrefillAttention,
    PrefillAttnTuning, QkNormRope, QkNormRopeDesc,
};
use std::sync::{Mutex, Weak};

pub struct GpuKv {
    /// The model whose buffers the dispatches bind (a cache serves only that model).
    pub(crate) owner: u64,
    pub(crate) capacity: usize,
    _k: Vec<wgpu::Buffer>,
    _v: Vec<wgpu::Buffer>,
    /// `[batch size index][layer]`: the QK-norm/RoPE/KV-append dispatch (`None` for one
    /// token, where the decode attention does that work itself) and the attention.
    ops: Vec<Vec<(Option<QkNormRope>, Attention)>>,
    /// Where this cache goes when its sequence is dropped.
    pool: Weak<KvPool>,
}

/// A model's dropped GPU KV caches, kept for reuse: a sequence's positions are always written
/// before they are read, so a reused cache needs no clearing. The most recently dropped are
/// kept, at most `KEEP` of them and `KEEP_BYTES` in all (but always the last one), holding their
/// GPU memory until reused, released (`clear`: a new cache that ran out of memory frees them and
/// tries again) or the model is dropped.
#[derive(Default)]
pub(crate) struct KvPool {
    free: Mutex<Vec<GpuKv>>,
}

impl KvPool {
    pub const KEEP: usize = 4;
    /// 2 GiB: two 4,096-position caches of Qwen3-30B-A3B shapes, one of Qwen3-235B-A22B's.
    pub const KEEP_BYTES: u64 = 2 << 30;

    /// How many of the oldest kept caches (`bytes`, oldest first) to free.
    fn surplus(bytes: &[u64]) -> usize {
        let mut keep = 0;
        let mut total = 0;
        for &b in bytes.iter().rev() {
            if keep == Self::KEEP || (keep > 0 && total + b > Self::KEEP_BYTES) {
                break;
            }
            keep += 1;
            total += b;
        }
        bytes.len() - keep
    }

    /// Frees every kept cache; returns how many there were.
    pub fn clear(&self) -> usize {
        let all = std::mem::take(&mut *self.free.lock().unwrap_or_else(|e| e.into_inner()));
        let n = all.len();
        all.into_iter().for_each(GpuKv::discard);
        n
    }

    /// A kept cache of exactly `capacity` positions.
    pub fn take(&self, capacity: usize) -> Option<GpuKv> {
        let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        let i = free.iter().rposition(|kv| kv.capacity == capacity)?;
        Some(free.remove(i))
    }

    pub fn len(&self) -> usize {
        self.free.lock().unwrap_or_else(|e| e.into_inner()).len()
    }
}

impl Drop for GpuKv {
    fn drop(&mut self) {
        let Some(pool) = self.pool.upgrade() else {
            return;
        };
        let kept = GpuKv {
            owner: self.owner,
            capacity: self.capacity,
            _k: std::mem::take(&mut self._k),
            _v: std::mem::take(&mut self._v),
            ops: std::mem::take(&mut self.ops),
            pool: self.pool.clone(),
        };
        let mut free = pool.free.lock().unwrap_or_else(|e| e.into_inner());
        free.push(kept);
        let sizes: Vec<u64> = free.iter().map(GpuKv::bytes).collect();
        let old: Vec<GpuKv> = free.drain(..KvPool::surplus(&sizes)).collect();
        // The oldest go, dropped outside the lock (their own drop finds the pool again).
        drop(free);
        old.into_iter().for_each(GpuKv::discard);
    }
}

impl GpuKv {
    /// Bytes of its K and V buffers.
    fn bytes(&self) -> u64 {
        self._k.iter().chain(&self._v).map(|b| b.size()).sum()
    }

    /// Frees the memory instead of going back to the pool (also for a cache whose allocation
    /// failed, which must never be reused).
    pub(crate) fn discard(mut self) {
        self.pool = Weak::new();
    }
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
    fn record_into(&self, pass: &mut wgpu::ComputePass<'_>, launch: &mut Launch) {
        match self {
            Attention::Decode(a) => a.record_with(pass, launch),
            Attention::Prefill(a) => a.record_with(pass, launch),
        }
    }
}

/// What the attention dispatches need besides the cache.
pub(crate) struct AttnCtx<'a> {
    pub ctx: &'a GpuContext,
    pub spec: &'a ModelSpec,
    pub w: &'a Weights,
    pub a: &'a Acts,
    /// The step uniform: the position of the batch's first token.
    pub step: &'a wgpu::Buffer,
    pub rope_scale: f32,
}

impl GpuKv {
    pub(crate) fn new(
        x: &AttnCtx,
        capacity: usize,
        owner: u64,
        pool: Weak<KvPool>,
    ) -> Result<Self, EngineError> {
        // Each layer's state, as its mixer keeps it (`spec::Mixer::state`): keys and values.
        let attention: Vec<_> = (x.spec.layers.iter())
            .map(|l| match &l.mixer {
                Mixer::Attention(a) => a,
            })
            .collect();
        let max = x.ctx.limits().max_buffer_size;
        let mut k = vec![];
        let mut v = vec![];
        for (l, a) in attention.iter().enumerate() {
            let bytes = 4 * (capacity * a.kv_heads * a.head_dim) as u64;
            if bytes > max {
                return Err(EngineError::Backend(format!(
                    "GPU: a KV cache of {capacity} positions needs {bytes}-byte buffers per \
                     layer, the adapter's largest is {max} (lower --ctx)"
                )));
            }
            k.push(x.ctx.storage_buffer(&format!("k cache {l}"), bytes));
            v.push(x.ctx.storage_buffer(&format!("v cache {l}"), bytes));
        }
        let mut ops = vec![];
        for n in batch_sizes() {
            let mut per_layer = vec![];
            // The decode kernel's partial results: one buffer for all layers of this batch
            // size (their attention dispatches run one after another), created on first need.
            let mut scratch: Option<wgpu::Buffer> = None;
            // The same for the prefill kernel's split tiles.
            let mut prefill_scratch: Option<wgpu::Buffer> = None;
            for (l, lw) in x.w.layers.iter().enumerate() {
                let at = attention[l];
                let hd = at.head_dim;
                let r = rope_inputs(lw, x.a, at, n);
                let desc = AttnDesc {
                    q: r.q,
                    k_cache: BufRef::new(&k[l]),
                    v_cache: BufRef::new(&v[l]),
                    out: BufRef::new(&x.a.attn),
                    step: x.step,
                    n_heads: at.heads,
                    n_kv_heads: at.kv_heads,
                    head_dim: hd,
                    n_tokens: n,
                    capacity,
                    scale: (hd as f32).powf(-0.5),
                    window: at.window,
                };
                let rope = FusedRope {
                    k: r.k,
                    v: r.v,
                    norms: r.norms,
                    inv_freq: BufRef::new(&x.w.inv_freq),
                    rot_dim: hd,
                    rope_scale: x.rope_scale,
                    eps: x.spec.eps,
                };
                // One token: the decode attention normalizes, rotates and appends itself.
                let fused = (n == 1).then_some(rope);
                let separate = match fused {
                    Some(_) => None,
                    None => {
                        let d = QkNormRopeDesc::before(&desc, &rope);
                        Some(QkNormRope::new(x.ctx, &d).map_err(gpu_err)?)
                    }
                };
                let attn = match n >= PREFILL_MIN {
                    true => {
                        let t = PrefillAttnTuning::pick_for(x.ctx, &desc);
                        let bytes = PrefillAttention::scratch_bytes(&desc, t).max(16);
                        let buf = prefill_scratch.get_or_insert_with(|| {
                            x.ctx.storage_buffer("prefill attention partials", bytes)
                        });
                        let a = PrefillAttention::with_scratch(x.ctx, &desc, t, buf);
                        Attention::Prefill(a.map_err(gpu_err)?)
                    }
                    false => {
                        let bytes = DecodeAttention::scratch_bytes(&desc).max(16);
                        let buf = scratch.get_or_insert_with(|| {
                            x.ctx.storage_buffer("attention partials", bytes)
                        });
                        let a = DecodeAttention::with_rope(x.ctx, &desc, buf, fused.as_ref());
                        Attention::Decode(a.map_err(gpu_err)?)
                    }
                };
                per_layer.push((separate, attn));
            }
            ops.push(per_layer);
        }
        Ok(GpuKv {
            owner,
            capacity,
            _k: k,
            _v: v,
            ops,
            pool,
        })
    }

    /// Records layer `l`'s RoPE/append and attention for batch size index `bi`.
    pub(crate) fn record(&self, bi: usize, l: usize, r: &mut Recorder) {
        let (rope, attn) = &self.ops[bi][l];
        if let Some(rope) = rope {
            r.step("qk-norm rope kv-append", rope);
        }
        r.step("attention", attn);
    }
}

#[cfg(test)]
mod tests {
    use super::KvPool;

    #[test]
    fn the_pool_keeps_the_newest_caches_within_its_limits() {
        const G: u64 = 1 << 30;
        // Small caches: at most KEEP, the newest.
        assert_eq!(KvPool::surplus(&[1, 1, 1, 1, 1, 1]), 2);
        assert_eq!(KvPool::surplus(&[1, 1]), 0);
        assert_eq!(KvPool::surplus(&[]), 0);
        // Large ones: at most KEEP_BYTES in all…
        assert_eq!(KvPool::surplus(&[G, G, G]), 1);
        assert_eq!(KvPool::surplus(&[G / 2, G, G]), 1);
        // …but always the newest, however large.
        assert_eq!(KvPool::surplus(&[G, 3 * G]), 1);
        assert_eq!(KvPool::surplus(&[5 * G]), 0);
    }
}
