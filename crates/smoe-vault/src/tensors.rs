//! The one table of tensor names and shapes: what a model of a given configuration holds, under
//! the vault's canonical (Qwen-style) names, and how each family's Hugging Face checkpoints spell
//! them. The importer, `synth`, the test fixtures and both executors read names from here, so a
//! new tensor kind is added in one place.

use crate::config::{Architecture, FfnKind, ModelConfig, QkNorm};
use crate::quant::DType;

/// One of a SwiGLU MLP's three matrices (dense MLP, shared expert or routed expert).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MlpPart {
    Gate,
    Up,
    Down,
}

impl MlpPart {
    pub const ALL: [MlpPart; 3] = [MlpPart::Gate, MlpPart::Up, MlpPart::Down];

    /// The canonical matrix name (`gate_proj`, `up_proj`, `down_proj`); also the names of a
    /// routed expert blob's parts.
    pub fn name(self) -> &'static str {
        match self {
            MlpPart::Gate => "gate_proj",
            MlpPart::Up => "up_proj",
            MlpPart::Down => "down_proj",
        }
    }
}

/// A q, k or v projection (for biases) or q / k (for norms).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Qkv {
    Q,
    K,
    V,
}

impl Qkv {
    fn letter(self) -> &'static str {
        match self {
            Qkv::Q => "q",
            Qkv::K => "k",
            Qkv::V => "v",
        }
    }
}

/// Every tensor a supported model can hold, by role and layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Tensor {
    Embed,
    FinalNorm,
    LmHead,
    /// The RMSNorm before attention.
    InputNorm(usize),
    /// The RMSNorm before the FFN.
    PostNorm(usize),
    /// A q, k or v projection's weight.
    Proj(usize, Qkv),
    /// The attention's output projection.
    OProj(usize),
    /// A q, k or v projection's bias (Qwen2-MoE).
    Bias(usize, Qkv),
    /// The q or k RMSNorm weight (per head or over the whole projection).
    QkNorm(usize, Qkv),
    /// The router (`[experts, hidden]`).
    Router(usize),
    /// A dense layer's MLP.
    Mlp(usize, MlpPart),
    /// The always-on shared expert.
    Shared(usize, MlpPart),
    /// The shared expert's sigmoid gate (`[1, hidden]`).
    SharedGate(usize),
    /// A routed expert's matrix: stored in the expert section, one blob per (layer, expert).
    Expert(usize, usize, MlpPart),
}

/// How a tensor is stored in a vault.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Storage {
    /// Norm weights and biases: f32, tiny, precision matters.
    Vector,
    /// Dense projections, embedding, LM head: the scout type.
    Scout,
    /// Routers and gates stay bf16 whatever the scout type: a flipped expert choice costs more
    /// than bytes.
    Router,
    /// Routed experts: the expert type, in blobs.
    Expert,
}

impl Storage {
    /// The storage type of a tensor stored this way in a vault of scout type `scout` and expert
    /// type `experts`.
    pub fn dtype(self, scout: DType, experts: DType) -> DType {
        match self {
            Storage::Vector => DType::F32,
            Storage::Scout => scout,
            Storage::Router => DType::Bf16,
            Storage::Expert => experts,
        }
    }
}

/// A tensor with its shape and storage, as `layout` lists them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSpec {
    pub id: Tensor,
    pub shape: Vec<usize>,
    pub storage: Storage,
}

impl TensorSpec {
    /// (rows, columns): a vector is one row.
    pub fn rows_cols(&self) -> (usize, usize) {
        match self.shape[..] {
            [n] => (1, n),
            [rows, cols] => (rows, cols),
            _ => unreachable!("the table holds only vectors and matrices"),
        }
    }

    /// Bytes of this tensor stored as `dtype` (rows of `dtype.row_stride(cols)` bytes).
    pub fn bytes(&self, dtype: DType) -> u64 {
        let (rows, cols) = self.rows_cols();
        (rows * dtype.row_stride(cols)) as u64
    }
}

impl Tensor {
    /// The vault's name of this tensor.
    pub fn name(self) -> String {
        use Tensor::*;
        let layer = |l: usize, rest: &str| format!("model.layers.{l}.{rest}");
        match self {
            Embed => "model.embed_tokens.weight".into(),
            FinalNorm => "model.norm.weight".into(),
            LmHead => "lm_head.weight".into(),
            InputNorm(l) => layer(l, "input_layernorm.weight"),
            PostNorm(l) => layer(l, "post_attention_layernorm.weight"),
            Proj(l, p) => layer(l, &format!("self_attn.{}_proj.weight", p.letter())),
            OProj(l) => layer(l, "self_attn.o_proj.weight"),
            Bias(l, p) => layer(l, &format!("self_attn.{}_proj.bias", p.letter())),
            QkNorm(l, p) => layer(l, &format!("self_attn.{}_norm.weight", p.letter())),
            Router(l) => layer(l, "mlp.gate.weight"),
            Mlp(l, p) => layer(l, &format!("mlp.{}.weight", p.name())),
            Shared(l, p) => layer(l, &format!("mlp.shared_expert.{}.weight", p.name())),
            SharedGate(l) => layer(l, "mlp.shared_expert_gate.weight"),
            Expert(l, e, p) => layer(l, &format!("mlp.experts.{e}.{}.weight", p.name())),
        }
    }

