//! The streaming expert store: blobs are read from the vault on demand by a pool of reader
//! threads (each blob in pieces that several readers share; needed reads before lookahead
//! guesses, see `read_queue`), verified, kept in a bounded cache, and handed to compute as they
//! arrive — resident experts first, misses as their reads complete.
//!
//! This file holds the store, its reader threads and what it starts reading; `layer_blobs`
//! hands a layer's blobs to compute and counts them, `busy` keeps the disk's busy and idle time.

mod busy;
mod layer_blobs;

use super::aligned::AlignedBuf;
use super::cache::ExpertCache;
use super::read_queue::{BlobRead, BufPool, Finished, PieceSink, Priority, ReadQueue, ReadTarget};
use super::reader::{BlobReader, FaultHook};
use super::stats::{Recall, StoreStats};
use crate::error::EngineError;
use busy::Busy;
use layer_blobs::Placed;
use smoe_vault::Vault;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// Lookahead guesses waiting to start: `(later layer, [(expert, blob)])`.
type Deferred = Vec<(usize, Vec<(usize, usize)>)>;

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
    deferred: Mutex<Deferred>,
    /// Blobs handed out ahead of their layer's choice (`take_ready`), by expert key, until
    /// `settle` counts them against what the layer used.
    placed: Mutex<HashMap<usize, Placed>>,
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
        let mut stats = self.stats.lock().unwrap().clone();
        let (busy, depth) = {
            let busy = self.busy.lock().unwrap();
            (busy.secs(), busy.mean_depth())
        };
        stats.read_depth = depth;
        stats.cache_bytes = self.cache.lock().unwrap().used();
        stats.direct_io = self.reader.is_direct();
        (stats.buffer_allocs, stats.buffer_alloc_seconds) = self.pool.inline_allocs();
        stats.finish(busy);
        stats
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
/// the pool's own thread, `BufPool::fill`, not from idle readers: while reads ahead keep every
/// reader busy, none is idle, and a reader would stop reading to allocate.)
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

#[cfg(test)]
mod tests {
    use super::pool_keep;

    #[test]
    fn the_read_buffer_pool_is_bounded_by_bytes() {
        // Qwen3-30B-A3B's q4 blobs (2.6 MiB): 64; 235B-A22B's (10.6 MiB): what 256 MiB holds.
        assert_eq!(pool_keep(2_654_208), 64);
        assert_eq!(pool_keep(10_616_832), 25);
        assert_eq!(pool_keep(1 << 30), 8);
        assert_eq!(pool_keep(0), 64);
    }
}
