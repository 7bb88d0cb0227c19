//! The two executors of a model description (`crate::spec`): the CPU executor (`cpu`)
//! interprets it and the GPU executor (`gpu_decoder`) lowers it to recorded dispatches. `Model`
//! is whichever of the two runs.

pub mod cpu;
pub mod gpu_decoder;

use crate::error::EngineError;
use crate::spec::{self, families};
use crate::state::SeqState;
use smoe_compute::cpu::QMatRef;
use smoe_vault::{ModelConfig, TensorData, Vault};

/// Which positions of a forward pass need logits (the LM head is the largest matrix: skip it
/// wherever no token is generated or scored).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logits {
    None,
    Last,
    All,
}

/// Activations reused across forward calls so the token loop does not reallocate them.
#[derive(Default)]
pub struct Scratch {
    pub x: Vec<f32>,
    pub h: Vec<f32>,
    pub q: Vec<f32>,
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    pub attn: Vec<f32>,
    pub o: Vec<f32>,
    /// The last lookahead guess while streaming: a later MoE layer and the experts it named.
    pub guess: Option<(usize, Vec<usize>)>,
}

/// A vault tensor as a matrix for the kernels (a vector is one row).
pub fn mat(t: &TensorData) -> QMatRef<'_> {
    let (rows, cols) = t.rows_cols();
    QMatRef::new(t.dtype(), rows, cols, t.bytes())
}

/// A loaded model: its description (`families::describe`) run by one of the two executors.
pub enum Model {
    Cpu(cpu::CpuModel),
    /// The same description on the GPU (`--backend gpu`).
    Gpu(gpu_decoder::GpuDecoder),
}

impl Model {
    pub fn load(vault: &Vault, store: &crate::store::StoreOptions) -> Result<Self, EngineError> {
        if store.vram_budget.is_some() {
            tracing::warn!("--vram-cache applies to the GPU backend; the CPU reads its experts from the host cache (--expert-cache)");
        }
        let spec = families::describe(&vault.header.config);
        Ok(Model::Cpu(cpu::CpuModel::load(vault, spec, store)?))
    }

    /// The decoder on the GPU; errors when there is no usable adapter or the model needs
    /// something the GPU kernels lack.
    pub fn load_gpu(
        vault: &Vault,
        store: &crate::store::StoreOptions,
    ) -> Result<Self, EngineError> {
        Ok(Model::Gpu(gpu_decoder::GpuDecoder::load(vault, store)?))
    }

