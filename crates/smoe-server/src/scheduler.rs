//! Continuous batching: one thread owns the engine and runs every active request's next step
//! (a prompt chunk or one decoded token) in a single `forward_batch`, so each weight is read once
//! per step for all of them.
//!
//! Requests wait in a FIFO queue and are admitted when one of `max_concurrent` preallocated
//! sessions (KV caches of `ctx` positions) is free. A request whose event channel is closed (the
//! client went away) is dropped before the next step and its session returns to the pool.

use crate::sequence::{Seq, StepOutcome};
use crate::stats::Stats;
use smoe_engine::model::Scratch;
use smoe_engine::sampler::SamplerConfig;
use smoe_engine::{Engine, Logits, Session};
use std::collections::VecDeque;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{mpsc, Arc};
use std::time::Instant;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

/// What to generate. The prompt is already tokenized and fits the context.
#[derive(Debug, Clone)]
pub struct GenRequest {
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub sampler: SamplerConfig,
    /// Generation ends after one of these ids (it is neither text nor a logprob entry).
    pub stop_ids: Vec<u32>,
    pub stop_strings: Vec<String>,
    /// `Some(k)`: report each token's log-probability and the k most likely alternatives.
    pub logprobs: Option<usize>,
}

#[derive(Debug, Clone)]
pub struct TokenOut {
    pub id: u32,
    /// log p(id) under the model's distribution (before penalties and temperature).
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    Stop,
    Length,
}

impl Finish {
    pub fn as_str(self) -> &'static str {
        match self {
            Finish::Stop => "stop",
            Finish::Length => "length",
        }
    }
}

#[derive(Debug, Clone)]
pub enum Event {
    /// New text (possibly empty: held back by the stream decoder or a possible stop string) and
    /// the token that produced it (absent for text flushed at the end).
    Text {
        text: String,
        token: Option<TokenOut>,
    },
    Done {
        finish: Finish,
        prompt_tokens: usize,
        completion_tokens: usize,
        /// Prompt positions whose KV was reused from the previous request in the same session.
        cached_tokens: usize,
    },
    Error(String),
}

pub struct Job {
    pub req: GenRequest,
    pub events: UnboundedSender<Event>,
}

#[derive(Debug, Clone)]
pub struct SchedulerOptions {
    pub max_concurrent: usize,
    pub ctx: usize,
    /// Requests allowed to wait for a session; more are refused (HTTP 503).
    pub max_queue: usize,
    /// Prompt tokens prefilled per step across all requests, so decoding requests keep getting
    /// steps while a long prompt is read (at least one chunk always runs).
    pub prefill_budget: usize,
}

/// The handle the HTTP side holds: submit requests, read statistics.
pub struct Scheduler {
    jobs: mpsc::Sender<Job>,
    pub stats: Arc<Stats>,
    max_queue: usize,
    pub ctx: usize,
}

#[derive(Debug)]
pub enum SubmitError {
    QueueFull,
    Stopped,
}

impl Scheduler {
    /// Starts the engine thread. The context is capped at the model's maximum.
    pub fn start(engine: Engine, opts: SchedulerOptions) -> anyhow::Result<Scheduler> {
        if engine.tokenizer.is_none() {
            anyhow::bail!("this model has no tokenizer; serving needs one to turn text into ids");
        }
        let max_pos = engine.model.config().max_position_embeddings;
        let opts = SchedulerOptions {
            ctx: opts.ctx.min(max_pos).max(2),
            max_concurrent: opts.max_concurrent.max(1),
            ..opts
        };
        let (tx, rx) = mpsc::channel();
        let stats = Arc::new(Stats::default());
        let (ctx, max_queue) = (opts.ctx, opts.max_queue);
        let st = stats.clone();
        std::thread::Builder::new()
            .name("smoe-engine".into())
            .spawn(move || run(engine, opts, rx, st))?;
        Ok(Scheduler {
            jobs: tx,
            stats,
            max_queue,
            ctx,
        })
    }

    /// Queues a request; its events arrive on the returned channel. Dropping the receiver
    /// cancels the request.
    pub fn submit(&self, req: GenRequest) -> Result<UnboundedReceiver<Event>, SubmitError> {
        if self.stats.queued.load(Relaxed) >= self.max_queue {
            return Err(SubmitError::QueueFull);
        }
        let (tx, rx) = unbounded_channel();
        self.stats.queued.fetch_add(1, Relaxed);
        if self.jobs.send(Job { req, events: tx }).is_err() {
            self.stats.queued.fetch_sub(1, Relaxed);
            return Err(SubmitError::Stopped);
        }
        Ok(rx)
    }
}

