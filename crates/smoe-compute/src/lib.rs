//! smoe compute: tensor ops for inference.
pub mod cpu;
