//! `smoe logprobs`: teacher-forced scoring of a token sequence.

use crate::common::{model_path, open_engine_with, parse_ids, Backend};
use anyhow::Result;
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct Args {
    /// The model vault (default: the built-in demo model).
    #[arg(short, long, value_name = "M.smoe")]
    model: Option<PathBuf>,
    /// Token ids, comma-separated (used verbatim; no BOS is added).
    #[arg(long, value_name = "1,2,3")]
    prompt_ids: String,
    #[arg(long, value_enum, default_value = "auto")]
    backend: Backend,
    /// Print one JSON object {"logprobs", "argmax", "nll"}.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    store: crate::store_args::StoreArgs,
}

pub fn run(a: Args) -> Result<()> {
    let ids = parse_ids(&a.prompt_ids)?;
    let engine = open_engine_with(&model_path(a.model.as_deref())?, a.backend, &a.store)?;
    let r = engine.logprobs(&ids)?;
    a.store.finish(&engine);
    if a.json {
        println!("{}", serde_json::to_string(&r)?);
    } else {
        println!(
            "{:>5} {:>8} {:>12} {:>8}",
            "pos", "token", "logprob", "argmax"
        );
        for (i, &t) in ids.iter().enumerate() {
            let lp = if i > 0 {
                format!("{:.5}", r.logprobs[i - 1])
            } else {
                "-".into()
            };
            println!("{i:>5} {t:>8} {lp:>12} {:>8}", r.argmax[i]);
        }
        println!("nll {:.6}  perplexity {:.4}", r.nll, r.nll.exp());
    }
    Ok(())
}