/// The engine thread. Returns when every `Scheduler` handle is gone.
fn run(engine: Engine, opts: SchedulerOptions, jobs: mpsc::Receiver<Job>, stats: Arc<Stats>) {
    let tok = engine
        .tokenizer
        .clone()
        .expect("checked in Scheduler::start");
    let chunk = engine.opts.prefill_chunk.max(1);
    let mut slots: Vec<Session<'_>> = (0..opts.max_concurrent)
        .map(|_| engine.session(opts.ctx))
        .collect();
    let mut free: Vec<usize> = (0..slots.len()).rev().collect();
    let mut waiting: VecDeque<Job> = VecDeque::new();
    let mut active: Vec<Seq> = Vec::new();
    let mut scratch = Scratch::default();
    let mut synced = Instant::now();
    let experts = engine.model.experts();
    stats.record_experts(experts.stats().as_ref());
    loop {
        // Block only when there is nothing to do.
        if active.is_empty() && waiting.is_empty() {
            stats.record_experts(experts.stats().as_ref());
            // The usage profile makes the next start's cache warm; idle is a good time to save.
            if let Err(e) = experts.save_profile() {
                tracing::warn!("cannot save the expert usage profile: {e}");
            }
            match jobs.recv() {
                Ok(j) => waiting.push_back(j),
                Err(_) => return,
            }
        }
        waiting.extend(jobs.try_iter());

        // Cancelled requests give their session back before anyone is admitted.
        active.retain(|s| {
            let gone = s.events.is_closed();
            if gone {
                stats.cancelled.fetch_add(1, Relaxed);
                free.push(s.slot);
                tracing::info!("request {} cancelled by the client", s.id);
            }
            !gone
        });

        // Admit in arrival order while sessions are free.
        while !free.is_empty() {
            let Some(job) = waiting.pop_front() else {
                break;
            };
            stats.queued.fetch_sub(1, Relaxed);
            if job.events.is_closed() {
                stats.cancelled.fetch_add(1, Relaxed);
                continue;
            }
            let slot = pick_slot(&mut free, &slots, &job.req.prompt);
            let cached = reuse_prefix(&mut slots[slot], &job.req.prompt);
            stats.requests.fetch_add(1, Relaxed);
            active.push(Seq::new(job, slot, cached, &tok, stats.next_id()));
        }
        stats.active.store(active.len(), Relaxed);
        if active.is_empty() {
            continue;
        }

        // Plan one step: every decoding sequence feeds its last token; prefilling ones feed a
        // chunk while the budget lasts (oldest first, so a long prompt cannot starve others).
        let mut budget = opts.prefill_budget.max(1);
        let mut plan: Vec<(usize, Vec<u32>, Logits)> = Vec::new(); // (index in active, run, want)
                                                                   // The slots whose prompt ends in this step: their state is checkpointed there, so a
                                                                   // later request sharing the prompt can go back to it (`SeqState::checkpoint`).
        let mut prompt_ends: Vec<usize> = Vec::new();
        for (i, s) in active.iter().enumerate() {
            match s.next_run(chunk) {
                (run, true) => plan.push((i, run, Logits::Last)),
                (run, false) => {
                    let n = run.len();
                    let first = !plan.iter().any(|p| active[p.0].prefilling());
                    if n <= budget || first {
                        budget = budget.saturating_sub(n);
                        let want = if s.is_last_chunk(n) {
                            prompt_ends.push(s.slot);
                            Logits::Last
                        } else {
                            Logits::None
                        };
                        plan.push((i, run, want));
                    }
                }
            }
        }
        // forward_batch takes the sessions in slot order; order the plan the same way.
        plan.sort_by_key(|p| active[p.0].slot);
        let in_plan: Vec<usize> = plan.iter().map(|p| active[p.0].slot).collect();
        let mut sessions: Vec<&mut Session<'_>> = slots
            .iter_mut()
            .enumerate()
            .filter(|(i, _)| in_plan.contains(i))
            .map(|(_, s)| s)
            .collect();
        let runs: Vec<&[u32]> = plan.iter().map(|p| p.1.as_slice()).collect();
        let want: Vec<Logits> = plan.iter().map(|p| p.2).collect();
        let t0 = Instant::now();
        let result = engine.forward_batch(&mut sessions, &runs, &want, &mut scratch);
        stats.record_step(runs.iter().map(|r| r.len()).sum(), t0.elapsed());
        drop(sessions);
        if result.is_ok() {
            prompt_ends
                .iter()
                .for_each(|&i| slots[i].state.checkpoint());
        }

        let mut finished: Vec<usize> = Vec::new();
        match result {
            Err(e) => {
                // A model fault (e.g. a corrupt expert blob): fail the requests of this step and
                // clear their sessions, whose caches may be half written.
                let msg = format!("generation failed: {e}");
                tracing::error!("{msg}");
                for (i, _, _) in &plan {
                    let _ = active[*i].events.send(Event::Error(msg.clone()));
                    slots[active[*i].slot].reset();
                    stats.failed.fetch_add(1, Relaxed);
                    finished.push(*i);
                }
            }
            Ok(outs) => {
                for ((i, run, _), logits) in plan.iter().zip(outs) {
                    let s = &mut active[*i];
                    let room = slots[s.slot].state.check_room(1).is_ok();
                    match s.advance(run.len(), logits, room, &stats) {
                        StepOutcome::Continue => {}
                        StepOutcome::Finished => finished.push(*i),
                    }
                }
            }
        }
        finished.sort_unstable();
        for i in finished.into_iter().rev() {
            let s = active.remove(i);
            free.push(s.slot);
        }
        stats.active.store(active.len(), Relaxed);
        if synced.elapsed() >= STATS_EVERY {
            stats.record_experts(experts.stats().as_ref());
            synced = Instant::now();
        }
    }
}

/// How often the expert store's counters are copied for /metrics while busy.
const STATS_EVERY: std::time::Duration = std::time::Duration::from_secs(1);

/// The free session that already holds the longest prefix of `prompt` (a chat's earlier turns),
/// removed from `free`.
fn pick_slot(free: &mut Vec<usize>, slots: &[Session<'_>], prompt: &[u32]) -> usize {
    let best = (0..free.len())
        .max_by_key(|&j| (common_prefix(&slots[free[j]].tokens, prompt), j))
        .expect("caller checked that a session is free");
    free.swap_remove(best)
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// Keeps the state of the longest common prefix (causal: those positions do not depend on what
/// follows), leaving at least one prompt token to feed for the first logits. Where a layer's
/// state cannot be truncated, `Session::rewind` goes back to a checkpoint or to the start.
fn reuse_prefix(s: &mut Session<'_>, prompt: &[u32]) -> usize {
    let keep = common_prefix(&s.tokens, prompt).min(prompt.len().saturating_sub(1));
    s.rewind(keep)
}
