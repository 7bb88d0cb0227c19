//! Per-head QK-norm + RoPE + KV append (`gpu::QkNormRope`), decode attention (alone and with
//! those steps fused in) and prefill attention, against the CPU forward's steps:
//! `cpu::ops::{rms_norm_inplace, rope_inplace, attention}`.

use super::{guarded, guards_kept, poisoned, read_guarded, read_span, submit, AT};
use crate::conformance::{Case, Check, Op, Rng, Tol, Unsupported};
use smoe_compute::cpu::ops::{self, AttnShape};
use smoe_compute::gpu::{
    AttnDesc, BufRef, DecodeAttention, FusedRope, GpuContext, GpuError, PrefillAttention,
    PrefillAttnTuning, QkNormRopeDesc,
};

const EPS: f32 = 1e-6;

/// Inverse frequencies as the engine's RopeTable computes them (no YaRN).
fn inv_freq(theta: f64, dims: usize) -> Vec<f32> {
    (0..dims / 2)
        .map(|i| 1.0 / theta.powf((2 * i) as f64 / dims as f64) as f32)
        .collect()
}

/// cos/sin at `pos` as the engine computes them: f32 angle, f64 trigonometry, times scale.
fn cos_sin(inv: &[f32], pos: usize, scale: f32) -> (Vec<f32>, Vec<f32>) {
    let a: Vec<f32> = inv.iter().map(|f| f * pos as f32).collect();
    (
        a.iter().map(|a| (*a as f64).cos() as f32 * scale).collect(),
        a.iter().map(|a| (*a as f64).sin() as f32 * scale).collect(),
    )
}

/// The CPU's QK-norm (if `norms`) and rotate-half RoPE of each head's first `rot` dims, token
/// `t` of `x` (rows of `width`) at position `pos0 + t`.
#[allow(clippy::too_many_arguments)]
fn norm_rope(
    x: &mut [f32],
    width: usize,
    hd: usize,
    rot: usize,
    norm: Option<&[f32]>,
    pos0: usize,
    inv: &[f32],
    scale: f32,
) {
    if let Some(w) = norm {
        ops::rms_norm_inplace(x, w, EPS);
    }
    for (t, row) in x.chunks_exact_mut(width).enumerate() {
        let (c, s) = cos_sin(inv, pos0 + t, scale);
        for head in row.chunks_exact_mut(hd) {
            ops::rope_inplace(&mut head[..rot], rot, &c, &s);
        }
    }
}

/// Heads, KV heads and head width of a GQA layer.
#[derive(Clone, Copy, Debug)]
pub struct Heads(pub usize, pub usize, pub usize);

impl Heads {
    fn shape(self, scale: f32, window: Option<usize>) -> AttnShape {
        AttnShape {
            n_heads: self.0,
            n_kv_heads: self.1,
            head_dim: self.2,
            scale,
            window,
        }
    }
}

/// QK-norm (optional), RoPE and the KV append of `tokens` tokens at `pos0`: q in place, k and
/// v into the caches (one buffer, V after K), the rest of the cache left alone.
#[derive(Clone, Debug)]
pub struct QkNormRope {
    pub heads: Heads,
    pub tokens: usize,
    pub pos0: usize,
    pub norm: bool,
}

impl Case for QkNormRope {
    fn op(&self) -> Op {
        Op::QkNormRope
    }
    fn shape(&self) -> String {
        let Heads(nh, nkv, hd) = self.heads;
        format!("{nh}/{nkv}x{hd} t{} pos {}", self.tokens, self.pos0)
    }
    fn types(&self) -> String {
        if self.norm { "f32 +norm" } else { "f32" }.into()
    }

