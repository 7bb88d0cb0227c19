//! `model::decoder` on the GPU (wgpu): the same math, with every kernel recorded at load.
//!
//! A forward pass over n tokens (n a power of two ≤ `T_MAX`; longer runs are split) writes the
//! tokens' embedding rows and the position (a few KiB), records the prepared dispatches (per
//! layer: q/k/v with the input norm fused, QK-norm + RoPE + KV append, attention, o + residual,
//! router matvec with the post-attention norm fused, softmax top-k, grouped gate_up and down over
//! the router's ids with the weighted sum and residual fused — the router's choice never leaves
//! the GPU), then the final norm and LM head only if a token is generated or scored, submitting
//! every `SUBMIT_LAYERS` layers (a greedy chain's pass: once). It reads back only what the caller asked for: a greedy token id
//! (4 bytes, argmax on the GPU), the last row of logits (sampling) or every row (log-probs).
//! Greedy decoding (`decode_greedy`) chains passes: each gathers its input from the previous
//! pass's argmax on the device and is queued before the host reads that id.
//!
//! With `--expert-cache` other than resident, experts stream (`Streaming`): each MoE layer has a
//! few VRAM expert slots, and a prompt pass is split after every MoE layer's router so the host
//! can read the chosen ids (and the next MoE layer's predicted ones, whose reads it starts), fill
//! missing slots from the streaming store, and hand the grouped products slot indices — one
//! submission and wait per MoE layer. Decode batches run through the layers whose experts sit in
//! VRAM and halt only where one must be read (`through`).

use super::{mat, Logits};
use crate::error::EngineError;
use crate::gpu::{
    self, Acts, AtRoutes, FfnW, GpuKv, Head, KvPool, LayerOps, Readback, Recorder, SlotPlan,
    Weights, GEMM_MIN, LOGIT_ROWS, T_MAX,
};
use crate::rope::RopeTable;
use crate::state::SeqState;
use crate::store::{CacheBudget, Experts, StoreOptions};
use smoe_compute::gpu::{
    wgpu, BufRef, ClockHold, EmbedGather, GpuContext, MatrixUnits, Timestamps,
};
use smoe_vault::{ModelConfig, TensorData, Vault};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

mod oracle;
mod streaming;
mod through;
mod vram;

pub use oracle::RouteTrace;
use streaming::Streaming;
pub use streaming::{DiskIdle, SlotStats};
use through::Through;

pub struct GpuDecoder {
    pub cfg: ModelConfig,
    /// The model's description (`families::describe`).
    pub spec: crate::spec::ModelSpec,
    ctx: Arc<GpuContext>,
    /// Tells this model's KV caches from another's.
    id: u64,
    /// Embedding rows are gathered on the host (the vault is mapped) and written per batch.
    embed: TensorData,
    weights: Weights,
    acts: Acts,
    /// The uniform holding the batch's first position.
    step: wgpu::Buffer,
    rope_scale: f32,
    /// Per batch size (index log2 n): every layer's dispatches, and the head.
    batches: Vec<(Vec<LayerOps>, Head)>,
    readback: Readback,
    /// One forward pass at a time (they share the activations); holds the embedding rows.
    running: Mutex<Vec<f32>>,
    /// Resident: a memory-mapped view of the experts for `Model::experts` (the GPU holds its
    /// own copy). Streaming: the store the GPU's expert slots are filled from (O_DIRECT reads,
    /// verified, cached in host RAM under the same budget).
    pub experts: Experts,
    /// `--expert-cache` other than resident: each MoE layer has a few expert slots in VRAM.
    streaming: Option<Streaming>,
    /// While profiling: timestamps after every step, accumulated per step label.
    profiling: Mutex<Option<Profiling>>,
    /// Greedy chains (`decode_greedy`): when the embedding is on the GPU.
    chain: Option<Chain>,
    /// Dropped sequences' KV caches, reused by the next sequence of the same capacity.
    kv_pool: Arc<KvPool>,
}

/// What a greedy chain adds: the embedding gather from the argmax, and two read-back buffers
/// (pass i + 1 copies its id while the host reads pass i's).
struct Chain {
    gather: EmbedGather,
    ids: [Readback; 2],
}

