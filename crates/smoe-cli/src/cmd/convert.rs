//! `smoe convert`: Hugging Face checkpoint → .smoe vault.

use crate::common::{human_bytes, progress_bar};
use anyhow::{Context, Result};
use smoe_vault::import::{hf, ConvertOptions, HfCheckpoint};
use smoe_vault::DType;
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct Args {
    /// The checkpoint directory (config.json, *.safetensors, tokenizer files).
    hf_dir: PathBuf,
    /// Output vault.
    #[arg(short, long, value_name = "OUT.smoe")]
    output: PathBuf,
    /// Storage type of the routed experts.
    #[arg(long, default_value = "q4", value_parser = ["bf16", "q8", "q4", "q2"])]
    quant: String,
    /// Storage type of the dense scout tensors (attention, dense MLPs, embedding, LM head).
    #[arg(long, default_value = "bf16", value_parser = ["bf16", "q8"])]
    scout: String,
    /// Replace OUT if it exists.
    #[arg(long)]
    force: bool,
}

pub fn run(a: Args) -> Result<()> {
    crate::common::check_output(&a.output, a.force)?;
    let opts = ConvertOptions {
        experts: a.quant.parse::<DType>().map_err(anyhow::Error::msg)?,
        scout: a.scout.parse::<DType>().map_err(anyhow::Error::msg)?,
    };
    let ck = HfCheckpoint::open(&a.hf_dir)?;
    let c = &ck.config;
    eprintln!(
        "{}: {} layers, hidden {}, {} experts (top-{}), vocab {}; experts {}, scout {}",
        c.architecture.hf_class(),
        c.num_layers,
        c.hidden_size,
        c.num_experts,
        c.num_experts_per_tok,
        c.vocab_size,
        opts.experts,
        opts.scout
    );
    // The tokenizer must load as the engine will load it; a checkpoint without one converts
    // into a vault that takes token ids only, which is worth a warning.
    match &ck.text.tokenizer_json {
        Some(json) => {
            smoe_engine::tokenizer::Tokenizer::from_json(json).with_context(|| {
                format!("{}: tokenizer.json does not load", a.hf_dir.display())
            })?;
        }
        None => eprintln!(
            "warning: {} has no tokenizer.json: the vault will take --prompt-ids only (no --prompt, chat or serve)",
            a.hf_dir.display()
        ),
    }
    let pb = progress_bar(ck.source_bytes(), "converting");
    let mut progress = |bytes: u64, _what: &str| pb.inc(bytes);
    let len = hf::convert_checkpoint_to_path(&ck, &a.output, opts, &mut progress)
        .with_context(|| format!("converting {}", a.hf_dir.display()))?;
    pb.finish_and_clear();
    eprintln!("wrote {} ({})", a.output.display(), human_bytes(len));
    Ok(())
}
