//! What several commands share: backend choice, model opening, id lists, logging.

use anyhow::{bail, Context, Result};
use smoe_engine::engine::EngineOptions;
use smoe_engine::Engine;
use std::path::Path;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Backend {
    Cpu,
    Gpu,
    /// The GPU when one is usable, else the CPU.
    Auto,
}

/// Resolves `--backend` to what this build can run.
pub fn check_backend(b: Backend) -> Result<()> {
    match b {
        Backend::Cpu => Ok(()),
        Backend::Gpu => bail!("--backend gpu: this build of smoe has no GPU backend yet; use --backend cpu"),
        Backend::Auto => {
            tracing::info!("backend auto: using the CPU (no GPU backend in this build)");
            Ok(())
        }
    }
}

pub fn open_engine(path: &Path, backend: Backend) -> Result<Engine> {
    check_backend(backend)?;
    if !path.exists() {
        bail!("{}: no such file", path.display());
    }
    Engine::open(path, EngineOptions::default()).with_context(|| format!("cannot load {}", path.display()))
}

/// Parses `1,2,3` (spaces allowed).
pub fn parse_ids(s: &str) -> Result<Vec<u32>> {
    let ids: Vec<u32> = s
        .split(',')
        .map(str::trim)
        .filter(|x| !x.is_empty())
        .map(|x| x.parse::<u32>().with_context(|| format!("--prompt-ids: '{x}' is not a token id")))
        .collect::<Result<_>>()?;
    if ids.is_empty() {
        bail!("--prompt-ids: no token ids given");
    }
    Ok(ids)
}

pub fn init_logging(verbose: u8) {
    let default = match verbose {
        0 => "warn",
        1 => "info",
        _ => "debug",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_target(false).init();
}

pub fn progress_bar(len: u64, what: &str) -> indicatif::ProgressBar {
    let pb = indicatif::ProgressBar::new(len);
    let style = indicatif::ProgressStyle::with_template(
        "{msg:>12} [{bar:40}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
    )
    .unwrap()
    .progress_chars("=> ");
    pb.set_style(style);
    pb.set_message(what.to_string());
    pb
}

pub fn human_bytes(n: u64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < units.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else {
        format!("{v:.2} {}", units[u])
    }
}