/// Where a forward pass's time goes, accumulated over the passes run while profiling
/// (`GpuDecoder::profile_start` … `profile_take`).
#[derive(Debug, Clone, Default)]
pub struct GpuProfile {
    /// (step, GPU time in ns, dispatch groups recorded), in first-seen order. The GPU time of a
    /// step runs from the previous step's end to its own, so it includes any idle gap before it.
    pub steps: Vec<(&'static str, f64, u64)>,
    /// Host time spent recording and submitting command buffers, ns.
    pub record_ns: f64,
    /// Wall time of the forward calls, ns (host recording, GPU work, waits and read-backs).
    pub wall_ns: f64,
    /// Forward calls.
    pub passes: u64,
    /// Steps not timed because a submission had more than `Timestamps` can hold.
    pub dropped: u64,
}

struct Profiling {
    ts: Timestamps,
    acc: GpuProfile,
    /// A timestamp after every step, or only around each pass.
    fine: bool,
}

impl Profiling {
    /// After a submission completed: adds its marks to the totals.
    fn collect(&mut self, ctx: &GpuContext, recorded: std::time::Duration) {
        self.acc.record_ns += recorded.as_nanos() as f64;
        self.acc.dropped += self.ts.dropped();
        for (label, ns) in self.ts.collect(ctx) {
            match self.acc.steps.iter_mut().find(|s| s.0 == label) {
                Some(s) => {
                    s.1 += ns;
                    s.2 += 1;
                }
                None => self.acc.steps.push((label, ns, 1)),
            }
        }
    }
}

fn nanos(d: std::time::Duration) -> u64 {
    d.as_nanos() as u64
}

/// Adds the disk's idle time since `from` (a reading of `GpuDecoder::disk_idle`) to `to`.
fn add_idle(to: &AtomicU64, from: f64, now: f64) {
    to.fetch_add(((now - from).max(0.0) * 1e9) as u64, Ordering::Relaxed);
}

/// Layers per submission on the resident path: the GPU starts on the first layers while the
/// host records the rest, and wgpu's per-dispatch validation and tracking at `finish`/`submit`
/// (≈ 1.5 ms per decoded token of Qwen3-30B-A3B in one submission, H200 host) overlaps GPU
/// work instead of preceding it. Greedy chains (`decode_greedy`) submit each pass whole
/// instead: there the host records a pass while the previous one runs, and fewer submissions
/// won (H200, 30B q4, tg128: 296.2 tok/s whole, 292.3 every 16 layers, 286.3 every 8, 273.2
/// every 4, 250.7 every 2).
const SUBMIT_LAYERS: usize = 8;

/// Why recording stopped before the end of a pass.
#[derive(Clone, Copy, PartialEq)]
enum Stop {
    /// The pass is recorded to its end.
    End,
    /// Resident: a submission ends after this many layers; the next starts at that layer.
    Layer(usize),
    /// Streaming: at this MoE layer's router, to read its choice and fill expert slots.
    Route(usize),
}

/// How a forward pass ends.
#[derive(Clone, Copy, PartialEq)]
enum End {
    Logits(Logits),
    Greedy,
}

/// Records the head a pass of this `end` needs (`last`: its last piece): all logits, the last
/// row's, or its argmax.
fn record_head(head: &Head, r: &mut Recorder, end: End, last: bool) {
    match end {
        End::Logits(Logits::All) => head.record_all(r),
        End::Logits(Logits::Last) if last => head.record_last(r, false),
        End::Greedy if last => head.record_last(r, true),
        _ => {}
    }
}

impl GpuDecoder {
    pub fn load(vault: &Vault, store: &StoreOptions) -> Result<Self, EngineError> {
        let ctx = gpu::context()?;
        let cfg = vault.header.config.clone();
        // The GPU's free memory, asked once (where the driver answers; a model with experts).
        let room = vault.expert_section().and_then(|_| vram::room(&ctx, vault));
        // Resident experts go to VRAM whole; those that cannot (or a VRAM budget alone) stream.
        let streamed = vram::stream_instead(vault, store, room);
        let store = streamed.as_ref().unwrap_or(store);
        // Streaming expert slots that do not fit are retried with half as many, down to top-k,
        // unless the VRAM budget was given (then the error says to give a smaller one).
        let retry = vram::given(store).is_none();
        let k = cfg.num_experts_per_tok.max(1);
        let mut cap = None;
        let m = loop {
            // Out-of-memory while uploading becomes an error (a fallback under --backend auto)
            // rather than wgpu's default panic.
            let scope = ctx.device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
            let built = Self::build(&ctx, vault, cfg.clone(), store, (cap, room));
            if let Some(e) = pollster::block_on(scope.pop()) {
                return Err(EngineError::Backend(format!("GPU: {e}")));
            }
            match built {
                Err(EngineError::SlotsOutOfMemory { slots, bytes })
                    if retry && slots > k =>
                {
                    let fewer = (slots / 2).max(k);
                    vram::retrying(slots, bytes, fewer);
                    // Let wgpu free what the failed attempt allocated before the next one.
                    let _ = ctx.device.poll(wgpu::PollType::wait_indefinitely());
                    cap = Some(fewer);
                }
                // (Down to top-k, nothing fewer would do: say so rather than ask for less.)
                Err(EngineError::SlotsOutOfMemory { bytes, .. }) if retry => {
                    return Err(EngineError::Backend(format!(
                        "GPU: out of memory even for the {k} expert slots per MoE layer a token needs ({:.1} GiB in all): run this model with --backend cpu, or free GPU memory",
                        bytes as f64 / (1u64 << 30) as f64
                    )))
                }
                built => break built?,
            }
        };
        // Build one tiny KV cache now, so that shapes the attention kernels refuse fail the load
        // (and `auto` falls back) instead of the first request.
        m.kv(1)?;
        let info = ctx.info();
        tracing::info!(
            "GPU backend: {} ({:?}), shader bounds checks {}",
            info.adapter.name,
            info.adapter.backend,
            if info.bounds_checks { "on" } else { "off" }
        );
        // The prefill GEMMs were built above: say whether they run on the matrix units, and
        // warn if those were there but their kernel failed.
        match (ctx.matrix_units(), &info.matrix_units) {
            (MatrixUnits::Used, _) => tracing::info!("GPU prefill GEMMs on the matrix units"),
            (MatrixUnits::Unused(why), MatrixUnits::Used) => {
                tracing::warn!("GPU prefill GEMMs on the f32 ALUs: {why}")
            }
            (MatrixUnits::Unused(why), _) => {
                tracing::info!("GPU prefill GEMMs on the f32 ALUs ({why})")
            }
        }
        Ok(m)
    }

