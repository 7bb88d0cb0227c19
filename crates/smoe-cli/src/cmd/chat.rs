//! `smoe chat`: an interactive terminal chat with history. Runs on the server's scheduler, so
//! an answer is a request that Ctrl-C cancels (dropping its event channel) without quitting, and
//! the next turn reuses the KV cache of the conversation so far.

use crate::common::{model_path, open_engine_with, Backend};
use crate::store_args::StoreArgs;
use anyhow::{Context, Result};
use smoe_engine::chat::{ChatMessage, ChatTemplate};
use smoe_engine::sampler::SamplerConfig;
use smoe_engine::tokenizer::Tokenizer;
use smoe_server::{Event, GenRequest, Scheduler, SchedulerOptions};
use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::time::Instant;
use tokio::sync::mpsc::UnboundedReceiver;

#[derive(clap::Args)]
pub struct Args {
    /// The model vault (default: the built-in demo model).
    #[arg(short, long, value_name = "M.smoe")]
    model: Option<PathBuf>,
    /// System prompt (also settable in the chat with /system TEXT).
    #[arg(long)]
    system: Option<String>,
    /// Longest answer, in tokens (default: what the context leaves).
    #[arg(short = 'n', long = "max-tokens")]
    max_tokens: Option<usize>,
    #[command(flatten)]
    sampling: crate::sampling_args::SamplingArgs,
    /// Context length for the whole conversation; the oldest turns are dropped to fit.
    #[arg(long, default_value_t = 4096)]
    ctx: usize,
    #[arg(long, value_enum, default_value = "auto")]
    backend: Backend,
    #[command(flatten)]
    store: StoreArgs,
}

const HELP: &str =
    "commands: /reset (forget the conversation), /system TEXT (set the system prompt), \
/quit (or Ctrl-D); Ctrl-C stops an answer";

struct Chat {
    sched: Scheduler,
    tok: Tokenizer,
    template: ChatTemplate,
    eos: Vec<u32>,
    /// Sampling settings: the model's generation_config with the flags applied.
    sampler: SamplerConfig,
    args: Args,
    system: Option<String>,
    history: Vec<ChatMessage>,
    tty: bool,
}

pub fn run(a: Args) -> Result<()> {
    let mut engine = open_engine_with(&model_path(a.model.as_deref())?, a.backend, &a.store)?;
    let tok = engine.tokenizer()?.clone();
    let (template, _) = smoe_server::take_template(&mut engine)?;
    let eos = engine.generation.eos_token_ids.clone();
    let sampler = a.sampling.apply(engine.default_sampler());
    sampler.validate()?;
    let ctx = a.ctx.min(engine.model.config().max_position_embeddings);
    let sched = Scheduler::start(
        engine,
        SchedulerOptions {
            max_concurrent: 1,
            ctx,
            max_queue: 2,
            prefill_budget: 512,
        },
    )?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    let mut chat = Chat {
        sched,
        tok,
        template,
        eos,
        sampler,
        system: a.system.clone(),
        args: a,
        history: vec![],
        tty: std::io::stdin().is_terminal(),
    };
    rt.block_on(chat.main_loop())
}

/// Lines of stdin on a channel, so waiting for input can race Ctrl-C.
fn stdin_lines() -> UnboundedReceiver<String> {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    std::thread::spawn(move || {
        for line in std::io::stdin().lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    rx
}

impl Chat {
    async fn main_loop(&mut self) -> Result<()> {
        let mut lines = stdin_lines();
        if self.tty {
            eprintln!("smoe chat ({} positions). {HELP}", self.sched.ctx);
        }
        loop {
            if self.tty {
                print!("> ");
                let _ = std::io::stdout().flush();
            }
            let line = tokio::select! {
                l = lines.recv() => l,
                _ = tokio::signal::ctrl_c() => {
                    eprintln!("\n(/quit or Ctrl-D exits)");
                    continue;
                }
            };
            let Some(line) = line else { break };
            let line = line.trim();
            match line
                .split_once(' ')
                .map_or((line, ""), |(c, r)| (c, r.trim()))
            {
                ("", _) => {}
                ("/quit" | "/exit", _) => break,
                ("/reset", _) => {
                    self.history.clear();
                    eprintln!("[conversation cleared]");
                }
                ("/system", text) => {
                    self.system = (!text.is_empty()).then(|| text.to_string());
                    eprintln!(
                        "[system prompt {}]",
                        if text.is_empty() { "removed" } else { "set" }
                    );
                }
                ("/help", _) => eprintln!("{HELP}"),
                (c, _) if c.starts_with('/') => eprintln!("unknown command {c}; {HELP}"),
                _ => self.answer(line).await?,
            }
        }
        if self.tty {
            println!();
        }
        Ok(())
    }

    /// The conversation as prompt tokens, dropping the oldest turns until it leaves room for
    /// an answer.
    fn prompt(&mut self) -> Result<Option<Vec<u32>>> {
        loop {
            let mut msgs: Vec<ChatMessage> = self
                .system
                .iter()
                .map(|s| ChatMessage::new("system", s.as_str()))
                .collect();
            msgs.extend(self.history.iter().cloned());
            let text = self.template.render(&msgs, None, true, None)?;
            let ids = self.tok.encode(&text, false)?;
            if ids.len() + 16 <= self.sched.ctx {
                return Ok(Some(ids));
            }
            if self.history.len() <= 1 {
                eprintln!(
                    "[message too long for the context of {} tokens]",
                    self.sched.ctx
                );
                self.history.clear();
                return Ok(None);
            }
            self.history.remove(0);
        }
    }

    async fn answer(&mut self, line: &str) -> Result<()> {
        self.history.push(ChatMessage::new("user", line));
        let Some(prompt) = self.prompt()? else {
            return Ok(());
        };
        let room = self.sched.ctx - prompt.len();
        let mut sampler = self.sampler.clone();
        sampler.seed = self.args.sampling.seed();
        let req = GenRequest {
            max_tokens: self.args.max_tokens.unwrap_or(room).min(room),
            prompt,
            sampler,
            stop_ids: self.eos.clone(),
            stop_strings: vec![],
            logprobs: None,
        };
        let mut rx = self
            .sched
            .submit(req)
            .map_err(|e| anyhow::anyhow!("cannot submit: {e:?}"))?;
        let (mut text, mut out, t0) = (String::new(), std::io::stdout(), Instant::now());
        let mut tokens = 0;
        let stopped = loop {
            tokio::select! {
                ev = rx.recv() => match ev {
                    Some(Event::Text { text: t, .. }) => {
                        tokens += 1;
                        let _ = out.write_all(t.as_bytes());
                        let _ = out.flush();
                        text.push_str(&t);
                    }
                    Some(Event::Done { completion_tokens, .. }) => { tokens = completion_tokens; break false }
                    Some(Event::Error(m)) => { eprintln!("\nerror: {m}"); break false }
                    None => break false,
                },
                _ = tokio::signal::ctrl_c() => break true,
            }
        };
        drop(rx); // cancels the request if it is still running
        println!();
        if stopped {
            eprintln!("[stopped]");
        } else if self.tty {
            let s = t0.elapsed().as_secs_f64();
            eprintln!(
                "[{tokens} tokens, {:.1} tok/s]",
                tokens as f64 / s.max(1e-9)
            );
        }
        // A stopped answer stays in the history as far as it got: that is what the user saw.
        self.history.push(ChatMessage::new("assistant", text));
        Ok(())
    }
}
