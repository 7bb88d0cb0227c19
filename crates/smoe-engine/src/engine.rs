//! The generation loop: open a vault, prefill in chunks, decode, sample, stop.

use crate::chat::ChatTemplate;
use crate::error::EngineError;
use crate::model::{Logits, Model, Scratch};
use crate::sampler::{argmax, log_softmax_at, Sampler, SamplerConfig, StopStrings};
use crate::state::SeqState;
use crate::store::StoreOptions;
use crate::tokenizer::Tokenizer;
use serde::Serialize;
use smoe_vault::{GenerationDefaults, Vault};
use std::path::Path;
use std::time::Instant;

/// Where the model runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Backend {
    #[default]
    Cpu,
    /// The GPU (wgpu); opening fails when there is no usable adapter.
    Gpu,
    /// The GPU when one is usable (a device, not a software rasterizer), else the CPU, with a
    /// log line saying why.
    Auto,
}

#[derive(Debug, Clone)]
pub struct EngineOptions {
    /// Check every scout tensor's checksum at load (expert blobs are checked on first use).
    pub verify: bool,
    /// Tokens per prefill chunk: bounds activation memory, keeps weight reads shared (the GPU
    /// reads each expert once per chunk for all the tokens that chose it).
    pub prefill_chunk: usize,
    /// Where routed experts live: memory-mapped, or streamed into a bounded cache.
    pub store: StoreOptions,
    pub backend: Backend,
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            verify: true,
            prefill_chunk: 512,
            store: StoreOptions::default(),
            backend: Backend::Cpu,
        }
    }
}

/// A loaded model with its text side.
pub struct Engine {
    pub vault: Vault,
    pub model: Model,
    pub tokenizer: Option<Tokenizer>,
    pub template: Option<ChatTemplate>,
    pub generation: GenerationDefaults,
    pub opts: EngineOptions,
}

impl Engine {
    pub fn open(path: &Path, opts: EngineOptions) -> Result<Self, EngineError> {
        let vault = Vault::open(path)?;
        // The configuration must describe the tensors before anything is sized from it.
        vault.check_layout()?;
        if opts.verify {
            vault.verify_scout()?;
        }
        let model = match opts.backend {
            Backend::Cpu => Model::load(&vault, &opts.store)?,
            Backend::Gpu => Model::load_gpu(&vault, &opts.store)?,
            Backend::Auto => crate::gpu::auto_adapter()
                .and_then(|_| Model::load_gpu(&vault, &opts.store))
                .or_else(|e| {
                    tracing::info!("backend auto: using the CPU ({e})");
                    Model::load(&vault, &opts.store)
                })?,
        };
        let text = &vault.header.text;
        let tokenizer = text
            .tokenizer_json
            .as_deref()
            .map(Tokenizer::from_json)
            .transpose()?;
        let template = text
            .chat_template
            .as_deref()
            .map(|t| ChatTemplate::new(t, text.bos_token.clone(), text.eos_token.clone()))
            .transpose()?;
        let generation = vault.header.generation.clone();
        Ok(Engine {
            vault,
            model,
            tokenizer,
            template,
            generation,
            opts,
        })
    }

