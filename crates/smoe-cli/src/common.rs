//! What several commands share: backend choice, model opening, id lists, logging.

use anyhow::{bail, Context, Result};
use smoe_engine::engine::EngineOptions;
use smoe_engine::Engine;
use std::path::{Path, PathBuf};

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Backend {
    Cpu,
    Gpu,
    /// The GPU when one is usable, else the CPU.
    Auto,
}

/// `--backend` as the engine's option: `gpu` fails at load when there is no usable adapter,
/// `auto` falls back to the CPU with a log line (`-v` shows it).
pub fn check_backend(b: Backend) -> Result<smoe_engine::engine::Backend> {
    use smoe_engine::engine::Backend as B;
    Ok(match b {
        Backend::Cpu => B::Cpu,
        Backend::Gpu => B::Gpu,
        Backend::Auto => B::Auto,
    })
}

/// The demo model (docs/demo-model.md), built into the binary so `smoe generate` works anywhere
/// without a download.
static DEMO_VAULT: &[u8] = include_bytes!("../../../models/demo-qwen3-moe.smoe");

/// `-m PATH`, or the built-in demo model, written once to the user's cache directory (vaults are
/// memory-mapped, so they must live in a file).
pub fn model_path(arg: Option<&Path>) -> Result<PathBuf> {
    if let Some(p) = arg {
        return Ok(p.to_path_buf());
    }
    let sum = smoe_vault::format::checksum(DEMO_VAULT);
    let dir = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir)
        .join("smoe");
    let path = dir.join(format!("demo-qwen3-moe-{sum:016x}.smoe"));
    if std::fs::metadata(&path)
        .map(|m| m.len() == DEMO_VAULT.len() as u64)
        .unwrap_or(false)
    {
        return Ok(path);
    }
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let tmp = dir.join(format!(".demo-{}.partial", std::process::id()));
    std::fs::write(&tmp, DEMO_VAULT).with_context(|| format!("cannot write {}", tmp.display()))?;
    std::fs::rename(&tmp, &path).with_context(|| format!("cannot write {}", path.display()))?;
    tracing::info!("built-in demo model written to {}", path.display());
    Ok(path)
}

/// Opens a model with the expert-store flags; preloads the profile's hottest experts (with a
/// progress bar) when streaming.
pub fn open_engine_with(
    path: &Path,
    backend: Backend,
    store: &crate::store_args::StoreArgs,
) -> Result<Engine> {
    let backend = check_backend(backend)?;
    if !path.exists() {
        bail!("{}: no such file", path.display());
    }
    let opts = EngineOptions {
        store: store.options(path)?,
        backend,
        ..EngineOptions::default()
    };
    let engine =
        Engine::open(path, opts).with_context(|| format!("cannot load {}", path.display()))?;
    store.preload(&engine)?;
    Ok(engine)
}

/// Checks that a vault may be written to `out`: it does not exist, or `force` replaces it — and
/// then only a regular file (a device node such as /dev/full, a folder or a socket is never
/// replaced by the rename that finishes the write).
pub fn check_output(out: &std::path::Path, force: bool) -> Result<()> {
    let Ok(meta) = std::fs::symlink_metadata(out) else {
        return Ok(());
    };
    if !meta.file_type().is_file() {
        bail!(
            "{} exists and is not a regular file: it is never replaced",
            out.display()
        );
    }
    if !force {
        bail!("{} exists (pass --force to replace it)", out.display());
    }
    Ok(())
}

/// Parses `1,2,3` (spaces allowed; an empty item such as in `1,,2` is an error, not skipped).
pub fn parse_ids(s: &str) -> Result<Vec<u32>> {
    if s.split(',').all(|x| x.trim().is_empty()) {
        bail!("--prompt-ids: no token ids given");
    }
    let ids: Vec<u32> = s
        .split(',')
        .map(str::trim)
        .map(|x| {
            if x.is_empty() {
                bail!("--prompt-ids: an empty item in '{s}' (expected ids separated by single commas)");
            }
            x.parse::<u32>()
                .with_context(|| format!("--prompt-ids: '{x}' is not a token id"))
        })
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
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(false)
        .init();
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

#[cfg(test)]
mod ids_tests {
    use super::parse_ids;

    #[test]
    fn prompt_ids_refuse_empty_items() {
        assert_eq!(parse_ids(" 1, 2,3 ").unwrap(), vec![1, 2, 3]);
        for bad in ["1,,2", "1,2,", ",1", "", " ", ",", "1,x"] {
            assert!(parse_ids(bad).is_err(), "{bad:?} accepted");
        }
        let e = parse_ids("1,,2").unwrap_err().to_string();
        assert!(e.contains("empty item"), "{e}");
    }
}