    /// Streaming: at most `slot_cap` expert slots per MoE layer (a retry after the budget's did
    /// not fit), within `room` bytes of free GPU memory where known (`vram::room`).
    fn build(
        ctx: &Arc<GpuContext>,
        vault: &Vault,
        cfg: ModelConfig,
        store: &StoreOptions,
        (slot_cap, room): (Option<usize>, Option<u64>),
    ) -> Result<Self, EngineError> {
        static IDS: AtomicU64 = AtomicU64::new(1);
        let spec = crate::spec::families::describe(&cfg);
        let rope = RopeTable::new(&cfg.rope, cfg.head_dim);
        // On unified memory a host cache beside mapped slots would hold the same experts in
        // the same RAM twice: there disk reads land in the slots themselves (`SlotWriter::
        // target`), the slots take the whole budget, and the store keeps no cache of its own
        // (only what a smaller --vram-cache leaves of --expert-cache).
        let unified = matches!(
            ctx.info().adapter.device_type,
            wgpu::DeviceType::IntegratedGpu | wgpu::DeviceType::Cpu
        );
        let mappable = ctx
            .info()
            .features
            .contains(wgpu::Features::MAPPABLE_PRIMARY_BUFFERS);
        let lands = unified && mappable && store.tuning.mapped_slots;
        let budget = store.budget.bytes(vault);
        // The VRAM slots' budget: `--vram-cache`, else the host's (`--expert-cache`).
        // (`load` streams a resident host where a VRAM budget is given.)
        let vram_budget = match vram::given(store) {
            None => budget,
            Some(v) => budget.and(v.bytes(vault).or(Some(u64::MAX))),
        };
        let mut experts = match budget {
            None => {
                let no_profile = StoreOptions {
                    profile: false,
                    ..StoreOptions::default()
                };
                Experts::open(vault, &no_profile)?
            }
            Some(b) => Experts::open(
                vault,
                &StoreOptions {
                    // (Unified memory: what the slots leave of the budget, none unless
                    // --vram-cache took less than --expert-cache.)
                    budget: CacheBudget::Bytes(match lands {
                        true => b.saturating_sub(vram_budget.unwrap_or(b)),
                        false => b,
                    }),
                    ..store.clone()
                },
            )?,
        };
        let k = cfg.num_experts_per_tok.max(1);
        let mut streaming = match (vram_budget, vault.expert_section()) {
            (Some(budget), Some(sec)) if experts.is_streaming() => {
                let moe = cfg.moe_layers().count().max(1) as u64;
                let by_budget = budget / (sec.blob_stride * moe).max(1);
                let slots = (by_budget.min(cfg.num_experts as u64) as usize)
                    .min(slot_cap.unwrap_or(usize::MAX))
                    .max(k)
                    .min(cfg.num_experts);
                let slots = vram::fit_slots(store, room, (slots, k, sec.blob_stride * moe));
                let fit = (slots / k).clamp(1, T_MAX);
                let max_piece = 1 << (usize::BITS - 1 - fit.leading_zeros());
                tracing::info!(
                    "GPU backend: streaming experts, {slots} of {} slots per MoE layer in VRAM; batches of {GEMM_MIN}+ tokens run their experts in rounds of ≤ {slots}, smaller ones ≤ {max_piece} tokens",
                    cfg.num_experts
                );
                Some(Streaming::new(ctx, &cfg, slots, max_piece))
            }
            _ => None,
        };
        // The decode waits for reads with the GPU idle: keep its clock up meanwhile. Before the
        // uploads: the context's VRAM (527 MiB on the H200) is then taken before wgpu allocates
        // the weights and slots, so a card it leaves too small fails the load, not a request.
        if let Some(st) = &mut streaming {
            st.clocks = match ClockHold::acquire(ctx.info()) {
                Ok(hold) => {
                    tracing::info!("GPU backend: clocks held up by a CUDA context while streaming");
                    Some(hold)
                }
                // Worth a line only where it was tried (an NVIDIA GPU).
                Err(why) if ClockHold::applies(ctx.info()).is_ok() => {
                    tracing::info!("GPU backend: clocks left to the driver ({why}); the decode may run at its idle clock");
                    None
                }
                Err(why) => {
                    tracing::debug!("GPU backend: clocks not held ({why})");
                    None
                }
            };
        }
        let weights = Weights::upload(
            ctx,
            vault,
            (&spec, &rope),
            streaming.as_ref().map(|s| SlotPlan {
                slots: s.slots,
                mapped: store.tuning.mapped_slots,
                vram_limit: store.vram_limit,
            }),
        )?;
        if let Some(st) = &mut streaming {
            let mapped =
                (cfg.moe_layers()).all(|l| weights.expert_slots(l).is_some_and(|s| s.mappable));
            st.mapped = mapped;
            st.lands = mapped && lands;
            if lands && !mapped {
                // The slots could not be mapped after all: give the store its cache back.
                experts = Experts::open(vault, store)?;
            }
            tracing::info!(
                "GPU backend: expert slots filled {}",
                match (mapped, st.lands) {
                    (true, true) => "by disk reads landing in them (unified memory: no host cache)",
                    (true, false) =>
                        "by the host through a mapping (one copy per blob, no staging)",
                    (false, _) => "through wgpu's staging memory (write_buffer, then a GPU copy)",
                }
            );
        }
        let acts = Acts::new(ctx, &cfg);
        if let Some(st) = &mut streaming {
            // Speculative passes read guesses into host buffers: on unified memory, where misses
            // land in their slots, that would add a copy, so there they are off by default.
            let depth = match store.tuning.speculate {
                Some(d) => d,
                None if st.lands => 0,
                None => through::SPEC_DEPTH,
            };
            let trace = store.tuning.route_trace.as_ref();
            let oracle = trace.map(oracle::Oracle::open).transpose()?;
            // Replaying a trace, the oracle's guesses replace the decoder's own.
            let depth = match &oracle {
                Some(o) if o.replays() => 0,
                _ => depth,
            };
            st.lookahead = store.lookahead()?;
            let (piece, lookahead) = (st.max_piece, st.lookahead);
            st.through = Some(Through::new(
                ctx,
                &cfg,
                &acts,
                piece,
                depth,
                lookahead,
                oracle,
                &store.tuning,
            )?);
        }
        let chain = match weights.embedding(cfg.tie_word_embeddings) {
            Some(e) => {
                let (ids, x) = (BufRef::new(&acts.argmax), BufRef::new(&acts.x));
                match EmbedGather::new(ctx, &e, ids, x, 1) {
                    Ok(gather) => Some(Chain {
                        gather,
                        ids: [Readback::new(ctx, 4), Readback::new(ctx, 4)],
                    }),
                    Err(e) => {
                        tracing::debug!("GPU: no greedy chains: {e}");
                        None
                    }
                }
            }
            None => None,
        };
        let eps = spec.eps;
        let mut batches = vec![];
        // Streaming: each MoE layer also predicts the next MoE layers' experts (lookahead).
        let depth = streaming.as_ref().map_or(0, |st| st.lookahead.depth);
        let next_routers = |l: usize| -> Vec<&gpu::Packed> {
            (weights.layers[l + 1..].iter())
                .filter_map(|w| match &w.ffn {
                    FfnW::Moe { router, .. } => Some(router),
                    FfnW::Dense(_) => None,
                })
                .take(depth)
                .collect()
        };
        for n in gpu::batch_sizes() {
            let fused_router = store.tuning.fused_router;
            let layers = (spec.layers.iter().zip(&weights.layers).enumerate())
                .map(|(l, lw)| {
                    LayerOps::new(ctx, lw, &acts, eps, n, &next_routers(l), fused_router)
                })
                .collect::<Result<Vec<_>, _>>()?;
            batches.push((layers, Head::new(ctx, &weights, &acts, eps, n)?));
        }
        Ok(GpuDecoder {
            id: IDS.fetch_add(1, Ordering::Relaxed),
            spec,
            embed: vault.tensor("model.embed_tokens.weight")?,
            step: ctx.step_buffer(),
            rope_scale: rope.scale(),
            readback: Readback::new(ctx, 4 * (LOGIT_ROWS * cfg.vocab_size) as u64),
            running: Mutex::new(Vec::with_capacity(T_MAX * cfg.hidden_size)),
            experts,
            streaming,
            profiling: Mutex::new(None),
            chain,
            kv_pool: Arc::default(),
            ctx: ctx.clone(),
            weights,
            acts,
            batches,
            cfg,
        })
    }

