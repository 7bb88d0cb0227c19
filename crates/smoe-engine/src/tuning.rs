//! `Tuning`: how the engine fuses its GPU decode and streams experts (`StoreOptions::tuning`).
//! The defaults are the fastest measured choices; the others are for comparisons and
//! measurements. The library reads no environment: the `smoe` binary maps its `SMOE_*`
//! variables to these fields (`smoe-cli/src/tuning.rs`). The GPU device's own settings are a
//! `smoe_compute::gpu::GpuTuning`, given to `gpu::configure`.

use crate::error::EngineError;
use std::path::PathBuf;

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
    /// GPU streaming, a measurement: record each decode MoE layer's choice to a file, or
    /// replay such a trace as perfect guesses (`RouteTrace`). Default: `None`.
    pub route_trace: Option<RouteTrace>,
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
            route_trace: None,
        }
    }
}

/// What `Tuning::route_trace` asks for (the `smoe` binary: `SMOE_ROUTE_TRACE`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RouteTrace {
    /// Write each decode MoE layer's choice to the file.
    Record(PathBuf),
    /// Start reading the true experts of the next `depth` MoE layers from the file's trace.
    Replay { path: PathBuf, depth: usize },
}

/// MoE layers the replay reads ahead unless told.
pub const DEFAULT_TRACE_DEPTH: usize = 4;

impl RouteTrace {
    /// Parses `record:PATH` or `replay:PATH[:DEPTH]`.
    pub fn parse(v: &str) -> Result<Self, EngineError> {
        let bad = || {
            EngineError::Invalid(format!(
                "SMOE_ROUTE_TRACE={v}: expected record:PATH or replay:PATH[:DEPTH]"
            ))
        };
        let (mode, rest) = v.split_once(':').ok_or_else(bad)?;
        match mode {
            "record" if !rest.is_empty() => Ok(RouteTrace::Record(rest.into())),
            "replay" => {
                let (path, depth) = match rest.rsplit_once(':') {
                    Some((p, d)) if d.chars().all(|c| c.is_ascii_digit()) && !d.is_empty() => {
                        (p, d.parse().map_err(|_| bad())?)
                    }
                    _ => (rest, DEFAULT_TRACE_DEPTH),
                };
                if path.is_empty() || depth == 0 {
                    return Err(bad());
                }
                Ok(RouteTrace::Replay {
                    path: path.into(),
                    depth,
                })
            }
            _ => Err(bad()),
        }
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
