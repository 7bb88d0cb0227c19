//! One decoder layer's dispatches for a batch of n tokens, recorded at load: everything except
//! the QK-norm/RoPE/KV-append and attention dispatches, which bind a sequence's KV cache and live
//! in `kv.rs`. The math is `model::decoder`'s:
//!
//! h = n1(x); q, k, v = proj(h) (+ bias) → qk-norm → clip → rope, KV append, attention
//! x += o(attn);  h = n2(x);  x += Σ_top-k w_e · expert_e(h) + σ(g·h) · shared(h)   or   mlp(h)

use super::acts::Acts;
use super::gpu_err;
use super::record::{Dispatch, Recorder};
use super::weights::{FfnW, LayerW, Mlp};
use crate::error::EngineError;
use smoe_compute::gpu::{
    BufRef, EltOp, Eltwise, GpuContext, Grouped, MatVec, MatVecDesc, RmsNorm, Router, WeightRef,
    WeightedSum,
};
use smoe_vault::ModelConfig;

/// A recorded dispatch and the step of the layer it belongs to (the label of the time
/// breakdown).
pub(crate) struct Op {
    pub step: &'static str,
    pub kernel: Box<dyn Dispatch + Send + Sync>,
}

impl Op {
    fn new(step: &'static str, kernel: impl Dispatch + Send + Sync + 'static) -> Self {
        Op {
            step,
            kernel: Box::new(kernel),
        }
    }

    pub fn record(&self, r: &mut Recorder) {
        r.step(self.step, &*self.kernel);
    }
}

/// Where the QK-norm/RoPE/KV-append kernel finds q, k, v, and the per-head norm weights it
/// applies itself (`None` when the norm ran before, or there is none).
pub(crate) struct RopeIn<'a> {
    pub q: BufRef<'a>,
    pub k: BufRef<'a>,
    pub v: BufRef<'a>,
    pub norms: Option<(BufRef<'a>, BufRef<'a>)>,
}

/// The qk-norm is fused into the RoPE kernel when it is per head and nothing (clip_qkv) must
/// happen between the norm and the rotation; otherwise it runs as a separate RMSNorm.
fn separate_norm(w: &LayerW, c: &ModelConfig) -> bool {
    w.qk_norm.as_ref().is_some_and(|((_, lq), (_, lk))| {
        *lq != c.head_dim || *lk != c.head_dim || c.clip_qkv.is_some()
    })
}

pub(crate) fn rope_inputs<'a>(w: &'a LayerW, a: &'a Acts, c: &ModelConfig, n: usize) -> RopeIn<'a> {
    if separate_norm(w, c) {
        return RopeIn {
            q: a.qn(n),
            k: a.kn(n),
            v: a.v(n),
            norms: None,
        };
    }
    RopeIn {
        q: a.q(n),
        k: a.k(n),
        v: a.v(n),
        norms: w
            .qk_norm
            .as_ref()
            .map(|((qn, _), (kn, _))| (BufRef::new(qn), BufRef::new(kn))),
    }
}

/// A layer's dispatches for n tokens: `pre` up to the RoPE kernel, `post` after attention.
pub(crate) struct LayerOps {
    pub pre: Vec<Op>,
    pub post: Vec<Op>,
    /// MoE layers: where in `post` the expert dispatches begin (after the router), so that a
    /// streaming pass can stop there, read the ids and fill the expert slots.
    pub experts_at: Option<usize>,
}

struct B<'a> {
    ctx: &'a GpuContext,
    a: &'a Acts,
    n: usize,
}

impl B<'_> {
    fn mv(
        &self,
        step: &'static str,
        w: WeightRef,
        up: Option<u64>,
        x: BufRef,
        y: BufRef,
        grouped: Option<Grouped>,
    ) -> Result<Op, EngineError> {
        // A grouped product covers the n tokens through its slots (each slot one token's expert).
        let n_tokens = if grouped.is_some() { 1 } else { self.n };
        let d = MatVecDesc {
            w,
            up_offset: up,
            x,
            y,
            n_tokens,
            grouped,
        };
        Ok(Op::new(step, MatVec::new(self.ctx, &d).map_err(gpu_err)?))
    }

    fn norm(
        &self,
        step: &'static str,
        x: BufRef,
        w: BufRef,
        y: BufRef,
        width: usize,
        rows: usize,
        eps: f32,
    ) -> Result<Op, EngineError> {
        let k = RmsNorm::new(self.ctx, x, w, y, width, rows, eps).map_err(gpu_err)?;
        Ok(Op::new(step, k))
    }

    fn elt(&self, step: &'static str, y: BufRef, len: usize, op: EltOp) -> Result<Op, EngineError> {
        Ok(Op::new(
            step,
            Eltwise::new(self.ctx, y, len, op).map_err(gpu_err)?,
        ))
    }

    /// x += weights[t·k + s] · y[t·k + s] over each token's k rows of y.
    fn add_to_x(
        &self,
        step: &'static str,
        y: BufRef,
        weights: BufRef,
        k: usize,
    ) -> Result<Op, EngineError> {
        let a = self.a;
        let s = WeightedSum::new(self.ctx, BufRef::new(&a.x), y, weights, a.d.h, k, self.n);
        Ok(Op::new(step, s.map_err(gpu_err)?))
    }

    /// out = down(silu(gate·hn) · up·hn) for a dense or shared MLP.
    fn mlp(&self, m: &Mlp, ops: &mut Vec<Op>) -> Result<(), EngineError> {
        let a = self.a;
        let (hn, gu, tmp) = (BufRef::new(&a.hn), BufRef::new(&a.gu), BufRef::new(&a.tmp));
        ops.push(self.mv(
            "mlp gate_up",
            m.gate_up.w(0),
            Some(m.up_offset()),
            hn,
            gu,
            None,
        )?);
        ops.push(self.mv("mlp down", m.down.w(0), None, gu, tmp, None)?);
        Ok(())
    }
}

