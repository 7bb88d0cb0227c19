//! Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder): the decoder, as the math reads.
//!
//! x = embed(tokens)
//! per layer: x += o(attn(rope(qnorm(q(n1(x)))), rope(knorm(k(n1(x)))), v(n1(x))))
//!            x += moe(n2(x))  or  mlp(n2(x))
//! logits = lm_head(norm(x))

use super::{mat, Logits, Scratch};
use crate::error::EngineError;
use crate::experts::ExpertStore;
use crate::kv_cache::KvCache;
use crate::rope::RopeTable;
use smoe_compute::cpu::{self, matmul, ops, QMatRef};
use smoe_vault::{FfnKind, ModelConfig, TensorData, Vault};

struct Attention {
    q: TensorData,
    k: TensorData,
    v: TensorData,
    o: TensorData,
    q_norm: Vec<f32>,
    k_norm: Vec<f32>,
}

enum Ffn {
    Dense { gate: TensorData, up: TensorData, down: TensorData },
    Moe { router: TensorData },
}

struct Layer {
    input_norm: Vec<f32>,
    post_norm: Vec<f32>,
    attn: Attention,
    ffn: Ffn,
}

pub struct Qwen3Moe {
    pub cfg: ModelConfig,
    embed: TensorData,
    layers: Vec<Layer>,
    norm: Vec<f32>,
    lm_head: TensorData,
    rope: RopeTable,
    experts: ExpertStore,
}

