//! Quantized matrix × activations on the CPU.
//!
//! Weights stay in their vault storage type (`smoe_vault::quant`) and are decoded in registers
//! inside the dot-product kernels; activations are f32 and are never quantized. Decode-time
//! matmuls are bound by memory bandwidth, so the aim is to read every weight byte once per call:
//! work is split over rayon tasks by blocks of rows, and within a block each row is processed
//! for all tokens before moving on (tokens in tiles of up to four share one decode of the row).

use super::scalar;
use rayon::prelude::*;
use smoe_vault::quant::DType;
use std::sync::OnceLock;

#[cfg(target_arch = "x86_64")]
use super::simd_x86 as simd;

#[cfg(target_arch = "aarch64")]
use super::simd_neon as simd;

/// Targets without a SIMD path: nothing is ever detected, so `dot_tile` is never called.
#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
mod simd {
    use smoe_vault::quant::DType;
    pub(super) const NAME: &str = "portable";
    pub(super) fn detected() -> bool {
        false
    }
    pub(super) unsafe fn dot_tile<const NT: usize>(
        _: DType,
        _: &[u8],
        _: &[f32],
        _: usize,
    ) -> [f32; NT] {
        unreachable!("no SIMD path on this target")
    }
}

/// A borrowed weight matrix `[rows, cols]` in a vault storage type: `rows * dtype.row_stride(cols)`
/// bytes, row after row.
#[derive(Clone, Copy, Debug)]
pub struct QMatRef<'a> {
    pub dtype: DType,
    pub rows: usize,
    pub cols: usize,
    pub data: &'a [u8],
}

impl<'a> QMatRef<'a> {
    /// Panics if `data` is not exactly `rows` stored rows of `cols` inputs, or if `cols` cannot be
    /// stored in `dtype`: the kernels rely on both.
    pub fn new(dtype: DType, rows: usize, cols: usize, data: &'a [u8]) -> Self {
        if let Err(e) = dtype.check_cols(cols) {
            panic!("QMatRef: {e}");
        }
        let want = rows * dtype.row_stride(cols);
        assert_eq!(
            data.len(),
            want,
            "QMatRef: {rows}x{cols} {dtype} needs {want} bytes"
        );
        QMatRef {
            dtype,
            rows,
            cols,
            data,
        }
    }

    /// The stored bytes of row `r` (codes, group parameters, padding).
    pub fn row(&self, r: usize) -> &'a [u8] {
        let stride = self.dtype.row_stride(self.cols);
        &self.data[r * stride..(r + 1) * stride]
    }
}

/// Which kernels run. `Simd` is only ever constructed after `simd::detected()` said yes, which is
/// what makes the unsafe `simd::dot_tile` calls below sound.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Path {
    Portable,
    Simd,
}

/// Which CPU kernels a process runs (`set_simd`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Simd {
    /// The best SIMD path the CPU has (AVX2+FMA, NEON), else the portable one. The default.
    #[default]
    Best,
    /// The portable kernels (the tests' reference), whatever the CPU has: for comparisons.
    Portable,
}

/// The path of each choice on this CPU.
fn resolve(choice: Simd) -> Path {
    match choice {
        Simd::Best if simd::detected() => Path::Simd,
        _ => Path::Portable,
    }
}

/// The path this process runs, fixed at first use (feature detection is not free).
static PATH: OnceLock<Path> = OnceLock::new();

/// Chooses this process's CPU kernels; call it before the first product. Fails, naming the path
/// in use, where products already ran on another path (or an earlier call chose one): the
/// choice is made once per process.
pub fn set_simd(choice: Simd) -> Result<(), String> {
    let want = resolve(choice);
    match *PATH.get_or_init(|| want) {
        p if p == want => Ok(()),
        _ => Err(format!(
            "the CPU kernels already run on the {} path (the SIMD choice is made once per process)",
            simd_path()
        )),
    }
}

/// The path chosen for this process: `set_simd`'s, else the best detected one.
fn active_path() -> Path {
    *PATH.get_or_init(|| resolve(Simd::Best))
}

/// Which SIMD path is active: `"avx2+fma"`, `"neon"` or `"portable"`.
pub fn simd_path() -> &'static str {
    match active_path() {
        Path::Simd => simd::NAME,
        Path::Portable => "portable",
    }
}

/// Panics unless `row` can hold a row of `cols` inputs in `dtype`.
fn check_row(dtype: DType, row: &[u8], cols: usize) {
    if let Err(e) = dtype.check_cols(cols) {
        panic!("{dtype} row: {e}");
    }
    assert!(
        row.len() >= dtype.row_stride(cols),
        "{dtype} row of {cols} inputs is {} bytes",
        row.len()
    );
}

/// `Σ_c W[c] · x[c]` for one stored row (`x.len()` inputs), on the best SIMD path.
pub fn dot_row(dtype: DType, row: &[u8], x: &[f32]) -> f32 {
    check_row(dtype, row, x.len());
    dot_with(active_path(), dtype, row, x)
}

/// The portable path of `dot_row`: plain loops, the reference the SIMD kernels are tested against.
pub fn dot_row_scalar(dtype: DType, row: &[u8], x: &[f32]) -> f32 {
    check_row(dtype, row, x.len());
    scalar::dot(dtype, row, x)
}

