//! The blocks a layer is lowered from: matrix-vector products for one token, token-batched
//! GEMMs for a chunk, with the fusions each takes (a norm in the product's prologue, the residual
//! add or a router in its epilogue), and the router, norm, eltwise and MLP blocks built on them.
//! `layer.rs` composes them in the order of the model description.

use super::acts::Acts;
use super::gpu_err;
use super::layer::Op;
use super::weights::{Mlp, Packed};
use crate::error::EngineError;
use smoe_compute::gpu::{
    wgpu, BufRef, EltOp, Eltwise, Fuse, GpuContext, Grouped, MatMul, MatMulDesc, MatMulGrouped,
    MatVec, MatVecDesc, NextRoute, RmsNorm, RouteTail, Router, WeightRef, WeightedSum,
};

/// What lowering a layer for n tokens needs: the device, the activations and the batch size.
pub(super) struct Lowering<'a> {
    pub ctx: &'a GpuContext,
    pub a: &'a Acts,
    pub n: usize,
    /// n ≥ GEMM_MIN.
    pub gemm: bool,
    pub norm_topk: bool,
    /// `Tuning::fused_router`.
    pub fused_router: bool,
}

/// The normed input of a block: `hn` written by a separate RMSNorm, or x normed inside each
/// consuming matvec.
#[derive(Clone, Copy)]
pub(super) enum Input<'a> {
    Normed,
    Fused(BufRef<'a>, f32),
}

