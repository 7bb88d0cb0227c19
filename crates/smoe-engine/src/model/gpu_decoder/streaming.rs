//! GPU expert streaming (`--expert-cache` below resident): VRAM expert slots per MoE layer,
//! filled at each MoE layer's router stop from the streaming store — misses, lookahead guesses,
//! rounds of experts for prompt batches that outnumber the slots, the profile preload — and
//! what the host's time at the stops went to (`SlotStats`).

use super::through::Through;
use super::{add_idle, nanos, GpuDecoder};
use crate::error::EngineError;
use crate::gpu::{LayerOps, Op, Readback, Recorder, SlotWriter, T_MAX};
use crate::store::{Lookahead, PieceSink, ReadTarget, Recall};
use smoe_compute::gpu::{wgpu, ClockHold, GpuContext};
use smoe_vault::ModelConfig;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// GPU expert streaming. Per MoE layer the GPU holds `slots` expert blobs (at the blob stride);
/// a forward pass stops after each MoE layer's router, reads back the chosen ids (one submit +
/// wait per MoE layer), makes sure those experts sit in slots (misses: bytes from `experts`
/// into least recently used slots, `gpu::slots`), and writes the slot indices into the ids
/// buffer for the grouped expert products. A batch on the GEMM path whose experts outnumber the
/// slots runs them in rounds (`fill_in_rounds`); a smaller batch is kept small enough to fit.
/// Results do not depend on the slots: the same bytes are multiplied, each slot's product alone,
/// and outputs are summed by top-k position.
pub(super) struct Streaming {
    pub(super) slots: usize,
    /// The largest batch whose n·k experts always fit in the slots (for batches below the
    /// GEMM path's `GEMM_MIN` tokens, which cannot run in rounds).
    pub(super) max_piece: usize,
    /// Every MoE layer's slots are filled through a mapping (`SlotWriter::Mapped`).
    pub(super) mapped: bool,
    /// ... and disk reads land in them (unified memory; the store keeps no cache).
    pub(super) lands: bool,
    /// Blobs read straight into a slot.
    pub(super) landed: AtomicU64,
    pub(super) table: Mutex<SlotTable>,
    pub(super) ids: Readback,
    /// The lookahead router's ids (`LayerOps::lookahead`).
    pub(super) ahead: Readback,
    /// MoE layers each decode layer's lookahead predicts, and the experts per token of each
    /// guess that start reads (`StoreOptions::lookahead`; the window read-backs bring back all
    /// the guesses).
    pub(super) lookahead: Lookahead,
    pub(super) hits: AtomicU64,
    pub(super) misses: AtomicU64,
    /// Nanoseconds the host spent, per kind (`SlotStats`).
    pub(super) gpu_wait_ns: AtomicU64,
    pub(super) fill_ns: AtomicU64,
    pub(super) upload_ns: AtomicU64,
    pub(super) map_ns: AtomicU64,
    pub(super) pass_ns: AtomicU64,
    /// Nanoseconds with no disk read in flight, during the GPU waits, the fills and the passes
    /// (`SlotStats::disk_idle_s`).
    pub(super) idle_gpu_wait_ns: AtomicU64,
    pub(super) idle_fill_ns: AtomicU64,
    pub(super) idle_pass_ns: AtomicU64,
    pub(super) stops: AtomicU64,
    /// Stops where every chosen expert already had a slot (`SlotStats::hit_stops`).
    pub(super) hit_stops: AtomicU64,
    /// MoE layers that ran without a stop (`SlotStats::run_through`).
    pub(super) through_layers: AtomicU64,
    /// Speculative passes, and the reads their guesses started (`SlotStats`).
    pub(super) spec_runs: AtomicU64,
    pub(super) spec_guesses: AtomicU64,
    /// The speculative passes' guesses, scored against what their layers used
    /// (`SlotStats::spec_recall`).
    pub(super) spec_scores: Mutex<Recall>,
    /// Reads a replayed routing trace started (`oracle`).
    pub(super) oracle_reads: AtomicU64,
    /// Experts placed in later layers' slots ahead of their use, and the time it took
    /// (`fill_ahead`).
    pub(super) placed_ahead: AtomicU64,
    pub(super) ahead_ns: AtomicU64,
    /// Decode batches run through the layers whose experts sit in VRAM (`through`); `None`
    /// where its buffers could not be made.
    pub(super) through: Option<Through>,
    /// Keeps an NVIDIA GPU at its full clock while the decode waits for reads
    /// (`smoe_compute::gpu::ClockHold`); `None` where that does not apply or is turned off.
    pub(super) clocks: Option<ClockHold>,
}

