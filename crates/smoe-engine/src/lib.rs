//! smoe engine: model descriptions and their CPU and GPU executors, per-layer sequence state,
//! expert store, sampler, tokenizer + chat template and the
//! generation loop.
pub mod chat;
pub mod engine;
pub mod error;
pub mod experts;
pub mod gpu;
pub mod model;
pub mod rope;
pub mod sampler;
pub mod spec;
pub mod state;
pub mod store;
pub mod tokenizer;
pub mod tuning;

pub use engine::{Engine, GenerateOptions, Generation, LogprobsResult, Session};
pub use error::EngineError;
pub use model::{Logits, Model};
pub use tuning::Tuning;
