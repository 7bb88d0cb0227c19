//! The pool of blob-sized read buffers, and the thread that keeps spares ready so that a reader
//! never stops reading to allocate.

use super::lock;
use crate::store::aligned::AlignedBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Instant;

/// Blob-sized read buffers for reuse. Getting 2.5 MiB of aligned, zeroed memory from the OS
/// costs page faults and a memset (with its unmapping, on the order of a millisecond per
/// blob), and the store needs one per read: evicted cache entries, dropped guesses and failed reads come back
/// here instead, and while the cache grows (nothing evicted to recycle) a thread of its own
/// (`fill`) keeps spares ready, so that a reader does not stop reading to allocate.
pub struct BufPool {
    /// Bytes per buffer: one blob stride.
    pub(super) len: usize,
    free: Mutex<Vec<AlignedBuf>>,
    keep: usize,
    /// Signalled when `take` leaves fewer than half of `keep` spare.
    low: Condvar,
    /// Buffers `take` found no spare for and allocated itself, and the nanoseconds that took.
    inline: (AtomicU64, AtomicU64),
}

impl BufPool {
    /// Buffers of `len` bytes; at most `keep` wait for reuse (the rest are freed).
    pub fn new(len: usize, keep: usize) -> Self {
        BufPool {
            len,
            free: Mutex::default(),
            keep,
            low: Condvar::new(),
            inline: Default::default(),
        }
    }

    /// The spare-keeping thread's loop (`StreamedStore` starts one): `top_up` while it allocates,
    /// otherwise wait until `take` finds the spares low. Returns once the pool is dropped.
    pub fn fill(pool: std::sync::Weak<BufPool>) {
        while let Some(p) = pool.upgrade() {
            if p.top_up() {
                continue;
            }
            // (Timeouts, so that a dropped pool is noticed.)
            let wait = std::time::Duration::from_millis(100);
            let free = p.free();
            if free.len() >= p.keep / 2 {
                let _ = p.low.wait_timeout(free, wait);
            } else {
                // Out of memory: try again later rather than spin.
                drop(free);
                std::thread::sleep(wait);
            }
        }
    }

    /// Allocates one spare buffer (touching its pages) while fewer than half of `keep` wait,
    /// so that reads find their memory ready while the cache grows (no evictions yet to
    /// recycle). False when there was nothing to do.
    pub fn top_up(&self) -> bool {
        if self.free().len() >= self.keep / 2 {
            return false;
        }
        let buf = AlignedBuf::new(self.len);
        let made = buf.is_some();
        if let Some(buf) = buf {
            self.give(buf);
        }
        made
    }

    fn free(&self) -> MutexGuard<'_, Vec<AlignedBuf>> {
        lock(&self.free)
    }

    /// A buffer (its old contents are overwritten by the read), or None when out of memory.
    pub fn take(&self) -> Option<AlignedBuf> {
        let reused = {
            let mut free = self.free();
            let b = free.pop();
            if free.len() < self.keep / 2 {
                self.low.notify_one();
            }
            b
        };
        reused.or_else(|| {
            let t = Instant::now();
            let b = AlignedBuf::new(self.len);
            self.inline.0.fetch_add(1, Ordering::Relaxed);
            let ns = t.elapsed().as_nanos() as u64;
            self.inline.1.fetch_add(ns, Ordering::Relaxed);
            b
        })
    }

    /// Buffers `take` allocated itself (no spare was ready), and the seconds that took: time
    /// a reader spent not reading.
    pub fn inline_allocs(&self) -> (u64, f64) {
        let (n, ns) = &self.inline;
        (
            n.load(Ordering::Relaxed),
            ns.load(Ordering::Relaxed) as f64 * 1e-9,
        )
    }

    pub fn reset_inline_allocs(&self) {
        self.inline.0.store(0, Ordering::Relaxed);
        self.inline.1.store(0, Ordering::Relaxed);
    }

    pub fn give(&self, buf: AlignedBuf) {
        let mut free = self.free();
        if buf.len() == self.len && free.len() < self.keep && !buf.is_borrowed() {
            free.push(buf);
        }
    }

    /// Gives back a shared buffer nobody else holds.
    pub fn give_shared(&self, buf: Arc<AlignedBuf>) {
        if let Ok(buf) = Arc::try_unwrap(buf) {
            self.give(buf);
        }
    }

    /// Buffers waiting for reuse.
    pub fn spare(&self) -> usize {
        self.free().len()
    }
}