pub(super) struct SlotTable {
    /// Per layer (empty for dense layers): expert → slot.
    slot_of: Vec<Vec<Option<u32>>>,
    /// Per layer: slot → (expert held, last use).
    held: Vec<Vec<(Option<usize>, u64)>>,
    /// Per layer: the slots `fill_ahead` filled since the layer last ran. A use of one is a
    /// miss all the same (its blob was brought in for it), counted when the layer runs.
    placed: Vec<Vec<bool>>,
    clock: u64,
}

impl SlotTable {
    /// MoE layer `l` runs with the distinct experts `used`: how many of them sit in slots
    /// `fill_ahead` filled for it (misses, brought in ahead of the stop). Clears its marks.
    /// (Every MoE layer of every token asks: nothing to do unless a slot is marked.)
    fn settle_placed(&mut self, l: usize, used: impl IntoIterator<Item = usize>) -> usize {
        let (marks, slot_of) = (&mut self.placed[l], &self.slot_of[l]);
        if !marks.contains(&true) {
            return 0;
        }
        let n = (used.into_iter())
            .filter(|&e| slot_of[e].is_some_and(|s| marks[s as usize]))
            .count();
        marks.fill(false);
        n
    }
}

/// Frees the slot holding expert `e` of one layer (`slot_of`, `held`), if one does: after a
/// fill that failed or a blob that was not handed over, no slot claims it.
fn release(slot_of: &mut [Option<u32>], held: &mut [(Option<usize>, u64)], e: usize) {
    if let Some(s) = slot_of[e].take() {
        held[s as usize] = (None, 0);
    }
}

/// The distinct values of `ids`, ascending.
pub(super) fn distinct(ids: &[u32]) -> Vec<u32> {
    let mut v = ids.to_vec();
    v.sort_unstable();
    v.dedup();
    v
}

/// A slot id that the expert sort skips (`ExpertSort`: any id ≥ the slot count): a slot of
/// another round's expert.
const SKIP_SLOT: u32 = u32::MAX;

/// Bytes per copy when the forward pass's thread copies a whole blob into a slot, on several
/// threads: writes into a discrete GPU's mapped VRAM run a few GB/s per thread, so a 2.6 MiB
/// blob wants ~20 of them in flight. Measured (H100, q4 30B-A3B at 25 % and 50 %, 64 tokens):
/// 128 KiB pieces copy in 0.32–0.39 s what 512 KiB pieces copy in 0.43–0.50 s and 2 MiB ones in
/// 0.80–0.86 s; 64 KiB ones are no faster than 128.
const UPLOAD_PIECE: usize = 128 << 10;

/// Copies a whole blob into its slot (`base`, `stride` bytes) in `UPLOAD_PIECE`s on several
/// threads.
fn copy_blob(writer: &SlotWriter, (base, stride): (u64, u64), bytes: &[u8]) {
    use rayon::prelude::*;
    (bytes.par_chunks(UPLOAD_PIECE).enumerate())
        .for_each(|(i, piece)| writer.write((base, stride), i * UPLOAD_PIECE, piece));
}

