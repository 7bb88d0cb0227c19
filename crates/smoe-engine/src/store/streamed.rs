//! The streaming expert store: blobs are read from the vault on demand by a pool of reader
//! threads (one read per blob, in parallel), verified, kept in a bounded cache, and handed to
//! compute as they arrive — resident experts first, misses as their reads complete.

use super::aligned::AlignedBuf;
use super::cache::ExpertCache;
use super::reader::{BlobReader, FaultHook};
use super::stats::StoreStats;
use crate::error::EngineError;
use smoe_vault::Vault;
use std::collections::HashMap;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;

type ReadResult = (usize, Result<AlignedBuf, EngineError>, f64);

/// Where a finished read goes: to a layer waiting on it, or into a prefetch slot.
enum Reply {
    Now(Sender<ReadResult>),
    Prefetch(Arc<Pending>),
}

/// A lookahead read: filled by a reader thread, taken by the layer that needs it — or abandoned
/// by a layer that turned out not to need it (`abandon`).
#[derive(Default)]
pub struct Pending {
    slot: Mutex<Slot>,
    done: Condvar,
}

#[derive(Default)]
struct Slot {
    result: Option<ReadResult>,
    /// A reader took the job and is reading.
    started: bool,
    /// No layer will take it: a reader that has not started skips the read, one that has puts
    /// the blob straight into the cache.
    abandoned: bool,
}

/// What abandoning a lookahead read found.
enum Abandoned {
    /// Queued, not started: it will never be read.
    Cancelled,
    /// Being read: its reader caches it when done.
    InFlight,
    /// Already read.
    Done(ReadResult),
}

impl Pending {
    fn wait(&self) -> ReadResult {
        let mut g = self.slot.lock().unwrap();
        loop {
            if let Some(r) = g.result.take() {
                return r;
            }
            g = self.done.wait(g).unwrap();
        }
    }

    /// A reader takes the job: false if it was abandoned first (skip the read).
    fn start(&self) -> bool {
        let mut g = self.slot.lock().unwrap();
        g.started = !g.abandoned;
        g.started
    }

    /// A reader is done: hands the result to the waiting layer, or back (`Some`) when the read
    /// was abandoned meanwhile.
    fn finish(&self, r: ReadResult) -> Option<ReadResult> {
        let mut g = self.slot.lock().unwrap();
        if g.abandoned {
            return Some(r);
        }
        g.result = Some(r);
        self.done.notify_all();
        None
    }

    fn abandon(&self) -> Abandoned {
        let mut g = self.slot.lock().unwrap();
        if let Some(r) = g.result.take() {
            return Abandoned::Done(r);
        }
        g.abandoned = true;
        match g.started {
            true => Abandoned::InFlight,
            false => Abandoned::Cancelled,
        }
    }
}

struct Job {
    key: usize,
    layer: usize,
    expert: usize,
    blob: usize,
    reply: Reply,
}

pub struct StreamedStore {
    vault: Vault,
    pub(super) n_experts: usize,
    stride: usize,
    pub(super) cache: Mutex<ExpertCache>,
    pub(super) stats: Mutex<StoreStats>,
    jobs: Mutex<Sender<Job>>,
    reader: Arc<BlobReader>,
    /// Wall time during which at least one read was in flight, for read GB/s.
    busy: Mutex<(f64, usize, Option<Instant>)>,
    /// Lookahead reads in flight or done, by expert key, until their layer takes them.
    prefetched: Mutex<HashMap<usize, Arc<Pending>>>,
    /// A lookahead to start once the next `for_each_blob` has queued its own misses.
    deferred: Mutex<Option<(usize, Vec<(usize, usize)>)>>,
}

impl StreamedStore {
    pub fn new(
        vault: &Vault,
        budget: u64,
        threads: usize,
        fault: Option<FaultHook>,
    ) -> Result<Arc<Self>, EngineError> {
        let cfg = &vault.header.config;
        let x = vault
            .expert_section()
            .ok_or_else(|| EngineError::Invalid("vault has no experts".into()))?;
        let reader = BlobReader::open(vault.path(), fault)
            .map_err(|e| EngineError::Invalid(format!("{}: {e}", vault.path().display())))?;
        let (tx, rx) = channel::<Job>();
        let mut stats = StoreStats::new(cfg.num_layers);
        stats.cache_budget = budget;
        stats.direct_io = reader.is_direct();
        let store = Arc::new(StreamedStore {
            vault: vault.clone(),
            n_experts: cfg.num_experts,
            stride: x.blob_stride as usize,
            cache: Mutex::new(ExpertCache::new(budget, cfg.num_layers * cfg.num_experts)),
            stats: Mutex::new(stats),
            jobs: Mutex::new(tx),
            reader: Arc::new(reader),
            busy: Mutex::new((0.0, 0, None)),
            prefetched: Mutex::new(HashMap::new()),
            deferred: Mutex::new(None),
        });
        let rx = Arc::new(Mutex::new(rx));
        for i in 0..threads.max(1) {
            let (rx, weak) = (rx.clone(), Arc::downgrade(&store));
            std::thread::Builder::new()
                .name(format!("smoe-read-{i}"))
                .spawn(move || worker(rx, weak))
                .map_err(|e| EngineError::Invalid(format!("cannot start reader threads: {e}")))?;
        }
        Ok(store)
    }

