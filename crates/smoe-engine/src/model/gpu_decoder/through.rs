//! Streaming decode without a host round trip at every MoE layer: the GPU keeps a copy of the
//! host's slot table (expert → VRAM slot, per layer) and maps each router's choice to slots
//! itself (`SlotMap`). A window of layers runs as one submission whose dispatches launch
//! indirectly; the first MoE layer that chooses an expert no slot holds halts it (its slot map
//! zeroes the launch counts of everything after it) and the host reads which layer that was,
//! fills the slots as at a router stop, and resumes the pass at that layer's experts. A layer
//! whose lookahead guesses an expert of the next MoE layer that no slot holds halts too, so the
//! host starts that read as at a stop (running through it measured 11 % slower at a 25 %
//! budget: the next layer's misses went unguessed); with a lookahead top of r, only for one
//! of a token's r best-ranked guesses, the ones the host reads. A token whose experts and
//! guesses all sit in VRAM costs one round trip per window instead of one per MoE layer.
//!
//! While the host reads a halted layer's misses the GPU would idle, so it runs a speculative
//! pass instead (`speculate`): the layer's experts with the missing ones left out (slot map
//! `SlotMapBufs::spec`: router weight 0), then the next layers up to the router of the
//! `depth`-th MoE layer after it, on a saved copy of the state the resume needs (restored at its
//! end). Their routers see the residual short only of the missing experts' share — a far better
//! guess of the experts they will choose than the lookahead's, which lacks this layer's whole
//! MoE output and the next attention — and the host starts reading those guesses at once, so
//! the disk keeps reading what the next layers need while the GPU and the host work through
//! the current one. It runs only when some miss must still come from the disk (else the resume
//! would wait behind it), and changes nothing but which reads start early.
//!
//! Fill-ahead: the experts later layers are expected to choose (a replayed trace's, or the
//! guesses') whose blobs are in host memory already go into those layers' slots before the
//! layers run — at a halt for the rest of the resumed window, and while the GPU runs a window
//! for the layers outside it (their slot buffers are in no submission in flight) — so a layer
//! whose reads were started early need not halt only to have them copied.
//!
//! The next window is recorded while the GPU runs the current one and submitted once the
//! current one is known to have run through (two sets of launch counts, by window parity).
//! While the decoder is profiling (`--breakdown`) decode takes the stop at every MoE layer
//! instead: its timestamps mark every step of one submission.