impl Streaming {
    /// `slots` per MoE layer, all empty; batches below the GEMM path of at most `max_piece`
    /// tokens.
    pub(super) fn new(ctx: &GpuContext, cfg: &ModelConfig, slots: usize, max_piece: usize) -> Self {
        let k = cfg.num_experts_per_tok.max(1);
        let layers = cfg.num_layers;
        let is_moe = |l: usize| cfg.moe_layers().any(|m| m == l);
        Streaming {
            slots,
            max_piece,
            mapped: false,
            lands: false,
            landed: AtomicU64::new(0),
            table: Mutex::new(SlotTable {
                slot_of: (0..layers)
                    .map(|l| vec![None; if is_moe(l) { cfg.num_experts } else { 0 }])
                    .collect(),
                held: (0..layers)
                    .map(|l| vec![(None, 0); if is_moe(l) { slots } else { 0 }])
                    .collect(),
                placed: (0..layers)
                    .map(|l| vec![false; if is_moe(l) { slots } else { 0 }])
                    .collect(),
                clock: 0,
            }),
            ids: Readback::new(ctx, 4 * (T_MAX * k) as u64),
            ahead: Readback::new(ctx, 4 * (T_MAX * k) as u64),
            lookahead: Lookahead::default(),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
            gpu_wait_ns: AtomicU64::new(0),
            fill_ns: AtomicU64::new(0),
            upload_ns: AtomicU64::new(0),
            map_ns: AtomicU64::new(0),
            pass_ns: AtomicU64::new(0),
            idle_gpu_wait_ns: AtomicU64::new(0),
            idle_fill_ns: AtomicU64::new(0),
            idle_pass_ns: AtomicU64::new(0),
            stops: AtomicU64::new(0),
            hit_stops: AtomicU64::new(0),
            through_layers: AtomicU64::new(0),
            spec_runs: AtomicU64::new(0),
            spec_guesses: AtomicU64::new(0),
            spec_scores: Mutex::default(),
            oracle_reads: AtomicU64::new(0),
            placed_ahead: AtomicU64::new(0),
            ahead_ns: AtomicU64::new(0),
            through: None,
            clocks: None,
        }
    }
}

impl Streaming {
    /// The distinct experts of `ids` that no VRAM slot of MoE layer `l` holds (ids that are no
    /// expert of it left out), in the order of their first appearance in `ids` (reads of
    /// guesses in rank order: the likeliest first).
    pub(super) fn missing(&self, l: usize, ids: &[u32]) -> Vec<usize> {
        let t = self.table.lock().unwrap_or_else(|e| e.into_inner());
        let mut out: Vec<usize> = vec![];
        for e in ids.iter().map(|&e| e as usize) {
            if t.slot_of[l].get(e).is_some_and(|s| s.is_none()) && !out.contains(&e) {
                out.push(e);
            }
        }
        out
    }
}

impl GpuDecoder {
    /// A streaming pass of n tokens stopped at MoE layer `l`'s routes-known point (its router):
    /// submits `enc` with copies of the chosen ids (and the lookahead's guesses), records what
    /// follows (`resume`) while the GPU runs up to the stop, then reads the ids, starts the
    /// guesses' reads, fills the missing VRAM slots and writes the slot indices the experts
    /// read — before `resume`'s submission. Returns what `resume` recorded.
    pub(super) fn routes_known<R>(
        &self,
        st: &Streaming,
        mut enc: wgpu::CommandEncoder,
        (l, n): (usize, usize),
        layers: &[LayerOps],
        host: &mut Duration,
        resume: impl FnOnce() -> R,
    ) -> Result<R, EngineError> {
        let q = &self.ctx.queue;
        let submitting = Instant::now();
        let k = self.acts.d.k;
        let bytes = 4 * (n * k) as u64;
        st.ids.copy(&mut enc, &self.acts.ids, bytes);
        let ahead = self
            .spec
            .next_moe(l)
            .filter(|_| !layers[l].lookahead.is_empty());
        if ahead.is_some() {
            st.ahead.copy(&mut enc, &self.acts.ahead[1], bytes);
        }
        q.submit([enc.finish()]);
        *host += submitting.elapsed();
        let next = resume();
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
        (st.gpu_wait_ns).fetch_add(nanos(filling - waiting), Ordering::Relaxed);
        (st.fill_ns).fetch_add(nanos(filling.elapsed()), Ordering::Relaxed);
        let idle_filled = self.disk_idle();
        add_idle(&st.idle_gpu_wait_ns, idle_waiting, idle_filling);
        add_idle(&st.idle_fill_ns, idle_filling, idle_filled);
        q.write_buffer(&self.acts.ids, 0, bytemuck::cast_slice(&slots));
        Ok(next)
    }