impl Qwen3Moe {
    pub fn load(vault: &Vault) -> Result<Self, EngineError> {
        let cfg = vault.header.config.clone();
        let t = |n: &str| vault.tensor(n);
        let v = |n: &str| vault.tensor(n).map(|t| t.to_f32());
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for l in 0..cfg.num_layers {
            let p = format!("model.layers.{l}");
            let ffn = match cfg.ffn[l] {
                FfnKind::Moe => Ffn::Moe { router: t(&format!("{p}.mlp.gate.weight"))? },
                FfnKind::Dense => Ffn::Dense {
                    gate: t(&format!("{p}.mlp.gate_proj.weight"))?,
                    up: t(&format!("{p}.mlp.up_proj.weight"))?,
                    down: t(&format!("{p}.mlp.down_proj.weight"))?,
                },
            };
            layers.push(Layer {
                input_norm: v(&format!("{p}.input_layernorm.weight"))?,
                post_norm: v(&format!("{p}.post_attention_layernorm.weight"))?,
                attn: Attention {
                    q: t(&format!("{p}.self_attn.q_proj.weight"))?,
                    k: t(&format!("{p}.self_attn.k_proj.weight"))?,
                    v: t(&format!("{p}.self_attn.v_proj.weight"))?,
                    o: t(&format!("{p}.self_attn.o_proj.weight"))?,
                    q_norm: v(&format!("{p}.self_attn.q_norm.weight"))?,
                    k_norm: v(&format!("{p}.self_attn.k_norm.weight"))?,
                },
                ffn,
            });
        }
        let embed = t("model.embed_tokens.weight")?;
        let lm_head = if cfg.tie_word_embeddings { embed.clone() } else { t("lm_head.weight")? };
        Ok(Qwen3Moe {
            rope: RopeTable::new(&cfg.rope, cfg.head_dim),
            experts: ExpertStore::new(vault)?,
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
    pub fn forward(&self, kv: &mut KvCache, tokens: &[u32], want: Logits, s: &mut Scratch) -> Result<Vec<f32>, EngineError> {
        let c = &self.cfg;
        kv.check_room(tokens.len())?;
        if let Some(&id) = tokens.iter().find(|&&id| id as usize >= c.vocab_size) {
            return Err(EngineError::TokenOutOfRange { id, vocab: c.vocab_size });
        }
        let (h, t) = (c.hidden_size, tokens.len());
        let pos0 = kv.len;
        s.x.resize(t * h, 0.0);
        let embed = mat(&self.embed);
        for (i, &id) in tokens.iter().enumerate() {
            smoe_vault::quant::dequantize_row(embed.dtype, embed.row(id as usize), &mut s.x[i * h..(i + 1) * h]);
        }
        for (l, layer) in self.layers.iter().enumerate() {
            s.h.resize(t * h, 0.0);
            ops::rms_norm(&s.x, &layer.input_norm, c.rms_norm_eps as f32, &mut s.h);
            self.attention(l, &layer.attn, kv, pos0, s)?;
            ops::rms_norm(&s.x, &layer.post_norm, c.rms_norm_eps as f32, &mut s.h);
            match &layer.ffn {
                Ffn::Dense { gate, up, down } => dense_mlp(mat(gate), mat(up), mat(down), t, s),
                Ffn::Moe { router } => self.moe(l, mat(router), t, s)?,
            }
        }
        kv.len += t;
        // Final norm and LM head only at the positions that need logits.
        let rows: Vec<usize> = match want {
            Logits::Last => vec![t - 1],
            Logits::All => (0..t).collect(),
            Logits::None => vec![],
        };
        let mut hn = vec![0f32; rows.len() * h];
        for (j, &r) in rows.iter().enumerate() {
            ops::rms_norm(&s.x[r * h..(r + 1) * h], &self.norm, c.rms_norm_eps as f32, &mut hn[j * h..(j + 1) * h]);
        }
        let mut logits = vec![0f32; rows.len() * c.vocab_size];
        if !rows.is_empty() {
            matmul(mat(&self.lm_head), &hn, rows.len(), &mut logits);
        }
        Ok(logits)
    }

    fn attention(&self, l: usize, a: &Attention, kv: &mut KvCache, pos0: usize, s: &mut Scratch) -> Result<(), EngineError> {
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
        ops::rms_norm_inplace(&mut s.q, &a.q_norm, eps);
        ops::rms_norm_inplace(&mut s.k, &a.k_norm, eps);
        let half = self.rope.half();
        let (mut cos, mut sin) = (vec![0f32; half], vec![0f32; half]);
        for i in 0..t {
            self.rope.at(pos0 + i, &mut cos, &mut sin);
            ops::rope_inplace(&mut s.q[i * qw..(i + 1) * qw], hd, &cos, &sin);
            ops::rope_inplace(&mut s.k[i * kw..(i + 1) * kw], hd, &cos, &sin);
        }
        kv.write(l, pos0, &s.k, &s.v);
        s.attn.resize(t * qw, 0.0);
        let shape = ops::AttnShape {
            n_heads: c.num_heads,
            n_kv_heads: c.num_kv_heads,
            head_dim: hd,
            scale: (hd as f32).powf(-0.5),
        };
        ops::attention(&s.q, &kv.k[l], &kv.v[l], pos0, shape, &mut s.attn);
        s.o.resize(t * c.hidden_size, 0.0);
        matmul(mat(&a.o), &s.attn, t, &mut s.o);
        for (x, o) in s.x.iter_mut().zip(&s.o) {
            *x += o;
        }
        Ok(())
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
        for (e, routed) in by_expert.iter().enumerate().filter(|(_, r)| !r.is_empty()) {
            let ex = self.experts.get(l, e)?;
            let n = routed.len();
            let xs: Vec<f32> = routed.iter().flat_map(|&(i, _)| s.h[i * h..(i + 1) * h].iter().copied()).collect();
            let out = swiglu(ex.gate, ex.up, ex.down, &xs, n);
            for (j, &(i, w)) in routed.iter().enumerate() {
                ops::axpy(&mut s.x[i * h..(i + 1) * h], w, &out[j * h..(j + 1) * h]);
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

fn dense_mlp(gate: QMatRef, up: QMatRef, down: QMatRef, t: usize, s: &mut Scratch) {
    let out = swiglu(gate, up, down, &s.h, t);
    for (x, o) in s.x.iter_mut().zip(&out) {
        *x += o;
    }
}