    fn run(&self, ctx: &GpuContext, rng: &mut Rng) -> Result<Vec<Check>, Unsupported> {
        let (Heads(nh, nkv, hd), nt, pos0) = (self.heads, self.tokens, self.pos0);
        let (qw, kw, cap) = (nh * hd, nkv * hd, pos0 + nt + 3);
        let (q, k, v) = (
            rng.vec(nt * qw, 2.0),
            rng.vec(nt * kw, 2.0),
            rng.vec(nt * kw, 2.0),
        );
        let (qn, kn) = (rng.vec(hd, 1.5), rng.vec(hd, 1.5));
        let (inv, scale) = (inv_freq(1e6, hd), 1.1);
        let (mut qc, mut kc) = (q.clone(), k.clone());
        let norms = |w| self.norm.then_some(w);
        norm_rope(&mut qc, qw, hd, hd, norms(&qn[..]), pos0, &inv, scale);
        norm_rope(&mut kc, kw, hd, hd, norms(&kn[..]), pos0, &inv, scale);

        let (qb, kb, vb) = (
            guarded(ctx, "q", &q),
            guarded(ctx, "k", &k),
            guarded(ctx, "v", &v),
        );
        let cache = poisoned(ctx, "kv cache", 2 * cap * kw);
        let nbuf = ctx.upload_f32("norms", &[qn, kn].concat());
        let invb = ctx.upload_f32("inv_freq", &inv);
        let step = ctx.step_buffer();
        ctx.write_step(&step, pos0 as u32);
        let kern = smoe_compute::gpu::QkNormRope::new(
            ctx,
            &QkNormRopeDesc {
                q: BufRef::at(&qb, AT),
                k: BufRef::at(&kb, AT),
                v: BufRef::at(&vb, AT),
                k_cache: BufRef::at(&cache, AT),
                v_cache: BufRef::at(&cache, AT + (4 * cap * kw) as u64),
                norms: self
                    .norm
                    .then(|| (BufRef::new(&nbuf), BufRef::at(&nbuf, 4 * hd as u64))),
                inv_freq: BufRef::new(&invb),
                rot_dim: hd,
                rope_scale: scale,
                eps: EPS,
                step: &step,
                n_heads: nh,
                n_kv_heads: nkv,
                head_dim: hd,
                n_tokens: nt,
                capacity: cap,
            },
        )
        .unwrap();
        submit(ctx, |enc| kern.encode(enc));
        let (got_q, q_guards) = read_guarded(ctx, &qb, nt * qw);
        let guards = guards_kept(ctx, &cache, 2 * cap * kw);
        let (k_at, v_at) = (pos0 * kw, (cap + pos0) * kw);
        // The position before the appended ones (if any) and the three after them.
        let neighbours = |at: usize| {
            let before = (pos0 > 0).then(|| read_span(ctx, &cache, at - kw, kw));
            let after = read_span(ctx, &cache, at + nt * kw, 3 * kw);
            before.iter().flatten().chain(&after).all(|x| x.is_nan())
        };
        Ok(vec![
            Check::values("q", got_q, qc),
            Check::values("appended k", read_span(ctx, &cache, k_at, nt * kw), kc),
            Check::values_within(
                "appended v",
                read_span(ctx, &cache, v_at, nt * kw),
                v,
                Tol::MaxAbs(0.0),
            ),
            Check::holds(
                "the rest of the cache untouched",
                neighbours(k_at) && neighbours(v_at),
            ),
            Check::holds("nothing written around q and the cache", q_guards && guards),
        ])
    }
}

/// Decode attention of `tokens` tokens at `pos0` over caches of `capacity` positions (random
/// before the context, never read after it), optionally within a sliding window.
#[derive(Clone, Debug)]
pub struct Decode {
    pub heads: Heads,
    pub tokens: usize,
    pub pos0: usize,
    pub capacity: usize,
    pub window: Option<usize>,
}

impl Case for Decode {
    fn op(&self) -> Op {
        Op::DecodeAttention
    }
    fn shape(&self) -> String {
        let Heads(nh, nkv, hd) = self.heads;
        let (nt, pos0, cap) = (self.tokens, self.pos0, self.capacity);
        format!(
            "{nh}/{nkv}x{hd} t{nt} pos {pos0} cap {cap} window {:?}",
            self.window
        )
    }
    fn types(&self) -> String {
        "f32".into()
    }

