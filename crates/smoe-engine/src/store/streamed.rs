//! The streaming expert store: blobs are read from the vault on demand by a pool of reader
//! threads (each blob in pieces that several readers share; needed reads before lookahead
//! guesses, see `read_queue`), verified, kept in a bounded cache, and handed to compute as they
//! arrive — resident experts first, misses as their reads complete.

use super::aligned::AlignedBuf;
use super::cache::ExpertCache;
use super::read_queue::{
    Abandoned, BlobRead, BufPool, Finished, PieceSink, Priority, ReadQueue, ReadTarget,
};
use super::reader::{BlobReader, FaultHook};
use super::stats::{Recall, StoreStats};
use crate::error::EngineError;
use smoe_vault::Vault;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

pub struct StreamedStore {
    vault: Vault,
    pub(super) n_experts: usize,
    /// Bytes per piece of a blob read (several readers share one blob).
    piece: usize,
    pub(super) cache: Mutex<ExpertCache>,
    pub(super) stats: Mutex<StoreStats>,
    queue: Arc<ReadQueue>,
    /// Read buffers for reuse (evicted entries, dropped guesses, failed reads).
    pool: Arc<BufPool>,
    reader: Arc<BlobReader>,
    /// Wall time during which at least one read was in flight (read GB/s), and when no read
    /// was (`disk_idle_s`).
    busy: Mutex<Busy>,
    /// Lookahead reads queued, in flight or done, by expert key, until their layer takes them.
    prefetched: Mutex<HashMap<usize, Arc<BlobRead>>>,
    /// Lookahead guesses (per later layer) to start once the next `for_each_blob` has queued
    /// its own misses.
    deferred: Mutex<Vec<(usize, Vec<(usize, usize)>)>>,
    /// Blobs handed out ahead of their layer's choice (`take_ready`), by expert key, until
    /// `settle` counts them against what the layer used.
    placed: Mutex<HashMap<usize, Placed>>,
}

/// A blob `take_ready` handed out before its layer chose: what to count once it has.
#[derive(Debug, Clone, Copy)]
enum Placed {
    /// From the cache: a hit if used.
    Cached,
    /// A read started ahead (`guess`: as a lookahead guess) and done: a miss read ahead if
    /// used, a wasted read if not.
    Read { guess: bool, secs: f64 },
}

impl Drop for StreamedStore {
    fn drop(&mut self) {
        self.queue.close();
    }
}

impl StreamedStore {
    /// `threads` readers share the reads, each blob in pieces of `piece` bytes (rounded to
    /// 16 KiB; at most the blob: `usize::MAX` reads whole blobs); at most `guess_readers` of
    /// them read lookahead guesses at a time.
    pub fn new(
        vault: &Vault,
        budget: u64,
        threads: usize,
        piece: usize,
        fault: Option<FaultHook>,
    ) -> Result<Arc<Self>, EngineError> {
        let cfg = &vault.header.config;
        let x = vault
            .expert_section()
            .ok_or_else(|| EngineError::Invalid("vault has no experts".into()))?;
        let reader = BlobReader::open(vault.path(), fault)
            .map_err(|e| EngineError::Invalid(format!("{}: {e}", vault.path().display())))?;
        let mut stats = StoreStats::new(cfg.num_layers);
        stats.cache_budget = budget;
        stats.direct_io = reader.is_direct();
        let threads = threads.max(1);
        let store = Arc::new(StreamedStore {
            vault: vault.clone(),
            n_experts: cfg.num_experts,
            piece: super::read_piece_bytes(piece, x.blob_stride as usize),
            cache: Mutex::new(ExpertCache::new(budget, cfg.num_layers * cfg.num_experts)),
            stats: Mutex::new(stats),
            queue: Arc::new(ReadQueue::new(guess_readers(threads))),
            // Enough for a few layers' misses and guesses between two evictions (64 blobs of
            // the 30B's 2.6 MiB), but at most 256 MiB waiting, half of it kept ready.
            pool: Arc::new(BufPool::new(
                x.blob_stride as usize,
                pool_keep(x.blob_stride),
            )),
            reader: Arc::new(reader),
            busy: Mutex::new(Busy::new()),
            prefetched: Mutex::new(HashMap::new()),
            deferred: Mutex::new(vec![]),
            placed: Mutex::new(HashMap::new()),
        });
        let pool = Arc::downgrade(&store.pool);
        std::thread::Builder::new()
            .name("smoe-read-buffers".into())
            .spawn(move || BufPool::fill(pool))
            .map_err(|e| {
                EngineError::Invalid(format!("cannot start the read-buffer thread: {e}"))
            })?;
        for i in 0..threads {
            let (queue, weak) = (store.queue.clone(), Arc::downgrade(&store));
            std::thread::Builder::new()
                .name(format!("smoe-read-{i}"))
                .spawn(move || worker(queue, weak))
                .map_err(|e| EngineError::Invalid(format!("cannot start reader threads: {e}")))?;
        }
        Ok(store)
    }

