//! CPU backend.
//!
//! `matmul` holds the quantized matrix kernels; the SIMD modules are private and chosen at run
//! time (see `matmul::simd_path`, `matmul::set_simd`), `scalar` is the portable path and the tests' reference.

pub mod matmul;
pub mod ops;
mod scalar;
#[cfg(target_arch = "aarch64")]
mod simd_neon;
#[cfg(target_arch = "x86_64")]
mod simd_x86;

pub use matmul::{
    dot_row, dot_row_scalar, matmul, matmul_rows, set_simd, simd_path, QMatRef, Simd,
};
