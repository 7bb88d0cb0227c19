//! The one place where `smoe` turns its `SMOE_*` environment variables into the libraries'
//! typed settings (the libraries read no environment):
//!
//! | variable | setting | default |
//! |---|---|---|
//! | `SMOE_SIMD=portable` | `cpu::set_simd(Simd::Portable)` | the best SIMD path |
//! | `SMOE_FUSED_TAILS=0` | `GpuTuning::fused_tails` false | on (Vulkan) |
//! | `SMOE_MATRIX_UNITS=0` | `GpuTuning::matrix_units` false | on where offered |
//! | `SMOE_EXEC_BARRIERS=0\|gemm\|1` | `GpuTuning::exec_barriers` | NVIDIA's driver: every kernel |
//! | `SMOE_GPU_HOLD_CLOCKS=0` | `GpuTuning::hold_clocks` false | on |
//! | `SMOE_KERNEL_DIR=DIR` | `GpuTuning::kernel_dir` | none |
//! | `SMOE_FUSED_ROUTER=0` | `Tuning::fused_router` false | on |
//! | `SMOE_GPU_SLOT_TABLE=0` | `Tuning::run_through` false | on |
//! | `SMOE_GPU_FILL_AHEAD=0` | `Tuning::fill_ahead` false | on |
//! | `SMOE_GPU_SPECULATE=N` | `Tuning::speculate` | 2 (discrete GPU), 0 (unified memory) |
//! | `SMOE_LOOKAHEAD_DEPTH=N` | `Tuning::lookahead` depth | 1 |
//! | `SMOE_LOOKAHEAD_TOP=N` | `Tuning::lookahead` top | every guessed expert |
//! | `SMOE_MAPPED_SLOTS=0` | `Tuning::mapped_slots` false | on |
//! | `SMOE_ROUTE_TRACE=record:PATH\|replay:PATH[:DEPTH]` | `Tuning::route_oracle` (`route_trace::Oracle`) | none |
//!
//! The process-wide ones (the CPU kernels, the GPU device) are applied once at start
//! (`configure_process`); the engine's go into every model's `StoreOptions` (`engine`).

use crate::route_trace::{Oracle, RouteTrace};
use anyhow::{bail, Result};
use smoe_compute::cpu::Simd;
use smoe_compute::gpu::{ExecBarriers, GpuTuning};
use smoe_engine::store::{Lookahead, LOOKAHEAD_MAX};
use smoe_engine::Tuning;
use std::ffi::OsString;
use std::sync::Arc;

/// A source of variables: the process's environment, or a test's table.
type Env<'a> = &'a dyn Fn(&str) -> Option<OsString>;

fn process_env(name: &str) -> Option<OsString> {
    std::env::var_os(name)
}

/// The variable as text (`None`: unset).
fn text(env: Env, name: &str) -> Option<String> {
    env(name).map(|v| v.to_string_lossy().into_owned())
}

/// Whether the variable is set to exactly `0` (how every on/off switch is turned off).
fn off(env: Env, name: &str) -> bool {
    text(env, name).as_deref() == Some("0")
}

/// Chooses the CPU kernels and sets up the GPU device (before anything uses either).
pub fn configure_process() -> Result<()> {
    smoe_compute::cpu::set_simd(simd(&process_env)).map_err(anyhow::Error::msg)?;
    smoe_engine::gpu::configure(gpu(&process_env))?;
    Ok(())
}

/// The engine's settings for a model (`StoreOptions::tuning`), with the routing oracle opened
/// where `SMOE_ROUTE_TRACE` asks for one.
pub fn engine() -> Result<Tuning> {
    let oracle = match route_trace(&process_env)? {
        Some(trace) => Some(smoe_engine::tuning::Oracle(Arc::new(Oracle::open(&trace)?))),
        None => None,
    };
    Ok(Tuning {
        route_oracle: oracle,
        ..engine_from(&process_env)?
    })
}

/// What `SMOE_ROUTE_TRACE` asks for.
fn route_trace(env: Env) -> Result<Option<RouteTrace>> {
    text(env, "SMOE_ROUTE_TRACE")
        .map(|v| RouteTrace::parse(&v))
        .transpose()
}

fn simd(env: Env) -> Simd {
    match text(env, "SMOE_SIMD") {
        Some(v) if v.eq_ignore_ascii_case("portable") => Simd::Portable,
        _ => Simd::Best,
    }
}

fn gpu(env: Env) -> GpuTuning {
    let exec_barriers = match text(env, "SMOE_EXEC_BARRIERS").as_deref() {
        None => None,
        Some("0") => Some(ExecBarriers::Off),
        Some("gemm") => Some(ExecBarriers::TensorCoreGemm),
        Some("1") => Some(ExecBarriers::AllKernels),
        Some(other) => {
            tracing::warn!("SMOE_EXEC_BARRIERS={other}: expected 0, gemm or 1; using the default");
            None
        }
    };
    GpuTuning {
        fused_tails: !off(env, "SMOE_FUSED_TAILS"),
        matrix_units: !off(env, "SMOE_MATRIX_UNITS"),
        exec_barriers,
        hold_clocks: !off(env, "SMOE_GPU_HOLD_CLOCKS"),
        kernel_dir: env("SMOE_KERNEL_DIR").map(Into::into),
        ..GpuTuning::default()
    }
}

