//! `Tuning`: how the engine fuses its GPU decode and streams experts (`StoreOptions::tuning`).
//! The defaults are the fastest measured choices; the others are for comparisons and
//! measurements. The library reads no environment: the `smoe` binary maps its `SMOE_*`
//! variables to these fields (`smoe-cli/src/tuning.rs`). The GPU device's own settings are a
//! `smoe_compute::gpu::GpuTuning`, given to `gpu::configure`.

use crate::error::EngineError;
use std::sync::Arc;

/// The engine's tuning switches.
#[derive(Clone, Debug, PartialEq)]
pub struct Tuning {
    /// GPU, one token: the o projection runs the next MoE block's router (its RMSNorm, logits
    /// and top-k) in its last workgroups, where the device fuses tails and the router fits
    /// (`Fuse::next_route`); false: the router gets a dispatch of its own. Default: true.
    pub fused_router: bool,
    /// GPU streaming: decode batches run through the MoE layers whose experts sit in VRAM,
    /// the router's choice mapped to slots on the GPU, halting only where one is missing;
    /// false: they stop at every router, as prompt batches do. Default: true.
    pub run_through: bool,
    /// GPU streaming: decode copies into later MoE layers' slots, ahead of them, the experts
    /// they are expected to choose whose blobs are in host memory. Default: true.
    pub fill_ahead: bool,
    /// GPU streaming: MoE layers after a halted decode layer that a speculative pass looks
    /// ahead while that layer's misses are read (0: none). `None`: 2 on a discrete GPU, 0 on
    /// unified memory (where misses land in their slots, the pass's host buffers would add a
    /// copy). Default: `None`.
    pub speculate: Option<usize>,
    /// Streaming: how far the lookahead guesses (MoE layers ahead, 1 to `LOOKAHEAD_MAX`, and
    /// experts kept per token of each guess, its best-ranked). Default: one layer, every
    /// guessed expert.
    pub lookahead: Lookahead,
    /// GPU streaming: the host writes blobs straight into the VRAM expert slots through a
    /// mapping where the device allows it; false: always through wgpu's staging memory.
    /// Default: true.
    pub mapped_slots: bool,
    /// GPU streaming, a measurement: routing known ahead (`RouteOracle`). Default: `None`.
    pub route_oracle: Option<Oracle>,
}

impl Default for Tuning {
    fn default() -> Self {
        Tuning {
            fused_router: true,
            run_through: true,
            fill_ahead: true,
            speculate: None,
            lookahead: Lookahead::default(),
            mapped_slots: true,
            route_oracle: None,
        }
    }
}

/// Routing known ahead, a measurement hook of the streamed GPU decode: the decoder tells it each
/// decode MoE layer's choice (`used`) and, where it `replays`, reads the experts of the choices it
/// says come next (`ahead`) as needed reads instead of guessing. It measures how close the decode
/// gets to the I/O bound when guessing is not what limits it; `smoe`'s routing oracle (a
/// recorded trace, `SMOE_ROUTE_TRACE`) is one, in the CLI's bench code.
pub trait RouteOracle: Send + Sync {
    /// Decode MoE layer `layer` ran with the experts `ids` (router order).
    fn used(&self, layer: usize, ids: &[u32]) -> Result<(), EngineError>;
    /// The next MoE layers' choices it knows, nearest first (none: guess as usual).
    fn ahead(&self) -> Vec<(usize, Vec<u32>)>;
    /// Whether it knows choices ahead: the decoder's own guesses are then off.
    fn replays(&self) -> bool;
}

/// A `RouteOracle` in `Tuning` (compared by identity).
#[derive(Clone)]
pub struct Oracle(pub Arc<dyn RouteOracle>);

impl std::fmt::Debug for Oracle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mode = if self.0.replays() {
            "replays"
        } else {
            "records"
        };
        write!(f, "RouteOracle({mode})")
    }
}

impl PartialEq for Oracle {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

/// The most MoE layers a streaming lookahead predicts.
pub const LOOKAHEAD_MAX: usize = 4;

/// How far a streaming decoder's lookahead guesses (`Tuning::lookahead`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Lookahead {
    /// MoE layers each MoE layer predicts: the next `depth` (1 to `LOOKAHEAD_MAX`).
    pub depth: usize,
    /// Experts per token kept of every guess (the next MoE layer's and those beyond), its
    /// best-ranked (at least 1): a guess no slot or cache holds starts a read, and such guesses
    /// are wrong mostly in their low ranks.
    pub top: usize,
}

impl Default for Lookahead {
    /// One MoE layer ahead, every guessed expert kept.
    fn default() -> Self {
        Lookahead {
            depth: 1,
            top: usize::MAX,
        }
    }
}

impl Lookahead {
    /// Experts per token kept of a guess, of the `k` a token routes to.
    pub fn keep(&self, k: usize) -> usize {
        self.top.min(k)
    }
}