use super::streaming::{distinct, Streaming};
use super::{add_idle, nanos, record_head, End, GpuDecoder};
use crate::error::EngineError;
use crate::gpu::{
    Acts, AtRoutes, GpuKv, Head, LayerOps, Op, Readback, Recorder, AHEAD_MAX, GEMM_MIN, T_MAX,
};
use crate::store::{Lookahead, Recall};
use crate::tuning::RouteOracle;
use smoe_compute::gpu::{
    wgpu, BufRef, GpuContext, IndirectArgs, SlotGuess, SlotMap, SlotMapBufs, NO_SLOT,
};
use smoe_vault::ModelConfig;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Layers per submission (a window); windows start at multiples of it. (H200, q4 30B-A3B
/// shapes, 96 tokens: 4, 8 and 16 decoded within the disk's run-to-run spread at 25 % and 50 %
/// budgets.)
const WINDOW: usize = 8;

/// The largest batch that runs through (decode and short pieces; the slot maps and `chosen`
/// are sized for it).
const MAX_N: usize = GEMM_MIN / 2;

/// Dispatches one window can record (a Qwen3-MoE layer records ~8 for a decode batch; the
/// head a few more).
const WINDOW_DISPATCHES: usize = 64 * WINDOW + 64;

/// MoE layers after a halted one whose choice a speculative pass shows, by default (discrete
/// GPUs; `Tuning::speculate` or `GpuDecoder::set_speculate` set it, 0 turns it off).
pub(super) const SPEC_DEPTH: usize = 2;

/// What running through needs on the GPU, beside `Streaming`.
pub(super) struct Through {
    /// `[layers][experts]` u32: the slot holding each expert, or `NO_SLOT` (the host's table,
    /// written after every fill).
    table: wgpu::Buffer,
    experts: usize,
    /// `[layers][MAX_N·k]`: each MoE layer's chosen expert ids, for the host.
    chosen: wgpu::Buffer,
    /// `[0]`: 1 + the layer that halted the pass, or 0.
    status: wgpu::Buffer,
    /// Launch counts by window parity.
    args: Mutex<[IndirectArgs; 2]>,
    /// Per batch size (index log2 n, up to `MAX_N`) and layer: the slot map of MoE layers.
    maps: Vec<Vec<Option<Op>>>,
    /// The same, speculative (misses left out, never halting).
    spec_maps: Vec<Vec<Option<Op>>>,
    /// A speculative pass's copies of the state a resume reads: x, hn and the router weights.
    saved: [wgpu::Buffer; 3],
    /// A speculative pass's chosen ids (`chosen`).
    spec_readback: Readback,
    /// MoE layers a speculative pass looks ahead; 0: none.
    pub(super) depth: AtomicUsize,
    /// Status, chosen ids and the lookahead's guess of the last window.
    readback: Readback,
    /// Off: every MoE layer stops for the host, as prompt batches do (`set_run_through`).
    pub(super) on: AtomicBool,
    /// Copy into later layers' slots the experts expected there whose blobs are in host
    /// memory, at halts and while the GPU runs a window (`fill_ahead`; `Tuning::fill_ahead`
    /// or `set_fill_ahead` turn it off).
    pub(super) fill_ahead: AtomicBool,
    /// Routing known ahead, a measurement (`Tuning::route_oracle`).
    oracle: Option<Arc<dyn RouteOracle>>,
}

/// Byte layout of `Through::readback`: status (16 bytes), chosen ids, lookahead ids.
fn chosen_bytes(cfg: &ModelConfig) -> u64 {
    4 * (cfg.num_layers * MAX_N * cfg.num_experts_per_tok.max(1)) as u64
}

impl Through {
    /// `max_piece`: the largest batch whose experts always fit the slots; `spec_depth`: MoE
    /// layers a speculative pass looks ahead (0: none); `lookahead`: a slot map halts only for
    /// each token's kept best-ranked guesses (`Lookahead::keep`); `oracle`: routing known ahead, to
    /// record or replay (replaying, no layer halts for a lookahead guess: the oracle's reads
    /// replace those guesses).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn new(
        ctx: &GpuContext,
        cfg: &ModelConfig,
        acts: &Acts,
        max_piece: usize,
        spec_depth: usize,
        lookahead: Lookahead,
        oracle: Option<Arc<dyn RouteOracle>>,
        tuning: &crate::Tuning,
    ) -> Result<Self, EngineError> {
        let guesses = !oracle.as_ref().is_some_and(|o| o.replays());
        let k = cfg.num_experts_per_tok.max(1);
        let buf = |label: &str, bytes: u64, usage: wgpu::BufferUsages| {
            ctx.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some(label),
                size: bytes.max(16).next_multiple_of(16),
                usage: wgpu::BufferUsages::STORAGE | usage,
                mapped_at_creation: false,
            })
        };
        let experts = cfg.num_experts;
        let table = buf(
            "slot table",
            4 * (cfg.num_layers * experts) as u64,
            wgpu::BufferUsages::COPY_DST,
        );
        let none = vec![NO_SLOT; cfg.num_layers * experts];
        ctx.queue
            .write_buffer(&table, 0, bytemuck::cast_slice(&none));
        let chosen = buf(
            "chosen experts",
            chosen_bytes(cfg),
            wgpu::BufferUsages::COPY_SRC,
        );
        let status = buf(
            "halt status",
            16,
            wgpu::BufferUsages::COPY_SRC | wgpu::BufferUsages::COPY_DST,
        );
        let args = [0, 1].map(|_| IndirectArgs::new(ctx, WINDOW_DISPATCHES));
        let (mut maps, mut spec_maps) = (vec![], vec![]);
        for n in crate::gpu::batch_sizes() {
            if n > MAX_N.min(max_piece) {
                break;
            }
            let layer_maps = |spec: bool| {
                (0..cfg.num_layers)
                    .map(|l| {
                        if !cfg.moe_layers().any(|m| m == l) {
                            return Ok(None);
                        }
                        // The lookahead (`LayerOps::lookahead`) guesses the next MoE layer's.
                        let next = (cfg.moe_layers().find(|&m| m > l)).filter(|_| !spec && guesses);
                        let b = SlotMapBufs {
                            ids: BufRef::new(&acts.ids),
                            table: &table,
                            chosen: &chosen,
                            args: &args[(l / WINDOW) % 2],
                            status: &status,
                            guess: next.map(|layer| SlotGuess {
                                ids: BufRef::new(&acts.ahead[1]),
                                layer,
                                per_token: k,
                                keep: lookahead.keep(k),
                            }),
                            spec: spec.then(|| BufRef::new(&acts.rw)),
                        };
                        // `chosen` rows are `MAX_N·k` wide whatever n is.
                        let map = SlotMap::new(ctx, &b, l, experts, n * k, MAX_N * k)
                            .map_err(crate::gpu::gpu_err)?;
                        Ok(Some(Op::new("slot map", map)))
                    })
                    .collect::<Result<Vec<_>, EngineError>>()
            };
            maps.push(layer_maps(false)?);
            spec_maps.push(layer_maps(true)?);
        }
        let h = acts.d.h;
        let saved = [MAX_N * h, MAX_N * h, MAX_N * k]
            .map(|len| ctx.storage_buffer("saved", 4 * len as u64));
        let ahead = 4 * (AHEAD_MAX * MAX_N * k) as u64;
        Ok(Through {
            readback: Readback::new(ctx, 16 + chosen_bytes(cfg) + ahead),
            table,
            experts,
            chosen,
            status,
            args: Mutex::new(args),
            maps,
            spec_maps,
            saved,
            spec_readback: Readback::new(ctx, chosen_bytes(cfg)),
            depth: AtomicUsize::new(spec_depth),
            on: AtomicBool::new(tuning.run_through),
            fill_ahead: AtomicBool::new(tuning.fill_ahead),
            oracle,
        })
    }

    /// Whether a routing trace is replayed: its reads replace the lookahead's guesses.
    fn replays(&self) -> bool {
        self.oracle.as_ref().is_some_and(|o| o.replays())
    }

    /// The slot maps of a batch of n tokens (a power of two), where such a batch runs through.
    pub(super) fn maps(&self, n: usize) -> Option<&[Option<Op>]> {
        let maps = self.maps.get(n.trailing_zeros() as usize)?;
        self.on.load(Ordering::Relaxed).then_some(&maps[..])
    }

    /// Copies layer `l`'s row of the host's slot table to the GPU (ordered before the next
    /// submission).
    pub(super) fn write_row(&self, ctx: &GpuContext, l: usize, slot_of: &[Option<u32>]) {
        let row: Vec<u32> = (slot_of.iter()).map(|s| s.unwrap_or(NO_SLOT)).collect();
        let at = 4 * (l * self.experts) as u64;
        ctx.queue
            .write_buffer(&self.table, at, bytemuck::cast_slice(&row));
    }
}

