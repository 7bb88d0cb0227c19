//! Wrappers of the attention kernels: per-head QK-norm + RoPE + KV append and decode attention
//! (flash-decoding: split the context, then combine); prefill attention (flash-attention tiles
//! of queries × keys, for chunks of many tokens) is in `attn_prefill.rs`. All read the step's
//! position `pos0` from
//! the step uniform (`GpuContext::step_buffer` / `write_step`), so they are recorded once and
//! replayed at every position. The caller keeps `pos0 + n_tokens <= capacity` (the engine's
//! `KvCache::check_room`): positions are not bounds-checked on the GPU in release builds.

use super::buffers::{Binding, BufRef};
use super::context::{GpuContext, GpuError};
use super::ops::{recordable, Dispatch};

/// Per-head RMSNorm of q and k, RoPE on both, and the append of k and v to the caches.
#[derive(Clone, Copy, Debug)]
pub struct QkNormRopeDesc<'a> {
    /// `[n_tokens][n_heads·head_dim]`, rotated in place.
    pub q: BufRef<'a>,
    /// `[n_tokens][n_kv_heads·head_dim]` each.
    pub k: BufRef<'a>,
    pub v: BufRef<'a>,
    /// Position 0 of this layer's caches, `[capacity][n_kv_heads·head_dim]` each.
    pub k_cache: BufRef<'a>,
    pub v_cache: BufRef<'a>,
    /// `(q_norm, k_norm)`, `head_dim` f32 each; `None`: no QK-norm.
    pub norms: Option<(BufRef<'a>, BufRef<'a>)>,
    /// `rot_dim / 2` inverse frequencies (the engine's `RopeTable`); `rot_dim < head_dim` is
    /// partial rotary.
    pub inv_freq: BufRef<'a>,
    pub rot_dim: usize,
    /// Multiplies cos and sin (YaRN's attention factor; 1 otherwise).
    pub rope_scale: f32,
    pub eps: f32,
    pub step: &'a wgpu::Buffer,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub n_tokens: usize,
    pub capacity: usize,
}

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct RopeParams {
    n_heads: u32,
    n_kv: u32,
    head_dim: u32,
    rot_dim: u32,
    q_off: u32,
    k_off: u32,
    v_off: u32,
    kc_off: u32,
    vc_off: u32,
    qn_off: u32,
    kn_off: u32,
    inv_off: u32,
    eps: f32,
    rope_scale: f32,
    has_norm: u32,
    _pad: u32,
}

pub struct QkNormRope {
    d: Dispatch,
}

impl QkNormRope {
    pub fn new(ctx: &GpuContext, a: &QkNormRopeDesc) -> Result<Self, GpuError> {
        let (hd, kvw) = (a.head_dim, a.n_kv_heads * a.head_dim);
        if !a.rot_dim.is_multiple_of(2)
            || a.rot_dim > hd
            || a.n_kv_heads == 0
            || !a.n_heads.is_multiple_of(a.n_kv_heads)
        {
            return Err(GpuError::Shape(format!(
                "qk_norm_rope: rot_dim {} head_dim {hd}, {} heads over {} kv heads",
                a.rot_dim, a.n_heads, a.n_kv_heads
            )));
        }
        let (qb, q_off) =
            a.q.bind(ctx, "qk_norm_rope q", a.n_tokens * a.n_heads * hd, 4)?;
        let (kb, k_off) = a.k.bind(ctx, "qk_norm_rope k", a.n_tokens * kvw, 4)?;
        let (vb, v_off) = a.v.bind(ctx, "qk_norm_rope v", a.n_tokens * kvw, 4)?;
        let (kcb, kc_off) = a
            .k_cache
            .bind(ctx, "qk_norm_rope k cache", a.capacity * kvw, 4)?;
        let (vcb, vc_off) = a
            .v_cache
            .bind(ctx, "qk_norm_rope v cache", a.capacity * kvw, 4)?;
        let (ib, inv_off) = a
            .inv_freq
            .bind(ctx, "qk_norm_rope inv_freq", a.rot_dim / 2, 4)?;
        // Without QK-norm the norm bindings are never read: bind the frequencies there.
        let ((qnb, qn_off), (knb, kn_off)) = match a.norms {
            Some((qn, kn)) => (
                qn.bind(ctx, "q_norm", hd, 4)?,
                kn.bind(ctx, "k_norm", hd, 4)?,
            ),
            None => ((ib, inv_off), (ib, inv_off)),
        };
        let p = RopeParams {
            n_heads: a.n_heads as u32,
            n_kv: a.n_kv_heads as u32,
            head_dim: hd as u32,
            rot_dim: a.rot_dim as u32,
            q_off,
            k_off,
            v_off,
            kc_off,
            vc_off,
            qn_off,
            kn_off,
            inv_off,
            eps: a.eps,
            rope_scale: a.rope_scale,
            has_norm: a.norms.is_some() as u32,
            _pad: 0,
        };
        let bufs = [Binding::whole(a.step), qb, kb, vb, kcb, vcb, qnb, knb, ib];
        let heads = a.n_heads + 2 * a.n_kv_heads;
        let d = Dispatch::new(
            ctx,
            "qk_norm_rope",
            &[("WG", 128.0)],
            &p,
            &bufs,
            [heads, a.n_tokens, 1],
        )?;
        Ok(QkNormRope { d })
    }
}
recordable!(QkNormRope, "qk_norm_rope", d);