    /// A read of blob `blob` (expert `expert` of `layer`), not yet queued.
    fn new_read(
        &self,
        (layer, expert, blob): (usize, usize, usize),
        p: Priority,
        (sink, target): (Option<PieceSink>, Option<ReadTarget>),
    ) -> Arc<BlobRead> {
        let entry = &self.vault.expert_section().unwrap().blobs[blob];
        let key = layer * self.n_experts + expert;
        let at = (key, layer, expert, blob);
        BlobRead::new(at, entry.offset, self.piece, (p, sink, target), &self.pool)
    }

    /// Reads one piece of `read` (a reader thread's job) and, after its last piece, verifies
    /// the blob and hands it on.
    fn read_piece(&self, read: &BlobRead) {
        let Some(piece) = read.take_piece() else {
            return;
        };
        let ok = piece.and_then(|(_, offset, dst)| {
            // A piece must be finished whatever happens (a layer may be waiting for its blob):
            // a panic in the read or the sink fails the piece instead.
            let len = dst.len() as u64;
            self.busy(true);
            let run = std::panic::AssertUnwindSafe(|| {
                let ok = self.reader.read(read.layer, read.expert, offset, dst);
                if ok.is_ok() {
                    if let Some(sink) = &read.sink {
                        sink(read.expert, (offset - read.offset) as usize, dst);
                    }
                }
                ok.map_err(|e| e.to_string())
            });
            let ok = std::panic::catch_unwind(run)
                .unwrap_or_else(|_| Err("the reader thread panicked while reading it".into()));
            self.busy(false);
            if ok.is_ok() {
                self.stats.lock().unwrap().per_layer[read.layer].bytes_read += len;
            }
            ok
        });
        let verify = |buf: AlignedBuf| {
            let x = self.vault.expert_section().unwrap();
            self.vault
                .verify_expert(
                    &x.blobs[read.blob],
                    &buf.as_slice()[..x.used_bytes as usize],
                )
                .map(|()| buf)
                .map_err(|e| EngineError::ExpertRead {
                    layer: read.layer,
                    expert: read.expert,
                    reason: e.to_string(),
                })
        };
        if let Finished::Unneeded((key, r, _)) = read.finish_piece(ok, verify) {
            // Abandoned while it was read: the layer has moved on.
            self.keep_unneeded(key, r);
        }
    }

    /// Loads `(layer, expert, blob)` into the cache ahead of use (profile preload), pinned.
    pub fn preload(&self, layer: usize, expert: usize, blob: usize) -> Result<bool, EngineError> {
        let key = layer * self.n_experts + expert;
        if self.cache.lock().unwrap().contains(key) {
            return Ok(true);
        }
        let read = self.new_read((layer, expert, blob), Priority::Needed, (None, None));
        self.queue.push(&read);
        let buf = Arc::new(read.wait().1?);
        Ok(self.insert(key, buf, true))
    }

    /// Starts reading the experts a later layer will probably need (not cached, not already
    /// coming) as guesses: they use the disk only while no needed read waits.
    pub fn prefetch(&self, layer: usize, experts: &[(usize, usize)]) -> usize {
        self.start(layer, experts, Priority::Guess)
    }

    /// Starts reading experts that `layer` certainly needs (not cached, not already coming)
    /// before its `for_each_blob` asks for them, as needed reads.
    pub fn fetch_early(&self, layer: usize, experts: &[(usize, usize)]) -> usize {
        self.start(layer, experts, Priority::Needed)
    }