    /// Reads, verifies and returns one blob (used by workers and by preloading).
    fn read_blob(
        &self,
        layer: usize,
        expert: usize,
        blob: usize,
    ) -> Result<AlignedBuf, EngineError> {
        let entry = &self.vault.expert_section().unwrap().blobs[blob];
        let fail = |what: String| EngineError::ExpertRead {
            layer,
            expert,
            reason: what,
        };
        let mut buf = AlignedBuf::new(self.stride)
            .ok_or_else(|| fail("out of memory for the read buffer".into()))?;
        self.reader
            .read(layer, expert, entry.offset, &mut buf)
            .map_err(|e| fail(e.to_string()))?;
        let used = self.vault.expert_section().unwrap().used_bytes as usize;
        self.vault
            .verify_expert(entry, &buf.as_slice()[..used])
            .map_err(|e| fail(e.to_string()))?;
        Ok(buf)
    }

    /// Loads `(layer, expert, blob)` into the cache ahead of use (profile preload), pinned.
    pub fn preload(&self, layer: usize, expert: usize, blob: usize) -> Result<bool, EngineError> {
        let key = layer * self.n_experts + expert;
        if self.cache.lock().unwrap().contains(key) {
            return Ok(true);
        }
        let buf = Arc::new(self.read_blob(layer, expert, blob)?);
        Ok(self.cache.lock().unwrap().insert(key, buf, true))
    }

    /// Starts reading the experts a later layer will probably need (not cached, not already
    /// coming), so the reads overlap this layer's compute.
    pub fn prefetch(&self, layer: usize, experts: &[(usize, usize)]) {
        let cache = self.cache.lock().unwrap();
        let mut pre = self.prefetched.lock().unwrap();
        let jobs = self.jobs.lock().unwrap();
        for &(e, blob) in experts {
            let key = layer * self.n_experts + e;
            if cache.contains(key) || pre.contains_key(&key) {
                continue;
            }
            let p = Arc::new(Pending::default());
            pre.insert(key, p.clone());
            let _ = jobs.send(Job {
                key,
                layer,
                expert: e,
                blob,
                reply: Reply::Prefetch(p),
            });
        }
    }

    /// As `prefetch`, but started by the next `for_each_blob` right after it queues its own
    /// misses: the reader threads take jobs in order, and a guess must not delay a read that is
    /// certainly needed.
    pub fn prefetch_after(&self, layer: usize, experts: Vec<(usize, usize)>) {
        *self.deferred.lock().unwrap() = Some((layer, experts));
    }

