//! `smoe serve`: the OpenAI-compatible HTTP server (docs/server.md).

use crate::common::{model_path, open_engine_with, Backend};
use crate::store_args::StoreArgs;
use anyhow::{bail, Result};
use smoe_server::ServerConfig;
use std::io::Write;
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct Args {
    /// The model vault (default: the built-in demo model).
    #[arg(short, long, value_name = "M.smoe")]
    model: Option<PathBuf>,
    /// Address to listen on; 127.0.0.1 keeps the server local. Use 0.0.0.0 to expose it.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port (0 picks a free one; the address is printed on stdout).
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Require `Authorization: Bearer KEY` on every endpoint but /health.
    #[arg(long, value_name = "KEY")]
    api_key: Option<String>,
    /// Requests generated at once (each holds a KV cache of --ctx positions); more wait in a queue.
    #[arg(long, default_value_t = 4, value_name = "N")]
    max_concurrent: usize,
    /// Context length per request: prompt + completion (capped at the model's maximum).
    #[arg(long, default_value_t = 4096, value_name = "N")]
    ctx: usize,
    /// The model id clients send as `model` (default: the vault's file name without .smoe).
    #[arg(long, value_name = "NAME")]
    model_name: Option<String>,
    /// Largest accepted request body, in bytes.
    #[arg(long, default_value_t = 4 << 20, value_name = "BYTES")]
    max_body: usize,
    #[arg(long, value_enum, default_value = "auto")]
    backend: Backend,
    #[command(flatten)]
    store: StoreArgs,
}

pub fn run(a: Args) -> Result<()> {
    if a.max_concurrent == 0 {
        bail!("--max-concurrent must be at least 1");
    }
    if a.ctx < 2 {
        bail!("--ctx must be at least 2");
    }
    let path = model_path(a.model.as_deref())?;
    let model_id = a.model_name.clone().unwrap_or_else(|| match &a.model {
        Some(p) => p
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "smoe".into()),
        None => "demo-qwen3-moe".into(),
    });
    let engine = open_engine_with(&path, a.backend, &a.store)?;
    let max_pos = engine.model.config().max_position_embeddings;
    let ctx = a.ctx.min(max_pos);
    if ctx < a.ctx {
        eprintln!(
            "note: --ctx {} capped at the model's maximum, {max_pos}",
            a.ctx
        );
    }
    let cfg = ServerConfig {
        host: a.host.clone(),
        port: a.port,
        api_key: a.api_key.clone(),
        max_concurrent: a.max_concurrent,
        ctx,
        model_id: model_id.clone(),
        max_body_bytes: a.max_body,
        ..ServerConfig::default()
    };
    smoe_server::serve(engine, cfg, |addr| {
        // One line on stdout that scripts (and our tests) wait for.
        println!("smoe serve: listening on http://{addr} (model '{model_id}', {} sessions of {ctx} positions)", a.max_concurrent);
        let _ = std::io::stdout().flush();
    })
}
