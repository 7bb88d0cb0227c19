//! Weight quantization: bf16, q8, q4 and q2 with groups of 64 along the input dimension.
//!
//! A matrix `[rows, cols]` (PyTorch's `[out_features, in_features]`) is stored row by row. Each row
//! holds all of its codes first, then one parameter record per group of 64 inputs, and is padded
//! with zeros to a multiple of 16 bytes (`row_stride`). Because a group's codes are 64, 32 or 16
//! bytes, a 16-byte chunk of codes never straddles a group.
//!
//! Code → value mapping (`d` and `m` are IEEE binary16, little-endian):
//! - `bf16`: 2 bytes per value, no parameters.
//! - `q8`: one signed byte `c ∈ [-127, 127]` per value; params `d`; value = `d · c`.
//! - `q4`: group `g` uses bytes `[32g, 32g+32)`; byte `j` holds input `64g + j` in its low nibble and
//!   input `64g + 32 + j` in its high nibble; `c ∈ [0, 15]`; params `d`; value = `d · (c − 8)`.
//! - `q2`: group `g` uses bytes `[16g, 16g+16)`; bits `2k..2k+2` of byte `j` hold input
//!   `64g + 16k + j`; `c ∈ [0, 3]`; params `d, m`; value = `d · c + m`.

use half::{bf16, f16};
use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// Number of inputs that share one set of quantization parameters.
pub const GROUP: usize = 64;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    /// Plain little-endian f32 (used for norm weights and other vectors).
    F32,
    Bf16,
    Q8,
    Q4,
    Q2,
}

impl DType {
    /// Bytes of codes for `cols` inputs.
    pub fn code_bytes(self, cols: usize) -> usize {
        match self {
            DType::F32 => cols * 4,
            DType::Bf16 => cols * 2,
            DType::Q8 => cols,
            DType::Q4 => cols / 2,
            DType::Q2 => cols / 4,
        }
    }

    /// Bytes of parameters per group of 64 inputs.
    pub fn param_bytes_per_group(self) -> usize {
        match self {
            DType::F32 | DType::Bf16 => 0,
            DType::Q8 | DType::Q4 => 2,
            DType::Q2 => 4,
        }
    }

    pub fn is_quantized(self) -> bool {
        matches!(self, DType::Q8 | DType::Q4 | DType::Q2)
    }

    /// Bytes of one stored row of `cols` inputs, padded to 16.
    pub fn row_stride(self, cols: usize) -> usize {
        let groups = if self.is_quantized() { cols / GROUP } else { 0 };
        let raw = self.code_bytes(cols) + groups * self.param_bytes_per_group();
        raw.next_multiple_of(16)
    }

    /// Whether `cols` inputs can be stored in this type.
    pub fn check_cols(self, cols: usize) -> Result<(), String> {
        if self.is_quantized() && !cols.is_multiple_of(GROUP) {
            return Err(format!(
                "input dimension {cols} is not a multiple of {GROUP}"
            ));
        }
        Ok(())
    }

    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::Bf16 => "bf16",
            DType::Q8 => "q8",
            DType::Q4 => "q4",
            DType::Q2 => "q2",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for DType {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s.to_ascii_lowercase().as_str() {
            "f32" => DType::F32,
            "bf16" => DType::Bf16,
            "q8" => DType::Q8,
            "q4" => DType::Q4,
            "q2" => DType::Q2,
            other => {
                return Err(format!(
                    "unknown quantization '{other}' (expected bf16, q8, q4 or q2)"
                ))
            }
        })
    }
}

/// Quantizes one row of `cols` f32 values into `out` (exactly `dtype.row_stride(cols)` bytes).
pub fn quantize_row(dtype: DType, row: &[f32], out: &mut [u8]) {
    let cols = row.len();
    debug_assert_eq!(out.len(), dtype.row_stride(cols));
    out.fill(0);
    match dtype {
        DType::F32 => {
            for (o, v) in out.chunks_exact_mut(4).zip(row) {
                o.copy_from_slice(&v.to_le_bytes());
            }
        }
        DType::Bf16 => {
            for (o, v) in out.chunks_exact_mut(2).zip(row) {
                o.copy_from_slice(&bf16::from_f32(*v).to_bits().to_le_bytes());
            }
        }
        DType::Q8 => {
            let (codes, params) = out.split_at_mut(cols);
            for (g, x) in row.chunks_exact(GROUP).enumerate() {
                let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
                let d = f16::from_f32(amax / 127.0);
                put_f16(params, g, d);
                let inv = inv_or_zero(d.to_f32());
                for (j, v) in x.iter().enumerate() {
                    codes[g * GROUP + j] = ((v * inv).round().clamp(-127.0, 127.0) as i8) as u8;
                }
            }
        }
        DType::Q4 => {
            let (codes, params) = out.split_at_mut(cols / 2);
            for (g, x) in row.chunks_exact(GROUP).enumerate() {
                // The value of largest magnitude maps exactly to code 0 (−8·d): all 16 levels used.
                let mx = x
                    .iter()
                    .fold(0f32, |a, &v| if v.abs() > a.abs() { v } else { a });
                let d = f16::from_f32(mx / -8.0);
                put_f16(params, g, d);
                let inv = inv_or_zero(d.to_f32());
                let c = |v: f32| ((v * inv).round() + 8.0).clamp(0.0, 15.0) as u8;
                for j in 0..32 {
                    codes[g * 32 + j] = c(x[j]) | (c(x[j + 32]) << 4);
                }
            }
        }
        DType::Q2 => {
            let (codes, params) = out.split_at_mut(cols / 4);
            for (g, x) in row.chunks_exact(GROUP).enumerate() {
                let (d, m, q) = fit_q2(x);
                params[g * 4..g * 4 + 2].copy_from_slice(&d.to_bits().to_le_bytes());
                params[g * 4 + 2..g * 4 + 4].copy_from_slice(&m.to_bits().to_le_bytes());
                for (j, &c) in q.iter().enumerate() {
                    let (k, jj) = (j / 16, j % 16);
                    codes[g * 16 + jj] |= c << (2 * k);
                }
            }
        }
    }
}

