//! `smoe perplexity`: exp(mean NLL) of a text file, in non-overlapping windows.

use crate::common::{model_path, open_engine_with, Backend};
use anyhow::{bail, Context, Result};
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct Args {
    /// The model vault (default: the built-in demo model).
    #[arg(short, long, value_name = "M.smoe")]
    model: Option<PathBuf>,
    /// UTF-8 text to score.
    #[arg(long)]
    file: PathBuf,
    /// Window length in tokens; each window is scored on its own.
    #[arg(long, default_value_t = 512)]
    ctx: usize,
    #[arg(long, value_enum, default_value = "auto")]
    backend: Backend,
    /// Print {"perplexity", "nll", "tokens", "windows"} as JSON.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    store: crate::store_args::StoreArgs,
}

pub fn run(a: Args) -> Result<()> {
    if a.ctx < 2 {
        bail!("--ctx must be at least 2");
    }
    let bytes =
        std::fs::read(&a.file).with_context(|| format!("cannot read {}", a.file.display()))?;
    let text = String::from_utf8(bytes)
        .map_err(|_| anyhow::anyhow!("{}: not UTF-8 text", a.file.display()))?;
    let engine = open_engine_with(&model_path(a.model.as_deref())?, a.backend, &a.store)?;
    let ids = engine.tokenizer()?.encode(&text, false)?;
    if ids.len() < 2 {
        bail!("{}: fewer than 2 tokens", a.file.display());
    }
    let ctx = a.ctx.min(engine.model.config().max_position_embeddings);
    let windows: Vec<&[u32]> = ids.chunks(ctx).filter(|w| w.len() >= 2).collect();
    let pb = indicatif::ProgressBar::new(ids.len() as u64);
    pb.set_style(
        indicatif::ProgressStyle::with_template("{msg} [{bar:40}] {pos}/{len} tokens eta {eta}")
            .unwrap(),
    );
    pb.set_message("scoring");
    let (mut sum, mut n) = (0f64, 0usize);
    for w in &windows {
        let r = engine.logprobs(w)?;
        sum += r.nll * r.logprobs.len() as f64;
        n += r.logprobs.len();
        pb.inc(w.len() as u64);
    }
    pb.finish_and_clear();
    a.store.finish(&engine);
    let nll = sum / n as f64;
    if a.json {
        println!(
            "{}",
            serde_json::json!({"perplexity": nll.exp(), "nll": nll, "tokens": n, "windows": windows.len(), "ctx": ctx})
        );
    } else {
        println!(
            "perplexity {:.4} (nll {:.5}) over {n} predicted tokens in {} windows of ≤{ctx}",
            nll.exp(),
            nll,
            windows.len()
        );
    }
    Ok(())
}