    fn run(&self, ctx: &GpuContext, rng: &mut Rng) -> Result<Vec<Check>, Unsupported> {
        let (Heads(nh, nkv, hd), nt, pos0, cap) =
            (self.heads, self.tokens, self.pos0, self.capacity);
        let kw = nkv * hd;
        let n_ctx = pos0 + nt;
        let q = rng.vec(nt * nh * hd, 1.0);
        let (mut kcache, mut vcache) = (rng.vec(cap * kw, 1.0), rng.vec(cap * kw, 1.0));
        let scale = 1.0 / (hd as f32).sqrt();
        let mut want = vec![0f32; nt * nh * hd];
        let (kx, vx) = (&kcache[..n_ctx * kw], &vcache[..n_ctx * kw]);
        ops::attention(
            &q,
            kx,
            vx,
            pos0,
            self.heads.shape(scale, self.window),
            &mut want,
        );

        kcache[n_ctx * kw..].fill(f32::NAN);
        vcache[n_ctx * kw..].fill(f32::NAN);
        let qb = guarded(ctx, "q", &q);
        let kb = guarded(ctx, "k cache", &kcache);
        let vb = guarded(ctx, "v cache", &vcache);
        let ob = poisoned(ctx, "out", nt * nh * hd);
        let step = ctx.step_buffer();
        ctx.write_step(&step, pos0 as u32);
        let desc = AttnDesc {
            q: BufRef::at(&qb, AT),
            k_cache: BufRef::at(&kb, AT),
            v_cache: BufRef::at(&vb, AT),
            out: BufRef::at(&ob, AT),
            step: &step,
            n_heads: nh,
            n_kv_heads: nkv,
            head_dim: hd,
            n_tokens: nt,
            capacity: cap,
            scale,
            window: self.window,
        };
        let attn = DecodeAttention::new(ctx, &desc).unwrap();
        submit(ctx, |enc| attn.encode(enc));
        let (got, guards) = read_guarded(ctx, &ob, nt * nh * hd);
        Ok(vec![
            Check::values("out", got, want),
            Check::holds("nothing written around out", guards),
        ])
    }
}

/// Decode attention of one token with QK-norm (optional), RoPE of the first `rot` dims of each
/// head and the KV append fused in (`DecodeAttention::with_rope`), q, k and v read from one
/// buffer as the qkv projection writes them: the output, the appended key and value, and the
/// cache after them left alone.
#[derive(Clone, Debug)]
pub struct DecodeRope {
    pub heads: Heads,
    pub pos0: usize,
    pub capacity: usize,
    pub window: Option<usize>,
    pub norm: bool,
    pub rot: usize,
}

impl Case for DecodeRope {
    fn op(&self) -> Op {
        Op::DecodeAttention
    }
    fn shape(&self) -> String {
        let Heads(nh, nkv, hd) = self.heads;
        let (pos0, cap) = (self.pos0, self.capacity);
        format!(
            "{nh}/{nkv}x{hd} t1 pos {pos0} cap {cap} window {:?}",
            self.window
        )
    }
    fn types(&self) -> String {
        let norm = if self.norm { "+norm" } else { "" };
        format!("f32 {norm}+rope({})+append", self.rot)
    }