    /// A fresh sequence with room for `ctx` positions (capped at the model's maximum).
    pub fn session(&self, ctx: usize) -> Session<'_> {
        let ctx = ctx.min(self.model.config().max_position_embeddings).max(1);
        Session {
            engine: self,
            state: self.model.new_state(ctx),
            scratch: Scratch::default(),
            tokens: vec![],
        }
    }

    pub fn tokenizer(&self) -> Result<&Tokenizer, EngineError> {
        self.tokenizer.as_ref().ok_or(EngineError::NoTokenizer)
    }

    /// Sampling settings from the model's generation_config, where it has them.
    pub fn default_sampler(&self) -> SamplerConfig {
        let g = &self.generation;
        if g.do_sample == Some(false) {
            return SamplerConfig::greedy();
        }
        let d = SamplerConfig::default();
        SamplerConfig {
            temperature: g.temperature.unwrap_or(d.temperature),
            top_k: g.top_k.unwrap_or(d.top_k),
            top_p: g.top_p.unwrap_or(d.top_p),
            min_p: g.min_p.unwrap_or(d.min_p),
            repetition_penalty: g.repetition_penalty.unwrap_or(d.repetition_penalty),
            ..d
        }
    }

    /// One forward pass over several sessions (continuous batching): `runs[i]` (a prompt chunk
    /// or one decoded token) continues `sessions[i]`. Weights are read once for the whole batch.
    pub fn forward_batch(
        &self,
        sessions: &mut [&mut Session<'_>],
        runs: &[&[u32]],
        want: &[Logits],
        scratch: &mut Scratch,
    ) -> Result<Vec<Vec<f32>>, EngineError> {
        let mut states: Vec<&mut SeqState> = sessions.iter_mut().map(|s| &mut s.state).collect();
        let out = self.model.forward_batch(&mut states, runs, want, scratch)?;
        for (s, run) in sessions.iter_mut().zip(runs) {
            s.tokens.extend_from_slice(run);
        }
        Ok(out)
    }

    /// Log-probabilities of a token sequence under the model (teacher forcing).
    pub fn logprobs(&self, ids: &[u32]) -> Result<LogprobsResult, EngineError> {
        if ids.is_empty() {
            return Err(EngineError::Invalid("no tokens to score".into()));
        }
        let mut s = self.session(ids.len());
        if s.state.capacity() < ids.len() {
            return Err(EngineError::ContextFull {
                needed: ids.len(),
                capacity: s.state.capacity(),
            });
        }
        let logits = s.feed(ids, Logits::All)?;
        let vocab = self.model.config().vocab_size;
        let rows: Vec<&[f32]> = logits.chunks_exact(vocab).collect();
        let argmax = rows.iter().map(|r| argmax(r)).collect();
        let logprobs: Vec<f32> = (0..ids.len() - 1)
            .map(|i| log_softmax_at(rows[i], ids[i + 1]))
            .collect();
        let nll = if logprobs.is_empty() {
            0.0
        } else {
            -logprobs.iter().map(|&x| x as f64).sum::<f64>() / logprobs.len() as f64
        };
        Ok(LogprobsResult {
            logprobs,
            argmax,
            nll,
        })
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct LogprobsResult {
    /// `logprobs[i]` = log p(t[i+1] | t[..=i]).
    pub logprobs: Vec<f32>,
    /// The most likely next token after every position.
    pub argmax: Vec<u32>,
    /// −mean(logprobs).
    pub nll: f64,
}

#[derive(Debug, Clone)]
pub struct GenerateOptions {
    pub max_tokens: usize,
    pub sampler: SamplerConfig,
    /// Generation ends after emitting one of these ids (it is not part of the text).
    pub stop_ids: Vec<u32>,
    pub stop_strings: Vec<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum FinishReason {
    /// An EOS id or a stop string.
    Stop,
    /// `max_tokens` reached.
    Length,
}

#[derive(Debug, Clone, Serialize)]
pub struct Generation {
    pub tokens: Vec<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
    pub finish_reason: FinishReason,
    pub prompt_tokens: usize,
    pub prefill_seconds: f64,
    pub decode_seconds: f64,
}

impl Generation {
    pub fn decode_tok_per_s(&self) -> f64 {
        // The first token comes out of the prefill; the rest are decode steps.
        let steps = self.tokens.len().saturating_sub(1);
        if self.decode_seconds > 0.0 {
            steps as f64 / self.decode_seconds
        } else {
            0.0
        }
    }
}

/// What a forward pass of `generate` hands the sampler.
enum Next {
    Logits(Vec<f32>),
    Id(u32),
}

/// One sequence: its state (per layer) and the tokens it has seen.
pub struct Session<'e> {
    engine: &'e Engine,
    pub state: SeqState,
    scratch: Scratch,
    pub tokens: Vec<u32>,
}

impl<'e> Session<'e> {
    /// Appends `tokens`, prefilling in chunks; returns logits as `want` asks (`All`: every
    /// position of `tokens`; `Last`: the final one).
    pub fn feed(&mut self, tokens: &[u32], want: Logits) -> Result<Vec<f32>, EngineError> {
        self.state.check_room(tokens.len())?;
        let chunk = self.engine.opts.prefill_chunk.max(1);
        let mut out = vec![];
        let n_chunks = tokens.len().div_ceil(chunk);
        for (i, part) in tokens.chunks(chunk).enumerate() {
            let w = match want {
                Logits::All => Logits::All,
                Logits::Last if i + 1 == n_chunks => Logits::Last,
                _ => Logits::None,
            };
            out.extend(
                self.engine
                    .model
                    .forward(&mut self.state, part, w, &mut self.scratch)?,
            );
            self.tokens.extend_from_slice(part);
        }
        Ok(out)
    }

    /// Appends `tokens` and returns the most likely next token (`sampler::argmax`); on the GPU
    /// only that id comes back, not the logits.
    pub fn feed_greedy(&mut self, tokens: &[u32]) -> Result<u32, EngineError> {
        self.state.check_room(tokens.len())?;
        if tokens.is_empty() {
            return Err(EngineError::Invalid("no tokens to run".into()));
        }
        let chunk = self.engine.opts.prefill_chunk.max(1);
        let model = &self.engine.model;
        let mut id = 0;
        let n_chunks = tokens.len().div_ceil(chunk);
        for (i, part) in tokens.chunks(chunk).enumerate() {
            if i + 1 == n_chunks {
                id = model.forward_greedy(&mut self.state, part, &mut self.scratch)?;
            } else {
                model.forward(&mut self.state, part, Logits::None, &mut self.scratch)?;
            }
            self.tokens.extend_from_slice(part);
        }
        Ok(id)
    }

    /// Greedy decoding after `first` (just chosen, not yet fed): see `Model::decode_greedy`.
    /// On a resident GPU model the device feeds its own choices back, a pass ahead of the host.
    pub fn decode_greedy(
        &mut self,
        first: u32,
        max_tokens: usize,
        on_token: &mut dyn FnMut(u32) -> Result<bool, EngineError>,
    ) -> Result<(), EngineError> {
        let model = &self.engine.model;
        let fed = model.decode_greedy(
            &mut self.state,
            first,
            max_tokens,
            on_token,
            &mut self.scratch,
        )?;
        self.tokens.extend(fed);
        Ok(())
    }

    /// The next token's logits, or (plain greedy decoding) only its id.
    fn next(&mut self, tokens: &[u32], greedy: bool) -> Result<Next, EngineError> {
        Ok(if greedy {
            Next::Id(self.feed_greedy(tokens)?)
        } else {
            Next::Logits(self.feed(tokens, Logits::Last)?)
        })
    }

    /// Forgets the tokens from `keep` on, as far as the state allows (`SeqState::rewind`):
    /// returns how many it kept, which the caller feeds on from.
    pub fn rewind(&mut self, keep: usize) -> usize {
        let kept = self.state.rewind(keep);
        self.tokens.truncate(kept);
        kept
    }

    pub fn reset(&mut self) {
        self.state.clear();
        self.tokens.clear();
    }

    /// Generates after `prompt`; `on_text` receives text deltas as they become final (only when
    /// the model has a tokenizer).
    pub fn generate(
        &mut self,
        prompt: &[u32],
        opts: &GenerateOptions,
        on_text: &mut dyn FnMut(&str),
    ) -> Result<Generation, EngineError> {
        if prompt.is_empty() {
            return Err(EngineError::Invalid("the prompt is empty".into()));
        }
        opts.sampler.validate()?;
        let tok = self.engine.tokenizer.as_ref();
        let mut decoder = tok.map(|t| t.stream_decoder(true));
        let mut stops = StopStrings::new(opts.stop_strings.clone());
        let mut text = tok.map(|_| String::new());
        let mut sampler = Sampler::new(opts.sampler.clone());
        // Argmax without penalties needs no logits: the GPU picks the token and sends its id.
        let c = &opts.sampler;
        let greedy = (c.temperature <= 0.0 || c.top_k == 1)
            && c.repetition_penalty == 1.0
            && c.presence_penalty == 0.0
            && c.frequency_penalty == 0.0;
        let t0 = Instant::now();
        let mut next = self.next(prompt, greedy)?;
        let prefill_seconds = t0.elapsed().as_secs_f64();
        let t1 = Instant::now();
        let mut generated = vec![];
        let mut finish = FinishReason::Length;
        // Takes a chosen id; false when generation ends with it.
        let max_tokens = opts.max_tokens;
        let mut accept = |id: u32| -> Result<bool, EngineError> {
            generated.push(id);
            if opts.stop_ids.contains(&id) {
                finish = FinishReason::Stop;
                return Ok(false);
            }
            if let (Some(d), Some(t)) = (decoder.as_mut(), text.as_mut()) {
                if let Some(delta) = d.step(id)? {
                    let out = stops.push(&delta);
                    t.push_str(&out.text);
                    on_text(&out.text);
                    if out.stopped.is_some() {
                        finish = FinishReason::Stop;
                        return Ok(false);
                    }
                }
            }
            Ok(generated.len() < max_tokens)
        };
        if max_tokens > 0 {
            let first = match &mut next {
                Next::Id(id) => *id,
                Next::Logits(logits) => sampler.sample(logits, &self.tokens),
            };
            if accept(first)? {
                let left = max_tokens - 1;
                if greedy {
                    self.decode_greedy(first, left, &mut accept)?;
                } else {
                    let mut id = first;
                    while self.state.check_room(1).is_ok() {
                        let mut logits = self.feed(&[id], Logits::Last)?;
                        id = sampler.sample(&mut logits, &self.tokens);
                        if !accept(id)? {
                            break;
                        }
                    }
                }
            }
        }
        if let (Some(d), Some(t)) = (decoder.as_mut(), text.as_mut()) {
            if finish != FinishReason::Stop || stops.stopped().is_none() {
                let rest = d.finish()?;
                let out = stops.push(&rest);
                let tail = if out.stopped.is_some() {
                    out.text
                } else {
                    out.text + &stops.finish()
                };
                t.push_str(&tail);
                on_text(&tail);
            }
        }
        Ok(Generation {
            tokens: generated,
            text,
            finish_reason: finish,
            prompt_tokens: prompt.len(),
            prefill_seconds,
            decode_seconds: t1.elapsed().as_secs_f64(),
        })
    }
}
