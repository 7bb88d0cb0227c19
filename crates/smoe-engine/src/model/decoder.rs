//! The MoE decoder shared by every supported family, as the math reads:
//!
//! x = embed(tokens)
//! per layer: h = n1(x); q, k, v = proj(h) (+ bias) → qk-norm → clip → rope
//!            x += o(attn(q, k, v))                    (causal; sliding window if any)
//!            h = n2(x)
//!            x += Σ_top-k w_e · expert_e(h) + σ(g·h) · shared(h)   or   mlp(h)
//! logits = lm_head(norm(x))
//!
//! What differs between families is data, not code (see `docs/models.md`):
//! Qwen3-MoE normalises q and k per head; OLMoE over the whole projection and clips q, k, v;
//! Qwen2-MoE biases q, k, v and adds a sigmoid-gated shared expert; Mixtral has none of these
//! but a sliding attention window and always renormalised top-k weights.

use super::{mat, Logits, Scratch};
use crate::error::EngineError;
use crate::kv_cache::KvCache;
use crate::rope::RopeTable;
use crate::store::{Experts, Lookahead, Recall, StoreOptions};
use smoe_compute::cpu::{self, matmul, ops, QMatRef};
use smoe_vault::config::QkNorm;
use smoe_vault::{FfnKind, ModelConfig, TensorData, Vault};

struct Attention {
    q: TensorData,
    k: TensorData,
    v: TensorData,
    o: TensorData,
    /// q, k, v biases (Qwen2-MoE).
    bias: Option<[Vec<f32>; 3]>,
    /// q and k norm weights: `head_dim` long (per head) or the projection's width (whole).
    qk_norm: Option<(Vec<f32>, Vec<f32>)>,
}

struct Mlp {
    gate: TensorData,
    up: TensorData,
    down: TensorData,
}

enum Ffn {
    Dense(Mlp),
    Moe {
        router: TensorData,
        shared: Option<(Mlp, TensorData)>,
    },
}

struct Layer {
    input_norm: Vec<f32>,
    post_norm: Vec<f32>,
    attn: Attention,
    ffn: Ffn,
}

pub struct Decoder {
    pub cfg: ModelConfig,
    embed: TensorData,
    layers: Vec<Layer>,
    norm: Vec<f32>,
    lm_head: TensorData,
    rope: RopeTable,
    pub experts: Experts,
    /// Streaming: how many MoE layers ahead `prefetch_next` guesses, and how much of them.
    lookahead: Lookahead,
}

impl Decoder {
    pub fn load(vault: &Vault, store: &StoreOptions) -> Result<Self, EngineError> {
        let cfg = vault.header.config.clone();
        let t = |n: &str| vault.tensor(n);
        let v = |n: &str| vault.tensor(n).map(|t| t.to_f32());
        let mut layers = Vec::with_capacity(cfg.num_layers);
        let mlp = |p: &str| -> Result<Mlp, EngineError> {
            Ok(Mlp {
                gate: t(&format!("{p}.gate_proj.weight"))?,
                up: t(&format!("{p}.up_proj.weight"))?,
                down: t(&format!("{p}.down_proj.weight"))?,
            })
        };
        for l in 0..cfg.num_layers {
            let p = format!("model.layers.{l}");
            let a = format!("{p}.self_attn");
            let ffn = match cfg.ffn[l] {
                FfnKind::Moe => Ffn::Moe {
                    router: t(&format!("{p}.mlp.gate.weight"))?,
                    shared: if cfg.shared_expert_intermediate_size > 0 {
                        Some((
                            mlp(&format!("{p}.mlp.shared_expert"))?,
                            t(&format!("{p}.mlp.shared_expert_gate.weight"))?,
                        ))
                    } else {
                        None
                    },
                },
                FfnKind::Dense => Ffn::Dense(mlp(&format!("{p}.mlp"))?),
            };
            let bias = if cfg.qkv_bias {
                Some([
                    v(&format!("{a}.q_proj.bias"))?,
                    v(&format!("{a}.k_proj.bias"))?,
                    v(&format!("{a}.v_proj.bias"))?,
                ])
            } else {
                None
            };
            let qk_norm = match cfg.qk_norm {
                QkNorm::None => None,
                QkNorm::PerHead | QkNorm::Full => Some((
                    v(&format!("{a}.q_norm.weight"))?,
                    v(&format!("{a}.k_norm.weight"))?,
                )),
            };
            layers.push(Layer {
                input_norm: v(&format!("{p}.input_layernorm.weight"))?,
                post_norm: v(&format!("{p}.post_attention_layernorm.weight"))?,
                attn: Attention {
                    q: t(&format!("{a}.q_proj.weight"))?,
                    k: t(&format!("{a}.k_proj.weight"))?,
                    v: t(&format!("{a}.v_proj.weight"))?,
                    o: t(&format!("{a}.o_proj.weight"))?,
                    bias,
                    qk_norm,
                },
                ffn,
            });
        }
        let embed = t("model.embed_tokens.weight")?;
        let lm_head = if cfg.tie_word_embeddings {
            embed.clone()
        } else {
            t("lm_head.weight")?
        };
        Ok(Decoder {
            rope: RopeTable::new(&cfg.rope, cfg.head_dim),
            experts: Experts::open(vault, store)?,
            lookahead: store.lookahead()?,
            norm: v("model.norm.weight")?,
            embed,
            layers,
            lm_head,
            cfg,
        })
    }

