//! The GPU executor's lowering of one layer of the model description (`spec::LayerSpec`) to
//! dispatches for a batch of n tokens, recorded at load: everything except the
//! QK-norm/RoPE/KV-append and attention dispatches, which bind a sequence's KV cache and live in
//! `kv.rs`. The math is the CPU executor's (`model::cpu`):
//!
//! h = n1(x); q, k, v = proj(h) (+ bias) → qk-norm → clip → rope, KV append, attention
//! x += o(attn);  h = n2(x);  x += Σ_top-k w_e · expert_e(h) + σ(g·h) · shared(h)   or   mlp(h)
//!
//! Decoding is a chain of dependent dispatches, each with a floor of ~4 µs on an H200 however
//! little it does (`smoe bench decode --breakdown`), so cheap work is fused into the matvecs
//! (`smoe_compute::gpu::Fuse`): the residual add into o, and for single tokens the RMSNorms into
//! the matvecs that read the normed input — qkv recomputes its norm; the router's also writes
//! the normed input, which the experts' gate_up then reads. Not everything fused pays: the
//! experts' weighted sum fused into their down projection (`Fuse::reduce`) was slower than a
//! separate sum (see the down projection below). A layer with a shared expert keeps its
//! post-attention norm separate: its shared MLP must read the normed input after the routed
//! experts have already added to x.
//!
//! Batches of `GEMM_MIN` tokens or more (prefill) are throughput-bound instead: their matrix
//! products are token-batched GEMMs (`MatMul`) that read each weight tile once per tile of
//! tokens, and the routed experts' slots are first sorted by expert (`ExpertSort`) so each
//! expert's weights are read once per chunk for all the tokens that chose it.

use super::acts::{Acts, AHEAD_MAX};
use super::gpu_err;
use super::kv::GpuKv;
use super::lowering::{Input, Lowering};
use super::record::{Dispatch, Recorder};
use super::weights::{FfnW, LayerW, Packed};
use super::T_MAX;
use crate::error::EngineError;
use crate::spec::{Attention, Ffn, LayerSpec, Mixer};
use smoe_compute::gpu::{
    BufRef, EltOp, ExpertSort, Fuse, GpuContext, Grouped, MatMulGrouped, MatMulTuning, SumTail,
    WeightedSum,
};

/// A recorded dispatch and the step of the layer it belongs to (the label of the time
/// breakdown).
pub(crate) struct Op {
    pub step: &'static str,
    pub kernel: Box<dyn Dispatch + Send + Sync>,
}

