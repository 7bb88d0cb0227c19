//! The CPU executor: interprets a model description (`spec::ModelSpec`) layer by layer, as the
//! math reads:
//!
//! x = embed(tokens)
//! per layer: x += mixer(norm₁(x))      (attention over the layer's KV state)
//!            x += ffn(norm₂(x))        (routed experts + shared expert, or a dense MLP)
//! logits = lm_head(norm(x))
//!
//! Every weight is read once per pass for all rows of all sequences in it; only the mixer is
//! per sequence. The blocks live in `attention.rs` and `ffn.rs`.

mod attention;
mod ffn;

use super::{mat, Logits, Scratch};
use crate::error::EngineError;
use crate::rope::RopeTable;
use crate::spec::{Ffn, Mixer, ModelSpec};
use crate::state::SeqState;
use crate::store::{Experts, Lookahead, StoreOptions};
use attention::AttentionW;
use ffn::FfnW;
use smoe_compute::cpu::{matmul, ops};
use smoe_vault::{ModelConfig, TensorData, Vault};

/// A mixer's weights, as its spec names them.
enum MixerW {
    Attention(AttentionW),
}

struct LayerW {
    mixer_norm: Vec<f32>,
    mixer: MixerW,
    ffn_norm: Vec<f32>,
    ffn: FfnW,
}

pub struct CpuModel {
    pub cfg: ModelConfig,
    pub spec: ModelSpec,
    embed: TensorData,
    layers: Vec<LayerW>,
    norm: Vec<f32>,
    lm_head: TensorData,
    rope: RopeTable,
    pub experts: Experts,
    /// Streaming: how many MoE layers ahead `ffn::prefetch_next` guesses, and how much of them.
    lookahead: Lookahead,
}

impl CpuModel {
    pub fn load(vault: &Vault, spec: ModelSpec, store: &StoreOptions) -> Result<Self, EngineError> {
        let cfg = vault.header.config.clone();
        let vector = |t: smoe_vault::tensors::Tensor| vault.tensor(&t.name()).map(|t| t.to_f32());
        let mut layers = Vec::with_capacity(spec.layers.len());
        for l in &spec.layers {
            let mixer = match &l.mixer {
                Mixer::Attention(a) => MixerW::Attention(AttentionW::load(vault, a)?),
            };
            layers.push(LayerW {
                mixer_norm: vector(l.mixer_norm)?,
                mixer,
                ffn_norm: vector(l.ffn_norm)?,
                ffn: FfnW::load(vault, &l.ffn)?,
            });
        }
        Ok(CpuModel {
            rope: RopeTable::new(&cfg.rope, cfg.head_dim),
            experts: Experts::open(vault, store)?,
            lookahead: store.lookahead()?,
            norm: vector(spec.final_norm)?,
            embed: vault.tensor(&spec.embed.name())?,
            lm_head: vault.tensor(&spec.lm_head.name())?,
            layers,
            spec,
            cfg,
        })
    }

    /// A sequence's state on the CPU: each layer's, preallocated for `capacity` positions.
    pub fn new_state(&self, capacity: usize) -> SeqState {
        SeqState::new(self.spec.states(), capacity)
    }

    /// Runs `tokens` (positions `state.len()..`) through the model, appending to its state,
    /// and returns logits (`[rows, vocab]`) for the positions `want` asks for.
    pub fn forward(
        &self,
        state: &mut SeqState,
        tokens: &[u32],
        want: Logits,
        s: &mut Scratch,
    ) -> Result<Vec<f32>, EngineError> {
        let mut out = self.forward_batch(&mut [state], &[tokens], &[want], s)?;
        Ok(out.pop().unwrap_or_default())
    }

    /// Several sequences in one pass: `runs[i]` continues `states[i]`. Returns each run's logits
    /// as `want[i]` asks.
    pub fn forward_batch(
        &self,
        states: &mut [&mut SeqState],
        runs: &[&[u32]],
        want: &[Logits],
        s: &mut Scratch,
    ) -> Result<Vec<Vec<f32>>, EngineError> {
        let spec = &self.spec;
        if states.len() != runs.len() || runs.len() != want.len() {
            return Err(EngineError::Invalid(
                "forward_batch: one run, one state and one logits choice per sequence".into(),
            ));
        }
        for (state, run) in states.iter().zip(runs) {
            state.check_room(run.len())?;
            if let Some(&id) = run.iter().find(|&&id| id as usize >= spec.vocab) {
                return Err(EngineError::TokenOutOfRange {
                    id,
                    vocab: spec.vocab,
                });
            }
        }
        // Row offset of each run in the stacked activations.
        let mut spans = Vec::with_capacity(runs.len());
        let mut t = 0;
        for run in runs {
            spans.push(t..t + run.len());
            t += run.len();
        }
        let h = spec.hidden;
        s.x.resize(t * h, 0.0);
        let embed = mat(&self.embed);
        for (i, &id) in runs.iter().flat_map(|r| r.iter()).enumerate() {
            smoe_vault::quant::dequantize_row(
                embed.dtype,
                embed.row(id as usize),
                &mut s.x[i * h..(i + 1) * h],
            );
        }
        for (l, layer) in self.layers.iter().enumerate() {
            s.h.resize(t * h, 0.0);
            ops::rms_norm(&s.x, &layer.mixer_norm, spec.eps, &mut s.h);
            match (&layer.mixer, &spec.layers[l].mixer) {
                (MixerW::Attention(w), Mixer::Attention(a)) => {
                    w.forward(a, (l, spec.eps), &self.rope, states, &spans, s)
                }
            }
            ops::rms_norm(&s.x, &layer.ffn_norm, spec.eps, &mut s.h);
            match (&layer.ffn, &spec.layers[l].ffn) {
                (FfnW::Dense(m), _) => {
                    let out = m.forward(&s.h, t);
                    ffn::add_into(&mut s.x, &out);
                }
                (FfnW::Moe { router, shared }, Ffn::Moe(moe)) => {
                    self.moe(l, moe, mat(router), t, s)?;
                    if let Some((m, gate)) = shared {
                        ffn::shared_expert(m, mat(gate), t, s);
                    }
                }
                (FfnW::Moe { .. }, Ffn::Dense(_)) => unreachable!("loaded from this spec"),
            }
        }
        for (state, run) in states.iter_mut().zip(runs) {
            state.advance(run.len());
        }
        self.experts.tick();
        spans
            .iter()
            .zip(want)
            .map(|(span, w)| Ok(self.logits(s, span.clone(), *w)))
            .collect()
    }

    /// Final norm and LM head, only at the rows of `span` that need logits.
    fn logits(&self, s: &Scratch, span: std::ops::Range<usize>, want: Logits) -> Vec<f32> {
        let (h, vocab) = (self.spec.hidden, self.spec.vocab);
        let rows: Vec<usize> = match want {
            Logits::Last if !span.is_empty() => vec![span.end - 1],
            Logits::All => span.collect(),
            _ => vec![],
        };
        let mut hn = vec![0f32; rows.len() * h];
        for (j, &r) in rows.iter().enumerate() {
            ops::rms_norm(
                &s.x[r * h..(r + 1) * h],
                &self.norm,
                self.spec.eps,
                &mut hn[j * h..(j + 1) * h],
            );
        }
        let mut logits = vec![0f32; rows.len() * vocab];
        if !rows.is_empty() {
            matmul(mat(&self.lm_head), &hn, rows.len(), &mut logits);
        }
        logits
    }
}
