//! Feed-forward blocks on the CPU (`spec::Ffn`): a dense SwiGLU MLP, or routed experts (softmax
//! top-k; each used expert run once over the tokens routed to it, its weights read once per
//! pass) with an optional sigmoid-gated shared expert. The routed experts come from the expert
//! store (`Experts::for_each`), which also starts the lookahead's reads when streaming.

use super::super::{mat, Scratch};
use super::CpuModel;
use crate::error::EngineError;
use crate::spec::{Ffn, Moe};
use crate::store::Recall;
use smoe_compute::cpu::{self, matmul, ops, QMatRef};
use smoe_vault::tensors::Tensor;
use smoe_vault::{TensorData, Vault};

pub(super) struct MlpW {
    gate: TensorData,
    up: TensorData,
    down: TensorData,
}

pub(super) enum FfnW {
    Dense(MlpW),
    Moe {
        router: TensorData,
        /// The shared expert and its `[1, hidden]` gate.
        shared: Option<(MlpW, TensorData)>,
    },
}

impl FfnW {
    pub fn load(vault: &Vault, ffn: &Ffn) -> Result<Self, EngineError> {
        let t = |t: Tensor| vault.tensor(&t.name());
        let mlp = |m: &crate::spec::Mlp| -> Result<MlpW, EngineError> {
            Ok(MlpW {
                gate: t(m.gate)?,
                up: t(m.up)?,
                down: t(m.down)?,
            })
        };
        Ok(match ffn {
            Ffn::Dense(m) => FfnW::Dense(mlp(m)?),
            Ffn::Moe(m) => FfnW::Moe {
                router: t(m.router)?,
                shared: match &m.shared {
                    Some(s) => Some((mlp(&s.mlp)?, t(s.gate)?)),
                    None => None,
                },
            },
        })
    }
}

impl MlpW {
    pub fn forward(&self, x: &[f32], n: usize) -> Vec<f32> {
        swiglu(mat(&self.gate), mat(&self.up), mat(&self.down), x, n)
    }
}

/// `down(silu(gate(x)) * up(x))` for `n` rows of x.
fn swiglu(gate: QMatRef, up: QMatRef, down: QMatRef, x: &[f32], n: usize) -> Vec<f32> {
    let i = gate.rows;
    let (mut g, mut u) = (vec![0f32; n * i], vec![0f32; n * i]);
    matmul(gate, x, n, &mut g);
    matmul(up, x, n, &mut u);
    ops::silu_mul(&mut g, &u);
    let mut out = vec![0f32; n * down.rows];
    cpu::matmul(down, &g, n, &mut out);
    out
}

/// x += σ(gate · h) · shared(h), per token.
pub(super) fn shared_expert(m: &MlpW, gate: QMatRef, t: usize, s: &mut Scratch) {
    let h = s.h.len() / t;
    let out = m.forward(&s.h, t);
    let mut g = vec![0f32; t];
    matmul(gate, &s.h, t, &mut g);
    for (i, gi) in g.iter().enumerate() {
        ops::axpy(
            &mut s.x[i * h..(i + 1) * h],
            1.0 / (1.0 + (-gi).exp()),
            &out[i * h..(i + 1) * h],
        );
    }
}

