//! One request inside the scheduler: where its prompt is, its own seeded sampler, stream decoder
//! and stop strings, and what it has sent to its client.

use crate::scheduler::{Event, Finish, GenRequest, Job, TokenOut};
use crate::stats::Stats;
use smoe_engine::sampler::{log_softmax_at, top_logprobs, Sampler, StopOutput, StopStrings};
use smoe_engine::tokenizer::{StreamDecoder, Tokenizer};
use std::sync::atomic::Ordering::Relaxed;
use std::time::Instant;
use tokio::sync::mpsc::UnboundedSender;

pub struct Seq {
    pub id: u64,
    pub slot: usize,
    pub events: UnboundedSender<Event>,
    req: GenRequest,
    /// Prompt tokens already in the session's KV cache.
    fed: usize,
    cached: usize,
    sampler: Sampler,
    /// What the penalties look at: prompt + output when a repetition penalty is set (as
    /// transformers does), else the output only (OpenAI's presence/frequency penalties).
    history: Vec<u32>,
    generated: usize,
    /// The last sampled token, fed at the next step.
    last: Option<u32>,
    decoder: StreamDecoder,
    stops: StopStrings,
    started: Instant,
    first_token: Option<Instant>,
}

pub enum StepOutcome {
    Continue,
    Finished,
}

impl Seq {
    pub fn new(job: Job, slot: usize, cached: usize, tok: &Tokenizer, id: u64) -> Seq {
        let req = job.req;
        let history = if req.sampler.repetition_penalty != 1.0 {
            req.prompt.clone()
        } else {
            Vec::new()
        };
        Seq {
            id,
            slot,
            events: job.events,
            fed: cached,
            cached,
            sampler: Sampler::new(req.sampler.clone()),
            history,
            generated: 0,
            last: None,
            decoder: tok.stream_decoder(true),
            stops: StopStrings::new(req.stop_strings.clone()),
            started: Instant::now(),
            first_token: None,
            req,
        }
    }

    pub fn prefilling(&self) -> bool {
        self.fed < self.req.prompt.len()
    }

    /// The tokens to feed at the next step, and whether this is a decode step (one token).
    pub fn next_run(&self, chunk: usize) -> (Vec<u32>, bool) {
        if self.prefilling() {
            let end = (self.fed + chunk).min(self.req.prompt.len());
            (self.req.prompt[self.fed..end].to_vec(), false)
        } else {
            (
                vec![self.last.expect("a decoding sequence has a token")],
                true,
            )
        }
    }

    pub fn is_last_chunk(&self, n: usize) -> bool {
        self.fed + n == self.req.prompt.len()
    }

    /// Takes the result of a step that fed `n` tokens. `logits` is empty for a non-final prompt
    /// chunk. `room`: whether the session can take one more position.
    pub fn advance(
        &mut self,
        n: usize,
        logits: Vec<f32>,
        room: bool,
        stats: &Stats,
    ) -> StepOutcome {
        if self.prefilling() {
            self.fed += n;
            stats.prompt_tokens.fetch_add(n as u64, Relaxed);
            if self.prefilling() {
                return StepOutcome::Continue;
            }
        }
        self.sample(logits, room, stats)
    }

    fn sample(&mut self, mut logits: Vec<f32>, room: bool, stats: &Stats) -> StepOutcome {
        // Log-probabilities describe the model, so take them before penalties and temperature.
        let raw = self.req.logprobs.map(|k| (logits.clone(), k));
        let id = self.sampler.sample(&mut logits, &self.history);
        self.history.push(id);
        self.generated += 1;
        stats.generated_tokens.fetch_add(1, Relaxed);
        if self.first_token.is_none() {
            self.first_token = Some(Instant::now());
        }
        if self.req.stop_ids.contains(&id) {
            return self.finish(Finish::Stop, stats);
        }
        let token = raw.map(|(raw, k)| TokenOut {
            id,
            logprob: log_softmax_at(&raw, id),
            top: if k > 0 { top_logprobs(&raw, k) } else { vec![] },
        });
        let text = match self.decoder.step(id) {
            Ok(Some(delta)) => self.stops.push(&delta),
            Ok(None) => StopOutput {
                text: String::new(),
                stopped: None,
            },
            Err(e) => return self.fail(format!("cannot decode token {id}: {e}"), stats),
        };
        let stopped = text.stopped.is_some();
        let quiet = text.text.is_empty() && token.is_none();
        if !quiet
            && self
                .events
                .send(Event::Text {
                    text: text.text,
                    token,
                })
                .is_err()
        {
            // The client left between steps.
            stats.cancelled.fetch_add(1, Relaxed);
            tracing::info!("request {} cancelled by the client", self.id);
            return StepOutcome::Finished;
        }
        if stopped {
            return self.finish(Finish::Stop, stats);
        }
        if self.generated >= self.req.max_tokens || !room {
            return self.finish(Finish::Length, stats);
        }
        self.last = Some(id);
        StepOutcome::Continue
    }

    fn finish(&mut self, finish: Finish, stats: &Stats) -> StepOutcome {
        // Release text the decoder or the stop-string matcher still holds, unless a stop string
        // already ended the text.
        if self.stops.stopped().is_none() {
            let rest = match self.decoder.finish() {
                Ok(r) => r,
                Err(e) => return self.fail(format!("cannot decode the output: {e}"), stats),
            };
            let out = self.stops.push(&rest);
            let mut text = out.text;
            if out.stopped.is_none() {
                text.push_str(&self.stops.finish());
            }
            if !text.is_empty() {
                let _ = self.events.send(Event::Text { text, token: None });
            }
        }
        let _ = self.events.send(Event::Done {
            finish,
            prompt_tokens: self.req.prompt.len(),
            completion_tokens: self.generated,
            cached_tokens: self.cached,
        });
        stats.completed.fetch_add(1, Relaxed);
        let total = self.started.elapsed().as_secs_f64();
        let ttft = self
            .first_token
            .map(|t| (t - self.started).as_secs_f64() * 1e3)
            .unwrap_or(0.0);
        tracing::info!(
            "request {}: {} prompt tokens ({} cached), {} generated, {}, first token {ttft:.1} ms, {total:.2} s",
            self.id,
            self.req.prompt.len(),
            self.cached,
            self.generated,
            finish.as_str()
        );
        StepOutcome::Finished
    }

    fn fail(&mut self, msg: String, stats: &Stats) -> StepOutcome {
        tracing::error!("request {}: {msg}", self.id);
        let _ = self.events.send(Event::Error(msg));
        stats.failed.fetch_add(1, Relaxed);
        StepOutcome::Finished
    }
}