    fn run(&self, ctx: &GpuContext, rng: &mut Rng) -> Result<Vec<Check>, Unsupported> {
        let (Heads(nh, nkv, hd), pos0, cap) = (self.heads, self.pos0, self.capacity);
        let (qw, kw) = (nh * hd, nkv * hd);
        let (q, k, v) = (rng.vec(qw, 2.0), rng.vec(kw, 2.0), rng.vec(kw, 2.0));
        let (qn, kn) = (rng.vec(hd, 1.5), rng.vec(hd, 1.5));
        let (inv, rscale) = (inv_freq(1e6, self.rot), 1.05);
        let (mut qc, mut kc) = (q.clone(), k.clone());
        let norms = |w| self.norm.then_some(w);
        norm_rope(
            &mut qc,
            qw,
            hd,
            self.rot,
            norms(&qn[..]),
            pos0,
            &inv,
            rscale,
        );
        norm_rope(
            &mut kc,
            kw,
            hd,
            self.rot,
            norms(&kn[..]),
            pos0,
            &inv,
            rscale,
        );
        // Earlier positions random, the current one appended, later ones poisoned.
        let (mut kcache, mut vcache) = (rng.vec(cap * kw, 1.0), rng.vec(cap * kw, 1.0));
        kcache[pos0 * kw..][..kw].copy_from_slice(&kc);
        vcache[pos0 * kw..][..kw].copy_from_slice(&v);
        let scale = 1.0 / (hd as f32).sqrt();
        let mut want = vec![0f32; qw];
        let (kx, vx) = (&kcache[..(pos0 + 1) * kw], &vcache[..(pos0 + 1) * kw]);
        ops::attention(
            &qc,
            kx,
            vx,
            pos0,
            self.heads.shape(scale, self.window),
            &mut want,
        );

        let qkv = guarded(ctx, "qkv", &[q, k, v.clone()].concat());
        kcache[pos0 * kw..].fill(f32::NAN);
        vcache[pos0 * kw..].fill(f32::NAN);
        let kb = guarded(ctx, "k cache", &kcache);
        let vb = guarded(ctx, "v cache", &vcache);
        let ob = poisoned(ctx, "out", qw);
        let nbuf = ctx.upload_f32("norms", &[qn, kn].concat());
        let invb = ctx.upload_f32("inv_freq", &inv);
        let step = ctx.step_buffer();
        ctx.write_step(&step, pos0 as u32);
        let desc = AttnDesc {
            q: BufRef::at(&qkv, AT),
            k_cache: BufRef::at(&kb, AT),
            v_cache: BufRef::at(&vb, AT),
            out: BufRef::at(&ob, AT),
            step: &step,
            n_heads: nh,
            n_kv_heads: nkv,
            head_dim: hd,
            n_tokens: 1,
            capacity: cap,
            scale,
            window: self.window,
        };
        let rope = FusedRope {
            k: BufRef::at(&qkv, AT + 4 * qw as u64),
            v: BufRef::at(&qkv, AT + 4 * (qw + kw) as u64),
            norms: self
                .norm
                .then(|| (BufRef::new(&nbuf), BufRef::at(&nbuf, 4 * hd as u64))),
            inv_freq: BufRef::new(&invb),
            rot_dim: self.rot,
            rope_scale: rscale,
            eps: EPS,
        };
        let scratch = ctx.storage_buffer("partials", DecodeAttention::scratch_bytes(&desc));
        let attn = DecodeAttention::with_rope(ctx, &desc, &scratch, Some(&rope)).unwrap();
        submit(ctx, |enc| attn.encode(enc));
        let (got, guards) = read_guarded(ctx, &ob, qw);
        let guards = guards && guards_kept(ctx, &kb, cap * kw) && guards_kept(ctx, &vb, cap * kw);
        let (at, rest) = (pos0 * kw, (cap - pos0 - 1) * kw);
        let after = |b| read_span(ctx, b, at + kw, rest).iter().all(|x| x.is_nan());
        Ok(vec![
            Check::values("out", got, want),
            Check::values("appended k", read_span(ctx, &kb, at, kw), kc),
            Check::values_within(
                "appended v",
                read_span(ctx, &vb, at, kw),
                v,
                Tol::MaxAbs(0.0),
            ),
            Check::holds("cache after pos0 untouched", after(&kb) && after(&vb)),
            Check::holds("nothing written around out and the caches", guards),
        ])
    }
}

/// The prefill attention's tile.
#[derive(Clone, Copy, Debug)]
pub enum PrefillTile {
    /// `PrefillAttention::new`'s.
    Default,
    /// Rows and score dims, no key splits: not supported where the device lacks the workgroup
    /// memory, except 32 × 128, which every device with 40 KiB must run.
    Fixed(usize, usize),
    /// `PrefillAttnTuning::pick(ctx, 64)` with this many key splits.
    Splits(usize),
}

/// Causal prefill attention of `tokens` tokens, recorded once and run at each of `pos0s`
/// (set through the step uniform only). Keys are scaled up so that softmaxes are peaked as
/// well as flat; cache positions past the chunk hold NaN and must never be read.
#[derive(Clone, Debug)]
pub struct Prefill {
    pub heads: Heads,
    pub tokens: usize,
    pub capacity: usize,
    pub window: Option<usize>,
    pub pos0s: Vec<usize>,
    pub tile: PrefillTile,
}

