//! The `.smoe` vault: one self-contained file per model (see `docs/vault-format.md`).
//!
//! - [`quant`]: the storage types (bf16, q8, q4, q2) and their exact code → value mapping.
//! - [`format`]: preamble, header and directory structures.
//! - [`writer`] / [`reader`]: streaming writer and memory-mapped reader.
//! - [`tensors`]: the one table of tensor names and shapes every part of smoe reads.
//! - [`import`]: Hugging Face checkpoints (config.json + safetensors + tokenizer files).
pub mod config;
mod consistency;
pub mod error;
pub mod format;
pub mod import;
pub mod quant;
pub mod reader;
pub mod synth;
pub mod tensors;
pub mod writer;

pub use config::{Architecture, FfnKind, GenerationDefaults, ModelConfig};
pub use error::{Result, VaultError};
pub use quant::{DType, GROUP};
pub use reader::{TensorData, Vault};
pub use writer::VaultWriter;
