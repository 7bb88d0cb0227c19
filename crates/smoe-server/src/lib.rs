//! smoe server: an OpenAI-compatible HTTP API over a continuous-batching scheduler.
//!
//! `Scheduler` (one engine thread, batched steps, a pool of sessions) is usable on its own, as
//! `smoe chat` does; `serve` puts the HTTP routes of `app` in front of it.

mod app;
mod chat_api;
mod completions_api;
pub mod error;
mod logprobs;
mod messages;
mod params;
mod reasoning;
mod respond;
pub mod scheduler;
mod sequence;
mod stats;
pub mod tools;

pub use scheduler::{
    Event, Finish, GenRequest, Scheduler, SchedulerOptions, SubmitError, TokenOut,
};

use anyhow::Context;
use smoe_engine::chat::{ChatTemplate, CHATML_TEMPLATE};
use smoe_engine::Engine;
use std::sync::Arc;

#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub host: String,
    pub port: u16,
    pub api_key: Option<String>,
    pub max_concurrent: usize,
    pub ctx: usize,
    /// The id clients pass as `model`.
    pub model_id: String,
    pub max_body_bytes: usize,
    pub max_queue: usize,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            host: "127.0.0.1".into(),
            port: 8080,
            api_key: None,
            max_concurrent: 4,
            ctx: 4096,
            model_id: "smoe".into(),
            max_body_bytes: 4 << 20,
            max_queue: 1024,
        }
    }
}

/// The model's chat template (or ChatML when it ships none), taken out of the engine so request
/// handlers can render prompts while the engine thread runs.
pub fn take_template(engine: &mut Engine) -> anyhow::Result<(ChatTemplate, bool)> {
    let source = engine.vault.header.text.chat_template.clone();
    let has_tools = source.as_deref().is_some_and(|s| s.contains("tools"));
    let t = match engine.template.take() {
        Some(t) => t,
        None => {
            ChatTemplate::new(CHATML_TEMPLATE, None, None).context("built-in ChatML template")?
        }
    };
    Ok((t, has_tools))
}

/// Runs the server until Ctrl-C. `on_listen` gets the bound address (port 0 picks a free one).
pub fn serve(
    mut engine: Engine,
    cfg: ServerConfig,
    on_listen: impl FnOnce(std::net::SocketAddr),
) -> anyhow::Result<()> {
    let tok = engine.tokenizer()?.clone();
    let (template, template_has_tools) = take_template(&mut engine)?;
    let defaults = engine.default_sampler();
    let eos = engine.generation.eos_token_ids.clone();
    let sched = Scheduler::start(
        engine,
        SchedulerOptions {
            max_concurrent: cfg.max_concurrent,
            ctx: cfg.ctx,
            max_queue: cfg.max_queue,
            prefill_budget: 512,
        },
    )?;
    let state = Arc::new(app::AppState {
        sched,
        tok,
        template,
        template_has_tools,
        model_id: cfg.model_id.clone(),
        created: respond::unix_time(),
        api_key: cfg.api_key.clone(),
        defaults,
        eos,
    });
    // The engine thread does the heavy work (with rayon); HTTP needs only a couple of threads.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    rt.block_on(async move {
        let addr = format!("{}:{}", cfg.host, cfg.port);
        let listener = tokio::net::TcpListener::bind(&addr)
            .await
            .with_context(|| format!("cannot listen on {addr}"))?;
        on_listen(listener.local_addr()?);
        let app = app::router(state, cfg.max_body_bytes);
        // Ctrl-C stops accepting connections; streams in flight get a few seconds to finish.
        let (stop_tx, mut stop_rx) = tokio::sync::watch::channel(false);
        let server = axum::serve(listener, app).with_graceful_shutdown(async move {
            let _ = tokio::signal::ctrl_c().await;
            eprintln!("shutting down (waiting up to {}s for requests in flight)", GRACE.as_secs());
            let _ = stop_tx.send(true);
        });
        tokio::select! {
            r = server => r.context("server error"),
            _ = async { let _ = stop_rx.changed().await; tokio::time::sleep(GRACE).await } => Ok(()),
        }
    })
}

const GRACE: std::time::Duration = std::time::Duration::from_secs(5);