impl Case for Prefill {
    fn op(&self) -> Op {
        Op::PrefillAttention
    }
    fn shape(&self) -> String {
        let Heads(nh, nkv, hd) = self.heads;
        let (nt, cap, w) = (self.tokens, self.capacity, self.window);
        format!(
            "{nh}/{nkv}x{hd} t{nt} pos {:?} cap {cap} window {w:?}",
            self.pos0s
        )
    }
    fn types(&self) -> String {
        match self.tile {
            PrefillTile::Default => "f32".into(),
            PrefillTile::Fixed(rows, dims) => format!("f32 tile {rows}x{dims}"),
            PrefillTile::Splits(s) => format!("f32 picked tile, {s} splits"),
        }
    }

    fn run(&self, ctx: &GpuContext, rng: &mut Rng) -> Result<Vec<Check>, Unsupported> {
        let (Heads(nh, nkv, hd), nt, cap) = (self.heads, self.tokens, self.capacity);
        let kw = nkv * hd;
        let q = rng.vec(nt * nh * hd, 1.0);
        let (kcache, vcache) = (rng.vec(cap * kw, 3.0), rng.vec(cap * kw, 1.0));
        let scale = 1.0 / (hd as f32).sqrt();
        let qb = guarded(ctx, "q", &q);
        let kb = poisoned(ctx, "k cache", cap * kw);
        let vb = poisoned(ctx, "v cache", cap * kw);
        let ob = poisoned(ctx, "out", nt * nh * hd);
        let step = ctx.step_buffer();
        let desc = AttnDesc {
            q: BufRef::at(&qb, AT),
            k_cache: BufRef::at(&kb, AT),
            v_cache: BufRef::at(&vb, AT),
            out: BufRef::at(&ob, AT),
            step: &step,
            n_heads: nh,
            n_kv_heads: nkv,
            head_dim: hd,
            n_tokens: nt,
            capacity: cap,
            scale,
            window: self.window,
        };
        let attn = match self.tile {
            PrefillTile::Default => PrefillAttention::new(ctx, &desc),
            PrefillTile::Fixed(rows, dims) => {
                let t = PrefillAttnTuning {
                    rows,
                    dims,
                    splits: 1,
                };
                let must_fit = (rows, dims) == (32, 128)
                    && ctx.limits().max_compute_workgroup_storage_size >= 40 << 10;
                match PrefillAttention::with_tuning(ctx, &desc, t) {
                    Err(GpuError::Shape(m)) if m.contains("workgroup memory") && !must_fit => {
                        return Err(Unsupported(m));
                    }
                    r => r,
                }
            }
            PrefillTile::Splits(splits) => {
                let t = PrefillAttnTuning {
                    splits,
                    ..PrefillAttnTuning::pick(ctx, 64)
                };
                PrefillAttention::with_tuning(ctx, &desc, t)
            }
        }
        .unwrap();
        let mut checks = vec![];
        for &pos0 in &self.pos0s {
            let n_ctx = pos0 + nt;
            assert!(n_ctx <= cap);
            let mut want = vec![0f32; nt * nh * hd];
            let (kx, vx) = (&kcache[..n_ctx * kw], &vcache[..n_ctx * kw]);
            ops::attention(
                &q,
                kx,
                vx,
                pos0,
                self.heads.shape(scale, self.window),
                &mut want,
            );
            let upto = |c: &[f32]| {
                let mut c = c[..n_ctx * kw].to_vec();
                c.resize(cap * kw, f32::NAN);
                c
            };
            let write = |b, v: &[f32]| ctx.queue.write_buffer(b, AT, bytemuck::cast_slice(v));
            write(&kb, &upto(&kcache));
            write(&vb, &upto(&vcache));
            write(&ob, &vec![f32::NAN; nt * nh * hd]);
            ctx.write_step(&step, pos0 as u32);
            submit(ctx, |enc| attn.encode(enc));
            let (got, guards) = read_guarded(ctx, &ob, nt * nh * hd);
            checks.push(Check::values(format!("out at pos0 {pos0}"), got, want));
            checks.push(Check::holds(
                format!("nothing written around out at pos0 {pos0}"),
                guards,
            ));
        }
        Ok(checks)
    }
}
