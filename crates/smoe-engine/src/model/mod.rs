//! Model architectures: one file per family; this module holds what they share.

pub mod decoder;

use crate::error::EngineError;
use crate::kv_cache::KvCache;
use smoe_compute::cpu::QMatRef;
use smoe_vault::{Architecture, ModelConfig, TensorData, Vault};

/// Which positions of a forward pass need logits (the LM head is the largest matrix: skip it
/// wherever no token is generated or scored).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logits {
    None,
    Last,
    All,
}

/// Activations reused across forward calls so the token loop does not reallocate them.
#[derive(Default)]
pub struct Scratch {
    pub x: Vec<f32>,
    pub h: Vec<f32>,
    pub q: Vec<f32>,
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    pub attn: Vec<f32>,
    pub o: Vec<f32>,
}

/// A vault tensor as a matrix for the kernels (a vector is one row).
pub fn mat(t: &TensorData) -> QMatRef<'_> {
    let (rows, cols) = t.rows_cols();
    QMatRef::new(t.dtype(), rows, cols, t.bytes())
}

/// A loaded model. Every supported family (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE) is the same
/// decoder with different options; an architecture that needs other blocks (MLA, linear
/// attention) becomes a new variant here.
pub enum Model {
    Decoder(decoder::Decoder),
}

impl Model {
    pub fn load(vault: &Vault, store: &crate::store::StoreOptions) -> Result<Self, EngineError> {
        use Architecture::*;
        match vault.header.config.architecture {
            Qwen3Moe | Qwen2Moe | Mixtral | Olmoe => {
                Ok(Model::Decoder(decoder::Decoder::load(vault, store)?))
            }
        }
    }

    pub fn config(&self) -> &ModelConfig {
        match self {
            Model::Decoder(m) => &m.cfg,
        }
    }

    /// The routed experts' store (stats, profile, preload).
    pub fn experts(&self) -> &crate::store::Experts {
        match self {
            Model::Decoder(m) => &m.experts,
        }
    }

    pub fn new_cache(&self, capacity: usize) -> KvCache {
        let c = self.config();
        KvCache::new(c.num_layers, c.num_kv_heads * c.head_dim, capacity)
    }

    pub fn forward(
        &self,
        kv: &mut KvCache,
        tokens: &[u32],
        want: Logits,
        s: &mut Scratch,
    ) -> Result<Vec<f32>, EngineError> {
        match self {
            Model::Decoder(m) => m.forward(kv, tokens, want, s),
        }
    }

    /// Several sequences in one pass (continuous batching): `runs[i]` continues `kvs[i]`.
    pub fn forward_batch(
        &self,
        kvs: &mut [&mut KvCache],
        runs: &[&[u32]],
        want: &[Logits],
        s: &mut Scratch,
    ) -> Result<Vec<Vec<f32>>, EngineError> {
        match self {
            Model::Decoder(m) => m.forward_batch(kvs, runs, want, s),
        }
    }
}
