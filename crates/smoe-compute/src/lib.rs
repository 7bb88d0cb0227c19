//! smoe compute: tensor ops for inference.
pub mod cpu;
#[cfg(feature = "gpu")]
pub mod gpu;