    pub fn kv_width(&self) -> usize {
        self.cfg.num_kv_heads * self.cfg.head_dim
    }

    /// Runs `tokens` (positions `kv.len..`) through the model, appending to the KV cache, and
    /// returns logits (`[rows, vocab]`) for the positions `want` asks for.
    pub fn forward(
        &self,
        kv: &mut KvCache,
        tokens: &[u32],
        want: Logits,
        s: &mut Scratch,
    ) -> Result<Vec<f32>, EngineError> {
        let mut out = self.forward_batch(&mut [kv], &[tokens], &[want], s)?;
        Ok(out.pop().unwrap_or_default())
    }

    /// Several sequences in one pass: `runs[i]` continues the sequence cached in `kvs[i]`. Every
    /// weight is read once for all rows of all sequences (what makes batched decoding cheap);
    /// only attention is per sequence. Returns each run's logits as `want[i]` asks.
    pub fn forward_batch(
        &self,
        kvs: &mut [&mut KvCache],
        runs: &[&[u32]],
        want: &[Logits],
        s: &mut Scratch,
    ) -> Result<Vec<Vec<f32>>, EngineError> {
        let c = &self.cfg;
        assert!(
            kvs.len() == runs.len() && runs.len() == want.len(),
            "one run and one cache per sequence"
        );
        for (kv, run) in kvs.iter().zip(runs) {
            kv.check_room(run.len())?;
            if let Some(&id) = run.iter().find(|&&id| id as usize >= c.vocab_size) {
                return Err(EngineError::TokenOutOfRange {
                    id,
                    vocab: c.vocab_size,
                });
            }
        }
        // Row offset of each run in the stacked activations.
        let mut spans = Vec::with_capacity(runs.len());
        let mut t = 0;
        for run in runs {
            spans.push(t..t + run.len());
            t += run.len();
        }
        let h = c.hidden_size;
        s.x.resize(t * h, 0.0);
        let embed = mat(&self.embed);
        for (i, &id) in runs.iter().flat_map(|r| r.iter()).enumerate() {
            smoe_vault::quant::dequantize_row(
                embed.dtype,
                embed.row(id as usize),
                &mut s.x[i * h..(i + 1) * h],
            );
        }
        for (l, layer) in self.layers.iter().enumerate() {
            s.h.resize(t * h, 0.0);
            ops::rms_norm(&s.x, &layer.input_norm, c.rms_norm_eps as f32, &mut s.h);
            self.attention(l, &layer.attn, kvs, &spans, s)?;
            ops::rms_norm(&s.x, &layer.post_norm, c.rms_norm_eps as f32, &mut s.h);
            match &layer.ffn {
                Ffn::Dense(m) => {
                    let out = m.forward(&s.h, t);
                    add_into(&mut s.x, &out);
                }
                Ffn::Moe { router, shared } => {
                    self.moe(l, mat(router), t, s)?;
                    if let Some((m, gate)) = shared {
                        shared_expert(m, mat(gate), t, s);
                    }
                }
            }
        }
        for (kv, run) in kvs.iter_mut().zip(runs) {
            kv.len += run.len();
        }
        self.experts.tick();
        spans
            .iter()
            .zip(want)
            .map(|(span, w)| Ok(self.logits(s, span.clone(), *w)))
            .collect()
    }

