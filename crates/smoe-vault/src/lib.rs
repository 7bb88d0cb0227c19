//! The `.smoe` vault: one self-contained file per model (see `docs/vault-format.md`).
pub mod quant;

pub use quant::{DType, GROUP};
