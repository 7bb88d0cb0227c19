//! A model as data: per layer, a token mixer and a feed-forward block, each built from shared
//! blocks and naming its tensors through `smoe_vault::tensors`. A family (`families`) is a
//! short function from a configuration to this description; the CPU executor interprets it and
//! the GPU executor lowers it to recorded dispatches. Neither the description nor a family names
//! a kernel or a backend.

use smoe_vault::tensors::{MlpPart, Qkv, Tensor};
use smoe_vault::ModelConfig;

pub mod families;

/// The whole model: embedding, layers, final norm and LM head.
#[derive(Debug, Clone)]
pub struct ModelSpec {
    pub vocab: usize,
    pub hidden: usize,
    /// The RMSNorms' epsilon.
    pub eps: f32,
    pub embed: Tensor,
    pub layers: Vec<LayerSpec>,
    pub final_norm: Tensor,
    /// The LM head: `Tensor::Embed` when tied to the embedding.
    pub lm_head: Tensor,
}

/// One pre-norm residual layer: `x += mixer(norm(x)); x += ffn(norm(x))`.
#[derive(Debug, Clone)]
pub struct LayerSpec {
    pub index: usize,
    pub mixer_norm: Tensor,
    pub mixer: Mixer,
    pub ffn_norm: Tensor,
    pub ffn: Ffn,
}

/// What mixes information across positions (and so owns the layer's sequence state).
#[derive(Debug, Clone)]
pub enum Mixer {
    /// Softmax attention over a KV cache (MHA, GQA, MQA).
    Attention(Attention),
}

/// Grouped-query softmax attention with RoPE.
#[derive(Debug, Clone)]
pub struct Attention {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// q, k, v projections.
    pub qkv: [Tensor; 3],
    pub o: Tensor,
    /// Biases of the q, k and v projections.
    pub bias: Option<[Tensor; 3]>,
    pub qk_norm: Option<QkNorm>,
    /// Clamp q, k and v to ±clip after the projections and norm.
    pub clip: Option<f32>,
    /// Attend only to the last `window` positions, the current one included.
    pub window: Option<usize>,
}

/// RMSNorm of queries and keys before RoPE.
#[derive(Debug, Clone)]
pub struct QkNorm {
    pub q: Tensor,
    pub k: Tensor,
    /// Over each head's `head_dim` values; otherwise over the whole projection.
    pub per_head: bool,
}

/// The feed-forward block.
#[derive(Debug, Clone)]
pub enum Ffn {
    /// A SwiGLU MLP.
    Dense(Mlp),
    /// Routed experts (streamed from the vault's expert section), plus an optional shared one.
    Moe(Moe),
}

/// `down(silu(gate·x) ⊙ up·x)`.
#[derive(Debug, Clone)]
pub struct Mlp {
    pub gate: Tensor,
    pub up: Tensor,
    pub down: Tensor,
}

#[derive(Debug, Clone)]
pub struct Moe {
    pub router: Tensor,
    pub experts: usize,
    pub top_k: usize,
    pub routing: Routing,
    /// Each expert is an MLP of this width, stored as one blob per (layer, expert).
    pub expert_width: usize,
    pub shared: Option<SharedExpert>,
}

/// How router logits become the top-k experts and their weights.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Routing {
    /// Softmax over all experts, then the top k.
    pub score: Score,
    /// Renormalise the k weights to sum to one.
    pub renormalize: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Score {
    Softmax,
}

/// An always-on expert added to the routed ones: `x += σ(gate·h) · mlp(h)`.
#[derive(Debug, Clone)]
pub struct SharedExpert {
    pub mlp: Mlp,
    /// The sigmoid gate's `[1, hidden]` weight.
    pub gate: Tensor,
}

/// The kind of sequence state a layer keeps (what `state::LayerState` holds for it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StateKind {
    /// Keys and values per position, `width` each: truncating is dropping positions.
    Kv { width: usize },
    /// A fixed-size state every position rewrites (linear attention, SSMs): it cannot be
    /// truncated, only snapshotted and restored.
    Recurrent { floats: usize },
}

impl StateKind {
    /// Whether the state at an earlier position can be recovered by forgetting later ones.
    pub fn truncatable(self) -> bool {
        match self {
            StateKind::Kv { .. } => true,
            StateKind::Recurrent { .. } => false,
        }
    }
}

impl Mixer {
    pub fn state(&self) -> StateKind {
        match self {
            Mixer::Attention(a) => StateKind::Kv {
                width: a.kv_heads * a.head_dim,
            },
        }
    }
}

impl Ffn {
    pub fn moe(&self) -> Option<&Moe> {
        match self {
            Ffn::Moe(m) => Some(m),
            Ffn::Dense(_) => None,
        }
    }
}