/// Records layer `l` of a pass that maps its router's choice to slots on the GPU (`map`, MoE
/// layers; `LayerOps::record`): attention, the router, `lookahead`, the map and, with `experts`,
/// the experts and what follows them; a layer without a map records all of it.
fn record_layer(
    r: &mut Recorder,
    (ops, gkv, n, l): (&LayerOps, &GpuKv, usize, usize),
    map: Option<&Op>,
    lookahead: &[Op],
    experts: bool,
) {
    let at_routes = match map {
        Some(map) => AtRoutes::Map {
            lookahead,
            map,
            experts,
        },
        None => AtRoutes::Run,
    };
    ops.record(r, gkv, (n, l), at_routes);
}

/// What one window's submission read back.
struct Ran {
    /// The MoE layer that halted the window, if one did.
    halted: Option<usize>,
    /// `[layers][MAX_N·k]` chosen ids.
    chosen: Vec<u32>,
    /// The lookahead router's ids at the halted layer (else the window's last MoE layer):
    /// `[ahead_depth][MAX_N·k]`, the j-th next MoE layer's in row j.
    guess: Vec<u32>,
}

impl GpuDecoder {
    /// Runs a streaming batch of n ≤ `MAX_N` tokens through its layers (module doc), with the
    /// head `end` asks for (`last`: the caller's last piece). Returns the greedy id, or appends
    /// the logits to `out`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn run_through(
        &self,
        st: &Streaming,
        th: &Through,
        maps: &[Option<Op>],
        gkv: &GpuKv,
        (layers, head): (&[LayerOps], &Head),
        n: usize,
        (end, last): (End, bool),
        host: &mut Duration,
        out: &mut Vec<f32>,
    ) -> Result<Option<u32>, EngineError> {
        let q = &self.ctx.queue;
        let k = self.acts.d.k;
        let row = MAX_N * k;
        let chosen_len = chosen_bytes(&self.cfg);
        let mut args = th.args.lock().unwrap_or_else(|e| e.into_inner());
        // Records the window that starts at layer `from` (`resume`: at its experts).
        let record = |args: &mut [IndirectArgs; 2], from: usize, resume: bool| {
            let recording = Instant::now();
            let to = ((from / WINDOW + 1) * WINDOW).min(layers.len());
            let mut enc = self.ctx.encoder();
            {
                let pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                    label: Some("forward, through"),
                    timestamp_writes: None,
                });
                let mut r = Recorder::through(pass, &mut args[(from / WINDOW) % 2]);
                for (l, ops) in layers.iter().enumerate().take(to).skip(from) {
                    if resume && l == from {
                        ops.experts().iter().for_each(|op| op.record(&mut r));
                        continue;
                    }
                    let lookahead = &ops.lookahead[..];
                    record_layer(&mut r, (ops, gkv, n, l), maps[l].as_ref(), lookahead, true);
                }
                if to == layers.len() {
                    record_head(head, &mut r, end, last);
                }
                r.end();
            }
            th.readback.copy_at(&mut enc, &th.status, 0, 16);
            th.readback.copy_at(&mut enc, &th.chosen, 16, chosen_len);
            for j in 0..st.lookahead.depth {
                let from = 4 * (j * T_MAX * k) as u64;
                let at = 16 + chosen_len + 4 * (j * row) as u64;
                let ids = (&self.acts.ahead[1], from);
                th.readback.copy_from(&mut enc, ids, at, 4 * row as u64);
            }
            let bytes = match to == layers.len() {
                true => self.copy_result(&mut enc, end, last, n),
                false => 0,
            };
            (enc, (from, resume, to), bytes, recording.elapsed())
        };
        q.write_buffer(&th.status, 0, &[0; 16]);
        // Guesses the host read from, scored once their layer has run: (layer, ids, speculative).
        let mut guesses: Vec<(usize, Vec<u32>, bool)> = vec![];
        let mut next = record(&mut args, 0, false);
        // The window after `next`, when it was recorded before `next` (a resumed window).
        let mut following = None;
        loop {
            let (enc, (from, resume, to), bytes, recorded) = next;
            let submitting = Instant::now();
            args[(from / WINDOW) % 2].upload(q);
            q.submit([enc.finish()]);
            *host += recorded + submitting.elapsed();
            // The next window is recorded while the GPU runs this one, and the experts that
            // layers outside it are expected to choose go into their slots where their blobs
            // are in host memory (their slot buffers are not in flight).
            let ahead = match following.take() {
                Some(a) => Some(a),
                None => (to < layers.len()).then(|| record(&mut args, to, false)),
            };
            let outside = |m: usize| !(from..to).contains(&m);
            self.fill_ahead(st, &self.expected(th, &guesses, outside))?;
            let waiting = Instant::now();
            let idle_waiting = self.disk_idle();
            let guessed = 4 * (st.lookahead.depth * row) as u64;
            let ran = th
                .readback
                .read(&self.ctx, 16 + chosen_len + guessed, |b| {
                    let words: &[u32] = bytemuck::cast_slice(b);
                    let chosen_end = 4 + chosen_len as usize / 4;
                    Ran {
                        halted: (words[0] as usize).checked_sub(1),
                        chosen: words[4..chosen_end].to_vec(),
                        guess: words[chosen_end..].to_vec(),
                    }
                })?;
            st.gpu_wait_ns
                .fetch_add(nanos(waiting.elapsed()), Ordering::Relaxed);
            let idle_waited = self.disk_idle();
            add_idle(&st.idle_gpu_wait_ns, idle_waiting, idle_waited);
            let ids_of = |l: usize| &ran.chosen[l * row..l * row + n * k];
            // The MoE layers whose experts ran from VRAM without the host (a resumed layer
            // was counted at its stop).
            let through_to = ran.halted.unwrap_or(to);
            let ran_through =
                || (from..through_to).filter(|&l| maps[l].is_some() && !(resume && l == from));
            for l in ran_through() {
                self.ran_through(st, l, ids_of(l))?;
            }
            for l in ran_through().chain(ran.halted) {
                if let Some(o) = &th.oracle {
                    o.used(l, ids_of(l))?;
                }
                self.score_guesses(st, &mut guesses, l, ids_of(l));
            }
            self.oracle_reads(st, th, ran.halted.map(|l| (l, ids_of(l))));
            // The lookahead's guesses for the MoE layers after `l` (row j: the j-th), none where
            // `l` made none or the oracle guesses.
            let ahead_of = |l: usize| -> Vec<(usize, Vec<u32>)> {
                if layers[l].lookahead.is_empty() || th.replays() {
                    return vec![];
                }
                let next = self
                    .cfg
                    .moe_layers()
                    .filter(|&m| m > l)
                    .take(st.lookahead.depth);
                let row_of = |j: usize| ran.guess[j * row..j * row + n * k].to_vec();
                next.enumerate().map(|(j, m)| (m, row_of(j))).collect()
            };
            if ran.halted.is_none() && st.lookahead.depth > 1 {
                // A window that ran through: its last MoE layer's deeper guesses (its next
                // layer's all sit in VRAM, or it would have halted).
                let last = (from..to)
                    .rev()
                    .find(|&l| maps[l].is_some() && !(resume && l == from));
                // (Started at once: no needed read is being queued.)
                for (m, guess) in last.map_or(vec![], ahead_of).into_iter().skip(1) {
                    self.experts.prefetch(m, &self.guessed_reads(st, m, &guess));
                }
            }
            let Some(l) = ran.halted else {
                match ahead {
                    Some(a) => {
                        next = a;
                        continue;
                    }
                    None => return self.read_result(end, bytes, out),
                }
            };
            // Halted at layer l: what its router chose, the next MoE layer's guess, slots. The
            // window recorded ahead still follows the resumed one (it reads the slot table and
            // ids when it runs, and uses the other set of launch counts).
            following = ahead;
            let filling = Instant::now();
            let idle_filling = self.disk_idle();
            let ids = ids_of(l).to_vec();
            let used: Vec<usize> = ids.iter().map(|&e| e as usize).collect();
            // While this layer's misses are read, a speculative pass shows what the next layers
            // will choose (a better guess than the lookahead's, which then goes unused).
            let spec = self.speculate(st, th, gkv, layers, n, l, &ids);
            let ahead = ahead_of(l);
            if let Some((next_moe, guess)) = ahead.first() {
                guesses.push((*next_moe, guess.clone(), false));
            }
            // The lookahead's guesses beyond the layers a speculative pass shows.
            let deep = &ahead[spec.as_ref().map_or(0, |s| s.layers.len()).min(ahead.len())..];
            self.experts.note_uses(l, &used);
            // What the rest of the resumed window's layers are expected to choose: the ones
            // already in host memory go into their slots at this halt too, so those layers need
            // not halt for a copy. (Later layers' are placed while the resumed window runs.)
            let wants = self.expected(th, &guesses, |m| m > l && m < to);
            // The resumed window is recorded while the slots fill (it reads the ids written
            // below when it runs). The fill maps this layer's slots, which a speculative pass
            // reads: it waits for that pass anyway, and starts its guesses' reads first.
            let counts: &mut [IndirectArgs; 2] = &mut args;
            let (resumed, filled) = rayon::join(
                || record(counts, l, true),
                || {
                    let spec = match spec {
                        Some(spec) => self.spec_guesses(st, th, spec, n)?,
                        None => vec![],
                    };
                    for (m, guess) in deep {
                        self.prefetch_guess(st, *m, guess);
                    }
                    let slots = self.fill_stop(st, l, &ids, None)?;
                    self.fill_ahead(st, &wants)?;
                    Ok::<_, EngineError>((spec, slots))
                },
            );
            let (spec, slots) = filled?;
            guesses.extend(spec.into_iter().map(|(m, ids)| (m, ids, true)));
            st.fill_ns
                .fetch_add(nanos(filling.elapsed()), Ordering::Relaxed);
            add_idle(&st.idle_fill_ns, idle_filling, self.disk_idle());
            q.write_buffer(&self.acts.ids, 0, bytemuck::cast_slice(&slots));
            q.write_buffer(&th.status, 0, &[0; 16]);
            next = resumed;
        }
    }
}

