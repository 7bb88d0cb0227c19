//! Tests of `matmul` / `dot_row` against `dequantize_row` with f64 accumulation.
//!
//! The reference uses the very weights the kernels decode, so the only legitimate difference is
//! f32 rounding in the sums: tolerances are tight enough that one wrong code or scale fails.

use super::*;
use smoe_vault::quant::{dequantize_row, quantize_matrix};

const ALL: [DType; 5] = [DType::F32, DType::Bf16, DType::Q8, DType::Q4, DType::Q2];

/// Deterministic N(0, scale²) samples (splitmix64 + Box-Muller).
pub(super) fn gaussian(n: usize, seed: u64, scale: f32) -> Vec<f32> {
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
            ((-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()) as f32 * scale
        })
        .collect()
}

/// Reference result and, per element, `Σ|W·x|` (the scale of the f32 rounding error).
fn reference(w: QMatRef, x: &[f32], n_tokens: usize) -> (Vec<f64>, Vec<f64>) {
    let (rows, cols) = (w.rows, w.cols);
    let (mut out, mut mag) = (vec![0f64; n_tokens * rows], vec![0f64; n_tokens * rows]);
    let mut wr = vec![0f32; cols];
    for r in 0..rows {
        dequantize_row(w.dtype, w.row(r), &mut wr);
        for t in 0..n_tokens {
            let xt = &x[t * cols..(t + 1) * cols];
            out[t * rows + r] = wr.iter().zip(xt).map(|(a, b)| *a as f64 * *b as f64).sum();
            mag[t * rows + r] = wr
                .iter()
                .zip(xt)
                .map(|(a, b)| (*a as f64 * *b as f64).abs())
                .sum();
        }
    }
    (out, mag)
}

/// Why `got` is not close to the reference, if it is not: every element finite and within
/// `1e-5 · Σ|W·x|`, and a normalized MSE below 1e-10.
fn mismatch(got: &[f32], want: &[f64], mag: &[f64]) -> Option<String> {
    let (mut num, mut den) = (0f64, 0f64);
    for (i, ((g, w), m)) in got.iter().zip(want).zip(mag).enumerate() {
        let err = (*g as f64 - w).abs();
        if !g.is_finite() || err > 1e-5 * m + 1e-30 {
            return Some(format!("element {i}: got {g}, want {w} (Σ|w·x| = {m})"));
        }
        num += err * err;
        den += w * w;
    }
    let nmse = num / den.max(1e-300);
    (nmse > 1e-10).then(|| format!("nmse {nmse:e}"))
}

fn paths() -> Vec<Path> {
    let mut p = vec![Path::Portable];
    if simd::detected() {
        p.push(Path::Simd);
    }
    p
}

fn make(dtype: DType, rows: usize, cols: usize, seed: u64) -> Vec<u8> {
    quantize_matrix(dtype, &gaussian(rows * cols, seed, 0.02), rows, cols)
}