    /// "cpu" or "gpu".
    pub fn backend(&self) -> &'static str {
        match self {
            Model::Cpu(_) => "cpu",
            Model::Gpu(_) => "gpu",
        }
    }

    pub fn config(&self) -> &ModelConfig {
        match self {
            Model::Cpu(m) => &m.cfg,
            Model::Gpu(m) => &m.cfg,
        }
    }

    /// The routed experts' store (stats, profile, preload).
    pub fn experts(&self) -> &crate::store::Experts {
        match self {
            Model::Cpu(m) => &m.experts,
            Model::Gpu(m) => &m.experts,
        }
    }

    /// Starts the GPU's per-step timing (`GpuDecoder::profile_start`); an error on the CPU.
    pub fn profile_start(&self, fine: bool) -> Result<(), EngineError> {
        match self {
            Model::Gpu(m) => m.profile_start(fine),
            Model::Cpu(_) => Err(EngineError::Backend(
                "per-step timing needs the GPU backend".into(),
            )),
        }
    }

    /// What the GPU measured since `profile_start`.
    pub fn profile_take(&self) -> Option<gpu_decoder::GpuProfile> {
        match self {
            Model::Gpu(m) => m.profile_take(),
            Model::Cpu(_) => None,
        }
    }

    /// VRAM expert slots (hits, misses, host time at the router stops) when the GPU backend
    /// streams experts.
    /// Streaming: loads the hottest experts of the saved usage profile ahead of use — into the
    /// host cache, and on the GPU into the VRAM expert slots too. `progress(done, total)` after
    /// each expert. Returns how many were loaded.
    pub fn preload(&self, progress: &mut dyn FnMut(usize, usize)) -> Result<usize, EngineError> {
        match self {
            Model::Cpu(m) => m.experts.preload(progress),
            Model::Gpu(m) => m.preload(progress),
        }
    }

    pub fn vram_slot_stats(&self) -> Option<gpu_decoder::SlotStats> {
        match self {
            Model::Gpu(m) => m.slot_stats(),
            Model::Cpu(_) => None,
        }
    }

    /// Zeroes what `vram_slot_stats` counts.
    pub fn reset_vram_slot_stats(&self) {
        if let Model::Gpu(m) = self {
            m.reset_slot_stats();
        }
    }

    /// The model's description.
    pub fn spec(&self) -> &spec::ModelSpec {
        match self {
            Model::Cpu(m) => &m.spec,
            Model::Gpu(m) => &m.spec,
        }
    }

    /// A new sequence's state, with room for `capacity` positions.
    pub fn new_state(&self, capacity: usize) -> SeqState {
        match self {
            Model::Cpu(m) => m.new_state(capacity),
            Model::Gpu(m) => m.new_state(capacity),
        }
    }

    pub fn forward(
        &self,
        state: &mut SeqState,
        tokens: &[u32],
        want: Logits,
        s: &mut Scratch,
    ) -> Result<Vec<f32>, EngineError> {
        match self {
            Model::Cpu(m) => m.forward(state, tokens, want, s),
            Model::Gpu(m) => m.forward(state, tokens, want),
        }
    }

    /// Runs `tokens` and returns the most likely next token (`sampler::argmax` of the last
    /// row). On the GPU the argmax runs there and only the id is read back.
    pub fn forward_greedy(
        &self,
        state: &mut SeqState,
        tokens: &[u32],
        s: &mut Scratch,
    ) -> Result<u32, EngineError> {
        match self {
            Model::Cpu(m) => {
                let logits = m.forward(state, tokens, Logits::Last, s)?;
                Ok(crate::sampler::argmax(&logits))
            }
            Model::Gpu(m) => m.forward_greedy(state, tokens),
        }
    }

    /// Greedy decoding after `first` (the token just chosen, not yet fed): feeds it and each
    /// following argmax, handing every chosen id to `on_token` until it says stop, `max_tokens`
    /// ids came out or the cache is full. Returns the ids fed (the cache holds them now). On the
    /// GPU (resident) each pass takes its input from the previous pass's argmax on the device
    /// and is queued before the host reads that id (`GpuDecoder::decode_greedy`); elsewhere it
    /// is one `forward_greedy` per token.
    pub fn decode_greedy(
        &self,
        state: &mut SeqState,
        first: u32,
        max_tokens: usize,
        on_token: &mut dyn FnMut(u32) -> Result<bool, EngineError>,
        s: &mut Scratch,
    ) -> Result<Vec<u32>, EngineError> {
        if let Model::Gpu(m) = self {
            if let Some(fed) = m.decode_greedy(state, first, max_tokens, on_token)? {
                return Ok(fed);
            }
        }
        let mut fed = vec![];
        let mut id = first;
        while fed.len() < max_tokens && state.check_room(1).is_ok() {
            fed.push(id);
            id = self.forward_greedy(state, &[id], s)?;
            if !on_token(id)? {
                break;
            }
        }
        Ok(fed)
    }

    /// Whether greedy decoding feeds the device's own choices back without the host
    /// (`decode_greedy` on a resident GPU model).
    pub fn chains_greedy(&self) -> bool {
        matches!(self, Model::Gpu(m) if m.chains_greedy())
    }

    /// Several sequences in one pass (continuous batching): `runs[i]` continues `states[i]`.
    pub fn forward_batch(
        &self,
        states: &mut [&mut SeqState],
        runs: &[&[u32]],
        want: &[Logits],
        s: &mut Scratch,
    ) -> Result<Vec<Vec<f32>>, EngineError> {
        match self {
            Model::Cpu(m) => m.forward_batch(states, runs, want, s),
            // One sequence after another (weights read once per sequence, not per batch).
            Model::Gpu(m) => states
                .iter_mut()
                .zip(runs)
                .zip(want)
                .map(|((state, run), w)| m.forward(state, run, *w))
                .collect(),
        }
    }
}
