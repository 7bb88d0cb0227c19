//! `smoe generate`: continue a prompt.

use crate::common::{model_path, open_engine_with, parse_ids, Backend};
use anyhow::{bail, Result};
use smoe_engine::chat::{ChatMessage, ChatTemplate, CHATML_TEMPLATE};
use smoe_engine::GenerateOptions;
use std::io::Write;
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct Args {
    /// The model vault (default: the built-in demo model).
    #[arg(short, long, value_name = "M.smoe")]
    model: Option<PathBuf>,
    /// Prompt text (tokenized with the model's tokenizer).
    #[arg(
        long,
        conflicts_with = "prompt_ids",
        required_unless_present = "prompt_ids"
    )]
    prompt: Option<String>,
    /// Prompt as token ids, comma-separated (used verbatim; no BOS is added).
    #[arg(long, value_name = "1,2,3")]
    prompt_ids: Option<String>,
    /// Wrap --prompt in the model's chat template as one user message.
    #[arg(long, requires = "prompt")]
    chat: bool,
    /// Maximum number of tokens to generate.
    #[arg(short = 'n', long = "max-tokens", default_value_t = 128,
          value_parser = at_least_one)]
    max_tokens: usize,
    #[command(flatten)]
    sampling: crate::sampling_args::SamplingArgs,
    /// Stop when this text appears (repeatable); the stop text is not printed.
    #[arg(long)]
    stop: Vec<String>,
    /// Do not stop at the model's end-of-sequence tokens.
    #[arg(long)]
    ignore_eos: bool,
    /// Context length to allocate (default: prompt + max tokens).
    #[arg(long)]
    ctx: Option<usize>,
    #[arg(long, value_enum, default_value = "auto")]
    backend: Backend,
    /// Print one JSON object with "tokens" (and "text" when the model has a tokenizer).
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    store: crate::store_args::StoreArgs,
}

pub fn run(a: Args) -> Result<()> {
    let engine = open_engine_with(&model_path(a.model.as_deref())?, a.backend, &a.store)?;
    let prompt: Vec<u32> = match (&a.prompt_ids, &a.prompt) {
        (Some(ids), _) => parse_ids(ids)?,
        (None, Some(text)) => {
            let tok = engine.tokenizer()?;
            let text = if a.chat {
                let fallback;
                let template = match &engine.template {
                    Some(t) => t,
                    None => {
                        fallback = ChatTemplate::new(CHATML_TEMPLATE, None, None)?;
                        &fallback
                    }
                };
                template.render(&[ChatMessage::new("user", text.as_str())], None, true, None)?
            } else {
                text.clone()
            };
            tok.encode(&text, true)?
        }
        (None, None) => bail!("give --prompt or --prompt-ids"),
    };
    if prompt.is_empty() {
        bail!("the prompt encodes to no tokens");
    }
    let mut sampler = a.sampling.apply(engine.default_sampler());
    sampler.seed = a.sampling.seed();
    // Bad settings are refused before anything is printed.
    sampler.validate()?;
    let opts = GenerateOptions {
        max_tokens: a.max_tokens,
        sampler: sampler.clone(),
        stop_ids: if a.ignore_eos {
            vec![]
        } else {
            engine.generation.eos_token_ids.clone()
        },
        stop_strings: a.stop.clone(),
    };
    let ctx = a.ctx.unwrap_or(prompt.len() + a.max_tokens);
    if ctx < prompt.len() + 1 {
        bail!(
            "--ctx {ctx} leaves no room after the {}-token prompt",
            prompt.len()
        );
    }
    let mut session = engine.session(ctx);
    let stream = !a.json && engine.tokenizer.is_some();
    let mut stdout = std::io::stdout();
    // Echo a plain text prompt so the continuation reads in context.
    if stream && !a.chat {
        if let Some(p) = &a.prompt {
            let _ = stdout.write_all(p.as_bytes());
        }
    }
    let g = session.generate(&prompt, &opts, &mut |delta| {
        if stream {
            let _ = stdout.write_all(delta.as_bytes());
            let _ = stdout.flush();
        }
    })?;
    if stream {
        println!();
    }
    let store_stats = a.store.finish(&engine);
    if a.json {
        let mut v = serde_json::json!({
            "tokens": g.tokens,
            "finish_reason": g.finish_reason,
            "prompt_tokens": g.prompt_tokens,
            "seed": sampler.seed,
            "prefill_seconds": g.prefill_seconds,
            "decode_seconds": g.decode_seconds,
            "decode_tok_per_s": g.decode_tok_per_s(),
        });
        if let Some(t) = &g.text {
            v["text"] = serde_json::Value::String(t.clone());
        }
        if let (true, Some(st)) = (a.store.stats, &store_stats) {
            v["expert_stats"] = serde_json::to_value(st)?;
        }
        println!("{v}");
    } else {
        if !stream {
            println!(
                "{}",
                g.tokens
                    .iter()
                    .map(|t| t.to_string())
                    .collect::<Vec<_>>()
                    .join(",")
            );
        }
        eprintln!(
            "[{} prompt tokens, {:.1} tok/s prefill; {} generated, {:.1} tok/s decode; {:?}]",
            g.prompt_tokens,
            g.prompt_tokens as f64 / g.prefill_seconds.max(1e-9),
            g.tokens.len(),
            g.decode_tok_per_s(),
            g.finish_reason
        );
    }
    Ok(())
}

/// `-n`: a count of tokens to generate, at least 1.
fn at_least_one(s: &str) -> Result<usize, String> {
    match s.trim().parse::<usize>() {
        Ok(0) => Err("nothing to generate: ask for at least 1 token".into()),
        Ok(n) => Ok(n),
        Err(_) => Err(format!("'{s}' is not a count of tokens")),
    }
}
