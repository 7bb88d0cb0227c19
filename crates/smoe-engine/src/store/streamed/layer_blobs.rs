//! Handing a layer's blobs to compute: hits at once, misses as their reads complete, lookahead
//! reads the layer used promoted and those it did not dropped; blobs placed ahead of the
//! layer's choice (`take_ready`) and counted once it has chosen (`settle`). Every blob a layer
//! gets is counted here as a hit, a miss, a lookahead read used or one wasted.

use super::StreamedStore;
use crate::error::EngineError;
use crate::store::aligned::AlignedBuf;
use crate::store::read_queue::{Abandoned, BlobRead, PieceSink, Priority, ReadTarget};
use std::sync::Arc;
use std::time::Instant;

/// A blob `take_ready` handed out before its layer chose: what to count once it has.
#[derive(Debug, Clone, Copy)]
pub(super) enum Placed {
    /// From the cache: a hit if used.
    Cached,
    /// A read started ahead (`guess`: as a lookahead guess) and done: a miss read ahead if
    /// used, a wasted read if not.
    Read { guess: bool, secs: f64 },
}

/// A layer's experts as `for_each_blob` finds them.
struct Found {
    /// Cached: handed over at once.
    hits: Vec<(usize, Arc<AlignedBuf>)>,
    /// Read ahead (as lookahead guesses, or early as needed reads): waited for with the misses.
    read_ahead: Vec<Arc<BlobRead>>,
    /// Neither cached nor coming: `(expert, blob)`, to read now.
    misses: Vec<(usize, usize)>,
    /// Reads ahead of this layer's experts that it did not ask for, or found cached after all.
    stale: Vec<Arc<BlobRead>>,
}

/// What handing a layer's blobs over took: seconds in the caller's function, waiting for reads,
/// and the reads' own time (first piece's start to last piece's end); and the first failed read.
#[derive(Default)]
struct Handover {
    compute: f64,
    io_wait: f64,
    read_secs: f64,
    first_err: Option<EngineError>,
}