impl Lowering<'_> {
    #[allow(clippy::too_many_arguments)]
    pub(super) fn matvec(
        &self,
        step: &'static str,
        w: WeightRef,
        up: Option<u64>,
        x: BufRef,
        y: BufRef,
        grouped: Option<Grouped>,
        fuse: Fuse,
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
        let k = MatVec::fused(self.ctx, &d, &fuse).map_err(gpu_err)?;
        Ok(Op::new(step, k))
    }

    /// A token-batched product of the n tokens (`MatMul`).
    pub(super) fn mm(
        &self,
        step: &'static str,
        w: WeightRef,
        up: Option<u64>,
        x: BufRef,
        y: BufRef,
        grouped: Option<MatMulGrouped>,
    ) -> Result<Op, EngineError> {
        self.gemm(step, self.mm_desc(w, up, x, y, grouped))
    }

    /// A dense `mm` writing its output rows `..a`, `a..b` and `b..` to three regions of `y`
    /// (`MatMulDesc::y_split`).
    pub(super) fn mm_split(
        &self,
        step: &'static str,
        w: WeightRef,
        x: BufRef,
        y: BufRef,
        split: [usize; 2],
    ) -> Result<Op, EngineError> {
        let d = MatMulDesc {
            y_split: Some(split),
            ..self.mm_desc(w, None, x, y, None)
        };
        self.gemm(step, d)
    }

    pub(super) fn mm_desc<'d>(
        &self,
        w: WeightRef<'d>,
        up: Option<u64>,
        x: BufRef<'d>,
        y: BufRef<'d>,
        grouped: Option<MatMulGrouped<'d>>,
    ) -> MatMulDesc<'d> {
        MatMulDesc {
            w,
            up_offset: up,
            x,
            y,
            n_tokens: self.n,
            grouped,
            y_split: None,
        }
    }

    pub(super) fn gemm(&self, step: &'static str, d: MatMulDesc) -> Result<Op, EngineError> {
        let k = MatMul::new(self.ctx, &d).map_err(gpu_err)?;
        Ok(Op::new(step, k))
    }

    /// A router's logits (a matvec even for a batch: it is small) and its top-k into `out`
    /// (logits, ids, weights): the top-k in the matvec's last workgroup where the adapter allows
    /// (`GpuContext::fused_tails`), otherwise a `Router` dispatch after it.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn route<'r>(
        &self,
        step: &'static str,
        router: &Packed,
        x: BufRef<'r>,
        out: [BufRef<'r>; 3],
        mut fuse: Fuse<'r>,
        n_exp: usize,
        k: usize,
    ) -> Result<Vec<Op>, EngineError> {
        let [logits, ids, weights] = out;
        let normalize = self.norm_topk;
        let top_k = |ops: &mut Vec<Op>| -> Result<(), EngineError> {
            let r = Router::new(self.ctx, logits, ids, weights, n_exp, k, self.n, normalize);
            let label = if step == "router" {
                "router top-k"
            } else {
                step
            };
            ops.push(Op::new(label, r.map_err(gpu_err)?));
            Ok(())
        };
        if self.gemm {
            // A prompt chunk: the logits as a token-batched GEMM (the matvec path reads the
            // router once per 8 tokens: 17.9 of 271 µs per prompt token on an H200).
            let mut ops = vec![self.mm(step, router.w(0), None, x, logits, None)?];
            top_k(&mut ops)?;
            return Ok(ops);
        }
        let tail = self.ctx.fused_tails();
        if tail {
            fuse.route = Some(RouteTail {
                ids,
                weights,
                k,
                normalize,
            });
        }
        let mut ops = vec![self.matvec(step, router.w(0), None, x, logits, None, fuse)?];
        if !tail {
            top_k(&mut ops)?;
        }
        Ok(ops)
    }

    /// x += weights[t·k + s] · y[t·k + s] over each token's k rows of y.
    pub(super) fn add_to_x(
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

    /// x += W·y: fused into the matvec, or a GEMM into `tmp` and a residual add.
    pub(super) fn proj_add(
        &self,
        step: &'static str,
        w: WeightRef,
        y: BufRef,
        ops: &mut Vec<Op>,
    ) -> Result<(), EngineError> {
        if !self.gemm {
            ops.push(self.matvec_add(step, w, y)?);
            return Ok(());
        }
        let (tmp, ones) = (BufRef::new(&self.a.tmp), BufRef::new(&self.a.ones));
        ops.push(self.mm(step, w, None, y, tmp, None)?);
        ops.push(self.add_to_x("residual add", tmp, ones, 1)?);
        Ok(())
    }

    /// Whether one token's o projection runs the next MoE block's router in its last
    /// workgroups (`Fuse::next_route`): where tails fuse and the router fits (`NextRoute::fits`:
    /// bf16, every converter's), unless `Tuning::fused_router` is off (the router's own dispatch,
    /// for comparisons). H100, q4 30B: see docs/performance.md ("The router inside the o projection").
    pub(super) fn router_in_o(&self, router: &Packed, o: WeightRef) -> bool {
        self.n == 1
            && !self.gemm
            && self.ctx.fused_tails()
            && NextRoute::fits(&router.w(0), o.rows)
            && self.fused_router
    }

    /// x += W·y for one token, with the next MoE block's router (its RMSNorm with `norm`, the
    /// logits, the top-k into ids and weights, the normed row into hn) in the product's last
    /// workgroups.
    pub(super) fn proj_add_route(
        &self,
        w: WeightRef,
        y: BufRef,
        router: &Packed,
        norm: &wgpu::Buffer,
        eps: f32,
        k: usize,
    ) -> Result<Op, EngineError> {
        let a = self.a;
        let fuse = Fuse {
            accumulate: true,
            next_route: Some(NextRoute {
                router: router.w(0),
                norm: (BufRef::new(norm), eps),
                normed: BufRef::new(&a.hn),
                route: RouteTail {
                    ids: BufRef::new(&a.ids),
                    weights: BufRef::new(&a.rw),
                    k,
                    normalize: self.norm_topk,
                },
            }),
            ..Fuse::default()
        };
        self.matvec("o proj + router", w, None, y, BufRef::new(&a.x), None, fuse)
    }

    /// A matvec reading the block's normed input (a GEMM for a batch).
    pub(super) fn matvec_in(
        &self,
        step: &'static str,
        input: Input,
        w: WeightRef,
        up: Option<u64>,
        y: BufRef,
        grouped: Option<Grouped>,
    ) -> Result<Op, EngineError> {
        let a = self.a;
        if self.gemm && grouped.is_none() {
            return self.mm(step, w, up, BufRef::new(&a.hn), y, None);
        }
        let (x, norm) = match input {
            Input::Normed => (BufRef::new(&a.hn), None),
            Input::Fused(nw, eps) => (BufRef::new(&a.x), Some((nw, eps))),
        };
        let fuse = Fuse {
            norm,
            ..Fuse::default()
        };
        self.matvec(step, w, up, x, y, grouped, fuse)
    }

    /// x += W·y.
    pub(super) fn matvec_add(
        &self,
        step: &'static str,
        w: WeightRef,
        y: BufRef,
    ) -> Result<Op, EngineError> {
        let fuse = Fuse {
            accumulate: true,
            ..Fuse::default()
        };
        self.matvec(step, w, None, y, BufRef::new(&self.a.x), None, fuse)
    }

    /// The input of a block: a separate norm into `hn` (pushed to `ops`), or fused.
    pub(super) fn input<'w>(
        &self,
        fused: bool,
        w: &'w wgpu::Buffer,
        eps: f32,
        ops: &mut Vec<Op>,
    ) -> Result<Input<'w>, EngineError> {
        if fused && !self.gemm {
            return Ok(Input::Fused(BufRef::new(w), eps));
        }
        let a = self.a;
        let (x, hn) = (BufRef::new(&a.x), BufRef::new(&a.hn));
        ops.push(self.norm("rms norm", x, BufRef::new(w), hn, a.d.h, self.n, eps)?);
        Ok(Input::Normed)
    }

    pub(super) fn norm(
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

    pub(super) fn elt(
        &self,
        step: &'static str,
        y: BufRef,
        len: usize,
        op: EltOp,
    ) -> Result<Op, EngineError> {
        let k = Eltwise::new(self.ctx, y, len, op).map_err(gpu_err)?;
        Ok(Op::new(step, k))
    }

    /// out = down(silu(gate·h) · up·h) for a dense or shared MLP; `add`: x += out, otherwise
    /// out lands in `tmp`.
    pub(super) fn mlp(
        &self,
        m: &Mlp,
        input: Input,
        add: bool,
        ops: &mut Vec<Op>,
    ) -> Result<(), EngineError> {
        let a = self.a;
        let (gu, tmp) = (BufRef::new(&a.gu), BufRef::new(&a.tmp));
        let up = Some(m.up_offset());
        ops.push(self.matvec_in("mlp gate_up", input, m.gate_up.w(0), up, gu, None)?);
        let down = m.down.w(0);
        match (add, self.gemm) {
            (true, _) => self.proj_add("mlp down", down, gu, ops)?,
            (false, true) => ops.push(self.mm("mlp down", down, None, gu, tmp, None)?),
            (false, false) => {
                ops.push(self.matvec("mlp down", down, None, gu, tmp, None, Fuse::default())?)
            }
        }
        Ok(())
    }
}