    /// Final norm and LM head, only at the rows of `span` that need logits.
    fn logits(&self, s: &Scratch, span: std::ops::Range<usize>, want: Logits) -> Vec<f32> {
        let c = &self.cfg;
        let h = c.hidden_size;
        let rows: Vec<usize> = match want {
            Logits::Last if !span.is_empty() => vec![span.end - 1],
            Logits::All => span.collect(),
            _ => vec![],
        };
        let mut hn = vec![0f32; rows.len() * h];
        for (j, &r) in rows.iter().enumerate() {
            ops::rms_norm(
                &s.x[r * h..(r + 1) * h],
                &self.norm,
                c.rms_norm_eps as f32,
                &mut hn[j * h..(j + 1) * h],
            );
        }
        let mut logits = vec![0f32; rows.len() * c.vocab_size];
        if !rows.is_empty() {
            matmul(mat(&self.lm_head), &hn, rows.len(), &mut logits);
        }
        logits
    }

    fn attention(
        &self,
        l: usize,
        a: &Attention,
        kvs: &mut [&mut KvCache],
        spans: &[std::ops::Range<usize>],
        s: &mut Scratch,
    ) -> Result<(), EngineError> {
        let c = &self.cfg;
        let (hd, t) = (c.head_dim, s.h.len() / c.hidden_size);
        let (qw, kw) = (c.num_heads * hd, c.num_kv_heads * hd);
        let eps = c.rms_norm_eps as f32;
        s.q.resize(t * qw, 0.0);
        s.k.resize(t * kw, 0.0);
        s.v.resize(t * kw, 0.0);
        matmul(mat(&a.q), &s.h, t, &mut s.q);
        matmul(mat(&a.k), &s.h, t, &mut s.k);
        matmul(mat(&a.v), &s.h, t, &mut s.v);
        if let Some([bq, bk, bv]) = &a.bias {
            add_rows(&mut s.q, bq);
            add_rows(&mut s.k, bk);
            add_rows(&mut s.v, bv);
        }
        // The norm weight's length says per head or whole projection: rows of that width.
        if let Some((qn, kn)) = &a.qk_norm {
            ops::rms_norm_inplace(&mut s.q, qn, eps);
            ops::rms_norm_inplace(&mut s.k, kn, eps);
        }
        if let Some(clip) = c.clip_qkv {
            for x in s.q.iter_mut().chain(s.k.iter_mut()).chain(s.v.iter_mut()) {
                *x = x.clamp(-clip, clip);
            }
        }
        let half = self.rope.half();
        let (mut cos, mut sin) = (vec![0f32; half], vec![0f32; half]);
        s.attn.resize(t * qw, 0.0);
        let shape = ops::AttnShape {
            n_heads: c.num_heads,
            n_kv_heads: c.num_kv_heads,
            head_dim: hd,
            scale: (hd as f32).powf(-0.5),
            window: c.sliding_window,
        };
        // Each sequence: rotate at its own positions, append to its cache, attend over it.
        for (kv, span) in kvs.iter_mut().zip(spans) {
            let pos0 = kv.len;
            for (j, i) in span.clone().enumerate() {
                self.rope.at(pos0 + j, &mut cos, &mut sin);
                ops::rope_inplace(&mut s.q[i * qw..(i + 1) * qw], hd, &cos, &sin);
                ops::rope_inplace(&mut s.k[i * kw..(i + 1) * kw], hd, &cos, &sin);
            }
            kv.write(
                l,
                pos0,
                &s.k[span.start * kw..span.end * kw],
                &s.v[span.start * kw..span.end * kw],
            );
            let (q, out) = (
                &s.q[span.start * qw..span.end * qw],
                &mut s.attn[span.start * qw..span.end * qw],
            );
            ops::attention(q, &kv.k[l], &kv.v[l], pos0, shape, out);
        }
        s.o.resize(t * c.hidden_size, 0.0);
        matmul(mat(&a.o), &s.attn, t, &mut s.o);
        add_into(&mut s.x, &s.o);
        Ok(())
    }

