//! What `gpu::bench` hands back: a `BenchRow` per (shape, dtype, kernel, tile) measured, each
//! against the copy bandwidth of the same run, gathered in a `BenchReport` that prints as the
//! CLI's table (decode rows in GB/s, prefill rows in GFLOP/s) and that the CLI turns into JSON.

use super::shape::BenchShape;
use super::timer::Timer;
use crate::gpu::attn_prefill::PrefillAttnTuning;
use crate::gpu::context::GpuContext;
use crate::gpu::matmul::MatMulTuning;
use crate::gpu::matvec::MatVecTuning;
use smoe_vault::quant::DType;
use std::fmt;

/// One measurement: a kernel on one shape and dtype, per call.
#[derive(Clone, Debug)]
pub struct BenchRow {
    pub shape: String,
    pub dtype: DType,
    pub tuning: MatVecTuning,
    /// Weight bytes one call reads.
    pub bytes: u64,
    pub micros: f64,
    pub gbps: f64,
    /// `gbps` over the copy's GB/s.
    pub ratio: f64,
    /// Prefill rows: tokens of the chunk (0: a decode row).
    pub tokens: usize,
    /// Prefill rows: "matvec" (the baseline), "matmul" or "expert_sort".
    pub kernel: &'static str,
    /// Prefill rows, matmul: its tile.
    pub gemm: Option<MatMulTuning>,
    /// Prefill attention rows, attn_prefill: its tile.
    pub attn: Option<PrefillAttnTuning>,
    /// Prefill rows: 2·rows·cols·slots (×2 gated) per second, in GFLOP/s (0 for the sort).
    pub gflops: f64,
}

impl BenchRow {
    /// A row for `bytes` read per call in `secs` per call, against the copy's GB/s; the prefill
    /// fields (`tokens`, `gemm`, `attn`, `gflops`) empty, for the caller to fill.
    pub(super) fn measured(
        shape: &BenchShape,
        dtype: DType,
        kernel: &'static str,
        bytes: u64,
        secs: f64,
        copy_gbps: f64,
    ) -> Self {
        let gbps = bytes as f64 / secs / 1e9;
        BenchRow {
            shape: shape.name.clone(),
            dtype,
            tuning: MatVecTuning::default(),
            bytes,
            micros: secs * 1e6,
            gbps,
            ratio: gbps / copy_gbps,
            tokens: 0,
            kernel,
            gemm: None,
            attn: None,
            gflops: 0.0,
        }
    }

    /// The kernel as the report prints it: "matmul tc 128x48x64" (tensor cores), "matmul
    /// 128x48x16", "attn_prefill 64x32" (with key splits "64x32 /4"), or the kernel's name.
    pub fn kernel_label(&self) -> String {
        match (self.gemm, self.attn) {
            (Some(t), _) if t.coop => format!("matmul tc {}x{}x{}", t.bm, t.bn, t.bk),
            (Some(t), _) => format!("matmul {}x{}x{}", t.bm, t.bn, t.bk),
            (_, Some(t)) if t.splits > 1 => {
                format!("{} {}x{} /{}", self.kernel, t.rows, t.dims, t.splits)
            }
            (_, Some(t)) => format!("{} {}x{}", self.kernel, t.rows, t.dims),
            _ => self.kernel.to_string(),
        }
    }
}

/// One run's measurements, beside the copy bandwidth they are judged against.
#[derive(Clone, Debug)]
pub struct BenchReport {
    pub device: String,
    pub timer: &'static str,
    /// Copy kernel, bytes read + bytes written per second.
    pub copy_gbps: f64,
    pub rows: Vec<BenchRow>,
    /// Measurements that could not run (e.g. a shape too large for this device).
    pub errors: Vec<String>,
}

impl BenchReport {
    /// The report of one run: `rows` and `errors` measured with `timer` beside the copy's GB/s.
    pub(super) fn new(
        ctx: &GpuContext,
        timer: &Timer,
        copy_gbps: f64,
        rows: Vec<BenchRow>,
        errors: Vec<String>,
    ) -> Self {
        let timer_name = if timer.query.is_some() {
            "GPU timestamps"
        } else {
            "wall clock"
        };
        BenchReport {
            device: device_label(ctx),
            timer: timer_name,
            copy_gbps,
            rows,
            errors,
        }
    }

    /// The decode rows (`tokens == 0`): bandwidth-bound, so GB/s and its ratio to the copy's,
    /// with the matvec launch shape that gave them.
    fn write_decode(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.rows.iter().any(|r| r.tokens == 0) {
            writeln!(
                f,
                "{:<18} {:<5} {:>10} {:>10} {:>9} {:>7}  tuning",
                "shape", "dtype", "MB", "µs", "GB/s", "ratio"
            )?;
        }
        for r in self.rows.iter().filter(|r| r.tokens == 0) {
            let t = &r.tuning;
            writeln!(
                f,
                "{:<18} {:<5} {:>10.1} {:>10.1} {:>9.0} {:>6.1}%  wg {} rows {}{} {}",
                r.shape,
                r.dtype.name(),
                r.bytes as f64 / 1e6,
                r.micros,
                r.gbps,
                100.0 * r.ratio,
                t.wg,
                t.rows,
                match t.items {
                    0 => String::new(),
                    u => format!(" items {u}"),
                },
                if r.dtype == DType::Q4 {
                    format!("{:?}", t.q4)
                } else {
                    String::new()
                }
            )?;
        }
        Ok(())
    }

    /// The prefill rows (`tokens > 0`): compute-bound, so GFLOP/s first, under a legend of how
    /// each column is counted.
    fn write_prefill(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.rows.iter().any(|r| r.tokens > 0) {
            writeln!(
                f,
                "prefill: GFLOP/s = 2·rows·cols·slots (×2 gated) / time; GB/s = weight bytes / time"
            )?;
            writeln!(
                f,
                "  attention: GFLOP/s = 4·head_dim·heads·visible keys / time; GB/s = K+V cache \
                 bytes / time; attn_prefill ROWSxDIMS, the default tile first"
            )?;
            writeln!(
                f,
                "{:<18} {:<5} {:<22} {:>10} {:>9} {:>7}",
                "shape", "dtype", "kernel", "µs", "GFLOP/s", "GB/s"
            )?;
        }
        for r in self.rows.iter().filter(|r| r.tokens > 0) {
            let kernel = r.kernel_label();
            writeln!(
                f,
                "{:<18} {:<5} {:<22} {:>10.1} {:>9.0} {:>7.0}",
                r.shape,
                r.dtype.name(),
                kernel,
                r.micros,
                r.gflops,
                r.gbps
            )?;
        }
        Ok(())
    }
}

impl fmt::Display for BenchReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "device: {} (timer: {})", self.device, self.timer)?;
        writeln!(f, "copy: {:.0} GB/s (read + write)", self.copy_gbps)?;
        self.write_decode(f)?;
        self.write_prefill(f)?;
        for e in &self.errors {
            writeln!(f, "skipped: {e}")?;
        }
        Ok(())
    }
}

/// The adapter as a report names it: "name (backend, driver)".
pub fn device_label(ctx: &GpuContext) -> String {
    let a = &ctx.info().adapter;
    format!("{} ({:?}, {})", a.name, a.backend, a.driver_info)
}