impl LayerOps {
    pub fn new(
        ctx: &GpuContext,
        w: &LayerW,
        a: &Acts,
        c: &ModelConfig,
        n: usize,
    ) -> Result<Self, EngineError> {
        let b = B { ctx, a, n };
        let d = a.d;
        let eps = c.rms_norm_eps as f32;
        let (x, hn) = (BufRef::new(&a.x), BufRef::new(&a.hn));
        let mut pre = vec![b.norm("rms norm", x, BufRef::new(&w.input_norm), hn, d.h, n, eps)?];
        // q, k, v: one matvec over the three stacked matrices when a batch is one token.
        match w.qkv.fused().filter(|_| n == 1) {
            Some(fw) => pre.push(b.mv("qkv", fw, None, hn, a.q(1), None)?),
            None => {
                for (i, y) in [a.q(n), a.k(n), a.v(n)].into_iter().enumerate() {
                    pre.push(b.mv("qkv", w.qkv.w(i), None, hn, y, None)?);
                }
            }
        }
        let regions = [
            (a.q(n), d.qw, 0),
            (a.k(n), d.kw, d.qw),
            (a.v(n), d.kw, d.qw + d.kw),
        ];
        if let Some(bias) = &w.bias {
            for (y, width, at) in regions {
                let op = EltOp::AddRows {
                    bias: BufRef::at(bias, 4 * at as u64),
                    len: width,
                };
                pre.push(b.elt("qkv bias", y, n * width, op)?);
            }
        }
        if separate_norm(w, c) {
            let ((qn, lq), (kn, lk)) = w.qk_norm.as_ref().expect("checked by separate_norm");
            pre.push(b.norm(
                "qk norm",
                a.q(n),
                BufRef::new(qn),
                a.qn(n),
                *lq,
                n * d.qw / lq,
                eps,
            )?);
            pre.push(b.norm(
                "qk norm",
                a.k(n),
                BufRef::new(kn),
                a.kn(n),
                *lk,
                n * d.kw / lk,
                eps,
            )?);
        }
        if let Some(clip) = c.clip_qkv {
            let r = rope_inputs(w, a, c, n);
            for (y, width) in [(r.q, d.qw), (r.k, d.kw), (r.v, d.kw)] {
                pre.push(b.elt("clip qkv", y, n * width, EltOp::Clamp(clip))?);
            }
        }

        let (tmp, ones) = (BufRef::new(&a.tmp), BufRef::new(&a.ones));
        let mut post = vec![
            b.mv("o proj", w.o.w(0), None, BufRef::new(&a.attn), tmp, None)?,
            b.add_to_x("residual add", tmp, ones, 1)?,
            b.norm("rms norm", x, BufRef::new(&w.post_norm), hn, d.h, n, eps)?,
        ];
        let mut experts_at = None;
        match &w.ffn {
            FfnW::Dense(m) => {
                b.mlp(m, &mut post)?;
                post.push(b.add_to_x("residual add", tmp, ones, 1)?);
            }
            FfnW::Moe {
                router,
                experts: e,
                shared,
            } => {
                let k = d.k;
                let (rlog, ids, rw) = (
                    BufRef::new(&a.rlog),
                    BufRef::new(&a.ids),
                    BufRef::new(&a.rw),
                );
                post.push(b.mv("router", router.w(0), None, hn, rlog, None)?);
                let route = Router::new(ctx, rlog, ids, rw, e.n, k, n, c.norm_topk_prob);
                post.push(Op::new("router top-k", route.map_err(gpu_err)?));
                experts_at = Some(post.len());
                // Slot t·k + s is token t's s-th expert: gate_up reads token t's input (k slots
                // share it), down reads its slot's gate_up output.
                let grouped = |slots_per_x| Grouped {
                    ids: &a.ids,
                    ids_offset: 0,
                    n_slots: n * k,
                    n_mats: e.slots,
                    mat_stride: e.stride,
                    x_per_slot: true,
                    slots_per_x,
                };
                let (gu, eo) = (BufRef::new(&a.gu), BufRef::new(&a.eo));
                post.push(b.mv(
                    "experts gate_up",
                    e.gate.on(&e.buf),
                    Some(e.up_offset),
                    hn,
                    gu,
                    Some(grouped(k)),
                )?);
                post.push(b.mv(
                    "experts down",
                    e.down.on(&e.buf),
                    None,
                    gu,
                    eo,
                    Some(grouped(1)),
                )?);
                post.push(b.add_to_x("experts sum", eo, rw, k)?);
                if let Some((m, gate)) = shared {
                    b.mlp(m, &mut post)?;
                    let sg = BufRef::new(&a.sg);
                    post.push(b.mv("shared gate", gate.w(0), None, hn, sg, None)?);
                    post.push(b.elt("shared gate", sg, n, EltOp::Sigmoid)?);
                    post.push(b.add_to_x("shared sum", tmp, sg, 1)?);
                }
            }
        }
        Ok(LayerOps {
            pre,
            post,
            experts_at,
        })
    }
}