/// Asymmetric 2-bit fit: start from the min/max range, then alternate between assigning codes
/// and a least-squares refit of (d, m). Returns f16 parameters and codes consistent with them.
fn fit_q2(x: &[f32]) -> (f16, f16, [u8; GROUP]) {
    let lo = x.iter().copied().fold(f32::INFINITY, f32::min);
    let hi = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut d = (hi - lo) / 3.0;
    let mut m = lo;
    let mut q = [0u8; GROUP];
    let mut best = (f32::INFINITY, f16::ZERO, f16::ZERO, q);
    for _ in 0..4 {
        let (dh, mh) = (f16::from_f32(d), f16::from_f32(m));
        let (df, mf) = (dh.to_f32(), mh.to_f32());
        let inv = inv_or_zero(df);
        let mut err = 0f32;
        for (j, &v) in x.iter().enumerate() {
            let c = ((v - mf) * inv).round().clamp(0.0, 3.0);
            q[j] = c as u8;
            let e = df * c + mf - v;
            err += e * e;
        }
        if err < best.0 {
            best = (err, dh, mh, q);
        }
        // Least squares for v ≈ d·c + m given the codes.
        let n = GROUP as f32;
        let (sc, sv) = (
            q.iter().map(|&c| c as f32).sum::<f32>(),
            x.iter().sum::<f32>(),
        );
        let scc = q.iter().map(|&c| (c as f32) * (c as f32)).sum::<f32>();
        let scv = q.iter().zip(x).map(|(&c, &v)| c as f32 * v).sum::<f32>();
        let det = n * scc - sc * sc;
        if det.abs() < 1e-12 {
            break;
        }
        d = (n * scv - sc * sv) / det;
        m = (sv - d * sc) / n;
    }
    (best.1, best.2, best.3)
}

fn inv_or_zero(d: f32) -> f32 {
    if d == 0.0 {
        0.0
    } else {
        1.0 / d
    }
}

fn put_f16(params: &mut [u8], g: usize, d: f16) {
    params[g * 2..g * 2 + 2].copy_from_slice(&d.to_bits().to_le_bytes());
}

#[inline]
pub fn get_f16(bytes: &[u8], i: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]])).to_f32()
}