    /// Hands `f` each of `experts` (with their blob indices) of `layer` as its whole blob slot
    /// (`blob_stride` bytes, verified): cache hits first, then misses in the order their reads
    /// finish. The first failed read is returned after the others have drained; nothing from a
    /// failed read is cached.
    pub fn for_each_blob(
        &self,
        layer: usize,
        experts: &[(usize, usize)],
        f: &mut dyn FnMut(usize, &[u8]),
    ) -> Result<(), EngineError> {
        let mut hits = vec![];
        let mut misses = vec![];
        let mut pending = vec![];
        let stale: Vec<(usize, Arc<Pending>)>;
        {
            let mut cache = self.cache.lock().unwrap();
            let mut pre = self.prefetched.lock().unwrap();
            for &(e, blob) in experts {
                let key = layer * self.n_experts + e;
                match (cache.touch(key), pre.remove(&key)) {
                    (Some(buf), _) => hits.push((e, buf)),
                    (None, Some(p)) => pending.push(p),
                    (None, None) => misses.push((e, blob)),
                }
            }
            // Lookahead reads of this layer that turned out not to be needed.
            let range = layer * self.n_experts..(layer + 1) * self.n_experts;
            let keys: Vec<usize> = pre.keys().copied().filter(|k| range.contains(k)).collect();
            stale = keys
                .into_iter()
                .map(|k| (k, pre.remove(&k).unwrap()))
                .collect();
        }
        // Abandoned before this layer's own reads are queued: the readers skip the guesses that
        // have not started, so they never delay a needed read nor take disk bandwidth (at a
        // 10 % budget the disk is saturated and a third of the guesses are wrong), and nothing
        // waits for those already in flight.
        let (mut wasted, mut cancelled) = (0u64, 0u64);
        for (key, p) in stale {
            match p.abandon() {
                Abandoned::Cancelled => cancelled += 1,
                Abandoned::InFlight => wasted += 1,
                Abandoned::Done((_, r, _)) => {
                    wasted += 1;
                    self.keep_unneeded(key, r);
                }
            }
        }
        let (tx, rx) = channel();
        {
            let jobs = self.jobs.lock().unwrap();
            for &(e, blob) in &misses {
                let key = layer * self.n_experts + e;
                let job = Job {
                    key,
                    layer,
                    expert: e,
                    blob,
                    reply: Reply::Now(tx.clone()),
                };
                jobs.send(job)
                    .map_err(|_| EngineError::Invalid("reader threads stopped".into()))?;
            }
        }
        drop(tx);
        let deferred = self.deferred.lock().unwrap().take();
        if let Some((l, ex)) = deferred {
            self.prefetch(l, &ex);
        }
        let mut compute = 0.0;
        for (e, buf) in &hits {
            let t = Instant::now();
            f(*e, buf.as_slice());
            compute += t.elapsed().as_secs_f64();
        }
        let (mut wait, mut read, mut first_err) = (0.0, 0.0, None);
        let n_pending = pending.len();
        let mut pending = pending.into_iter();
        for _ in 0..n_pending + misses.len() {
            let t = Instant::now();
            // Lookahead reads were issued earlier, so they are the likeliest to be done.
            let got = match pending.next() {
                Some(p) => Some(p.wait()),
                None => rx.recv().ok(),
            };
            let Some((key, result, secs)) = got else {
                break;
            };
            wait += t.elapsed().as_secs_f64();
            read += secs;
            match result {
                Ok(buf) => {
                    let buf = Arc::new(buf);
                    let t = Instant::now();
                    f(key % self.n_experts, buf.as_slice());
                    compute += t.elapsed().as_secs_f64();
                    self.cache.lock().unwrap().insert(key, buf, false);
                }
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        // Unneeded lookahead reads that ran still count as bytes read (kept if the cache has room).
        let mut st = self.stats.lock().unwrap();
        let ls = &mut st.per_layer[layer];
        ls.hits += hits.len() as u64;
        ls.misses += (n_pending + misses.len()) as u64;
        ls.prefetched += n_pending as u64;
        ls.prefetch_wasted += wasted;
        ls.prefetch_cancelled += cancelled;
        ls.bytes_read += ((n_pending + misses.len() + wasted as usize) * self.stride) as u64;
        ls.read_seconds += read;
        ls.io_wait_seconds += wait;
        ls.compute_seconds += compute;
        first_err.map_or(Ok(()), Err)
    }

    pub fn tick(&self) {
        self.cache.lock().unwrap().tick();
    }

    /// Stats so far, with totals and the cache's current size.
    pub fn stats(&self) -> StoreStats {
        let mut st = self.stats.lock().unwrap().clone();
        let busy = self.busy.lock().unwrap().0;
        st.cache_bytes = self.cache.lock().unwrap().used();
        st.direct_io = self.reader.is_direct();
        st.finish(busy);
        st
    }

    pub fn reset_stats(&self) {
        self.stats.lock().unwrap().reset();
        self.busy.lock().unwrap().0 = 0.0;
    }

    /// A lookahead read the layer did not need: cached (not pinned) if the read succeeded and
    /// the cache has room; a failed one is dropped (nothing from a failed read is cached).
    fn keep_unneeded(&self, key: usize, r: Result<AlignedBuf, EngineError>) {
        if let Ok(buf) = r {
            self.cache.lock().unwrap().insert(key, Arc::new(buf), false);
        }
    }

    fn busy(&self, start: bool) {
        let mut b = self.busy.lock().unwrap();
        if start {
            if b.1 == 0 {
                b.2 = Some(Instant::now());
            }
            b.1 += 1;
        } else {
            b.1 -= 1;
            if b.1 == 0 {
                if let Some(t) = b.2.take() {
                    b.0 += t.elapsed().as_secs_f64();
                }
            }
        }
    }
}

/// A reader thread: takes jobs until the store is dropped.
fn worker(rx: Arc<Mutex<Receiver<Job>>>, store: std::sync::Weak<StreamedStore>) {
    loop {
        let job = match rx.lock().unwrap().recv() {
            Ok(j) => j,
            Err(_) => return,
        };
        let Some(store) = store.upgrade() else { return };
        if let Reply::Prefetch(p) = &job.reply {
            if !p.start() {
                continue;
            }
        }
        store.busy(true);
        let t = Instant::now();
        let result = store.read_blob(job.layer, job.expert, job.blob);
        let secs = t.elapsed().as_secs_f64();
        store.busy(false);
        match job.reply {
            Reply::Now(tx) => {
                let _ = tx.send((job.key, result, secs));
            }
            Reply::Prefetch(p) => {
                // Abandoned while it was read: the layer has moved on.
                if let Some((key, r, _)) = p.finish((job.key, result, secs)) {
                    store.keep_unneeded(key, r);
                }
            }
        }
    }
}