    /// Streaming, at MoE layer `l`'s router stop: puts the experts of `ids` (router order) in
    /// VRAM slots and returns their slot indices, in rounds where a batch on the GEMM path
    /// (`rounds`: its expert sort and grouped GEMMs) has more distinct experts than slots.
    pub(super) fn fill_stop(
        &self,
        st: &Streaming,
        l: usize,
        ids: &[u32],
        rounds: Option<&[Op]>,
    ) -> Result<Vec<u32>, EngineError> {
        let misses = st.misses.load(Ordering::Relaxed);
        let slots = match rounds {
            Some(ops) if distinct(ids).len() > st.slots => self.fill_in_rounds(st, l, ids, ops)?,
            _ => self.fill_slots(st, l, ids)?,
        };
        st.stops.fetch_add(1, Ordering::Relaxed);
        // (One pass at a time: no other fill counts misses meanwhile.)
        if st.misses.load(Ordering::Relaxed) == misses {
            st.hit_stops.fetch_add(1, Ordering::Relaxed);
        }
        Ok(slots)
    }

    /// Streaming lookahead: the experts of MoE layer `next` that its router, applied to the
    /// current layer's input, would choose and that no VRAM slot holds start reading into the
    /// host cache. They are issued after the current layer's own misses (`Experts::prefetch_after`),
    /// so a guess never delays a certain read.
    pub(super) fn prefetch_guess(&self, st: &Streaming, next: usize, guess: &[u32]) {
        self.experts
            .prefetch_after(next, &self.guessed_reads(st, next, guess));
    }

    /// The experts a lookahead guess for MoE layer `m` (tokens × top-k, in rank order) reads:
    /// each token's kept best-ranked (`Lookahead::keep`) that no VRAM slot holds, rank by rank
    /// (every token's best first), so that the queue reads the likeliest first.
    pub(super) fn guessed_reads(&self, st: &Streaming, m: usize, guess: &[u32]) -> Vec<usize> {
        let k = self.acts.d.k;
        let tokens = guess.len() / k;
        let kept: Vec<u32> = (0..st.lookahead.keep(k))
            .flat_map(|r| (0..tokens).map(move |t| guess[t * k + r]))
            .collect();
        st.missing(m, &kept)
    }

