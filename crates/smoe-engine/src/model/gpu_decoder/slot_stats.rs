//! What the streaming GPU path reports (`--stats`, `bench decode --json`): VRAM slot hits and
//! misses, where the host's time went at the router stops, and the disk's idle time within them.

use super::GpuDecoder;
use crate::store::Recall;
use std::sync::atomic::{AtomicU64, Ordering};

/// What the streaming GPU path did since load (or `reset_slot_stats`): VRAM slot hits and misses
/// (distinct experts per layer and batch), and where the host's time went at the router stops.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct SlotStats {
    /// VRAM expert slots per MoE layer, and their bytes in all (`--vram-cache`).
    pub slots: usize,
    pub slot_bytes: u64,
    pub hits: u64,
    pub misses: u64,
    /// Router stops (one submission and wait per MoE layer and batch).
    pub stops: u64,
    /// Stops at which every expert the router chose already sat in a VRAM slot: nothing was
    /// read or copied, and the round trip bought nothing but the slot indices. Prompt batches
    /// make one per such layer; decode batches run through them, and stop at one only where
    /// the lookahead guessed an expert the next layer has no slot for (to start that read).
    pub hit_stops: u64,
    /// MoE layers of decode batches whose experts all sat in VRAM and that ran without a stop:
    /// the GPU mapped the router's choice to slots itself (`gpu_decoder::through`).
    pub run_through: u64,
    /// Speculative passes run while a halted decode layer's misses were read
    /// (`gpu_decoder::through`), and the expert reads their guesses started.
    pub speculated: u64,
    pub spec_guesses: u64,
    /// Of the experts decode layers used after a speculative pass had guessed them, the share
    /// it named (None: no pass guessed a layer that then ran).
    pub spec_recall: Option<f64>,
    /// Reads started from a replayed routing trace (`Tuning::route_trace` replaying, a
    /// measurement): the true experts of the next MoE layers, in place of guesses.
    pub oracle_reads: u64,
    /// Experts copied into the slots of later MoE layers expected to choose them (a replayed
    /// trace's, or the guesses'), from host memory (cached or read ahead), at halts and while
    /// the GPU runs other layers, so those layers could run through (`Tuning::fill_ahead`
    /// turns it off); and the seconds it took (at halts, part of `fill_s`). A layer that then
    /// runs with such a slot counts a miss for it (its blob was brought in for that use).
    pub placed_ahead: u64,
    pub ahead_s: f64,
    /// Waiting for the GPU to reach a router stop (its compute, and the submission's latency).
    pub gpu_wait_s: f64,
    /// Filling slots: reads waited for, plus the uploads below.
    pub fill_s: f64,
    /// Copying whole blobs into the slots (mapped) or into `queue.write_buffer`'s staging
    /// memory, on the forward pass's thread: host-cache hits and lookahead reads (the pieces of
    /// blobs read at the stop are copied by the reader threads as they arrive, overlapping the
    /// reads).
    pub upload_s: f64,
    /// Mapping the layer's slot buffer for the host's writes at a stop with misses, and
    /// unmapping it after (the mapping waits for the GPU to be done with the buffer).
    pub map_s: f64,
    /// Forward passes in all (the rest is recording, submitting and the last wait).
    pub pass_s: f64,
    /// How long the disk sat idle (no read in flight) during the passes, and during their GPU
    /// waits and fills: the time the I/O bound assumes busy.
    pub disk_idle: DiskIdle,
    /// The host writes blobs straight into the slots through a mapping (`gpu::slots`); false:
    /// through wgpu's staging memory and a GPU copy.
    pub mapped: bool,
    /// Blobs read from disk straight into their slot (unified memory: the bytes moved once).
    pub landed: u64,
    /// The GPU is held at its full clock while the model is loaded (`ClockHold`: an NVIDIA
    /// GPU, whose driver otherwise lowers the clock while the decode waits for reads).
    pub clocks_held: bool,
}

/// Seconds with no disk read in flight (`SlotStats::disk_idle`), within the GPU waits, the
/// fills and the passes in all.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct DiskIdle {
    pub gpu_wait_s: f64,
    pub fill_s: f64,
    pub pass_s: f64,
}

impl GpuDecoder {
    /// Streaming: VRAM slot hits and misses, and the host's time at the router stops, since
    /// load or the last `reset_slot_stats`.
    pub fn slot_stats(&self) -> Option<SlotStats> {
        let secs = |a: &AtomicU64| a.load(Ordering::Relaxed) as f64 * 1e-9;
        let slot_bytes = (self.cfg.moe_layers())
            .filter_map(|l| self.weights.expert_slots(l))
            .map(|x| x.slots as u64 * x.stride)
            .sum();
        self.streaming.as_ref().map(|s| SlotStats {
            slots: s.slots,
            slot_bytes,
            hits: s.hits.load(Ordering::Relaxed),
            misses: s.misses.load(Ordering::Relaxed),
            stops: s.stops.load(Ordering::Relaxed),
            hit_stops: s.hit_stops.load(Ordering::Relaxed),
            run_through: s.through_layers.load(Ordering::Relaxed),
            speculated: s.spec_runs.load(Ordering::Relaxed),
            spec_guesses: s.spec_guesses.load(Ordering::Relaxed),
            spec_recall: (s.spec_scores.lock())
                .unwrap_or_else(|e| e.into_inner())
                .share(),
            oracle_reads: s.oracle_reads.load(Ordering::Relaxed),
            placed_ahead: s.placed_ahead.load(Ordering::Relaxed),
            ahead_s: secs(&s.ahead_ns),
            gpu_wait_s: secs(&s.gpu_wait_ns),
            fill_s: secs(&s.fill_ns),
            upload_s: secs(&s.upload_ns),
            map_s: secs(&s.map_ns),
            pass_s: secs(&s.pass_ns),
            disk_idle: DiskIdle {
                gpu_wait_s: secs(&s.idle_gpu_wait_ns),
                fill_s: secs(&s.idle_fill_ns),
                pass_s: secs(&s.idle_pass_ns),
            },
            mapped: s.mapped,
            landed: s.landed.load(Ordering::Relaxed),
            clocks_held: s.clocks.is_some(),
        })
    }

    pub fn reset_slot_stats(&self) {
        if let Some(s) = &self.streaming {
            for a in [
                &s.hits,
                &s.misses,
                &s.stops,
                &s.hit_stops,
                &s.through_layers,
                &s.spec_runs,
                &s.spec_guesses,
                &s.oracle_reads,
                &s.placed_ahead,
                &s.ahead_ns,
                &s.gpu_wait_ns,
                &s.fill_ns,
                &s.upload_ns,
                &s.map_ns,
                &s.pass_ns,
                &s.idle_gpu_wait_ns,
                &s.idle_fill_ns,
                &s.idle_pass_ns,
                &s.landed,
            ] {
                a.store(0, Ordering::Relaxed);
            }
            *s.spec_scores.lock().unwrap_or_else(|e| e.into_inner()) = Recall::default();
        }
    }
}
