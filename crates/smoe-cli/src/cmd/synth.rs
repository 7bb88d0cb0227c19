//! `smoe synth`: a full-size vault with random weights and a real model's exact shapes.

use crate::common::{human_bytes, progress_bar};
use anyhow::{bail, Context, Result};
use smoe_vault::synth::{estimate_bytes, preset, synth, SynthOptions, PRESETS};
use smoe_vault::{DType, VaultWriter};
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct Args {
    /// Which model's shapes: qwen3-30b-a3b, qwen3-235b-a22b, or tiny (for trials).
    #[arg(long)]
    preset: String,
    /// Storage type of the routed experts.
    #[arg(long, default_value = "q4", value_parser = ["bf16", "q8", "q4", "q2"])]
    quant: String,
    /// Storage type of the dense tensors (attention, embedding, LM head; the router stays
    /// bf16). q4 matches llama.cpp's Q4_0 files, which quantize those too.
    #[arg(long, default_value = "bf16", value_parser = ["bf16", "q8", "q4"])]
    scout: String,
    /// Skew expert popularity towards a Zipf law of about this exponent (0 = uniform routing,
    /// the cache's worst case; real models are skewed).
    #[arg(long, default_value_t = 0.0)]
    router_skew: f32,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Take the tokenizer, chat template and end-of-sequence ids from this vault (default: the
    /// built-in demo model), so `serve` and `chat` can drive the synthetic model.
    #[arg(long, value_name = "VAULT")]
    tokenizer_from: Option<PathBuf>,
    /// The vault to write (written as OUT.smoe.partial, renamed when complete).
    #[arg(short, long, value_name = "OUT.smoe")]
    output: PathBuf,
    /// Replace OUT if it exists.
    #[arg(long)]
    force: bool,
}

pub fn run(a: Args) -> Result<()> {
    let Some(cfg) = preset(&a.preset) else {
        bail!(
            "unknown preset '{}' (choose one of {})",
            a.preset,
            PRESETS.join(", ")
        );
    };
    crate::common::check_output(&a.output, a.force)?;
    if !a.router_skew.is_finite() || a.router_skew < 0.0 {
        bail!("--router-skew must be ≥ 0");
    }
    let opts = SynthOptions {
        experts: a.quant.parse::<DType>().map_err(anyhow::Error::msg)?,
        scout: a.scout.parse::<DType>().map_err(anyhow::Error::msg)?,
        router_skew: a.router_skew,
        seed: a.seed,
    };
    let source = crate::common::model_path(a.tokenizer_from.as_deref())?;
    let donor = smoe_vault::Vault::open(&source)
        .with_context(|| format!("--tokenizer-from {}", source.display()))?;
    let (text, generation) = (donor.header.text.clone(), donor.header.generation.clone());
    let total = estimate_bytes(&cfg, opts);
    eprintln!(
        "{}: {} layers × {} experts, about {}",
        a.preset,
        cfg.num_layers,
        cfg.num_experts,
        human_bytes(total)
    );
    let mut tmp = a.output.as_os_str().to_owned();
    tmp.push(".partial");
    let tmp = PathBuf::from(tmp);
    let pb = progress_bar(total, "writing");
    let start = std::time::Instant::now();
    let result = (|| -> Result<u64> {
        let w = VaultWriter::create(&tmp)?;
        let (len, buf) = synth(&cfg, opts, text.clone(), generation.clone(), w, &mut |n| {
            pb.inc(n)
        })?;
        let f = buf
            .into_inner()
            .map_err(|e| e.into_error())
            .context("flushing")?;
        f.sync_all().context("syncing")?;
        std::fs::rename(&tmp, &a.output).context("renaming")?;
        Ok(len)
    })();
    pb.finish_and_clear();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    let len = result?;
    let secs = start.elapsed().as_secs_f64();
    eprintln!(
        "wrote {} ({}) in {secs:.1}s, {:.2} GB/s",
        a.output.display(),
        human_bytes(len),
        len as f64 / secs / 1e9
    );
    Ok(())
}
