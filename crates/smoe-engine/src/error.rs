//! Errors of the engine, worded for the person who runs it.

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Vault(#[from] smoe_vault::VaultError),
    #[error(
        "the context is full: {needed} positions needed, the cache holds {capacity} (raise --ctx)"
    )]
    ContextFull { needed: usize, capacity: usize },
    #[error("token id {id} is out of range (the vocabulary has {vocab} entries)")]
    TokenOutOfRange { id: u32, vocab: usize },
    #[error("{0}")]
    Invalid(String),
    #[error("reading expert {expert} of layer {layer}: {reason}")]
    ExpertRead {
        layer: usize,
        expert: usize,
        reason: String,
    },
    #[error("this model has no tokenizer; pass token ids (--prompt-ids)")]
    NoTokenizer,
    #[error(transparent)]
    Text(#[from] crate::tokenizer::TextError),
    #[error("backend: {0}")]
    Backend(String),
    /// Streaming on the GPU: the VRAM expert slots did not fit (`slots` per MoE layer, `bytes`
    /// in all); the decoder's load tries fewer where the VRAM budget was not given.
    #[error("GPU: out of memory for {slots} expert slots per MoE layer ({bytes} bytes in all; give a smaller --vram-cache)")]
    SlotsOutOfMemory { slots: usize, bytes: u64 },
}
