//! The entry points of `gpu::bench`: a run that times the copy kernel first and then every
//! (shape, dtype, kernel, tuning) asked for, on one timer, so that each row's GB/s is a ratio
//! of a copy measured in the same run on the same device. A shape's kind picks its rows:
//! attention, prefill (GEMM beside the matvec baseline) or decode (matvec per launch shape).

use super::attention::bench_attention;
use super::copy::bench_copy;
use super::fill_weights;
use super::matvec::bench_matvec;
use super::prefill::{bench_prefill, host_weights, Kernel};
use super::report::{BenchReport, BenchRow};
use super::shape::{AttnBench, BenchShape};
use super::timer::Timer;
use crate::gpu::context::{GpuContext, GpuError};
use crate::gpu::matmul::MatMulTuning;
use crate::gpu::matvec::MatVecTuning;
use smoe_vault::quant::DType;

/// Runs the copy kernel and every (shape, dtype, tuning); `iters` calls per timing.
pub fn bench_kernels(
    ctx: &GpuContext,
    shapes: &[BenchShape],
    dtypes: &[DType],
    tunings: &[MatVecTuning],
    iters: usize,
) -> Result<BenchReport, GpuError> {
    let mut run = Sweep::start(ctx, iters)?;
    for shape in shapes {
        if let Some(a) = shape.attention {
            run.attention(shape, a);
        } else if shape.tokens > 0 {
            run.prefill(shape, dtypes, tunings.first().copied().unwrap_or_default());
        } else {
            run.decode(shape, dtypes, tunings);
        }
    }
    Ok(run.finish())
}

/// The GEMM on prefill `shapes` under each of `tunings` (a launch-shape sweep).
pub fn bench_gemm_tunings(
    ctx: &GpuContext,
    shapes: &[BenchShape],
    dtypes: &[DType],
    tunings: &[MatMulTuning],
    iters: usize,
) -> Result<BenchReport, GpuError> {
    let mut run = Sweep::start(ctx, iters)?;
    for shape in shapes
        .iter()
        .filter(|s| s.tokens > 0 && s.attention.is_none())
    {
        for &dtype in dtypes {
            let host = host_weights(shape, dtype);
            for &t in tunings {
                run.prefill_row(shape, dtype, Kernel::MatMul(Some(t)), &host);
            }
        }
    }
    Ok(run.finish())
}

/// A run in progress: its timer, the copy bandwidth its rows are judged against, and what it
/// has measured so far (a measurement that cannot run becomes an error line, not a failure).
struct Sweep<'a> {
    ctx: &'a GpuContext,
    timer: Timer<'a>,
    iters: usize,
    copy_gbps: f64,
    rows: Vec<BenchRow>,
    errors: Vec<String>,
}

impl<'a> Sweep<'a> {
    /// Times the copy first: the reference of every row that follows.
    fn start(ctx: &'a GpuContext, iters: usize) -> Result<Self, GpuError> {
        let timer = Timer::new(ctx);
        let copy_gbps = bench_copy(ctx, &timer, iters)?;
        Ok(Sweep {
            ctx,
            timer,
            iters,
            copy_gbps,
            rows: vec![],
            errors: vec![],
        })
    }

    fn finish(self) -> BenchReport {
        BenchReport::new(
            self.ctx,
            &self.timer,
            self.copy_gbps,
            self.rows,
            self.errors,
        )
    }

    /// The decode attention kernel and the prefill one in each of its tiles.
    fn attention(&mut self, shape: &BenchShape, a: AttnBench) {
        let (rows, errors) =
            bench_attention(self.ctx, &self.timer, shape, a, self.iters, self.copy_gbps);
        self.rows.extend(rows);
        self.errors.extend(errors);
    }

    /// Per dtype, the decode matvec in its `first` tuning (the baseline) and the GEMM, both of
    /// its kernels where the device has matrix units; with experts, the expert sort alone.
    fn prefill(&mut self, shape: &BenchShape, dtypes: &[DType], first: MatVecTuning) {
        for &dtype in dtypes {
            let host = host_weights(shape, dtype);
            let mut kernels = vec![Kernel::MatVec(first), Kernel::MatMul(None)];
            if self.ctx.has_matrix_units() {
                // Both GEMMs, to compare in one run.
                kernels.push(Kernel::MatMulAlu);
            }
            for kernel in kernels {
                self.prefill_row(shape, dtype, kernel, &host);
            }
        }
        if shape.experts > 0 {
            self.prefill_row(shape, DType::Q4, Kernel::Sort, &[]);
        }
    }

    /// The matvec of every dtype under every tuning that applies to it.
    fn decode(&mut self, shape: &BenchShape, dtypes: &[DType], tunings: &[MatVecTuning]) {
        for &dtype in dtypes {
            let stacked = if shape.experts > 0 { shape.stack } else { 1 };
            let host = fill_weights(
                dtype,
                shape.rows * stacked,
                shape.cols,
                0x5eed + shape.rows as u64,
            );
            for &tuning in tunings {
                if dtype != DType::Q4 && tuning.q4 != MatVecTuning::default().q4 {
                    continue; // the q4 decoder choice changes nothing for other types
                }
                let (ctx, timer, iters) = (self.ctx, &self.timer, self.iters);
                match bench_matvec(ctx, timer, shape, dtype, tuning, &host, iters) {
                    Ok((bytes, secs)) => self.rows.push(BenchRow {
                        tuning,
                        ..BenchRow::measured(shape, dtype, "matvec", bytes, secs, self.copy_gbps)
                    }),
                    Err(e) => self.errors.push(format!("{} {dtype}: {e}", shape.name)),
                }
            }
        }
    }

    /// One prefill row, or its error line.
    fn prefill_row(&mut self, shape: &BenchShape, dtype: DType, kernel: Kernel, host: &[u8]) {
        let (ctx, timer, iters) = (self.ctx, &self.timer, self.iters);
        match bench_prefill(ctx, timer, shape, dtype, kernel, host, iters) {
            Ok((bytes, secs, gemm)) => {
                let row = prefill_row(shape, dtype, kernel, bytes, secs, gemm, self.copy_gbps);
                self.rows.push(row);
            }
            Err(e) => self
                .errors
                .push(format!("{} {dtype} {kernel:?}: {e}", shape.name)),
        }
    }
}

/// The row of `kernel` on a prefill shape: `bytes` of weights read in `secs` per call, the
/// GEMM's tile where it ran, GFLOP/s of the product (none for the sort, which multiplies
/// nothing).
fn prefill_row(
    shape: &BenchShape,
    dtype: DType,
    kernel: Kernel,
    bytes: u64,
    secs: f64,
    gemm: Option<MatMulTuning>,
    copy_gbps: f64,
) -> BenchRow {
    let (name, tuning, flops) = match kernel {
        Kernel::MatVec(t) => ("matvec", t, shape.flops()),
        Kernel::MatMul(_) | Kernel::MatMulAlu => ("matmul", MatVecTuning::default(), shape.flops()),
        Kernel::Sort => ("expert_sort", MatVecTuning::default(), 0),
    };
    BenchRow {
        tuning,
        tokens: shape.tokens,
        gemm,
        gflops: flops as f64 / secs / 1e9,
        ..BenchRow::measured(shape, dtype, name, bytes, secs, copy_gbps)
    }
}