pub(super) fn add_into(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

/// Adds `bias` to every row of `x`.
pub(super) fn add_rows(x: &mut [f32], bias: &[f32]) {
    for row in x.chunks_exact_mut(bias.len()) {
        add_into(row, bias);
    }
}

impl CpuModel {
    /// Routes every token to its top-k experts, then runs each used expert once over the tokens
    /// routed to it (weights read once per pass) and adds the weighted outputs to the residual.
    pub(super) fn moe(
        &self,
        l: usize,
        moe: &Moe,
        router: QMatRef,
        t: usize,
        s: &mut Scratch,
    ) -> Result<(), EngineError> {
        let (h, ne) = (self.spec.hidden, moe.experts);
        let mut logits = vec![0f32; t * ne];
        matmul(router, &s.h, t, &mut logits);
        let mut by_expert: Vec<Vec<(usize, f32)>> = vec![vec![]; ne];
        let renorm = moe.routing.renormalize;
        for (i, row) in logits.chunks_exact(ne).enumerate() {
            for (e, w) in ops::route_softmax_topk(row, moe.top_k, renorm) {
                by_expert[e].push((i, w));
            }
        }
        // Experts may arrive in any order (cache hits first, then finished reads); their outputs
        // are summed in expert order so the tokens never depend on the cache.
        let used: Vec<usize> = (0..ne).filter(|&e| !by_expert[e].is_empty()).collect();
        // The routes are known: where streaming attaches (score the last guess, guess ahead).
        if self.experts.is_streaming() {
            if let Some((_, guess)) = s.guess.take().filter(|(n, _)| *n == l) {
                self.experts.note_lookahead(l, Recall::of(&guess, &used));
            }
            self.prefetch_next(l, t, s);
        }
        let mut outs: Vec<Vec<f32>> = vec![vec![]; ne];
        let x = &s.h;
        self.experts.for_each(l, &used, &mut |e, ex| {
            let routed = &by_expert[e];
            let xs: Vec<f32> = routed
                .iter()
                .flat_map(|&(i, _)| x[i * h..(i + 1) * h].iter().copied())
                .collect();
            outs[e] = swiglu(ex.gate, ex.up, ex.down, &xs, routed.len());
        })?;
        for &e in &used {
            for (j, &(i, w)) in by_expert[e].iter().enumerate() {
                ops::axpy(
                    &mut s.x[i * h..(i + 1) * h],
                    w,
                    &outs[e][j * h..(j + 1) * h],
                );
            }
        }
        Ok(())
    }

    /// Lookahead: the next MoE layer's router applied to this layer's input predicts its experts
    /// well (the residual stream changes little per layer), so their reads can start as soon as
    /// this layer's own misses are queued. Only a prediction: the real routing happens there
    /// (which scores the whole guess: `note_lookahead`). With a deeper `lookahead` the routers
    /// of the MoE layers after it guess too. Reads start for each token's `keep` best-ranked
    /// experts of each guess (wrong guesses are wrong mostly in their low ranks).
    fn prefetch_next(&self, l: usize, t: usize, s: &mut Scratch) {
        let next = (self.layers.iter().zip(&self.spec.layers).skip(l + 1))
            .filter_map(|(w, layer)| match (&w.ffn, layer.ffn.moe()) {
                (FfnW::Moe { router, .. }, Some(moe)) => Some((layer.index, moe, router)),
                _ => None,
            })
            .take(self.lookahead.depth);
        for (j, (n, moe, router)) in next.enumerate() {
            let (ne, k) = (moe.experts, moe.top_k);
            let keep = self.lookahead.keep(k);
            let mut logits = vec![0f32; t * ne];
            matmul(mat(router), &s.h, t, &mut logits);
            // Each expert's best rank among the tokens' guesses.
            let mut rank = vec![usize::MAX; ne];
            for row in logits.chunks_exact(ne) {
                // (In rank order: the best-ranked first.)
                let top = ops::route_softmax_topk(row, k, moe.routing.renormalize);
                for (r, &(e, _)) in top.iter().enumerate() {
                    rank[e] = rank[e].min(r);
                }
            }
            // Best rank first: the store queues a layer's guesses in this order.
            let mut named: Vec<usize> = (0..ne).filter(|&e| rank[e] < k).collect();
            named.sort_by_key(|&e| rank[e]);
            let kept = named.partition_point(|&e| rank[e] < keep);
            self.experts.prefetch_after(n, &named[..kept]);
            if j == 0 {
                s.guess = Some((n, named));
            }
        }
    }
}
