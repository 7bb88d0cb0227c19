//! Portable row · vector kernels, written as plain loops.
//!
//! They are the fallback on targets without a SIMD path and the reference that the SIMD kernels
//! are tested against, so they stay close to `smoe_vault::quant::dequantize_row`: each weight is
//! decoded by the documented formula and multiplied with its input. The only concession to
//! speed is eight independent partial sums per loop (see `dot_by`).

use smoe_vault::quant::{get_f16, DType, GROUP};

/// `Σ_j w(j) · x[j]` with eight interleaved partial sums: one long chain of dependent adds would
/// make the loop latency-bound, and the fixed interleave lets the compiler vectorise if it wants.
#[inline(always)]
fn dot_by(x: &[f32], w: impl Fn(usize) -> f32) -> f32 {
    let mut s = [0f32; 8];
    let full = x.len() - x.len() % 8;
    for (c, xs) in x[..full].chunks_exact(8).enumerate() {
        for (l, (acc, xv)) in s.iter_mut().zip(xs).enumerate() {
            *acc += w(8 * c + l) * xv;
        }
    }
    for (j, xv) in x.iter().enumerate().skip(full) {
        s[j % 8] += w(j) * xv;
    }
    s.iter().sum()
}

/// Sums `Σ_c W[c] · x[c]` over one stored row. `row` must hold at least `dtype.row_stride(x.len())`
/// bytes and, for quantized types, `x.len()` must be a multiple of 64 (checked by the caller).
pub(super) fn dot(dtype: DType, row: &[u8], x: &[f32]) -> f32 {
    let cols = x.len();
    match dtype {
        DType::F32 | DType::Bf16 => dot_plain_from(dtype, row, x, 0),
        DType::Q8 => {
            let (codes, params) = row.split_at(cols);
            x.chunks_exact(GROUP)
                .enumerate()
                .map(|(g, xg)| {
                    let c = &codes[g * GROUP..(g + 1) * GROUP];
                    get_f16(params, g) * dot_by(xg, |j| c[j] as i8 as f32)
                })
                .sum()
        }
        DType::Q4 => {
            let (codes, params) = row.split_at(cols / 2);
            x.chunks_exact(GROUP)
                .enumerate()
                .map(|(g, xg)| {
                    let c = &codes[g * 32..(g + 1) * 32];
                    let code = |j: usize| if j < 32 { c[j] & 15 } else { c[j - 32] >> 4 };
                    get_f16(params, g) * dot_by(xg, |j| code(j) as f32 - 8.0)
                })
                .sum()
        }
        DType::Q2 => {
            let (codes, params) = row.split_at(cols / 4);
            x.chunks_exact(GROUP)
                .enumerate()
                .map(|(g, xg)| {
                    let c = &codes[g * 16..(g + 1) * 16];
                    let (d, m) = (get_f16(params, 2 * g), get_f16(params, 2 * g + 1));
                    dot_by(xg, |j| d * ((c[j % 16] >> (2 * (j / 16))) & 3) as f32 + m)
                })
                .sum()
        }
    }
}

/// `Σ_{c ≥ from} W[c] · x[c]` for the unquantized types; the SIMD kernels use it for the
/// `cols % 64` inputs after their last full block.
pub(super) fn dot_plain_from(dtype: DType, row: &[u8], x: &[f32], from: usize) -> f32 {
    let x = &x[from..];
    match dtype {
        DType::F32 => {
            let w = &row[4 * from..4 * (from + x.len())];
            dot_by(x, |j| {
                f32::from_le_bytes([w[4 * j], w[4 * j + 1], w[4 * j + 2], w[4 * j + 3]])
            })
        }
        DType::Bf16 => {
            let w = &row[2 * from..2 * (from + x.len())];
            dot_by(x, |j| {
                f32::from_bits((u16::from_le_bytes([w[2 * j], w[2 * j + 1]]) as u32) << 16)
            })
        }
        _ => unreachable!("dot_plain_from is only for f32 and bf16 rows"),
    }
}