    /// Queues reads of those of `experts` neither cached nor already coming; returns how many.
    fn start(&self, layer: usize, experts: &[(usize, usize)], p: Priority) -> usize {
        let cache = self.cache.lock().unwrap();
        let mut pre = self.prefetched.lock().unwrap();
        let mut started = 0;
        for &(e, blob) in experts {
            let key = layer * self.n_experts + e;
            if cache.contains(key) || pre.contains_key(&key) {
                continue;
            }
            let read = self.new_read((layer, e, blob), p, (None, None));
            self.queue.push(&read);
            pre.insert(key, read);
            started += 1;
        }
        started
    }

    /// Of `experts` of `layer`, those a `for_each_blob` would still wait for: neither cached nor
    /// read ahead completely.
    pub fn pending(&self, layer: usize, experts: &[usize]) -> Vec<usize> {
        let cache = self.cache.lock().unwrap();
        let pre = self.prefetched.lock().unwrap();
        (experts.iter().copied())
            .filter(|&e| {
                let key = layer * self.n_experts + e;
                !cache.contains(key) && !pre.get(&key).is_some_and(|r| r.is_done())
            })
            .collect()
    }

    /// As `prefetch`, but started by the next `for_each_blob` right after it queues its own
    /// misses, so that no reader starts a guess just before a read that is certainly needed.
    pub fn prefetch_after(&self, layer: usize, experts: Vec<(usize, usize)>) {
        self.deferred.lock().unwrap().push((layer, experts));
    }