    /// Lookahead: the next MoE layer's router applied to this layer's input predicts its experts
    /// well (the residual stream changes little per layer), so their reads can start as soon as
    /// this layer's own misses are queued, and overlap this layer's reads and compute. Only a
    /// prediction: the real routing happens there (which scores the whole guess:
    /// `note_lookahead`). With a deeper `lookahead` the routers of the MoE layers after it guess
    /// too. Reads start for each token's `top` best-ranked experts of each guess (the guesses
    /// that need a read are wrong mostly in their low ranks, and deeper ones more often).
    fn prefetch_next(&self, l: usize, t: usize, s: &mut Scratch) {
        let c = &self.cfg;
        let (ne, k) = (c.num_experts, c.num_experts_per_tok);
        let keep = self.lookahead.keep(k);
        let next = (self.layers.iter().enumerate().skip(l + 1))
            .filter_map(|(n, layer)| match &layer.ffn {
                Ffn::Moe { router, .. } => Some((n, router)),
                Ffn::Dense(_) => None,
            })
            .take(self.lookahead.depth);
        for (j, (n, router)) in next.enumerate() {
            let mut logits = vec![0f32; t * ne];
            matmul(mat(router), &s.h, t, &mut logits);
            // Each expert's best rank among the tokens' guesses.
            let mut rank = vec![usize::MAX; ne];
            for row in logits.chunks_exact(ne) {
                // (In rank order: the best-ranked first.)
                let top = ops::route_softmax_topk(row, k, c.norm_topk_prob);
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

    /// Routes every token to its top-k experts, then runs each used expert once over the tokens
    /// routed to it (weights read once per chunk) and adds the weighted outputs to the residual.
    fn moe(&self, l: usize, router: QMatRef, t: usize, s: &mut Scratch) -> Result<(), EngineError> {
        let c = &self.cfg;
        let (h, ne) = (c.hidden_size, c.num_experts);
        let mut logits = vec![0f32; t * ne];
        matmul(router, &s.h, t, &mut logits);
        let mut by_expert: Vec<Vec<(usize, f32)>> = vec![vec![]; ne];
        for (i, row) in logits.chunks_exact(ne).enumerate() {
            for (e, w) in ops::route_softmax_topk(row, c.num_experts_per_tok, c.norm_topk_prob) {
                by_expert[e].push((i, w));
            }
        }
        // Experts may arrive in any order (cache hits first, then finished reads); their outputs
        // are summed in expert order so the tokens never depend on the cache.
        let used: Vec<usize> = (0..ne).filter(|&e| !by_expert[e].is_empty()).collect();
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

impl Mlp {
    fn forward(&self, x: &[f32], n: usize) -> Vec<f32> {
        swiglu(mat(&self.gate), mat(&self.up), mat(&self.down), x, n)
    }
}

/// x += σ(gate · h) · shared(h), per token (Qwen2-MoE's always-on expert).
fn shared_expert(m: &Mlp, gate: QMatRef, t: usize, s: &mut Scratch) {
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

fn add_into(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

/// Adds `bias` to every row of `x`.
fn add_rows(x: &mut [f32], bias: &[f32]) {
    for row in x.chunks_exact_mut(bias.len()) {
        add_into(row, bias);
    }
}