impl StreamedStore {
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
        let found = self.find(layer, experts);
        // Dropped before this layer's own reads are queued: the pieces no reader has started
        // are never read, and nothing waits for those being read.
        let (wasted, cancelled) = self.drop_stale(found.stale);
        // Guesses that were right go first (they started earlier), then the new reads.
        for read in &found.read_ahead {
            self.queue.promote(read);
        }
        let n_read_ahead = found.read_ahead.len();
        // (Reads started early as needed ones are misses, not lookahead reads used.)
        let n_lookahead = found.read_ahead.iter().filter(|r| r.guess).count();
        let mut waits = found.read_ahead;
        waits.extend(self.queue_misses(layer, &found.misses, (sink, targets)));
        self.start_deferred(layer);
        let handed = self.hand_over(&found.hits, &waits, f);
        // (Bytes read are counted by the readers, piece by piece, unneeded guesses included.)
        let mut stats = self.stats.lock().unwrap();
        let counts = &mut stats.per_layer[layer];
        counts.hits += found.hits.len() as u64;
        counts.misses += (n_read_ahead + found.misses.len()) as u64;
        counts.prefetched += n_lookahead as u64;
        counts.prefetch_wasted += wasted;
        counts.prefetch_cancelled += cancelled;
        counts.read_seconds += handed.read_secs;
        counts.io_wait_seconds += handed.io_wait;
        counts.compute_seconds += handed.compute;
        handed.first_err.map_or(Ok(()), Err)
    }

    /// Sorts `experts` of `layer` into hits (touched in the cache), reads ahead (taken out of
    /// `prefetched`) and misses, and takes out the layer's other reads ahead as stale.
    fn find(&self, layer: usize, experts: &[(usize, usize)]) -> Found {
        let mut found = Found {
            hits: vec![],
            read_ahead: vec![],
            misses: vec![],
            stale: vec![],
        };
        let mut cache = self.cache.lock().unwrap();
        let mut pre = self.prefetched.lock().unwrap();
        for &(e, blob) in experts {
            let key = layer * self.n_experts + e;
            match (cache.touch(key), pre.remove(&key)) {
                (Some(buf), p) => {
                    found.hits.push((e, buf));
                    found.stale.extend(p);
                }
                (None, Some(p)) => found.read_ahead.push(p),
                (None, None) => found.misses.push((e, blob)),
            }
        }
        // Lookahead reads of this layer that turned out not to be needed.
        let range = self.keys_of(layer);
        let keys: Vec<usize> = pre.keys().copied().filter(|k| range.contains(k)).collect();
        (found.stale).extend(keys.into_iter().map(|k| pre.remove(&k).unwrap()));
        found
    }

    /// Abandons reads ahead that their layer did not need; a whole blob among them is cached.
    /// Returns how many were read (or are being read) for nothing, and how many no reader had
    /// started.
    fn drop_stale(&self, stale: Vec<Arc<BlobRead>>) -> (u64, u64) {
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
        (wasted, cancelled)
    }

    /// Queues needed reads of `misses` of `layer`: into their expert's target if it has one,
    /// otherwise to `sink` (if any) piece by piece.
    fn queue_misses(
        &self,
        layer: usize,
        misses: &[(usize, usize)],
        (sink, targets): (Option<&PieceSink>, &[(usize, ReadTarget)]),
    ) -> Vec<Arc<BlobRead>> {
        let mut reads = vec![];
        for &(e, blob) in misses {
            let target = targets.iter().find(|t| t.0 == e).map(|t| t.1);
            let to = match target {
                Some(_) => (None, target),
                None => (sink.cloned(), None),
            };
            let read = self.new_read((layer, e, blob), Priority::Needed, to);
            self.queue.push(&read);
            reads.push(read);
        }
        reads
    }

    /// Starts the lookahead guesses `prefetch_after` deferred, now that `layer` has queued its
    /// own misses. (Guesses for this layer or earlier ones are stale: a pass ended before their
    /// use.)
    fn start_deferred(&self, layer: usize) {
        let deferred = std::mem::take(&mut *self.deferred.lock().unwrap());
        for (l, ex) in deferred.into_iter().filter(|(l, _)| *l > layer) {
            self.prefetch(l, &ex);
        }
    }

    /// Hands `f` the hits, then each read as it completes (a read into a target or to a sink
    /// is not handed to `f`); caches what was read unless it landed in a target.
    fn hand_over(
        &self,
        hits: &[(usize, Arc<AlignedBuf>)],
        waits: &[Arc<BlobRead>],
        f: &mut dyn FnMut(usize, &[u8]),
    ) -> Handover {
        let mut handed = Handover::default();
        for (e, buf) in hits {
            let t = Instant::now();
            f(*e, buf.as_slice());
            handed.compute += t.elapsed().as_secs_f64();
        }
        for read in waits {
            let t = Instant::now();
            let (key, result, secs) = read.wait();
            handed.io_wait += t.elapsed().as_secs_f64();
            handed.read_secs += secs;
            match result {
                // Landed in its target: nothing to hand on or keep.
                Ok(_) if read.target.is_some() => {}
                Ok(buf) => {
                    let buf = Arc::new(buf);
                    if read.sink.is_none() {
                        let t = Instant::now();
                        f(key % self.n_experts, buf.as_slice());
                        handed.compute += t.elapsed().as_secs_f64();
                    }
                    self.insert(key, buf, false);
                }
                Err(e) => {
                    handed.first_err.get_or_insert(e);
                }
            }
        }
        handed
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
        let mut stats = self.stats.lock().unwrap();
        let counts = &mut stats.per_layer[layer];
        for (key, p) in settled {
            let was_used = used.contains(&(key - range.start));
            match (p, was_used) {
                (Placed::Cached, true) => counts.hits += 1,
                (Placed::Cached, false) => {}
                (Placed::Read { guess, secs }, true) => {
                    counts.misses += 1;
                    counts.prefetched += guess as u64;
                    counts.read_seconds += secs;
                }
                (Placed::Read { secs, .. }, false) => {
                    counts.prefetch_wasted += 1;
                    counts.read_seconds += secs;
                }
            }
        }
    }

    /// Drops the lookahead guesses for `layer` that no reader has started: it ran without
    /// asking for its experts (the GPU found every one it chose in VRAM), so none was needed
    /// now, and their pieces would only delay later reads. Guesses already being read or read
    /// stay, where a later use of the layer finds them. (Reads started as needed stay too.)
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
}
