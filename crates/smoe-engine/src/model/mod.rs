//! Model architectures: one file per family; this module holds what they share.

pub mod qwen3_moe;

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

/// A loaded model of any supported architecture.
pub enum Model {
    Qwen3Moe(qwen3_moe::Qwen3Moe),
}

impl Model {
    pub fn load(vault: &Vault) -> Result<Self, EngineError> {
        match vault.header.config.architecture {
            Architecture::Qwen3Moe => Ok(Model::Qwen3Moe(qwen3_moe::Qwen3Moe::load(vault)?)),
        }
    }

    pub fn config(&self) -> &ModelConfig {
        match self {
            Model::Qwen3Moe(m) => &m.cfg,
        }
    }

    pub fn new_cache(&self, capacity: usize) -> KvCache {
        let c = self.config();
        KvCache::new(c.num_layers, c.num_kv_heads * c.head_dim, capacity)
    }

    pub fn forward(&self, kv: &mut KvCache, tokens: &[u32], want: Logits, s: &mut Scratch) -> Result<Vec<f32>, EngineError> {
        match self {
            Model::Qwen3Moe(m) => m.forward(kv, tokens, want, s),
        }
    }
}