    /// A KV cache in GPU memory with the dispatches bound to it.
    fn kv(&self, capacity: usize) -> Result<GpuKv, EngineError> {
        let x = gpu::AttnCtx {
            ctx: &self.ctx,
            spec: &self.spec,
            w: &self.weights,
            a: &self.acts,
            step: &self.step,
            rope_scale: self.rope_scale,
        };
        if let Some(kv) = self.kv_pool.take(capacity) {
            return Ok(kv);
        }
        loop {
            let scope = self
                .ctx
                .device
                .push_error_scope(wgpu::ErrorFilter::OutOfMemory);
            let kv = GpuKv::new(&x, capacity, self.id, Arc::downgrade(&self.kv_pool));
            let Some(e) = pollster::block_on(scope.pop()) else {
                return kv;
            };
            // Out of memory: this cache is unusable (never pooled); the kept ones of finished
            // sequences are freed and the allocation tried once more.
            kv.map(GpuKv::discard).ok();
            if self.kv_pool.clear() == 0 {
                return Err(EngineError::Backend(format!(
                    "GPU: KV cache of {capacity} positions: {e} (lower --ctx or --max-concurrent)"
                )));
            }
        }
    }

    /// A sequence whose state will live in GPU memory (allocated at its first pass).
    pub fn new_state(&self, capacity: usize) -> SeqState {
        SeqState::on_gpu(self.spec.states(), capacity)
    }