/// A submitted speculative pass: its submission, and the MoE layers whose choice it shows.
struct Spec {
    index: wgpu::SubmissionIndex,
    layers: Vec<usize>,
}

impl GpuDecoder {
    /// At a halt at MoE layer `l`, whose router chose `ids` (n tokens): if any expert the layer
    /// misses must still come from the disk, starts those reads (as needed ones: the fill that
    /// waits for them starts only after this pass) and submits a speculative pass
    /// (module doc) over the next `depth` MoE layers. The pass saves x, hn and the router
    /// weights first and restores them last, so the resume that follows it on the queue starts
    /// from the halted state.
    #[allow(clippy::too_many_arguments)]
    fn speculate(
        &self,
        st: &Streaming,
        th: &Through,
        gkv: &GpuKv,
        layers: &[LayerOps],
        n: usize,
        l: usize,
        ids: &[u32],
    ) -> Option<Spec> {
        let depth = th.depth.load(Ordering::Relaxed);
        let maps = th.spec_maps.get(n.trailing_zeros() as usize)?;
        let map = maps[l].as_ref()?;
        let ahead: Vec<usize> = (self.cfg.moe_layers())
            .filter(|&m| m > l)
            .take(depth)
            .collect();
        let &last = ahead.last()?;
        let disk = self.experts.pending(l, &st.missing(l, ids));
        if disk.is_empty() {
            return None;
        }
        self.experts.fetch_early(l, &disk);
        let d = self.acts.d;
        let live = [&self.acts.x, &self.acts.hn, &self.acts.rw];
        let bytes = [n * d.h, n * d.h, n * d.k].map(|len| 4 * len as u64);
        let mut enc = self.ctx.encoder();
        for ((from, to), b) in live.iter().zip(&th.saved).zip(bytes) {
            enc.copy_buffer_to_buffer(from, 0, to, 0, b);
        }
        {
            let pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: Some("forward, speculative"),
                timestamp_writes: None,
            });
            let mut r = Recorder::new(pass, None, false, false);
            map.record(&mut r);
            layers[l].experts().iter().for_each(|op| op.record(&mut r));
            for (m, ops) in layers.iter().enumerate().take(last + 1).skip(l + 1) {
                record_layer(&mut r, (ops, gkv, n, m), maps[m].as_ref(), &[], m < last);
            }
            r.end();
        }
        for ((to, from), b) in live.iter().zip(&th.saved).zip(bytes) {
            enc.copy_buffer_to_buffer(from, 0, to, 0, b);
        }
        th.spec_readback
            .copy(&mut enc, &th.chosen, chosen_bytes(&self.cfg));
        let index = self.ctx.queue.submit([enc.finish()]);
        st.spec_runs.fetch_add(1, Ordering::Relaxed);
        Some(Spec {
            index,
            layers: ahead,
        })
    }

    /// The experts the MoE layers that `keep` names are expected to choose, for `fill_ahead`:
    /// a replayed trace's next ones (up to a layer's next use), else the guesses not yet scored
    /// (the lookahead's and the speculative passes'). Nothing when fill-ahead is off.
    fn expected(
        &self,
        th: &Through,
        guesses: &[(usize, Vec<u32>, bool)],
        keep: impl Fn(usize) -> bool,
    ) -> Vec<(usize, Vec<u32>)> {
        match (th.fill_ahead.load(Ordering::Relaxed), &th.oracle) {
            (false, _) => vec![],
            (true, Some(o)) if th.replays() => {
                o.ahead().into_iter().filter(|e| keep(e.0)).collect()
            }
            (true, _) => (guesses.iter())
                .filter(|g| keep(g.0))
                .map(|g| (g.0, g.1.clone()))
                .collect(),
        }
    }

    /// Replaying a routing trace: starts reading the experts that the trace's next MoE layers
    /// choose and that no VRAM slot holds, as needed reads — after the `halted` layer's own
    /// misses, which go first.
    fn oracle_reads(&self, st: &Streaming, th: &Through, halted: Option<(usize, &[u32])>) {
        let Some(o) = th.oracle.as_ref().filter(|_| th.replays()) else {
            return;
        };
        if let Some((l, ids)) = halted {
            self.experts.fetch_early(l, &st.missing(l, ids));
        }
        // (Up to the halted layer's next use: its fill, still to come, would drop those reads.)
        let halted_layer = halted.map(|h| h.0);
        for (m, ids) in o
            .ahead()
            .into_iter()
            .take_while(|e| Some(e.0) != halted_layer)
        {
            let started = self.experts.fetch_early(m, &st.missing(m, &ids));
            (st.oracle_reads).fetch_add(started as u64, Ordering::Relaxed);
        }
    }

    /// Scores the guesses for MoE layer `l` against the `ids` it chose, and drops them: the
    /// lookahead router's in the store's lookahead recall, a speculative pass's in
    /// `SlotStats::spec_recall`.
    fn score_guesses(
        &self,
        st: &Streaming,
        guesses: &mut Vec<(usize, Vec<u32>, bool)>,
        l: usize,
        ids: &[u32],
    ) {
        if !guesses.iter().any(|g| g.0 == l) {
            return;
        }
        let used = distinct(ids);
        guesses.retain(|(m, guess, spec)| {
            if *m != l {
                return true;
            }
            let r = Recall::of(guess, &used);
            match spec {
                false => self.experts.note_lookahead(l, r),
                true => (st.spec_scores.lock().unwrap_or_else(|e| e.into_inner())).add(r),
            }
            false
        });
    }

    /// Waits for a speculative pass and starts reading the experts it chose that no VRAM slot
    /// of their layer holds (as lookahead guesses: after any read a layer waits for). Returns
    /// each layer's guessed ids.
    fn spec_guesses(
        &self,
        st: &Streaming,
        th: &Through,
        spec: Spec,
        n: usize,
    ) -> Result<Vec<(usize, Vec<u32>)>, EngineError> {
        let row = MAX_N * self.acts.d.k;
        let bytes = chosen_bytes(&self.cfg);
        let chosen = (th.spec_readback).read_after(&self.ctx, Some(spec.index), bytes, |b| {
            bytemuck::cast_slice::<u8, u32>(b).to_vec()
        })?;
        let mut guessed = vec![];
        for m in spec.layers {
            let ids = &chosen[m * row..m * row + n * self.acts.d.k];
            let started = self.experts.prefetch(m, &st.missing(m, ids));
            (st.spec_guesses).fetch_add(started as u64, Ordering::Relaxed);
            guessed.push((m, ids.to_vec()));
        }
        Ok(guessed)
    }
}