/// Causal GQA attention of `n_tokens` new tokens (positions `pos0..pos0 + n_tokens`, already
/// appended to the caches) over positions `0..=pos0 + t`.
#[derive(Clone, Copy, Debug)]
pub struct AttnDesc<'a> {
    /// `[n_tokens][n_heads·head_dim]`.
    pub q: BufRef<'a>,
    pub k_cache: BufRef<'a>,
    pub v_cache: BufRef<'a>,
    /// `[n_tokens][n_heads·head_dim]`.
    pub out: BufRef<'a>,
    pub step: &'a wgpu::Buffer,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub n_tokens: usize,
    pub capacity: usize,
    /// Multiplies q·k (1/sqrt(head_dim) for Qwen3).
    pub scale: f32,
    /// Sliding window: attend only to the last `window` positions (the current one included).
    pub window: Option<usize>,
}

/// An attention kernel's four bindings, each with the element offset of its first value.
pub(crate) struct AttnBindings<'a> {
    pub q: (Binding<'a>, u32),
    pub out: (Binding<'a>, u32),
    pub k: (Binding<'a>, u32),
    pub v: (Binding<'a>, u32),
}

impl<'a> AttnDesc<'a> {
    /// Binds q, the output (at a multiple of `out_align` bytes) and the K/V caches, checking
    /// their sizes.
    pub(crate) fn bind(
        &self,
        ctx: &GpuContext,
        out_align: u64,
    ) -> Result<AttnBindings<'a>, GpuError> {
        let (rows, kvw) = (
            self.n_tokens * self.n_heads * self.head_dim,
            self.n_kv_heads * self.head_dim,
        );
        Ok(AttnBindings {
            q: self.q.bind(ctx, "attention q", rows, 16)?,
            out: self.out.bind(ctx, "attention out", rows, out_align)?,
            k: self
                .k_cache
                .bind(ctx, "attention k cache", self.capacity * kvw, 16)?,
            v: self
                .v_cache
                .bind(ctx, "attention v cache", self.capacity * kvw, 16)?,
        })
    }
}

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct DecodeParams {
    n_heads: u32,
    n_kv: u32,
    head_dim: u32,
    n_split: u32,
    q_off: u32,
    kc_off: u32,
    vc_off: u32,
    ml_off: u32,
    scale: f32,
    window: u32,
    out_off: u32,
    k_off: u32,
    v_off: u32,
    qn_off: u32,
    kn_off: u32,
    inv_off: u32,
    rot_dim: u32,
    eps: f32,
    rope_scale: f32,
    has_norm: u32,
    _pad: [u32; 3],
}

/// `DecodeAttention::with_rope`: what `QkNormRope` would have done first, for one token — q (the
/// attention's `q`), `k` and `v` as the qkv projection wrote them, normalized per head, rotated,
/// and k, v appended to the caches, inside the attention dispatch.
#[derive(Clone, Copy, Debug)]
pub struct FusedRope<'a> {
    /// `[n_kv_heads·head_dim]` each.
    pub k: BufRef<'a>,
    pub v: BufRef<'a>,
    /// `(q_norm, k_norm)`, `head_dim` f32 each; `None`: no QK-norm.
    pub norms: Option<(BufRef<'a>, BufRef<'a>)>,
    /// `rot_dim / 2` inverse frequencies.
    pub inv_freq: BufRef<'a>,
    pub rot_dim: usize,
    pub rope_scale: f32,
    pub eps: f32,
}

impl<'a> QkNormRopeDesc<'a> {
    /// The separate dispatch of `rope`'s work before attention `a` (same q, caches and shape):
    /// what a batch of tokens runs where one token fuses it (`DecodeAttention::with_rope`).
    pub fn before(a: &AttnDesc<'a>, rope: &FusedRope<'a>) -> Self {
        QkNormRopeDesc {
            q: a.q,
            k: rope.k,
            v: rope.v,
            k_cache: a.k_cache,
            v_cache: a.v_cache,
            norms: rope.norms,
            inv_freq: rope.inv_freq,
            rot_dim: rope.rot_dim,
            rope_scale: rope.rope_scale,
            eps: rope.eps,
            step: a.step,
            n_heads: a.n_heads,
            n_kv_heads: a.n_kv_heads,
            head_dim: a.head_dim,
            n_tokens: a.n_tokens,
            capacity: a.capacity,
        }
    }
}

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct CombineParams {
    n_heads: u32,
    head_dim: u32,
    n_split: u32,
    ml_off: u32,
    out_off: u32,
    _pad: [u32; 3],
}

pub struct DecodeAttention {
    split: Dispatch,
    /// Merges the splits; `None` when there is one split, which writes the output directly, or
    /// when the last split merges them (`GpuContext::fused_tails`).
    combine: Option<Dispatch>,
    /// Partial outputs of the splits (shared by the layers of a sequence: their attention
    /// dispatches run one after another).
    _part: wgpu::Buffer,
}

/// Splits of the context: enough to fill a big GPU at long contexts; each split covers ≥ ~512
/// positions of a full cache, so at short contexts most of their tiles are cheap or empty. A
/// batch of 16 or more tokens fills the GPU with its (head, token) workgroups alone.
fn n_split(a: &AttnDesc) -> usize {
    match a.n_tokens {
        1..16 => a.capacity.div_ceil(512).clamp(1, 32),
        _ => 1,
    }
}

/// Largest head dimension the kernel's workgroup arrays hold.
pub const MAX_HEAD_DIM: usize = 512;

impl DecodeAttention {
    /// Bytes of partial results `a` needs in a scratch buffer (0: one split, which writes the
    /// output directly).
    pub fn scratch_bytes(a: &AttnDesc) -> u64 {
        match n_split(a) {
            1 => 0,
            s => 4 * (a.n_tokens * a.n_heads * s * (a.head_dim + 2)) as u64,
        }
    }

    /// With its own scratch buffer.
    pub fn new(ctx: &GpuContext, a: &AttnDesc) -> Result<Self, GpuError> {
        let scratch = ctx.storage_buffer("attention partials", Self::scratch_bytes(a).max(16));
        Self::with_scratch(ctx, a, &scratch)
    }

    /// Partial results in `scratch` (at least `scratch_bytes(a)`), which attention dispatches
    /// that run one after another — the layers of a sequence — can share.
    pub fn with_scratch(
        ctx: &GpuContext,
        a: &AttnDesc,
        scratch: &wgpu::Buffer,
    ) -> Result<Self, GpuError> {
        Self::with_rope(ctx, a, scratch, None)
    }

    /// As `with_scratch`, and with `rope` the kernel also does `QkNormRope`'s work (one token:
    /// `a.q` then holds the unrotated queries), saving that dispatch.
    pub fn with_rope(
        ctx: &GpuContext,
        a: &AttnDesc,
        scratch: &wgpu::Buffer,
        rope: Option<&FusedRope>,
    ) -> Result<Self, GpuError> {
        let hd = a.head_dim;
        if scratch.size() < Self::scratch_bytes(a) {
            return Err(GpuError::Shape(format!(
                "attention: scratch of {} bytes, needs {}",
                scratch.size(),
                Self::scratch_bytes(a)
            )));
        }
        if !hd.is_multiple_of(4)
            || hd > MAX_HEAD_DIM
            || a.n_kv_heads == 0
            || !a.n_heads.is_multiple_of(a.n_kv_heads)
        {
            return Err(GpuError::Shape(format!(
                "attention: head_dim {hd} (multiple of 4, at most {MAX_HEAD_DIM}), {} heads over {} kv heads",
                a.n_heads, a.n_kv_heads
            )));
        }
        let AttnBindings {
            q: (qb, q_off),
            out: (ob, out_off),
            k: (kb, kc_off),
            v: (vb, vc_off),
        } = a.bind(ctx, 4)?;
        let n_split = n_split(a);
        let rows = a.n_tokens * a.n_heads * n_split;
        let part = scratch.clone();
        let ml_off = (rows * hd) as u32;
        let kvw = a.n_kv_heads * hd;
        // Without a fused RoPE its bindings are never read: q stands in for them.
        let mut rb = [(qb, 0u32); 5];
        let (mut rot_dim, mut rope_scale, mut eps) = (0, 1.0, 0.0);
        if let Some(r) = rope {
            if a.n_tokens != 1 || r.rot_dim % 2 != 0 || r.rot_dim > hd {
                return Err(GpuError::Shape(format!(
                    "attention with RoPE: {} tokens (1), rot_dim {} of head_dim {hd}",
                    a.n_tokens, r.rot_dim
                )));
            }
            rb[0] = r.k.bind(ctx, "attention raw k", kvw, 4)?;
            rb[1] = r.v.bind(ctx, "attention raw v", kvw, 4)?;
            rb[4] = r
                .inv_freq
                .bind(ctx, "attention inv_freq", r.rot_dim / 2, 4)?;
            (rb[2], rb[3]) = match r.norms {
                Some((qn, kn)) => (
                    qn.bind(ctx, "attention q_norm", hd, 4)?,
                    kn.bind(ctx, "attention k_norm", hd, 4)?,
                ),
                None => (rb[4], rb[4]),
            };
            (rot_dim, rope_scale, eps) = (r.rot_dim, r.rope_scale, r.eps);
        }
        let dp = DecodeParams {
            n_heads: a.n_heads as u32,
            n_kv: a.n_kv_heads as u32,
            head_dim: hd as u32,
            n_split: n_split as u32,
            q_off,
            kc_off,
            vc_off,
            ml_off,
            scale: a.scale,
            window: a.window.unwrap_or(0) as u32,
            out_off,
            k_off: rb[0].1,
            v_off: rb[1].1,
            qn_off: rb[2].1,
            kn_off: rb[3].1,
            inv_off: rb[4].1,
            rot_dim: rot_dim as u32,
            eps,
            rope_scale,
            has_norm: rope.is_some_and(|r| r.norms.is_some()) as u32,
            _pad: [0; 3],
        };
        let direct = n_split == 1;
        // Several splits: on Vulkan the last split of each (head, token) merges them itself.
        let merge = !direct && ctx.fused_tails();
        let unused = ctx.storage_buffer("attention (unused)", 16);
        let out = if direct || merge {
            ob
        } else {
            Binding::whole(&unused)
        };
        // MERGE's counters, one per (token, head); without a merge the binding is never read.
        let counters = merge.then(|| {
            let n = a.n_tokens * a.n_heads;
            ctx.storage_buffer("attention merge counters", 4 * n as u64)
        });
        let bufs = [
            Binding::whole(a.step),
            qb,
            kb,
            vb,
            Binding::whole(&part),
            out,
            rb[0].0,
            rb[1].0,
            rb[2].0,
            rb[3].0,
            rb[4].0,
            Binding::whole(counters.as_ref().unwrap_or(&unused)),
            Binding::whole(&part),
        ];
        let groups = [n_split, a.n_heads, a.n_tokens];
        let consts = [
            ("WG", 128.0),
            ("DIRECT", direct as u8 as f64),
            ("ROPE", rope.is_some() as u8 as f64),
            ("MERGE", merge as u8 as f64),
        ];
        let split = Dispatch::new(ctx, "attn_decode", &consts, &dp, &bufs, groups)?;
        if direct || merge {
            return Ok(DecodeAttention {
                split,
                combine: None,
                _part: part,
            });
        }
        let cp = CombineParams {
            n_heads: a.n_heads as u32,
            head_dim: hd as u32,
            n_split: n_split as u32,
            ml_off,
            out_off,
            _pad: [0; 3],
        };
        let groups = [a.n_heads, a.n_tokens, 1];
        let combine = Some(Dispatch::new(
            ctx,
            "attn_combine",
            &[],
            &cp,
            &[Binding::whole(&part), ob],
            groups,
        )?);
        Ok(DecodeAttention {
            split,
            combine,
            _part: part,
        })
    }
}
recordable!(DecodeAttention, "attention", split, combine);