    /// As `Decoder::forward`: logits (`[rows, vocab]`) for the positions `want` asks for.
    pub fn forward(
        &self,
        kv: &mut SeqState,
        tokens: &[u32],
        want: Logits,
    ) -> Result<Vec<f32>, EngineError> {
        let mut out = vec![];
        self.run(kv, tokens, End::Logits(want), &mut out)?;
        Ok(out)
    }

    /// Runs `tokens` and returns the most likely next token (ties to the lowest id, as
    /// `sampler::argmax`), chosen on the GPU: only its id is read back.
    pub fn forward_greedy(&self, kv: &mut SeqState, tokens: &[u32]) -> Result<u32, EngineError> {
        let mut out = vec![];
        self.run(kv, tokens, End::Greedy, &mut out)?
            .ok_or_else(|| EngineError::Invalid("no tokens to run".into()))
    }

    /// Checks that `tokens` fit `kv` and the vocabulary, and that `kv` is this model's GPU
    /// cache (creating its GPU side at the first pass).
    fn prepare(&self, kv: &mut SeqState, tokens: &[u32]) -> Result<(), EngineError> {
        let c = &self.cfg;
        kv.check_room(tokens.len())?;
        if let Some(&id) = tokens.iter().find(|&&id| id as usize >= c.vocab_size) {
            return Err(EngineError::TokenOutOfRange {
                id,
                vocab: c.vocab_size,
            });
        }
        match &kv.gpu {
            Some(g) if g.owner == self.id => {}
            Some(_) => {
                return Err(EngineError::Backend(
                    "this KV cache belongs to another model".into(),
                ))
            }
            None if !kv.is_empty() => {
                return Err(EngineError::Backend(
                    "this KV cache holds CPU state; create sessions from the GPU model".into(),
                ))
            }
            None => kv.gpu = Some(Box::new(self.kv(kv.capacity())?)),
        }
        Ok(())
    }