fn dot_with(path: Path, dtype: DType, row: &[u8], x: &[f32]) -> f32 {
    match path {
        // SAFETY: `Path::Simd` implies the CPU features were detected.
        Path::Simd => unsafe { simd::dot_tile::<1>(dtype, row, x, x.len())[0] },
        Path::Portable => scalar::dot(dtype, row, x),
    }
}

/// `out[t*rows + r] = Σ_c W[r,c] · x[t*cols + c]` for `t in 0..n_tokens`: `x` is `n_tokens * cols`
/// values, `out` is `n_tokens * rows` (token-major, like `x`). Every element of `out` is written.
pub fn matmul(w: QMatRef, x: &[f32], n_tokens: usize, out: &mut [f32]) {
    matmul_rows(w, 0, w.rows, x, n_tokens, out);
}

/// `matmul` restricted to rows `row_start..row_start + out_rows`: `out[t*out_rows + i]` is row
/// `row_start + i` for token `t`. Lets a caller split one matrix over several workers or devices.
pub fn matmul_rows(
    w: QMatRef,
    row_start: usize,
    out_rows: usize,
    x: &[f32],
    n_tokens: usize,
    out: &mut [f32],
) {
    matmul_with(active_path(), w, row_start, out_rows, x, n_tokens, out);
}

/// Below this many multiply-adds a call runs on the calling thread: splitting it would cost
/// more in task hand-off than it saves (a 512×512 single-token matmul is a few microseconds).
const PAR_MIN_WORK: usize = 1 << 18;
/// Smallest share of one rayon task, in multiply-adds.
const TASK_MIN_WORK: usize = 1 << 16;
/// Tasks per rayon thread, so that uneven progress (other work on the pool) evens out.
const TASKS_PER_THREAD: usize = 4;

fn matmul_with(
    path: Path,
    w: QMatRef,
    row_start: usize,
    out_rows: usize,
    x: &[f32],
    n_tokens: usize,
    out: &mut [f32],
) {
    assert!(
        row_start + out_rows <= w.rows,
        "rows {row_start}+{out_rows} of {}",
        w.rows
    );
    assert_eq!(x.len(), n_tokens * w.cols, "x must be n_tokens * cols");
    assert_eq!(
        out.len(),
        n_tokens * out_rows,
        "out must be n_tokens * out_rows"
    );
    let per_row = w.cols.max(1) * n_tokens;
    let threads = rayon::current_num_threads();
    if out_rows * per_row < PAR_MIN_WORK || threads == 1 || out_rows < 2 {
        return run_block(path, w, row_start, out_rows, x, n_tokens, |t, i, v| {
            out[t * out_rows + i] = v
        });
    }
    let block = out_rows
        .div_ceil(threads * TASKS_PER_THREAD)
        .max(TASK_MIN_WORK.div_ceil(per_row));
    if n_tokens == 1 {
        out.par_chunks_mut(block).enumerate().for_each(|(b, o)| {
            run_block(path, w, row_start + b * block, o.len(), x, 1, |_, i, v| {
                o[i] = v
            });
        });
        return;
    }
    // With several tokens, a block of rows owns one slice per token. Splitting them up front
    // keeps this in safe code; it costs one small Vec per block per call, never per row.
    let mut blocks: Vec<Vec<&mut [f32]>> = (0..out_rows.div_ceil(block))
        .map(|_| Vec::with_capacity(n_tokens))
        .collect();
    for tok in out.chunks_mut(out_rows) {
        for (b, s) in tok.chunks_mut(block).enumerate() {
            blocks[b].push(s);
        }
    }
    blocks
        .into_par_iter()
        .enumerate()
        .for_each(|(b, mut outs)| {
            let n = outs[0].len();
            run_block(path, w, row_start + b * block, n, x, n_tokens, |t, i, v| {
                outs[t][i] = v
            });
        });
}

/// Computes rows `r0..r0 + n` for all tokens, handing each result to `emit(token, i, value)`.
/// The row loop is outside the token loop so each row's bytes come from memory once.
fn run_block(
    path: Path,
    w: QMatRef,
    r0: usize,
    n: usize,
    x: &[f32],
    n_tokens: usize,
    mut emit: impl FnMut(usize, usize, f32),
) {
    let cols = w.cols;
    for i in 0..n {
        let row = w.row(r0 + i);
        match path {
            Path::Portable => {
                for t in 0..n_tokens {
                    emit(
                        t,
                        i,
                        scalar::dot(w.dtype, row, &x[t * cols..(t + 1) * cols]),
                    );
                }
            }
            Path::Simd => {
                let mut t = 0;
                while t < n_tokens {
                    let left = n_tokens - t;
                    let xs = |nt: usize| &x[t * cols..(t + nt) * cols];
                    // SAFETY: `Path::Simd` implies the CPU features were detected.
                    let nt = unsafe {
                        if left >= 4 {
                            let r = simd::dot_tile::<4>(w.dtype, row, xs(4), cols);
                            r.iter().enumerate().for_each(|(k, v)| emit(t + k, i, *v));
                            4
                        } else if left >= 2 {
                            let r = simd::dot_tile::<2>(w.dtype, row, xs(2), cols);
                            r.iter().enumerate().for_each(|(k, v)| emit(t + k, i, *v));
                            2
                        } else {
                            emit(t, i, simd::dot_tile::<1>(w.dtype, row, xs(1), cols)[0]);
                            1
                        }
                    };
                    t += nt;
                }
            }
        }
    }
}

#[cfg(test)]
#[path = "matmul_tests.rs"]
mod tests;