/// Decodes one stored row back to f32: the reference every kernel is tested against.
pub fn dequantize_row(dtype: DType, row: &[u8], out: &mut [f32]) {
    let cols = out.len();
    match dtype {
        DType::F32 => {
            for (o, b) in out.iter_mut().zip(row.chunks_exact(4)) {
                *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        DType::Bf16 => {
            for (o, b) in out.iter_mut().zip(row.chunks_exact(2)) {
                *o = bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
            }
        }
        DType::Q8 => {
            let (codes, params) = row.split_at(cols);
            for (g, o) in out.chunks_exact_mut(GROUP).enumerate() {
                let d = get_f16(params, g);
                for (j, o) in o.iter_mut().enumerate() {
                    *o = d * (codes[g * GROUP + j] as i8) as f32;
                }
            }
        }
        DType::Q4 => {
            let (codes, params) = row.split_at(cols / 2);
            for (g, o) in out.chunks_exact_mut(GROUP).enumerate() {
                let d = get_f16(params, g);
                for j in 0..32 {
                    let b = codes[g * 32 + j];
                    o[j] = d * ((b & 15) as f32 - 8.0);
                    o[j + 32] = d * ((b >> 4) as f32 - 8.0);
                }
            }
        }
        DType::Q2 => {
            let (codes, params) = row.split_at(cols / 4);
            for (g, o) in out.chunks_exact_mut(GROUP).enumerate() {
                let d = get_f16(params, 2 * g);
                let m = get_f16(params, 2 * g + 1);
                for (j, o) in o.iter_mut().enumerate() {
                    let c = (codes[g * 16 + j % 16] >> (2 * (j / 16))) & 3;
                    *o = d * c as f32 + m;
                }
            }
        }
    }
}

/// Quantizes a whole `[rows, cols]` matrix; returns `rows * row_stride` bytes.
pub fn quantize_matrix(dtype: DType, data: &[f32], rows: usize, cols: usize) -> Vec<u8> {
    use rayon::prelude::*;
    let stride = dtype.row_stride(cols);
    let mut out = vec![0u8; rows * stride];
    out.par_chunks_mut(stride)
        .zip(data.par_chunks(cols))
        .for_each(|(o, r)| quantize_row(dtype, r, o));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gaussian(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed;
        let mut next = || {
            s = s.wrapping_add(0x9E3779B97F4A7C15);
            let mut z = s;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58476D1CE4E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D049BB133111EB);
            ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
        };
        (0..n)
            .map(|_| {
                let (u, v) = (next().max(1e-300), next());
                ((-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()) as f32 * 0.02
            })
            .collect()
    }

    pub(crate) fn rel_rms(dtype: DType, x: &[f32], cols: usize) -> f64 {
        let rows = x.len() / cols;
        let q = quantize_matrix(dtype, x, rows, cols);
        let stride = dtype.row_stride(cols);
        let mut y = vec![0f32; cols];
        let (mut num, mut den) = (0f64, 0f64);
        for r in 0..rows {
            dequantize_row(dtype, &q[r * stride..(r + 1) * stride], &mut y);
            for (a, b) in x[r * cols..(r + 1) * cols].iter().zip(&y) {
                num += ((a - b) as f64).powi(2);
                den += (*a as f64).powi(2);
            }
        }
        (num / den).sqrt()
    }

    #[test]
    fn strides_are_16_byte_aligned() {
        for dt in [DType::Bf16, DType::Q8, DType::Q4, DType::Q2] {
            for cols in [64, 192, 320, 4096] {
                assert_eq!(dt.row_stride(cols) % 16, 0, "{dt} {cols}");
                assert!(dt.row_stride(cols) >= dt.code_bytes(cols));
            }
        }
        assert_eq!(DType::Q4.row_stride(4096), 2048 + 128);
        assert_eq!(DType::Q2.row_stride(192), 48 + 12 + 4);
    }

    #[test]
    fn relative_rms_error_on_gaussian_weights() {
        let x = gaussian(256 * 1024, 7);
        let bf = rel_rms(DType::Bf16, &x, 1024);
        let q8 = rel_rms(DType::Q8, &x, 1024);
        let q4 = rel_rms(DType::Q4, &x, 1024);
        let q2 = rel_rms(DType::Q2, &x, 1024);
        eprintln!("rel rms: bf16 {bf:.5} q8 {q8:.5} q4 {q4:.5} q2 {q2:.5}");
        assert!(bf < 0.003, "bf16 {bf}");
        assert!(q8 < 0.01, "q8 {q8}");
        assert!(q4 < 0.12, "q4 {q4}");
        assert!(q2 < 0.45, "q2 {q2}");
        assert!(bf < q8 && q8 < q4 && q4 < q2);
    }

    #[test]
    fn bf16_is_lossless_for_bf16_input() {
        let x: Vec<f32> = gaussian(640, 3)
            .iter()
            .map(|v| bf16::from_f32(*v).to_f32())
            .collect();
        let q = quantize_matrix(DType::Bf16, &x, 10, 64);
        let mut y = vec![0f32; 64];
        for r in 0..10 {
            dequantize_row(DType::Bf16, &q[r * 128..(r + 1) * 128], &mut y);
            assert_eq!(&x[r * 64..(r + 1) * 64], &y[..]);
        }
    }

    #[test]
    fn layout_matches_documented_mapping() {
        // q4: input 64g+j in the low nibble of byte 32g+j, input 64g+32+j in the high nibble.
        let mut x = vec![0f32; 128];
        x[64 + 3] = -8.0; // largest magnitude of group 1 → code 0, d = 1
        x[64 + 35] = 7.0; // → code 15
        let q = quantize_matrix(DType::Q4, &x, 1, 128);
        assert_eq!(q[32 + 3] & 15, 0);
        assert_eq!(q[32 + 3] >> 4, 15);
        assert_eq!(get_f16(&q[64..], 1), 1.0);
        // q2: input 64g+16k+j in bits 2k..2k+2 of byte 16g+j.
        let mut x = vec![0f32; 64];
        for (i, v) in x.iter_mut().enumerate() {
            *v = (i % 4) as f32;
        }
        let q = quantize_matrix(DType::Q2, &x, 1, 64);
        let mut y = vec![0f32; 64];
        dequantize_row(DType::Q2, &q, &mut y);
        assert_eq!(x, y);
        let c = |i: usize| (q[i % 16] >> (2 * (i / 16))) & 3;
        assert_eq!(c(17), 1);
        assert_eq!(c(50), 2);
    }

    #[test]
    fn zero_groups_stay_zero() {
        for dt in [DType::Q8, DType::Q4, DType::Q2] {
            let x = vec![0f32; 128];
            let q = quantize_matrix(dt, &x, 1, 128);
            let mut y = vec![1f32; 128];
            dequantize_row(dt, &q, &mut y);
            assert!(y.iter().all(|v| *v == 0.0), "{dt}");
        }
    }
}