    fn run(
        &self,
        kv: &mut SeqState,
        tokens: &[u32],
        end: End,
        out: &mut Vec<f32>,
    ) -> Result<Option<u32>, EngineError> {
        self.prepare(kv, tokens)?;
        let gkv = kv.gpu.as_deref().expect("prepared");
        let mut rows = self.running.lock().unwrap_or_else(|e| e.into_inner());
        let started = Instant::now();
        let idle_from = self.disk_idle();
        let mut host = std::time::Duration::ZERO;
        let mut prof = self.profiling.lock().unwrap_or_else(|e| e.into_inner());
        let mut greedy = None;
        let mut done = 0;
        while done < tokens.len() {
            let mut n = gpu::piece_len(tokens.len() - done);
            // Streaming: a batch on the GEMM path runs its experts in rounds when they do not
            // fit the slots (`fill_in_rounds`), so a prompt chunk reads each expert once; a
            // smaller batch's experts must fit at once.
            if let Some(st) = &self.streaming {
                if n < GEMM_MIN {
                    n = n.min(st.max_piece);
                }
            }
            if end == End::Logits(Logits::All) {
                n = n.min(LOGIT_ROWS);
            }
            let last = done + n == tokens.len();
            self.write_inputs(&mut rows, &tokens[done..done + n], kv.len() + done);
            let q = &self.ctx.queue;
            let (layers, head) = &self.batches[n.trailing_zeros() as usize];
            // Streaming decode: through the layers whose experts sit in VRAM (`through`).
            let through = (self.streaming.as_ref().filter(|_| prof.is_none()))
                .and_then(|st| Some((st, st.through.as_ref()?)))
                .and_then(|(st, th)| Some((st, th, th.maps(n)?)));
            if let Some((st, th, maps)) = through {
                let ops = (&layers[..], head);
                let id =
                    self.run_through(st, th, maps, gkv, ops, n, (end, last), &mut host, out)?;
                greedy = id.or(greedy);
                done += n;
                continue;
            }
            // Resident: the whole pass is one submission. Streaming: one per MoE layer, each
            // ending at the router (`stop`); the next resumes at the layer's expert dispatches.
            let mut first = true;
            // Records layers `from..` (`resume`: layer `from` resumes at its experts) up to the
            // next stop, with the head when the pass ends there.
            let mut record = |from: usize, resume: bool| {
                let recording = Instant::now();
                let mut enc = self.ctx.encoder();
                let stop;
                {
                    let pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                        label: Some("forward"),
                        timestamp_writes: None,
                    });
                    let fine = prof.as_ref().is_some_and(|p| p.fine);
                    let ts = prof.as_mut().map(|p| &mut p.ts);
                    let mut r = Recorder::new(pass, ts, fine, first);
                    first = false;
                    stop = self.record_layers(&mut r, layers, gkv, n, from, resume, SUBMIT_LAYERS);
                    if stop == Stop::End {
                        record_head(head, &mut r, end, last);
                        r.end();
                    }
                }
                (enc, stop, recording.elapsed())
            };
            let mut next = record(0, false);
            let mut enc = loop {
                let (mut enc, stop, recorded) = next;
                host += recorded;
                match stop {
                    Stop::End => break enc,
                    Stop::Layer(from) => {
                        let submitting = Instant::now();
                        q.submit([enc.finish()]);
                        host += submitting.elapsed();
                        next = record(from, false);
                    }
                    Stop::Route(l) => {
                        let st = self
                            .streaming
                            .as_ref()
                            .expect("routes stop only when streaming");
                        let submitting = Instant::now();
                        let k = self.acts.d.k;
                        let bytes = 4 * (n * k) as u64;
                        st.ids.copy(&mut enc, &self.acts.ids, bytes);
                        let ahead = self.next_moe(l).filter(|_| !layers[l].lookahead.is_empty());
                        if ahead.is_some() {
                            st.ahead.copy(&mut enc, &self.acts.ahead[1], bytes);
                        }
                        q.submit([enc.finish()]);
                        host += submitting.elapsed();
                        // What follows the stop is recorded while the GPU runs up to it: the
                        // slot indices it reads are written (`write_buffer`) before its submit.
                        next = record(l, true);
                        let waiting = Instant::now();
                        let idle_waiting = self.disk_idle();
                        let read = |b: &[u8]| bytemuck::pod_collect_to_vec(b);
                        let ids: Vec<u32> = st.ids.read(&self.ctx, bytes, read)?;
                        if let Some(next) = ahead {
                            let guess: Vec<u32> = st.ahead.read(&self.ctx, bytes, read)?;
                            self.prefetch_guess(st, next, &guess);
                        }
                        let filling = Instant::now();
                        let idle_filling = self.disk_idle();
                        let used: Vec<usize> = ids.iter().map(|&e| e as usize).collect();
                        self.experts.note_uses(l, &used);
                        let ops = &layers[l];
                        let rounds = ops.expert_rounds.clone().map(|r| &ops.post[r]);
                        let slots = self.fill_stop(st, l, &ids, rounds)?;
                        st.gpu_wait_ns
                            .fetch_add(nanos(filling - waiting), Ordering::Relaxed);
                        st.fill_ns
                            .fetch_add(nanos(filling.elapsed()), Ordering::Relaxed);
                        let idle_filled = self.disk_idle();
                        add_idle(&st.idle_gpu_wait_ns, idle_waiting, idle_filling);
                        add_idle(&st.idle_fill_ns, idle_filling, idle_filled);
                        q.write_buffer(&self.acts.ids, 0, bytemuck::cast_slice(&slots));
                    }
                }
            };
            // The marks of every submission of this piece, resolved at once.
            if let Some(p) = prof.as_mut() {
                p.ts.resolve(&mut enc);
            }
            let bytes = self.copy_result(&mut enc, end, last, n);
            let submitting = Instant::now();
            q.submit([enc.finish()]);
            host += submitting.elapsed();
            greedy = self.read_result(end, bytes, out)?.or(greedy);
            if let Some(p) = prof.as_mut() {
                if bytes == 0 {
                    // Nothing was read back: wait for the GPU before reading the marks.
                    let _ = self.ctx.device.poll(wgpu::PollType::wait_indefinitely());
                }
                p.collect(&self.ctx, host);
            }
            done += n;
        }
        if let Some(p) = prof.as_mut() {
            p.acc.wall_ns += started.elapsed().as_nanos() as f64;
            p.acc.passes += 1;
        }
        kv.advance(tokens.len());
        if let Some(st) = &self.streaming {
            self.experts.tick();
            st.pass_ns
                .fetch_add(nanos(started.elapsed()), Ordering::Relaxed);
            add_idle(&st.idle_pass_ns, idle_from, self.disk_idle());
        }
        Ok(greedy)
    }

    /// The store's disk-idle clock (`Experts::disk_idle_s`; 0 when the experts are resident).
    fn disk_idle(&self) -> f64 {
        self.experts.disk_idle_s().unwrap_or(0.0)
    }

    /// Records the copy of what a pass of n tokens returns (`end`; `last`: its last piece) into
    /// the read-back buffer; returns its size (0: nothing).
    fn copy_result(&self, enc: &mut wgpu::CommandEncoder, end: End, last: bool, n: usize) -> u64 {
        let vocab = self.cfg.vocab_size;
        let (src, bytes) = match end {
            End::Logits(Logits::All) => (&self.acts.logits, 4 * (n * vocab) as u64),
            End::Logits(Logits::Last) if last => (&self.acts.logits, 4 * vocab as u64),
            End::Greedy if last => (&self.acts.argmax, 4),
            _ => (&self.acts.logits, 0),
        };
        if bytes > 0 {
            self.readback.copy(enc, src, bytes);
        }
        bytes
    }

    /// After the submission that copied it (`copy_result`): the greedy id, or the logits
    /// appended to `out`.
    fn read_result(
        &self,
        end: End,
        bytes: u64,
        out: &mut Vec<f32>,
    ) -> Result<Option<u32>, EngineError> {
        if bytes == 0 {
            return Ok(None);
        }
        if end == End::Greedy {
            return Ok(Some(self.readback.read(&self.ctx, 4, |b| {
                u32::from_le_bytes([b[0], b[1], b[2], b[3]])
            })?));
        }
        self.readback
            .read(&self.ctx, bytes, |b| gpu::extend_f32(out, b))?;
        Ok(None)
    }

    /// Records layers `from..` of a batch of n tokens until the pass's end, a submission
    /// boundary (every `submit_every` layers) or, streaming, an MoE layer's router. `resume`: layer `from`
    /// stopped at its router and continues at its experts.
    #[allow(clippy::too_many_arguments)]
    fn record_layers(
        &self,
        r: &mut Recorder,
        layers: &[LayerOps],
        gkv: &GpuKv,
        n: usize,
        from: usize,
        mut resume: bool,
        submit_every: usize,
    ) -> Stop {
        for (l, ops) in layers.iter().enumerate().skip(from) {
            if resume {
                resume = false;
                ops.experts().iter().for_each(|op| op.record(r));
            } else {
                let at_routes = match self.streaming {
                    Some(_) => AtRoutes::Stop {
                        lookahead: &ops.lookahead,
                    },
                    None => AtRoutes::Run,
                };
                if !ops.record(r, gkv, (n, l), at_routes) {
                    return Stop::Route(l);
                }
            }
            if (l + 1) % submit_every == 0 && l + 1 < layers.len() {
                return Stop::Layer(l + 1);
            }
        }
        Stop::End
    }

    /// Greedy decoding one pass ahead of the host. Feeds `first` (the token just chosen), then
    /// each token the GPU chooses: pass i + 1 gathers its input from pass i's argmax on the GPU
    /// and is queued before the host reads pass i's id, so wgpu's recording and submission of
    /// a pass (≈ 1.8 ms per token on an H200 for Qwen3-30B-A3B shapes) overlap the previous
    /// pass instead of leaving the GPU idle. `on_token` receives each chosen id in order and
    /// says whether to go on; at most `max_tokens` ids are produced, and `kv` advances by one
    /// position per id produced (a pass queued ahead of a `false` is discarded: it wrote only
    /// the KV position past the sequence's end). Returns the ids fed, in order.
    ///
    /// `None` (nothing run) where a chain cannot run: streaming (the host fills expert slots
    /// at every router), an embedding not on the GPU, or while profiling.
    pub fn decode_greedy(
        &self,
        kv: &mut SeqState,
        first: u32,
        max_tokens: usize,
        on_token: &mut dyn FnMut(u32) -> Result<bool, EngineError>,
    ) -> Result<Option<Vec<u32>>, EngineError> {
        let profiling = self.profiling.lock().unwrap_or_else(|e| e.into_inner());
        // A pass queued ahead of the host's `false` writes one position past the sequence's
        // end, which `SeqState::rewind` forgets only where every layer's state is truncatable.
        let chain = (self.chain()).filter(|_| profiling.is_none() && kv.truncatable());
        drop(profiling);
        let Some(chain) = chain else {
            return Ok(None);
        };
        let mut fed = vec![];
        if max_tokens == 0 || kv.check_room(1).is_err() {
            return Ok(Some(fed));
        }
        // The checks and KV cache set-up of a normal pass, with the first token.
        self.prepare(kv, &[first])?;
        // (Out of the state while the chain runs, so the state can count the positions.)
        let gpu = kv.gpu.take().expect("prepared");
        let (start, capacity) = (kv.len(), kv.capacity());
        let mut produced = 0;
        let mut chain_run = || -> Result<(), EngineError> {
            let gkv = &*gpu;
            let mut rows = self.running.lock().unwrap_or_else(|e| e.into_inner());
            let mut queued = std::collections::VecDeque::new();
            self.write_inputs(&mut rows, &[first], start);
            queued.push_back(self.chain_pass(chain, gkv, true, 0)?);
            fed.push(first);
            while let Some(idx) = queued.pop_front() {
                // Queue the next pass (its input is this one's argmax) unless the budget or the
                // cache says this pass is the last.
                let ahead = produced + 1 < max_tokens && start + fed.len() < capacity;
                if ahead {
                    let pass = fed.len();
                    self.ctx.write_step(&self.step, (start + pass) as u32);
                    queued.push_back(self.chain_pass(chain, gkv, false, pass % 2)?);
                }
                let id = chain.ids[produced % 2].read_after(&self.ctx, Some(idx), 4, |b| {
                    u32::from_le_bytes([b[0], b[1], b[2], b[3]])
                })?;
                produced += 1;
                if !on_token(id)? {
                    break;
                }
                if ahead {
                    fed.push(id);
                }
            }
            Ok(())
        };
        let ran = chain_run();
        kv.gpu = Some(gpu);
        kv.advance(produced);
        ran?;
        Ok(Some(fed))
    }

    /// Streaming: whether decode batches run through the MoE layers whose experts sit in VRAM
    /// (`through`, the default; `Tuning::run_through` false starts with it off) or stop at every
    /// router as prompt batches do. For tests and measurements.
    pub fn set_run_through(&self, on: bool) {
        if let Some(th) = self.streaming.as_ref().and_then(|s| s.through.as_ref()) {
            th.on.store(on, Ordering::Relaxed);
        }
    }

    /// Streaming: whether decode copies into later MoE layers' slots, ahead of them, the
    /// experts they are expected to choose whose blobs are in host memory (`through`, the default;
    /// `Tuning::fill_ahead` false starts with it off). For tests and measurements.
    pub fn set_fill_ahead(&self, on: bool) {
        if let Some(th) = self.streaming.as_ref().and_then(|s| s.through.as_ref()) {
            th.fill_ahead.store(on, Ordering::Relaxed);
        }
    }

    /// Streaming: how many MoE layers after a halted decode layer a speculative pass looks
    /// ahead while that layer's misses are read (`through`; 0 turns it off; the default is 2 on
    /// a discrete GPU, 0 on unified memory; `Tuning::speculate` sets it at load). For tests
    /// and measurements.
    pub fn set_speculate(&self, depth: usize) {
        if let Some(th) = self.streaming.as_ref().and_then(|s| s.through.as_ref()) {
            th.depth.store(depth, Ordering::Relaxed);
        }
    }

    /// Whether `decode_greedy` runs chains (resident, embedding on the GPU).
    pub fn chains_greedy(&self) -> bool {
        self.chain().is_some()
    }

    /// The chain's parts, where chains run: resident only (streaming needs the host at every
    /// router).
    fn chain(&self) -> Option<&Chain> {
        self.chain.as_ref().filter(|_| self.streaming.is_none())
    }

    /// Writes the embedding rows of `tokens` (dequantized on the host into `rows`) as a pass's
    /// input, and its first position.
    fn write_inputs(&self, rows: &mut Vec<f32>, tokens: &[u32], pos: usize) {
        let (h, embed) = (self.cfg.hidden_size, mat(&self.embed));
        rows.resize(tokens.len() * h, 0.0);
        for (row, &id) in rows.chunks_exact_mut(h).zip(tokens) {
            smoe_vault::quant::dequantize_row(embed.dtype, embed.row(id as usize), row);
        }
        self.ctx
            .queue
            .write_buffer(&self.acts.x, 0, bytemuck::cast_slice(&rows[..]));
        self.ctx.write_step(&self.step, pos as u32);
    }

    /// One single-token pass of a greedy chain, as one submission (the position is written):
    /// its input was written by the host (`from_host`), or is gathered on the GPU from the
    /// previous pass's argmax; its own argmax is copied into `chain.ids[slot]`.
    fn chain_pass(
        &self,
        chain: &Chain,
        gkv: &GpuKv,
        from_host: bool,
        slot: usize,
    ) -> Result<wgpu::SubmissionIndex, EngineError> {
        let (layers, head) = &self.batches[0];
        let mut enc = self.ctx.encoder();
        {
            let pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: Some("forward"),
                timestamp_writes: None,
            });
            let mut r = Recorder::new(pass, None, false, false);
            if !from_host {
                r.step("embedding", &chain.gather);
            }
            // Whole: no submission boundaries, and no router stops (chains are resident).
            let stop = self.record_layers(&mut r, layers, gkv, 1, 0, false, usize::MAX);
            if stop != Stop::End {
                return Err(EngineError::Backend(
                    "GPU: a greedy chain's pass stopped before its end".into(),
                ));
            }
            head.record_last(&mut r, true);
        }
        chain.ids[slot].copy(&mut enc, &self.acts.argmax, 4);
        Ok(self.ctx.queue.submit([enc.finish()]))
    }

    /// The first MoE layer after `l`.
    fn next_moe(&self, l: usize) -> Option<usize> {
        self.cfg.moe_layers().find(|&m| m > l)
    }

    /// Starts timing the following forward passes on the GPU (timestamp queries): every step
    /// (`fine`), or each pass as a whole. An error when the adapter cannot write timestamps
    /// inside compute passes.
    pub fn profile_start(&self, fine: bool) -> Result<(), EngineError> {
        let ts = Timestamps::new(&self.ctx).ok_or_else(|| {
            EngineError::Backend(
                "GPU: this adapter cannot write timestamps inside compute passes".into(),
            )
        })?;
        *self.profiling.lock().unwrap_or_else(|e| e.into_inner()) = Some(Profiling {
            ts,
            acc: GpuProfile::default(),
            fine,
        });
        Ok(())
    }

    /// Stops profiling and returns what was measured since `profile_start`.
    pub fn profile_take(&self) -> Option<GpuProfile> {
        let p = self
            .profiling
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        p.map(|p| p.acc)
    }

    /// GPU KV caches kept for reuse (dropped sequences' caches; see `gpu::KvPool`).
    pub fn kept_kv_caches(&self) -> usize {
        self.kv_pool.len()
    }
}