impl ModelSpec {
    /// Each layer's sequence state.
    pub fn states(&self) -> Vec<StateKind> {
        self.layers.iter().map(|l| l.mixer.state()).collect()
    }

    /// The MoE layers' indices.
    pub fn moe_layers(&self) -> impl Iterator<Item = usize> + '_ {
        (self.layers.iter()).filter_map(|l| l.ffn.moe().map(|_| l.index))
    }

    /// The first MoE layer after `l`.
    pub fn next_moe(&self, l: usize) -> Option<usize> {
        self.moe_layers().find(|&m| m > l)
    }

    /// Every tensor the description reads (for checks and tests).
    pub fn tensors(&self) -> Vec<Tensor> {
        let mut v = vec![self.embed, self.final_norm, self.lm_head];
        for l in &self.layers {
            v.extend([l.mixer_norm, l.ffn_norm]);
            match &l.mixer {
                Mixer::Attention(a) => {
                    v.extend(a.qkv);
                    v.push(a.o);
                    v.extend(a.bias.iter().flatten());
                    v.extend(a.qk_norm.iter().flat_map(|n| [n.q, n.k]));
                }
            }
            match &l.ffn {
                Ffn::Dense(m) => v.extend(m.tensors()),
                Ffn::Moe(m) => {
                    v.push(m.router);
                    if let Some(s) = &m.shared {
                        v.extend(s.mlp.tensors());
                        v.push(s.gate);
                    }
                }
            }
        }
        v.dedup();
        v
    }
}

impl Mlp {
    pub fn tensors(&self) -> [Tensor; 3] {
        [self.gate, self.up, self.down]
    }
}

// Shared blocks the families are built from.

/// A pre-norm layer with the standard norm names.
pub fn layer(l: usize, mixer: Mixer, ffn: Ffn) -> LayerSpec {
    LayerSpec {
        index: l,
        mixer_norm: Tensor::InputNorm(l),
        mixer,
        ffn_norm: Tensor::PostNorm(l),
        ffn,
    }
}

/// Plain GQA attention of layer `l` with the configuration's head counts.
pub fn gqa(c: &ModelConfig, l: usize) -> Attention {
    Attention {
        heads: c.num_heads,
        kv_heads: c.num_kv_heads,
        head_dim: c.head_dim,
        qkv: [Qkv::Q, Qkv::K, Qkv::V].map(|p| Tensor::Proj(l, p)),
        o: Tensor::OProj(l),
        bias: None,
        qk_norm: None,
        clip: None,
        window: None,
    }
}

impl Attention {
    /// With biases on q, k and v.
    pub fn with_qkv_bias(self, l: usize) -> Self {
        Attention {
            bias: Some([Qkv::Q, Qkv::K, Qkv::V].map(|p| Tensor::Bias(l, p))),
            ..self
        }
    }

    /// With an RMSNorm of q and k per head (`per_head`) or over the whole projection.
    pub fn with_qk_norm(self, l: usize, per_head: bool) -> Self {
        Attention {
            qk_norm: Some(QkNorm {
                q: Tensor::QkNorm(l, Qkv::Q),
                k: Tensor::QkNorm(l, Qkv::K),
                per_head,
            }),
            ..self
        }
    }
}

/// The dense SwiGLU MLP of layer `l`.
pub fn mlp(l: usize) -> Mlp {
    let [gate, up, down] = MlpPart::ALL.map(|p| Tensor::Mlp(l, p));
    Mlp { gate, up, down }
}

/// The routed experts of layer `l`: softmax top-k with the configuration's counts.
pub fn moe(c: &ModelConfig, l: usize, renormalize: bool) -> Moe {
    Moe {
        router: Tensor::Router(l),
        experts: c.num_experts,
        top_k: c.num_experts_per_tok,
        routing: Routing {
            score: Score::Softmax,
            renormalize,
        },
        expert_width: c.moe_intermediate_size,
        shared: None,
    }
}

impl Moe {
    /// With a sigmoid-gated shared expert.
    pub fn with_gated_shared(self, l: usize) -> Self {
        let [gate, up, down] = MlpPart::ALL.map(|p| Tensor::Shared(l, p));
        Moe {
            shared: Some(SharedExpert {
                mlp: Mlp { gate, up, down },
                gate: Tensor::SharedGate(l),
            }),
            ..self
        }
    }
}

/// The model around the layers: embedding, final norm, LM head (tied or not).
pub fn decoder(c: &ModelConfig, layers: Vec<LayerSpec>) -> ModelSpec {
    ModelSpec {
        vocab: c.vocab_size,
        hidden: c.hidden_size,
        eps: c.rms_norm_eps as f32,
        embed: Tensor::Embed,
        layers,
        final_norm: Tensor::FinalNorm,
        lm_head: if c.tie_word_embeddings {
            Tensor::Embed
        } else {
            Tensor::LmHead
        },
    }
}