#[test]
fn matmul_matches_reference_for_all_dtypes_shapes_and_paths() {
    for dtype in ALL {
        for rows in [1, 7, 33, 257] {
            for cols in [64, 192, 320, 1024] {
                let data = make(dtype, rows, cols, (rows * 31 + cols) as u64);
                let w = QMatRef::new(dtype, rows, cols, &data);
                for n_tokens in [1, 3, 5] {
                    let x = gaussian(n_tokens * cols, 99 + n_tokens as u64, 1.0);
                    let (want, mag) = reference(w, &x, n_tokens);
                    for path in paths() {
                        let mut out = vec![f32::NAN; n_tokens * rows];
                        matmul_with(path, w, 0, rows, &x, n_tokens, &mut out);
                        if let Some(e) = mismatch(&out, &want, &mag) {
                            panic!("{dtype} {rows}x{cols} n_tokens {n_tokens} {path:?}: {e}");
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn public_matmul_and_dot_row_match_reference() {
    for dtype in ALL {
        let (rows, cols) = (33, 320);
        let data = make(dtype, rows, cols, 5);
        let w = QMatRef::new(dtype, rows, cols, &data);
        let x = gaussian(3 * cols, 6, 1.0);
        let (want, mag) = reference(w, &x, 3);
        let mut out = vec![f32::NAN; 3 * rows];
        matmul(w, &x, 3, &mut out);
        assert_eq!(mismatch(&out, &want, &mag), None, "{dtype} matmul");
        let dots: Vec<f32> = (0..3 * rows)
            .map(|i| dot_row(dtype, w.row(i % rows), &x[i / rows * cols..][..cols]))
            .collect();
        assert_eq!(mismatch(&dots, &want, &mag), None, "{dtype} dot_row");
        let dots: Vec<f32> = (0..3 * rows)
            .map(|i| dot_row_scalar(dtype, w.row(i % rows), &x[i / rows * cols..][..cols]))
            .collect();
        assert_eq!(mismatch(&dots, &want, &mag), None, "{dtype} dot_row_scalar");
    }
}

#[test]
fn matmul_rows_computes_the_requested_slice() {
    for dtype in ALL {
        let (rows, cols, n_tokens) = (257, 1024, 3);
        let data = make(dtype, rows, cols, 11);
        let w = QMatRef::new(dtype, rows, cols, &data);
        let x = gaussian(n_tokens * cols, 12, 1.0);
        let (want, mag) = reference(w, &x, n_tokens);
        for (start, n) in [(0, 1), (5, 100), (100, 157), (256, 1), (3, 0)] {
            let mut out = vec![f32::NAN; n_tokens * n];
            matmul_rows(w, start, n, &x, n_tokens, &mut out);
            let pick = |v: &[f64]| {
                (0..n_tokens * n)
                    .map(|i| v[i / n * rows + start + i % n])
                    .collect::<Vec<_>>()
            };
            assert_eq!(
                mismatch(&out, &pick(&want), &pick(&mag)),
                None,
                "{dtype} rows {start}+{n}"
            );
        }
    }
}

/// f32 and bf16 rows may be any length; their last partial block goes through the scalar tail
/// for every token tile.
#[test]
fn unquantized_matmul_with_ragged_cols() {
    for dtype in [DType::F32, DType::Bf16] {
        for cols in [1, 63, 100, 1000] {
            let (rows, n_tokens) = (7, 7);
            let data = make(dtype, rows, cols, cols as u64);
            let w = QMatRef::new(dtype, rows, cols, &data);
            let x = gaussian(n_tokens * cols, 8, 1.0);
            let (want, mag) = reference(w, &x, n_tokens);
            for path in paths() {
                let mut out = vec![f32::NAN; n_tokens * rows];
                matmul_with(path, w, 0, rows, &x, n_tokens, &mut out);
                let e = mismatch(&out, &want, &mag);
                assert_eq!(e, None, "{dtype} cols {cols} {path:?}");
            }
        }
    }
}

/// SIMD against the portable kernels, including f32 / bf16 rows whose length is not a multiple
/// of the 64-input block (the tail goes through the scalar code).
#[test]
fn simd_dot_matches_scalar() {
    if !simd::detected() {
        eprintln!("no SIMD path on this machine: nothing to compare");
        return;
    }
    for dtype in ALL {
        let cols_list: &[usize] = if dtype.is_quantized() {
            &[64, 128, 448, 4096]
        } else {
            &[1, 7, 63, 64, 100, 1000]
        };
        for &cols in cols_list {
            let rows = 9;
            let data = make(dtype, rows, cols, cols as u64);
            let w = QMatRef::new(dtype, rows, cols, &data);
            let x = gaussian(cols, 3, 1.0);
            let (want, mag) = reference(w, &x, 1);
            let simd: Vec<f32> = (0..rows)
                .map(|r| dot_with(Path::Simd, dtype, w.row(r), &x))
                .collect();
            let scal: Vec<f32> = (0..rows)
                .map(|r| dot_row_scalar(dtype, w.row(r), &x))
                .collect();
            for r in 0..rows {
                let tol = 2e-5 * mag[r] + 1e-30;
                assert!(
                    (simd[r] - scal[r]).abs() as f64 <= tol,
                    "{dtype} cols {cols} row {r}: {} vs {}",
                    simd[r],
                    scal[r]
                );
            }
            assert_eq!(mismatch(&simd, &want, &mag), None, "{dtype} cols {cols}");
        }
    }
}

/// The checks above can fail: one changed weight byte is caught on every path.
#[test]
fn a_corrupted_weight_is_detected() {
    for dtype in ALL {
        let (rows, cols) = (7, 192);
        let data = make(dtype, rows, cols, 21);
        let x = gaussian(cols, 22, 1.0);
        let (want, mag) = reference(QMatRef::new(dtype, rows, cols, &data), &x, 1);
        let mut bad = data.clone();
        // Row 3, a third of the way in; for f32 / bf16 the top byte (sign and exponent).
        let top = match dtype {
            DType::F32 => 3,
            _ => 1,
        };
        let at = 3 * dtype.row_stride(cols) + dtype.code_bytes(cols) / 3 + top;
        bad[at] ^= 0x45;
        for path in paths() {
            let mut out = vec![f32::NAN; rows];
            matmul_with(
                path,
                QMatRef::new(dtype, rows, cols, &bad),
                0,
                rows,
                &x,
                1,
                &mut out,
            );
            assert!(
                mismatch(&out, &want, &mag).is_some(),
                "{dtype} {path:?}: corruption not detected"
            );
        }
    }
}

#[test]
fn zero_tokens_and_zero_rows_are_no_ops() {
    let data = make(DType::Q4, 7, 64, 1);
    let w = QMatRef::new(DType::Q4, 7, 64, &data);
    matmul(w, &[], 0, &mut []);
    matmul_rows(w, 7, 0, &gaussian(64, 2, 1.0), 1, &mut []);
}

#[test]
#[should_panic(expected = "needs")]
fn qmatref_rejects_wrong_size() {
    let data = make(DType::Q4, 7, 64, 1);
    QMatRef::new(DType::Q4, 8, 64, &data);
}

#[test]
#[should_panic(expected = "multiple of 64")]
fn dot_row_rejects_partial_groups() {
    let data = make(DType::Q8, 1, 64, 1);
    dot_row(DType::Q8, &data, &[0.0; 60]);
}

#[test]
fn simd_path_is_reported() {
    let p = simd_path();
    assert!(["avx2+fma", "neon", "portable"].contains(&p), "{p}");
    // Nothing in this test binary chooses: the best path runs, and choosing it again is fine.
    assert_eq!(p == "portable", !simd::detected(), "{p}");
    set_simd(Simd::Best).unwrap();
    // The portable path differs where there is SIMD: refused once products ran.
    assert_eq!(set_simd(Simd::Portable).is_err(), simd::detected());
    assert_eq!(simd_path(), p);
}

/// `cargo test --release -p smoe-compute -- --ignored --nocapture throughput`
///
/// Weight bytes per second of a 4096×4096 matmul, per storage type. "cold" cycles through
/// copies of the matrix totalling 256 MB, so every call streams its weights from DRAM as in
/// real inference; "hot" repeats one matrix, which then sits in the last-level cache where it
/// fits, so that column shows the kernels' compute rate. Each figure is the best of many calls
/// (noise on a shared machine only ever adds time).
#[test]
#[ignore]
fn throughput_probe() {
    let (rows, cols) = (4096, 4096);
    let src = gaussian(rows * cols, 1, 0.02);
    let x = gaussian(4 * cols, 2, 1.0);
    let one = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap();
    eprintln!(
        "simd path {}, {} rayon threads",
        simd_path(),
        rayon::current_num_threads()
    );
    for dtype in ALL {
        let data = quantize_matrix(dtype, &src, rows, cols);
        let copies: Vec<Vec<u8>> = (0..(256usize << 20).div_ceil(data.len()))
            .map(|_| data.clone())
            .collect();
        let gbs = |path: Path, n_tokens: usize, cold: bool| {
            let mut out = vec![0f32; n_tokens * rows];
            let mut run = |i: usize| {
                let w = QMatRef::new(
                    dtype,
                    rows,
                    cols,
                    if cold {
                        &copies[i % copies.len()]
                    } else {
                        &data
                    },
                );
                matmul_with(path, w, 0, rows, &x[..n_tokens * cols], n_tokens, &mut out)
            };
            run(0);
            let (mut best, t0) = (f64::INFINITY, std::time::Instant::now());
            for i in 1.. {
                let t = std::time::Instant::now();
                run(i);
                best = best.min(t.elapsed().as_secs_f64());
                if t0.elapsed().as_secs_f64() > 0.4 && i >= 2 * copies.len() {
                    break;
                }
            }
            data.len() as f64 / best / 1e9
        };
        let cold = gbs(active_path(), 1, true);
        let cold1 = one.install(|| gbs(active_path(), 1, true));
        let hot = gbs(active_path(), 1, false);
        let hot1 = one.install(|| gbs(active_path(), 1, false));
        let port = gbs(Path::Portable, 1, true);
        let four = gbs(active_path(), 4, true);
        eprintln!(
            "{dtype:>4} {:5.1} MB  GB/s: cold {cold:6.2} (1 thread {cold1:6.2})  hot {hot:6.2} (1 thread {hot1:6.2})  \
             portable cold {port:5.2}  4 tokens cold {four:5.2}",
            data.len() as f64 / 1e6
        );
    }
}