    /// How `arch`'s Hugging Face checkpoints name this tensor: Mixtral calls its MoE block
    /// `block_sparse_moe` and its experts' matrices w1 (gate), w3 (up), w2 (down).
    pub fn hub_name(self, arch: Architecture) -> String {
        match (arch, self) {
            (Architecture::Mixtral, Tensor::Router(l)) => {
                format!("model.layers.{l}.block_sparse_moe.gate.weight")
            }
            (Architecture::Mixtral, Tensor::Expert(l, e, p)) => {
                let w = match p {
                    MlpPart::Gate => "w1",
                    MlpPart::Up => "w3",
                    MlpPart::Down => "w2",
                };
                format!("model.layers.{l}.block_sparse_moe.experts.{e}.{w}.weight")
            }
            _ => self.name(),
        }
    }
}

/// The shape of one MLP part of width `inner` (`[inner, hidden]`, down `[hidden, inner]`).
fn mlp_shape(p: MlpPart, hidden: usize, inner: usize) -> Vec<usize> {
    match p {
        MlpPart::Down => vec![hidden, inner],
        _ => vec![inner, hidden],
    }
}

/// The dense tensors of a model (everything but the routed experts), in the vault's order.
pub fn scout_layout(c: &ModelConfig) -> Vec<TensorSpec> {
    let (h, q, kv) = (
        c.hidden_size,
        c.num_heads * c.head_dim,
        c.num_kv_heads * c.head_dim,
    );
    let mut v = vec![];
    let mut t = |id: Tensor, shape: Vec<usize>, storage| v.push(TensorSpec { id, shape, storage });
    t(Tensor::Embed, vec![c.vocab_size, h], Storage::Scout);
    for l in 0..c.num_layers {
        t(Tensor::InputNorm(l), vec![h], Storage::Vector);
        t(Tensor::PostNorm(l), vec![h], Storage::Vector);
        t(Tensor::Proj(l, Qkv::Q), vec![q, h], Storage::Scout);
        t(Tensor::Proj(l, Qkv::K), vec![kv, h], Storage::Scout);
        t(Tensor::Proj(l, Qkv::V), vec![kv, h], Storage::Scout);
        t(Tensor::OProj(l), vec![h, q], Storage::Scout);
        if c.qkv_bias {
            t(Tensor::Bias(l, Qkv::Q), vec![q], Storage::Vector);
            t(Tensor::Bias(l, Qkv::K), vec![kv], Storage::Vector);
            t(Tensor::Bias(l, Qkv::V), vec![kv], Storage::Vector);
        }
        let norm = match c.qk_norm {
            QkNorm::None => None,
            QkNorm::PerHead => Some((c.head_dim, c.head_dim)),
            QkNorm::Full => Some((q, kv)),
        };
        if let Some((qn, kn)) = norm {
            t(Tensor::QkNorm(l, Qkv::Q), vec![qn], Storage::Vector);
            t(Tensor::QkNorm(l, Qkv::K), vec![kn], Storage::Vector);
        }
        match c.ffn[l] {
            FfnKind::Moe => {
                t(Tensor::Router(l), vec![c.num_experts, h], Storage::Router);
                let s = c.shared_expert_intermediate_size;
                if s > 0 {
                    for p in MlpPart::ALL {
                        t(Tensor::Shared(l, p), mlp_shape(p, h, s), Storage::Scout);
                    }
                    t(Tensor::SharedGate(l), vec![1, h], Storage::Router);
                }
            }
            FfnKind::Dense => {
                for p in MlpPart::ALL {
                    let shape = mlp_shape(p, h, c.intermediate_size);
                    t(Tensor::Mlp(l, p), shape, Storage::Scout);
                }
            }
        }
    }
    t(Tensor::FinalNorm, vec![h], Storage::Vector);
    if !c.tie_word_embeddings {
        t(Tensor::LmHead, vec![c.vocab_size, h], Storage::Scout);
    }
    v
}

/// The routed experts' matrices of one MoE layer, expert by expert, gate, up, down.
pub fn expert_layout(c: &ModelConfig, layer: usize) -> Vec<TensorSpec> {
    let (h, i) = (c.hidden_size, c.moe_intermediate_size);
    (0..c.num_experts)
        .flat_map(|e| {
            MlpPart::ALL.map(|p| TensorSpec {
                id: Tensor::Expert(layer, e, p),
                shape: mlp_shape(p, h, i),
                storage: Storage::Expert,
            })
        })
        .collect()
}

/// Every tensor of a model: the dense ones, then each MoE layer's experts.
pub fn layout(c: &ModelConfig) -> Vec<TensorSpec> {
    let mut v = scout_layout(c);
    for l in c.moe_layers() {
        v.extend(expert_layout(c, l));
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_the_hub_names_of_qwen_and_mixtral_spellings() {
        assert_eq!(
            Tensor::Proj(3, Qkv::K).name(),
            "model.layers.3.self_attn.k_proj.weight"
        );
        assert_eq!(
            Tensor::Shared(1, MlpPart::Up).name(),
            "model.layers.1.mlp.shared_expert.up_proj.weight"
        );
        let e = Tensor::Expert(2, 5, MlpPart::Up);
        assert_eq!(e.name(), "model.layers.2.mlp.experts.5.up_proj.weight");
        assert_eq!(
            e.hub_name(Architecture::Mixtral),
            "model.layers.2.block_sparse_moe.experts.5.w3.weight"
        );
        assert_eq!(e.hub_name(Architecture::Qwen3Moe), e.name());
    }
}