    /// Streaming, a batch on the GEMM path whose distinct experts outnumber the slots of MoE
    /// layer `l`: the experts in rounds of at most `slots`, in id order. Every round but the last
    /// runs here: its experts fill the slots, `ops` (the expert sort and grouped GEMMs) run with
    /// the other rounds' slots marked to skip, and the GPU finishes before the next round
    /// refills the slots. Returns the last round's slot ids (others marked to skip) for the
    /// pass's own expert products, after which the weighted sum adds every slot's output. Each
    /// slot's output is the same product as in one round (the GEMMs compute each slot alone),
    /// and every expert is read once per batch.
    pub(super) fn fill_in_rounds(
        &self,
        st: &Streaming,
        l: usize,
        ids: &[u32],
        ops: &[Op],
    ) -> Result<Vec<u32>, EngineError> {
        let experts = distinct(ids);
        let rounds: Vec<&[u32]> = experts.chunks(st.slots).collect();
        for (i, round) in rounds.iter().enumerate() {
            let slots = self.fill_slots(st, l, round)?;
            let of_round: Vec<u32> = (ids.iter())
                .map(|e| round.binary_search(e).map_or(SKIP_SLOT, |j| slots[j]))
                .collect();
            if i + 1 == rounds.len() {
                return Ok(of_round);
            }
            let q = &self.ctx.queue;
            q.write_buffer(&self.acts.ids, 0, bytemuck::cast_slice(&of_round));
            let mut enc = self.ctx.encoder();
            {
                let pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                    label: Some("expert round"),
                    timestamp_writes: None,
                });
                let mut r = Recorder::new(pass, None, false, false);
                ops.iter().for_each(|op| op.record(&mut r));
                r.end();
            }
            self.ctx.submit_wait(enc);
        }
        unreachable!("a batch has at least one expert")
    }

    /// Streaming: makes sure the experts in `ids` (router order, `[n][k]`) of MoE layer `l` sit
    /// in its VRAM slots, and returns their slot indices in the same order. Misses take the
    /// least recently used slots not needed by this batch, and their bytes come from the store
    /// (host cache, lookahead read or an O_DIRECT read) through a `SlotWriter`: copied into the
    /// mapped slot, read straight into it (unified memory), or `queue.write_buffer`, which
    /// lands before the next submission. A failed read leaves no slot claiming the expert.
    pub(super) fn fill_slots(
        &self,
        st: &Streaming,
        l: usize,
        ids: &[u32],
    ) -> Result<Vec<u32>, EngineError> {
        let slots = self
            .weights
            .expert_slots(l)
            .ok_or_else(|| EngineError::Backend(format!("GPU: layer {l} has no experts")))?;
        let stride = slots.stride;
        let used: Vec<usize> = ids.iter().map(|&e| e as usize).collect();
        if let Some(&bad) = used.iter().find(|&&e| e >= self.cfg.num_experts) {
            return Err(EngineError::Backend(format!(
                "GPU: layer {l}: router chose expert {bad} of {}",
                self.cfg.num_experts
            )));
        }
        let distinct: Vec<usize> = distinct(ids).into_iter().map(|e| e as usize).collect();
        let mut t = st.table.lock().unwrap_or_else(|e| e.into_inner());
        t.clock += 1;
        let now = t.clock;
        let placed = t.settle_placed(l, distinct.iter().copied());
        let SlotTable { slot_of, held, .. } = &mut *t;
        let (slot_of, held) = (&mut slot_of[l], &mut held[l]);
        let mut misses = vec![];
        for &e in &distinct {
            match slot_of[e] {
                Some(s) => held[s as usize].1 = now,
                None => misses.push(e),
            }
        }
        for &e in &misses {
            // Empty slots first, then the least recently used; never one this batch uses.
            let victim = (0..held.len())
                .filter(|&s| held[s].1 != now)
                .min_by_key(|&s| (held[s].0.is_some(), held[s].1))
                .expect("a batch's experts fit in the slots (max_piece)");
            if let Some(old) = held[victim].0 {
                slot_of[old] = None;
            }
            held[victim] = (Some(e), now);
            slot_of[e] = Some(victim as u32);
        }
        let hits = distinct.len() - misses.len() - placed;
        st.hits.fetch_add(hits as u64, Ordering::Relaxed);
        (st.misses).fetch_add((misses.len() + placed) as u64, Ordering::Relaxed);
        // A failed fill leaves no slot claiming the missed experts.
        let forget = |slot_of: &mut Vec<Option<u32>>, held: &mut Vec<(Option<usize>, u64)>| {
            misses.iter().for_each(|&e| release(slot_of, held, e));
            self.sync_table(st, l, slot_of);
        };
        // (Called even without misses: it also drops this layer's unused lookahead reads and
        // starts the next layer's.)
        let writer = match misses.is_empty() {
            true => None,
            false => {
                let mapping = Instant::now();
                let opened = SlotWriter::open(&self.ctx, &slots.buf, slots.mappable, st.lands);
                st.map_ns
                    .fetch_add(nanos(mapping.elapsed()), Ordering::Relaxed);
                match opened {
                    Ok(w) => Some(Arc::new(w)),
                    Err(err) => {
                        forget(slot_of, held);
                        return Err(err);
                    }
                }
            }
        };
        // Blobs read from disk now reach their slots piece by piece from the reader threads,
        // each piece as soon as it is read; hits in the host cache and lookahead reads are
        // copied here.
        let sink: Option<PieceSink> = writer.clone().map(|writer| {
            let to: Vec<(usize, u64)> = misses
                .iter()
                .map(|&e| (e, slot_of[e].expect("assigned above") as u64 * stride))
                .collect();
            Arc::new(move |e: usize, at: usize, bytes: &[u8]| {
                if let Some(&(_, base)) = to.iter().find(|(x, _)| *x == e) {
                    writer.write((base, stride), at, bytes);
                }
            }) as PieceSink
        });
        // Unified memory: the blobs read now land in their slots.
        let targets: Vec<(usize, ReadTarget)> = (writer.iter())
            .flat_map(|w| {
                (misses.iter())
                    .filter_map(|&e| Some((e, w.target((slot_of[e]? as u64 * stride, stride))?)))
            })
            .collect();
        let mut copied = 0;
        let read =
            self.experts
                .for_each_blob(l, &misses, (sink.as_ref(), &targets), &mut |e, bytes| {
                    let (Some(writer), Some(s)) = (&writer, slot_of[e]) else {
                        return;
                    };
                    copied += 1;
                    let base = s as u64 * stride;
                    let t = Instant::now();
                    copy_blob(writer, (base, stride), bytes);
                    st.upload_ns
                        .fetch_add(nanos(t.elapsed()), Ordering::Relaxed);
                });
        // Every read this stop waited for is done: nothing writes into the slots any more.
        if let Some(w) = &writer {
            let t = Instant::now();
            w.finish();
            st.map_ns.fetch_add(nanos(t.elapsed()), Ordering::Relaxed);
        }
        if let Err(err) = read {
            forget(slot_of, held);
            return Err(err);
        }
        // Landing, the store handed over only what it had already (guessed or cached).
        if !targets.is_empty() {
            let landed = (misses.len() - copied) as u64;
            st.landed.fetch_add(landed, Ordering::Relaxed);
        }
        if !misses.is_empty() {
            self.sync_table(st, l, slot_of);
        }
        Ok(used.iter().map(|&e| slot_of[e].expect("filled")).collect())
    }

    /// Copies into the VRAM slots of later MoE layers the experts they are expected to choose (`wants`: layer and ids, likeliest first) whose blobs are in
    /// host memory already (cached, or read ahead completely), so that those layers find them
    /// and run through instead of halting for the copy. Each takes its layer's empty or least
    /// recently used slots, never one holding an expert `wants` names there or one placed so
    /// before (kept until its layer runs: evicted, a placed blob would be read twice where
    /// there is no host cache); nothing waits for a read. For layers whose slot buffers no
    /// submission in flight uses (at a halt, or outside the window the GPU runs). The store
    /// counts what it handed out once the layer has chosen (`Experts::note_uses`).
    pub(super) fn fill_ahead(
        &self,
        st: &Streaming,
        wants: &[(usize, Vec<u32>)],
    ) -> Result<(), EngineError> {
        if wants.is_empty() {
            return Ok(());
        }
        let t0 = Instant::now();
        let mut placed = 0;
        for (m, want) in wants {
            let missing = st.missing(*m, want);
            let pending = self.experts.pending(*m, &missing);
            let ready: Vec<usize> = (missing.into_iter())
                .filter(|e| !pending.contains(e))
                .collect();
            let Some(slots) = self.weights.expert_slots(*m).filter(|_| !ready.is_empty()) else {
                continue;
            };
            let stride = slots.stride;
            let mut t = st.table.lock().unwrap_or_else(|e| e.into_inner());
            t.clock += 1;
            let now = t.clock;
            let SlotTable {
                slot_of,
                held,
                placed: marks,
                ..
            } = &mut *t;
            let (slot_of, held, marks) = (&mut slot_of[*m], &mut held[*m], &mut marks[*m]);
            let wanted = |e: Option<usize>| e.is_some_and(|e| want.contains(&(e as u32)));
            let mut to = vec![];
            for &e in &ready {
                let Some(victim) = (0..held.len())
                    .filter(|&s| held[s].1 != now && !marks[s] && !wanted(held[s].0))
                    .min_by_key(|&s| (held[s].0.is_some(), held[s].1))
                else {
                    break;
                };
                if let Some(old) = held[victim].0 {
                    slot_of[old] = None;
                }
                held[victim] = (Some(e), now);
                slot_of[e] = Some(victim as u32);
                marks[victim] = true;
                to.push((e, victim as u64 * stride));
            }
            let writer = match SlotWriter::open(&self.ctx, &slots.buf, slots.mappable, st.lands) {
                Ok(w) => w,
                Err(err) => {
                    to.iter().for_each(|&(e, _)| release(slot_of, held, e));
                    self.sync_table(st, *m, slot_of);
                    return Err(err);
                }
            };
            let experts: Vec<usize> = to.iter().map(|t| t.0).collect();
            let handed = self.experts.take_ready(*m, &experts, &mut |e, bytes| {
                if let Some(&(_, base)) = to.iter().find(|t| t.0 == e) {
                    copy_blob(&writer, (base, stride), bytes);
                }
            });
            writer.finish();
            // Evicted from the cache or failed meanwhile: no slot claims it.
            for &e in experts.iter().filter(|e| !handed.contains(e)) {
                release(slot_of, held, e);
            }
            self.sync_table(st, *m, slot_of);
            placed += handed.len();
        }
        st.placed_ahead.fetch_add(placed as u64, Ordering::Relaxed);
        st.ahead_ns
            .fetch_add(nanos(t0.elapsed()), Ordering::Relaxed);
        Ok(())
    }

    /// The GPU's copy of layer `l`'s slot table (`through`) after the host's changed.
    fn sync_table(&self, st: &Streaming, l: usize, slot_of: &[Option<u32>]) {
        if let Some(th) = &st.through {
            th.write_row(&self.ctx, l, slot_of);
        }
    }

    /// A decode batch ran MoE layer `l` through with the experts `ids` from their slots: the
    /// same bookkeeping as a stop where all hit (uses, recency, hits).
    pub(super) fn ran_through(
        &self,
        st: &Streaming,
        l: usize,
        ids: &[u32],
    ) -> Result<(), EngineError> {
        let used: Vec<usize> = ids.iter().map(|&e| e as usize).collect();
        self.experts.note_uses(l, &used);
        // Every expert it chose sat in VRAM: its guesses still queued were wrong (a layer
        // that stops drops them at its fill).
        self.experts.drop_guesses(l);
        let experts = distinct(ids);
        let mut t = st.table.lock().unwrap_or_else(|e| e.into_inner());
        t.clock += 1;
        let now = t.clock;
        let placed = t.settle_placed(l, experts.iter().map(|&e| e as usize));
        let SlotTable { slot_of, held, .. } = &mut *t;
        for &e in &experts {
            let Some(s) = slot_of[l].get(e as usize).copied().flatten() else {
                return Err(EngineError::Backend(format!(
                    "GPU: layer {l} ran expert {e} from a VRAM slot, but the host's table has none for it"
                )));
            };
            held[l][s as usize].1 = now;
        }
        st.hits
            .fetch_add((experts.len() - placed) as u64, Ordering::Relaxed);
        st.misses.fetch_add(placed as u64, Ordering::Relaxed);
        st.through_layers.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Streaming: fills the host cache (where there is one) and then each MoE layer's VRAM slots
    /// with the hottest experts of the saved usage profile. `progress(done, total)` counts the
    /// experts read into the host cache, then (afresh) those placed in slots. Returns how many
    /// experts were loaded in all (slots and host cache). The slot counters start afresh after.
    pub fn preload(&self, progress: &mut dyn FnMut(usize, usize)) -> Result<usize, EngineError> {
        let cached = self.experts.preload(progress)?;
        let Some(st) = &self.streaming else {
            return Ok(cached);
        };
        let hot = self.experts.hottest();
        let per_layer: Vec<(usize, Vec<u32>)> = (self.cfg.moe_layers())
            .map(|l| {
                let ids = (hot.iter().filter(|h| h.0 == l))
                    .map(|h| h.1 as u32)
                    .take(st.slots)
                    .collect();
                (l, ids)
            })
            .collect();
        let total = per_layer.iter().map(|p| p.1.len()).sum();
        let mut done = 0;
        for (l, ids) in per_layer.iter().filter(|p| !p.1.is_empty()) {
            self.fill_slots(st, *l, ids)?;
            done += ids.len();
            progress(done, total);
        }
        self.reset_slot_stats();
        Ok(cached + done)
    }
}