impl Op {
    pub(crate) fn new(step: &'static str, kernel: impl Dispatch + Send + Sync + 'static) -> Self {
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

/// The qk-norm is fused into the RoPE kernel when it is per head and nothing (a clip) must
/// happen between the norm and the rotation; otherwise it runs as a separate RMSNorm.
fn separate_norm(at: &Attention) -> bool {
    at.qk_norm
        .as_ref()
        .is_some_and(|n| !n.per_head || at.clip.is_some())
}

pub(crate) fn rope_inputs<'a>(w: &'a LayerW, a: &'a Acts, at: &Attention, n: usize) -> RopeIn<'a> {
    if separate_norm(at) {
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
    /// Batches on the GEMM path: the ops of `post` that multiply by the experts (the sort and
    /// the two grouped GEMMs, before the weighted sum). A streaming batch whose experts do not
    /// all fit the VRAM slots runs them once per round of experts, the slots of the other
    /// rounds' experts skipped (`ExpertSort`), then the sum over all of them.
    pub expert_rounds: Option<std::ops::Range<usize>>,
    /// Streaming lookahead (recorded at that stop): the next MoE layers' routers and top-k on
    /// this layer's normed input, into `Acts::ahead` — a prediction of the experts they will
    /// want, so their reads can start while this layer's run.
    pub lookahead: Vec<Op>,
}

/// Batches at least this large take the GEMM path.
pub(crate) const GEMM_MIN: usize = 8;

/// What a pass records at an MoE layer's "routes known" point, right after its router: the
/// one place where expert residency (streaming) attaches to the layer.
#[derive(Clone, Copy)]
pub(crate) enum AtRoutes<'a> {
    /// Go on with the experts (resident, or a layer without experts).
    Run,
    /// Record `lookahead` and end the submission here: the host reads the router's choice and
    /// fills expert slots before the experts are recorded (`LayerOps::experts`).
    Stop { lookahead: &'a [Op] },
    /// Record `lookahead` and `map` (the router's choice mapped to slots on the GPU), then the
    /// experts only with `experts`.
    Map {
        lookahead: &'a [Op],
        map: &'a Op,
        experts: bool,
    },
}

impl LayerOps {
    /// Records layer `l` of a pass of n tokens, in the order every pass uses: the mixer (`pre`,
    /// then the sequence state's dispatches in `state`), the FFN's router, what `at_routes`
    /// says, and the rest of the FFN. Returns false where it stopped at the routes.
    pub fn record(
        &self,
        r: &mut Recorder,
        state: &GpuKv,
        (n, l): (usize, usize),
        at_routes: AtRoutes,
    ) -> bool {
        self.pre.iter().for_each(|op| op.record(r));
        state.record(n.trailing_zeros() as usize, l, r);
        let (router, experts) = match (self.routed(), at_routes) {
            (Some(split), AtRoutes::Stop { .. } | AtRoutes::Map { .. }) => split,
            _ => {
                self.post.iter().for_each(|op| op.record(r));
                return true;
            }
        };
        router.iter().for_each(|op| op.record(r));
        match at_routes {
            AtRoutes::Stop { lookahead } => {
                lookahead.iter().for_each(|op| op.record(r));
                false
            }
            AtRoutes::Map {
                lookahead,
                map,
                experts: run,
            } => {
                lookahead.iter().for_each(|op| op.record(r));
                map.record(r);
                if run {
                    experts.iter().for_each(|op| op.record(r));
                }
                run
            }
            AtRoutes::Run => unreachable!("matched above"),
        }
    }

    /// MoE layers: `post` split where the expert dispatches begin — (the router and what comes
    /// before it, the experts and what follows) — so that a streaming pass can stop between.
    pub fn routed(&self) -> Option<(&[Op], &[Op])> {
        self.experts_at.map(|at| self.post.split_at(at))
    }

    /// Where a streaming pass resumes after its stop at this layer's router: the experts and
    /// what follows (all of `post` for a layer without experts).
    pub fn experts(&self) -> &[Op] {
        self.routed().map_or(&self.post[..], |(_, experts)| experts)
    }

    /// `next_routers`: streaming, the routers of the next MoE layers (for `lookahead`; at most
    /// `AHEAD_MAX`). `fused_router`: `Tuning::fused_router`.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        ctx: &GpuContext,
        (layer, w): (&LayerSpec, &LayerW),
        a: &Acts,
        eps: f32,
        n: usize,
        next_routers: &[&Packed],
        fused_router: bool,
    ) -> Result<Self, EngineError> {
        let Mixer::Attention(at) = &layer.mixer;
        let b = Lowering {
            ctx,
            a,
            n,
            gemm: n >= GEMM_MIN,
            norm_topk: match &layer.ffn {
                Ffn::Moe(m) => m.routing.renormalize,
                Ffn::Dense(_) => false,
            },
            fused_router,
        };
        let d = a.d;
        let mut pre = vec![];
        // q, k, v: one matvec over the three stacked matrices when a batch is one token, with
        // the input norm fused in; one GEMM over them, writing q, k and v apart, for a batch on
        // the GEMM path (H200, 30B q4 pp512: 3 GEMMs took 19.8 µs per token).
        match w.qkv.fused() {
            Some(fw) if n == 1 => {
                let input = b.input(true, &w.input_norm, eps, &mut pre)?;
                pre.push(b.matvec_in("qkv", input, fw, None, a.q(1), None)?);
            }
            fused => {
                let input = b.input(false, &w.input_norm, eps, &mut pre)?;
                let split = [d.qw, d.qw + d.kw];
                let hn = BufRef::new(&a.hn);
                let one =
                    (fused.filter(|_| b.gemm)).map(|fw| b.mm_split("qkv", fw, hn, a.q(n), split));
                match one {
                    Some(Ok(op)) => pre.push(op),
                    // (The stacked matrix may not fit one storage binding where the separate
                    // ones do: three GEMMs then.)
                    one => {
                        if let Some(Err(e)) = one {
                            tracing::debug!("q, k and v in three GEMMs: {e}");
                        }
                        for (i, y) in [a.q(n), a.k(n), a.v(n)].into_iter().enumerate() {
                            pre.push(b.matvec_in("qkv", input, w.qkv.w(i), None, y, None)?);
                        }
                    }
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
        if separate_norm(at) {
            let ((qn, lq), (kn, lk)) = w.qk_norm.as_ref().expect("checked by separate_norm");
            let (q, k) = (BufRef::new(qn), BufRef::new(kn));
            pre.push(b.norm("qk norm", a.q(n), q, a.qn(n), *lq, n * d.qw / lq, eps)?);
            pre.push(b.norm("qk norm", a.k(n), k, a.kn(n), *lk, n * d.kw / lk, eps)?);
        }
        if let Some(clip) = at.clip {
            let r = rope_inputs(w, a, at, n);
            for (y, width) in [(r.q, d.qw), (r.k, d.kw), (r.v, d.kw)] {
                pre.push(b.elt("clip qkv", y, n * width, EltOp::Clamp(clip))?);
            }
        }

        // x += o(attn), then the FFN block.
        let mut post = vec![];
        let attn = BufRef::new(&a.attn);
        let router_in_o = match &w.ffn {
            FfnW::Moe {
                router,
                shared: None,
                ..
            } if b.router_in_o(router, w.o.w(0)) => {
                post.push(b.proj_add_route(w.o.w(0), attn, router, &w.post_norm, eps, d.k)?);
                true
            }
            _ => {
                b.proj_add("o proj", w.o.w(0), attn, &mut post)?;
                false
            }
        };
        let shared_expert = matches!(
            &w.ffn,
            FfnW::Moe {
                shared: Some(_),
                ..
            }
        );
        let input = b.input(n == 1 && !shared_expert, &w.post_norm, eps, &mut post)?;
        let mut experts_at = None;
        let mut expert_rounds = None;
        let mut lookahead = vec![];
        match &w.ffn {
            FfnW::Dense(m) => b.mlp(m, input, true, &mut post)?,
            FfnW::Moe {
                router,
                experts: e,
                shared,
            } => {
                let k = d.k;
                if k > smoe_compute::gpu::NT_MAX {
                    return Err(EngineError::Backend(format!(
                        "GPU: top-{k} routing; the GPU kernels sum at most {} experts per token \
                         (use --backend cpu)",
                        smoe_compute::gpu::NT_MAX
                    )));
                }
                let (rlog, ids, rw) = (
                    BufRef::new(&a.rlog),
                    BufRef::new(&a.ids),
                    BufRef::new(&a.rw),
                );
                // The router (`Lowering::route`): for decode a matvec with the norm fused in, which also
                // writes the normed input to hn, which the experts and the lookahead then read
                // instead of each of their workgroups renormalizing x; for a chunk a GEMM of hn.
                let hn = BufRef::new(&a.hn);
                let mut fuse = Fuse::default();
                let mut x = hn;
                if let (false, Input::Fused(nw, eps)) = (b.gemm, input) {
                    fuse.norm = Some((nw, eps));
                    fuse.norm_out = Some(hn);
                    x = BufRef::new(&a.x);
                }
                if !router_in_o {
                    post.extend(b.route("router", router, x, [rlog, ids, rw], fuse, e.n, k)?);
                }
                for (j, &next) in next_routers.iter().enumerate().take(AHEAD_MAX) {
                    let row = [e.n, k, k].map(|w| 4 * (j * T_MAX * w) as u64);
                    let ahead = [0, 1, 2].map(|i| BufRef::at(&a.ahead[i], row[i]));
                    let guess = b.route("lookahead", next, hn, ahead, Fuse::default(), e.n, k)?;
                    lookahead.extend(guess);
                }
                let input = Input::Normed;
                experts_at = Some(post.len());
                // Slot t·k + s is token t's s-th expert: gate_up reads token t's input (k slots
                // share it), down reads its slot's gate_up output and sums each token's k slots
                // with the router's weights into x.
                let grouped = |slots_per_x| Grouped {
                    ids: &a.ids,
                    ids_offset: 0,
                    n_slots: n * k,
                    n_mats: e.slots,
                    mat_stride: e.stride,
                    x_per_slot: true,
                    slots_per_x,
                };
                let gu = BufRef::new(&a.gu);
                let gate = e.gate.on(&e.buf);
                let up = Some(e.up_offset);
                let down = e.down.on(&e.buf);
                if b.gemm {
                    // Slots sorted by expert, cut into the GEMMs' token tiles; each expert's GEMM
                    // over the slots that chose it, a workgroup per tile.
                    let tile = MatMulTuning::grouped_bn(n * k, e.slots);
                    let sort = ExpertSort::new(ctx, ids, n * k, e.slots, tile).map_err(gpu_err)?;
                    let by = |x_div| MatMulGrouped {
                        sort: &sort,
                        mat_stride: e.stride,
                        x_div,
                    };
                    let (hn, eo) = (BufRef::new(&a.hn), BufRef::new(&a.eo));
                    let gate_up = b.mm("experts gate_up", gate, up, hn, gu, Some(by(k)))?;
                    let down = b.mm("experts down", down, None, gu, eo, Some(by(1)))?;
                    let start = post.len();
                    post.push(Op::new("expert sort", sort));
                    post.extend([gate_up, down]);
                    expert_rounds = Some(start..post.len());
                    post.push(b.add_to_x("experts sum", eo, rw, k)?);
                } else {
                    let grouped_gu = Some(grouped(k));
                    post.push(b.matvec_in("experts gate_up", input, gate, up, gu, grouped_gu)?);
                    // Each slot's down projection on its own (a workgroup per 16 rows of one
                    // expert), then the weighted sum into x: one dispatch more than the fused
                    // reduce (`Fuse::reduce`, a workgroup per 16 rows of all k experts), but the
                    // reduce's 128 workgroups each stage all k inputs and walk k × 16 items, and
                    // on an H200 the pair is faster: 262.5 → 281.2 tok/s decode (30B shapes, q4).
                    // Where the adapter allows (`GpuContext::fused_tails`), the sum runs in each
                    // row block's last workgroup of the down projection: one dispatch fewer.
                    let eo = BufRef::new(&a.eo);
                    let g = Some(grouped(1));
                    if ctx.fused_tails() {
                        let sum = SumTail {
                            acc: BufRef::new(&a.x),
                            weights: rw,
                            k,
                        };
                        let fuse = Fuse {
                            sum_into: Some(sum),
                            ..Fuse::default()
                        };
                        post.push(b.matvec("experts down", down, None, gu, eo, g, fuse)?);
                    } else {
                        post.push(b.matvec(
                            "experts down",
                            down,
                            None,
                            gu,
                            eo,
                            g,
                            Fuse::default(),
                        )?);
                        post.push(b.add_to_x("experts sum", eo, rw, k)?);
                    }
                }
                if let Some((m, gate)) = shared {
                    b.mlp(m, input, false, &mut post)?;
                    let (sg, tmp) = (BufRef::new(&a.sg), BufRef::new(&a.tmp));
                    post.push(b.matvec_in("shared gate", input, gate.w(0), None, sg, None)?);
                    post.push(b.elt("shared gate", sg, n, EltOp::Sigmoid)?);
                    let sum = WeightedSum::new(ctx, BufRef::new(&a.x), tmp, sg, d.h, 1, n);
                    post.push(Op::new("shared sum", sum.map_err(gpu_err)?));
                }
            }
        }
        Ok(LayerOps {
            pre,
            post,
            experts_at,
            expert_rounds,
            lookahead,
        })
    }
}