    /// Hands `f` each of `experts` (with their blob indices) of `layer` as its whole blob slot
    /// (`blob_stride` bytes, verified): cache hits first, then misses in the order they were
    /// queued (lookahead reads first: they started earlier). With a `sink`, the blobs read
    /// afresh go to it piece by piece instead of to `f` (lookahead reads and hits still go to
    /// `f`), and are verified before this returns. A blob read afresh whose expert has a
    /// `targets` entry is read straight into that memory instead (verified there; neither
    /// handed to `f` nor cached). The first failed read is returned after the others have
    /// drained; nothing from a failed read is cached.
    pub fn for_each_blob(
        &self,
        layer: usize,
        experts: &[(usize, usize)],
        (sink, targets): (Option<&PieceSink>, &[(usize, ReadTarget)]),
        f: &mut dyn FnMut(usize, &[u8]),
    ) -> Result<(), EngineError> {
        let mut hits = vec![];
        let mut guessed = vec![];
        let mut misses = vec![];
        let mut stale = vec![];
        {
            let mut cache = self.cache.lock().unwrap();
            let mut pre = self.prefetched.lock().unwrap();
            for &(e, blob) in experts {
                let key = layer * self.n_experts + e;
                match (cache.touch(key), pre.remove(&key)) {
                    (Some(buf), p) => {
                        hits.push((e, buf));
                        stale.extend(p);
                    }
                    (None, Some(p)) => guessed.push(p),
                    (None, None) => misses.push((e, blob)),
                }
            }
            // Lookahead reads of this layer that turned out not to be needed.
            let range = self.keys_of(layer);
            let keys: Vec<usize> = pre.keys().copied().filter(|k| range.contains(k)).collect();
            stale.extend(keys.into_iter().map(|k| pre.remove(&k).unwrap()));
        }
        // Dropped before this layer's own reads are queued: the pieces no reader has started
        // are never read, and nothing waits for those being read.
        let (mut wasted, mut cancelled) = (0u64, 0u64);
        for read in stale {
            match self.queue.abandon(&read) {
                Abandoned::Cancelled => cancelled += 1,
                Abandoned::InFlight => wasted += 1,
                Abandoned::Done((key, r, _)) => {
                    wasted += 1;
                    self.keep_unneeded(key, r);
                }
            }
        }
        // Guesses that were right go first (they started earlier), then the new reads.
        for read in &guessed {
            self.queue.promote(read);
        }
        let n_guessed = guessed.len();
        // (Reads started early as needed ones are misses, not lookahead reads used.)
        let n_lookahead = guessed.iter().filter(|r| r.guess).count();
        let mut waits = guessed;
        for &(e, blob) in &misses {
            let target = targets.iter().find(|t| t.0 == e).map(|t| t.1);
            let to = match target {
                Some(_) => (None, target),
                None => (sink.cloned(), None),
            };
            let read = self.new_read((layer, e, blob), Priority::Needed, to);
            self.queue.push(&read);
            waits.push(read);
        }
        // (Guesses for this layer or earlier ones are stale: a pass ended before their use.)
        let deferred = std::mem::take(&mut *self.deferred.lock().unwrap());
        for (l, ex) in deferred.into_iter().filter(|(l, _)| *l > layer) {
            self.prefetch(l, &ex);
        }
        let mut compute = 0.0;
        for (e, buf) in &hits {
            let t = Instant::now();
            f(*e, buf.as_slice());
            compute += t.elapsed().as_secs_f64();
        }
        let (mut wait, mut read_secs, mut first_err) = (0.0, 0.0, None);
        for read in &waits {
            let t = Instant::now();
            let (key, result, secs) = read.wait();
            wait += t.elapsed().as_secs_f64();
            read_secs += secs;
            match result {
                // Landed in its target: nothing to hand on or keep.
                Ok(_) if read.target.is_some() => {}
                Ok(buf) => {
                    let buf = Arc::new(buf);
                    if read.sink.is_none() {
                        let t = Instant::now();
                        f(key % self.n_experts, buf.as_slice());
                        compute += t.elapsed().as_secs_f64();
                    }
                    self.insert(key, buf, false);
                }
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        // (Bytes read are counted by the readers, piece by piece, unneeded guesses included.)
        let mut st = self.stats.lock().unwrap();
        let ls = &mut st.per_layer[layer];
        ls.hits += hits.len() as u64;
        ls.misses += (n_guessed + misses.len()) as u64;
        ls.prefetched += n_lookahead as u64;
        ls.prefetch_wasted += wasted;
        ls.prefetch_cancelled += cancelled;
        ls.read_seconds += read_secs;
        ls.io_wait_seconds += wait;
        ls.compute_seconds += compute;
        first_err.map_or(Ok(()), Err)
    }

    /// Hands `f` each of `experts` (with their blob indices) of `layer` whose blob is in memory
    /// now — cached, or read ahead completely — without waiting, reading or dropping anything,
    /// and returns those it handed. For a caller that places blobs before their layer chooses
    /// (the GPU's slots, filled ahead at a halt): a read taken so is cached like one the layer
    /// asked for, and `settle` counts it (used or wasted) once the layer has chosen. A read
    /// ahead that failed is dropped here unhanded: the layer reads that expert afresh if it
    /// needs it, and fails there with the error.
    pub fn take_ready(
        &self,
        layer: usize,
        experts: &[(usize, usize)],
        f: &mut dyn FnMut(usize, &[u8]),
    ) -> Vec<usize> {
        // (Cached blobs are taken under the lock; reads ahead that are done leave the map.)
        enum Ready {
            Cached(Arc<AlignedBuf>),
            Read(Arc<BlobRead>),
        }
        let mut ready = vec![];
        {
            let mut cache = self.cache.lock().unwrap();
            let mut pre = self.prefetched.lock().unwrap();
            for &(e, _) in experts {
                let key = layer * self.n_experts + e;
                if let Some(buf) = cache.touch(key) {
                    ready.push((e, key, Ready::Cached(buf)));
                } else if pre.get(&key).is_some_and(|r| r.is_done()) {
                    ready.push((e, key, Ready::Read(pre.remove(&key).unwrap())));
                }
            }
        }
        let mut handed = vec![];
        for (e, key, from) in ready {
            let (buf, placed) = match from {
                Ready::Cached(buf) => (buf, Placed::Cached),
                Ready::Read(read) => match read.wait() {
                    (_, Ok(buf), secs) => {
                        let buf = Arc::new(buf);
                        self.insert(key, buf.clone(), false);
                        (
                            buf,
                            Placed::Read {
                                guess: read.guess,
                                secs,
                            },
                        )
                    }
                    (_, Err(_), _) => continue,
                },
            };
            f(e, buf.as_slice());
            self.placed.lock().unwrap().insert(key, placed);
            handed.push(e);
        }
        handed
    }

    /// Counts the blobs of `layer` that `take_ready` handed out, now that the layer has chosen
    /// `used`: those used as the hits or the misses read ahead they were, the rest as wasted
    /// reads (from the cache: nothing).
    pub fn settle(&self, layer: usize, used: &[usize]) {
        let range = self.keys_of(layer);
        let settled: Vec<(usize, Placed)> = {
            let mut placed = self.placed.lock().unwrap();
            if placed.is_empty() {
                return;
            }
            let keys: Vec<usize> = placed
                .keys()
                .copied()
                .filter(|k| range.contains(k))
                .collect();
            keys.into_iter()
                .map(|k| (k, placed.remove(&k).unwrap()))
                .collect()
        };
        if settled.is_empty() {
            return;
        }
        let mut st = self.stats.lock().unwrap();
        let ls = &mut st.per_layer[layer];
        for (key, p) in settled {
            let was_used = used.contains(&(key - range.start));
            match (p, was_used) {
                (Placed::Cached, true) => ls.hits += 1,
                (Placed::Cached, false) => {}
                (Placed::Read { guess, secs }, true) => {
                    ls.misses += 1;
                    ls.prefetched += guess as u64;
                    ls.read_seconds += secs;
                }
                (Placed::Read { secs, .. }, false) => {
                    ls.prefetch_wasted += 1;
                    ls.read_seconds += secs;
                }
            }
        }
    }

    /// Drops the lookahead guesses for `layer` that no reader has started: it ran without
    /// asking for its experts (the GPU found every one it chose in VRAM), so none was needed
    /// now, and their pieces would only delay later reads. Guesses already being read or read
    /// stay where a later use of the layer finds them, as before. (Reads started as needed
    /// stay too.)
    pub fn drop_guesses(&self, layer: usize) {
        let cancelled = {
            let mut pre = self.prefetched.lock().unwrap();
            let range = self.keys_of(layer);
            let before = pre.len();
            // (The predicate cancels: a guess leaves the map only if no reader had started it.)
            pre.retain(|k, r| !(range.contains(k) && r.guess && self.queue.cancel_unstarted(r)));
            (before - pre.len()) as u64
        };
        // (Called for every MoE layer a GPU pass runs through: mostly nothing to count.)
        if cancelled > 0 {
            self.stats.lock().unwrap().per_layer[layer].prefetch_cancelled += cancelled;
        }
    }

    /// The cache and read keys of `layer`'s experts (`layer * n_experts + expert`).
    fn keys_of(&self, layer: usize) -> std::ops::Range<usize> {
        layer * self.n_experts..(layer + 1) * self.n_experts
    }

    pub fn tick(&self) {
        self.cache.lock().unwrap().tick();
    }

    /// Adds the score of a lookahead guess of `layer`'s experts.
    pub fn note_lookahead(&self, layer: usize, r: Recall) {
        self.stats.lock().unwrap().per_layer[layer].lookahead.add(r);
    }

    /// Stats so far, with totals and the cache's current size.
    pub fn stats(&self) -> StoreStats {
        let mut st = self.stats.lock().unwrap().clone();
        let (busy, depth) = {
            let b = self.busy.lock().unwrap();
            (b.secs(), b.mean_depth())
        };
        st.read_depth = depth;
        st.cache_bytes = self.cache.lock().unwrap().used();
        st.direct_io = self.reader.is_direct();
        (st.buffer_allocs, st.buffer_alloc_seconds) = self.pool.inline_allocs();
        st.finish(busy);
        st
    }

    pub fn reset_stats(&self) {
        self.stats.lock().unwrap().reset();
        self.busy.lock().unwrap().reset();
        self.pool.reset_inline_allocs();
    }

    /// A lookahead read the layer did not need: cached (not pinned) if the read succeeded and
    /// the cache has room; a failed one is dropped (nothing from a failed read is cached).
    fn keep_unneeded(&self, key: usize, r: Result<AlignedBuf, EngineError>) {
        if let Ok(buf) = r {
            self.insert(key, Arc::new(buf), false);
        }
    }

    /// Caches a blob (false when the cache refused it); what it evicts or refuses is reused.
    fn insert(&self, key: usize, buf: Arc<AlignedBuf>, pinned: bool) -> bool {
        let (kept, released) = {
            let mut cache = self.cache.lock().unwrap();
            (cache.insert(key, buf, pinned), cache.take_released())
        };
        for buf in released {
            self.pool.give_shared(buf);
        }
        kept
    }

    fn busy(&self, start: bool) {
        self.busy.lock().unwrap().change(start);
    }

    /// Seconds since the store opened during which no read was in flight: a monotone clock,
    /// so that a caller can tell how long the disk sat idle over a span of its own (the
    /// difference of two readings).
    pub fn disk_idle_s(&self) -> f64 {
        self.busy.lock().unwrap().idle_s()
    }
}

/// Read buffers the pool keeps for reuse: 64, or as many as fit 256 MiB, at least 8.
fn pool_keep(blob_stride: u64) -> usize {
    ((256u64 << 20) / blob_stride.max(1)).clamp(8, 64) as usize
}

/// A reader thread: reads pieces until the store is dropped. (Spare read buffers come from
/// the pool's own thread, `BufPool::fill`: readers that allocated them only while idle had to
/// allocate inline, not reading meanwhile, whenever reads ahead kept them all busy.)
fn worker(queue: Arc<ReadQueue>, store: std::sync::Weak<StreamedStore>) {
    loop {
        // (Not holding the store while waiting: it may be dropped meanwhile.)
        let Some(taken) = queue.pop() else {
            return;
        };
        let Some(store) = store.upgrade() else { return };
        store.read_piece(&taken.read);
        drop(store);
        queue.done(taken);
    }
}

/// Readers that may read lookahead guesses at once: enough to keep a disk busy while no
/// needed read waits, few enough that a needed read finds at most that many pieces ahead of it.
fn guess_readers(threads: usize) -> usize {
    threads.div_ceil(4)
}

/// Reads in flight and the time they took: `ever` since the store opened (with `opened`, the
/// disk's idle time), `ever - at_reset` since the last reset (read GB/s); and the reads in
/// flight summed over time (`depth`), so that busy time can tell a deep queue from one read
/// at a time.
struct Busy {
    ever: f64,
    at_reset: f64,
    n: usize,
    since: Option<Instant>,
    opened: Instant,
    /// ∫ reads in flight dt since the store opened, up to `last`, and at the last reset.
    depth: f64,
    depth_at_reset: f64,
    last: Instant,
}

impl Busy {
    fn new() -> Self {
        Busy {
            ever: 0.0,
            at_reset: 0.0,
            n: 0,
            since: None,
            opened: Instant::now(),
            depth: 0.0,
            depth_at_reset: 0.0,
            last: Instant::now(),
        }
    }

    /// A read started (`start`) or ended.
    fn change(&mut self, start: bool) {
        self.change_at(start, Instant::now());
    }

    /// `change` at `now` (tests give their own instants).
    fn change_at(&mut self, start: bool, now: Instant) {
        self.depth += self.n as f64 * now.duration_since(self.last).as_secs_f64();
        self.last = now;
        if start {
            if self.n == 0 {
                self.since = Some(now);
            }
            self.n += 1;
        } else {
            self.n -= 1;
            if self.n == 0 {
                if let Some(t) = self.since.take() {
                    self.ever += now.duration_since(t).as_secs_f64();
                }
            }
        }
    }

    /// Busy seconds since the last `reset` (of the reads that have finished).
    fn secs(&self) -> f64 {
        self.ever - self.at_reset
    }

    /// Reads in flight on average while at least one was, since the last `reset` (of the
    /// reads that have finished; 0 before any).
    fn mean_depth(&self) -> f64 {
        let busy = self.secs();
        match busy > 0.0 {
            true => (self.depth - self.depth_at_reset) / busy,
            false => 0.0,
        }
    }

    /// Starts the counts since the last reset afresh. A busy stretch still running is split
    /// here, so that its part before the reset is not counted after it (a disk kept busy
    /// across a warm-up's end would otherwise count busy longer than the run).
    fn reset(&mut self) {
        self.reset_at(Instant::now());
    }

    /// `reset` at `now`.
    fn reset_at(&mut self, now: Instant) {
        if let Some(t) = self.since.as_mut() {
            self.ever += now.duration_since(*t).as_secs_f64();
            *t = now;
        }
        self.depth += self.n as f64 * now.duration_since(self.last).as_secs_f64();
        self.last = now;
        self.at_reset = self.ever;
        self.depth_at_reset = self.depth;
    }

    fn idle_s(&self) -> f64 {
        let open = self.since.map_or(0.0, |t| t.elapsed().as_secs_f64());
        (self.opened.elapsed().as_secs_f64() - self.ever - open).max(0.0)
    }
}

#[cfg(test)]
mod tests {
    use super::{pool_keep, Busy};
    use std::time::Duration;

    #[test]
    fn the_read_buffer_pool_is_bounded_by_bytes() {
        // Qwen3-30B-A3B's q4 blobs (2.6 MiB): 64; 235B-A22B's (10.6 MiB): what 256 MiB holds.
        assert_eq!(pool_keep(2_654_208), 64);
        assert_eq!(pool_keep(10_616_832), 25);
        assert_eq!(pool_keep(1 << 30), 8);
        assert_eq!(pool_keep(0), 64);
    }

    /// The disk's idle clock stands still while a read is in flight, however many overlap,
    /// and runs while none is; the busy time since the store opened survives a reset.
    #[test]
    fn the_idle_clock_runs_only_while_no_read_is_in_flight() {
        let mut b = Busy::new();
        let nap = Duration::from_millis(20);
        b.change(true);
        b.change(true);
        let i0 = b.idle_s();
        std::thread::sleep(nap);
        b.change(false);
        std::thread::sleep(nap);
        let i1 = b.idle_s();
        b.change(false);
        assert!((i1 - i0).abs() < 1e-3, "idle {i0} -> {i1} while reading");
        assert!(
            b.secs() >= 0.04 && b.ever == b.secs(),
            "{} {}",
            b.secs(),
            b.ever
        );
        b.reset();
        assert_eq!(b.secs(), 0.0);
        std::thread::sleep(nap);
        let i2 = b.idle_s();
        assert!(i2 - i1 >= 0.019, "idle {i1} -> {i2} with nothing in flight");
        assert!(b.ever >= 0.04);
    }

    /// Two reads for one span and one for the next: 1.5 reads in flight on average while
    /// busy; the idle time between does not count, and a reset starts afresh.
    #[test]
    fn the_mean_depth_counts_reads_in_flight_while_busy() {
        let mut b = Busy::new();
        assert_eq!(b.mean_depth(), 0.0, "nothing read yet");
        let ms = |n: u64| Duration::from_millis(n);
        let t = b.last;
        b.change_at(true, t);
        b.change_at(true, t);
        b.change_at(false, t + ms(30));
        b.change_at(false, t + ms(60));
        // Idle from 60 to 100 ms: not in the mean.
        assert!((b.mean_depth() - 1.5).abs() < 1e-9, "{}", b.mean_depth());
        assert!((b.secs() - 0.06).abs() < 1e-9, "{}", b.secs());
        b.reset_at(t + ms(100));
        assert_eq!(b.mean_depth(), 0.0);
        b.change_at(true, t + ms(100));
        b.change_at(false, t + ms(130));
        assert!((b.mean_depth() - 1.0).abs() < 1e-9, "one read at a time");
    }

    /// A read in flight across a reset counts after it only for its time after it.
    #[test]
    fn a_read_spanning_a_reset_counts_only_its_part_after_it() {
        let mut b = Busy::new();
        let ms = |n: u64| Duration::from_millis(n);
        let t = b.last;
        b.change_at(true, t);
        b.change_at(true, t);
        b.reset_at(t + ms(150));
        b.change_at(false, t + ms(170));
        b.change_at(false, t + ms(170));
        assert!(
            (b.secs() - 0.02).abs() < 1e-9,
            "busy {} s after the reset",
            b.secs()
        );
        assert!(
            (b.mean_depth() - 2.0).abs() < 1e-9,
            "depth {}",
            b.mean_depth()
        );
        assert!((b.ever - 0.17).abs() < 1e-9, "busy since open {}", b.ever);
    }
}
