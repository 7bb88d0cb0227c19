//! Importers: Hugging Face checkpoints today (GGUF later).
pub mod hf;
pub mod safetensors;

pub use hf::{convert, convert_to_path, ConvertOptions, HfCheckpoint, Progress};