fn engine_from(env: Env) -> Result<Tuning> {
    // A number in `ok`, or an error naming the variable and `want`.
    let number = |name: &str, ok: &dyn Fn(usize) -> bool, want: &str| -> Result<Option<usize>> {
        let Some(v) = text(env, name) else {
            return Ok(None);
        };
        match v.trim().parse() {
            Ok(n) if ok(n) => Ok(Some(n)),
            _ => bail!("{name}={v}: expected {want}"),
        }
    };
    let depth = number(
        "SMOE_LOOKAHEAD_DEPTH",
        &|d| (1..=LOOKAHEAD_MAX).contains(&d),
        &format!("1 to {LOOKAHEAD_MAX} MoE layers"),
    )?;
    let top = number("SMOE_LOOKAHEAD_TOP", &|t| t > 0, "1 or more experts")?;
    let speculate = number(
        "SMOE_GPU_SPECULATE",
        &|_| true,
        "a number of MoE layers (0: off)",
    )?;
    route_trace(env)?;
    let d = Tuning::default();
    Ok(Tuning {
        fused_router: !off(env, "SMOE_FUSED_ROUTER"),
        run_through: !off(env, "SMOE_GPU_SLOT_TABLE"),
        fill_ahead: !off(env, "SMOE_GPU_FILL_AHEAD"),
        speculate,
        lookahead: Lookahead {
            depth: depth.unwrap_or(d.lookahead.depth),
            top: top.unwrap_or(d.lookahead.top),
        },
        mapped_slots: !off(env, "SMOE_MAPPED_SLOTS"),
        route_oracle: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A table of variables instead of the process's environment.
    fn table<'a>(vars: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<OsString> + 'a {
        move |name| {
            (vars.iter())
                .find(|(k, _)| *k == name)
                .map(|(_, v)| OsString::from(v))
        }
    }

    #[test]
    fn no_variables_give_the_defaults() {
        let none = table(&[]);
        assert_eq!(gpu(&none), GpuTuning::default());
        assert_eq!(engine_from(&none).unwrap(), Tuning::default());
        assert_eq!(simd(&none), Simd::Best);
    }

    #[test]
    fn each_variable_sets_its_field() {
        let vars = [
            ("SMOE_SIMD", "Portable"),
            ("SMOE_FUSED_TAILS", "0"),
            ("SMOE_MATRIX_UNITS", "0"),
            ("SMOE_EXEC_BARRIERS", "gemm"),
            ("SMOE_GPU_HOLD_CLOCKS", "0"),
            ("SMOE_KERNEL_DIR", "/tmp/k"),
            ("SMOE_FUSED_ROUTER", "0"),
            ("SMOE_GPU_SLOT_TABLE", "0"),
            ("SMOE_GPU_FILL_AHEAD", "0"),
            ("SMOE_GPU_SPECULATE", "3"),
            ("SMOE_LOOKAHEAD_DEPTH", "4"),
            ("SMOE_LOOKAHEAD_TOP", "2"),
            ("SMOE_MAPPED_SLOTS", "0"),
            ("SMOE_ROUTE_TRACE", "replay:/tmp/t:2"),
        ];
        let env = table(&vars);
        assert_eq!(simd(&env), Simd::Portable);
        let want = GpuTuning {
            fused_tails: false,
            matrix_units: false,
            exec_barriers: Some(ExecBarriers::TensorCoreGemm),
            hold_clocks: false,
            kernel_dir: Some("/tmp/k".into()),
            ..GpuTuning::default()
        };
        assert_eq!(gpu(&env), want);
        let want = Tuning {
            fused_router: false,
            run_through: false,
            fill_ahead: false,
            speculate: Some(3),
            lookahead: Lookahead { depth: 4, top: 2 },
            mapped_slots: false,
            route_oracle: None,
        };
        assert_eq!(engine_from(&env).unwrap(), want);
        let trace = RouteTrace::Replay {
            path: "/tmp/t".into(),
            depth: 2,
        };
        assert_eq!(route_trace(&env).unwrap(), Some(trace));
        // Only `0` turns a switch off; an unknown barrier scope keeps the default.
        let env = table(&[("SMOE_FUSED_ROUTER", "1"), ("SMOE_EXEC_BARRIERS", "x")]);
        assert!(engine_from(&env).unwrap().fused_router);
        assert_eq!(gpu(&env).exec_barriers, None);
    }

    #[test]
    fn bad_numbers_name_their_variable() {
        for (name, v) in [
            ("SMOE_LOOKAHEAD_DEPTH", "9"),
            ("SMOE_LOOKAHEAD_DEPTH", "deep"),
            ("SMOE_LOOKAHEAD_TOP", "0"),
            ("SMOE_GPU_SPECULATE", "-1"),
            ("SMOE_ROUTE_TRACE", "replay"),
        ] {
            let vars = [(name, v)];
            let err = engine_from(&table(&vars)).unwrap_err().to_string();
            assert!(err.contains(&format!("{name}={v}")), "{err}");
        }
    }
}
