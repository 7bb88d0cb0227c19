//! The GPU kernels against their CPU twins.
//!
//! `conformance` runs one table (`table.rs`) of rows — an op, its shapes, its types, a
//! tolerance — on fresh deterministic inputs, odd sizes, data at offsets inside its buffers and
//! outputs poisoned with NaN, judged by NMSE (ids exactly); one test per op. What is not such a
//! comparison has a test of its own: `msl` (every kernel through naga's Metal backend),
//! `limits` (what the kernels refuse, and how they meet the device's limits) and `control`
//! (the streaming slot map that halts a pass), `tuning` (a context's typed settings take effect).
//!
//! With no GPU adapter every row and test reports `skipped: no GPU adapter` and passes, unless
//! `SMOE_REQUIRE_GPU=1` (set by `.ci/run`), which turns that into a failure.
#![cfg(feature = "gpu")]

#[path = "gpu_kernels/cases/mod.rs"]
mod cases;
#[path = "gpu_kernels/conformance.rs"]
mod conformance;
#[path = "gpu_kernels/control.rs"]
mod control;
#[path = "gpu_kernels/limits.rs"]
mod limits;
#[path = "gpu_kernels/msl.rs"]
mod msl;
// One row a line: rustfmt would spread the table over several.
#[rustfmt::skip]
#[path = "gpu_kernels/table.rs"]
mod table;
#[path = "gpu_kernels/tuning.rs"]
mod tuning;

use smoe_compute::gpu::{wgpu, GpuContext};
use std::sync::OnceLock;

/// Whether `SMOE_REQUIRE_GPU=1`: a missing or unusable adapter is then a failure, not a skip.
pub fn gpu_required() -> bool {
    std::env::var("SMOE_REQUIRE_GPU").is_ok_and(|v| v == "1")
}

/// The shared device, or why there is none.
pub fn gpu_or_why() -> Result<&'static GpuContext, &'static str> {
    static CTX: OnceLock<Result<GpuContext, String>> = OnceLock::new();
    let ctx = CTX.get_or_init(|| GpuContext::new().map_err(|e| e.to_string()));
    ctx.as_ref().map_err(|e| e.as_str())
}

/// The shared device, or `None` (after saying so) when this machine has none.
pub fn gpu() -> Option<&'static GpuContext> {
    match gpu_or_why() {
        Ok(c) => Some(c),
        Err(e) => {
            if gpu_required() {
                panic!("SMOE_REQUIRE_GPU=1 but the GPU is unusable: {e}");
            }
            // Straight to stderr: libtest would swallow print!/eprint! of a passing test.
            use std::io::Write;
            let _ = writeln!(std::io::stderr(), "skipped: no GPU adapter ({e})");
            None
        }
    }
}

/// Deterministic uniform values in [-scale, scale); a different stream per seed.
pub fn rand_vec(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E3779B97F4A7C15) ^ 0xD1B54A32D192ED03;
    (0..n)
        .map(|_| {
            s = s.wrapping_add(0x9E3779B97F4A7C15);
            let mut z = s;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58476D1CE4E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D049BB133111EB);
            z ^= z >> 31;
            ((z >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

/// Σ(got − want)² / Σ want²; NaN anywhere (an unwritten poisoned output) gives +inf.
pub fn nmse(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len());
    let (mut num, mut den) = (0f64, 0f64);
    for (g, w) in got.iter().zip(want) {
        if !g.is_finite() {
            return f64::INFINITY;
        }
        num += ((g - w) as f64).powi(2);
        den += (*w as f64).powi(2);
    }
    num / den.max(1e-30)
}

#[track_caller]
pub fn assert_close(what: &str, got: &[f32], want: &[f32], tol: f64) {
    let e = nmse(got, want);
    assert!(
        e <= tol,
        "{what}: NMSE {e:.3e} > {tol:.0e}; got[..4] {:?} want[..4] {:?}",
        &got[..got.len().min(4)],
        &want[..want.len().min(4)]
    );
}

pub fn nan_buffer(ctx: &GpuContext, label: &str, n: usize) -> wgpu::Buffer {
    ctx.upload_f32(label, &vec![f32::NAN; n])
}

#[test]
fn adapter_info_is_printable() {
    let Some(ctx) = gpu() else { return };
    let info = ctx.info().to_string();
    println!("{info}");
    assert!(info.contains("SUBGROUP"));
}
