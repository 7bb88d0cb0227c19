//! Blob reads split into pieces, and the queue the reader threads take pieces from.
//!
//! Two priorities: a read a layer needs now always goes before a lookahead guess, and at most a
//! few readers read guesses at a time, so a needed read that arrives finds at most those few
//! pieces ahead of it on the disk. Guesses therefore use the disk's idle time instead of its
//! bandwidth, and a guess that turns out wrong is dropped piece by piece: the pieces no reader
//! has started are never read. Guesses queue by the layer they are for, nearest first, so a
//! deeper lookahead's far guesses never hold up a nearer layer's. Several readers share one
//! blob's pieces, so on a device that wants a deep queue (NVMe) even a single miss is read at
//! the device's parallel speed.
//!
//! This file holds the queue and the types a read is described by; `blob` is one blob's read
//! (its pieces, its result, abandoning and promoting it), `pool` the read buffers reused
//! between reads.

mod blob;
mod pool;
#[cfg(test)]
mod tests;

pub use blob::{Abandoned, BlobRead, Finished};
pub use pool::BufPool;

use super::aligned::AlignedBuf;
use crate::error::EngineError;
use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

/// Where the pieces of a layer's missed blobs go as soon as each is read, on the reader threads,
/// besides into the host cache: `(expert, offset in the blob, bytes)`. The GPU backend copies
/// them into the expert's VRAM slot there, so the copies overlap the reads of other pieces
/// instead of following the last one.
pub type PieceSink = Arc<dyn Fn(usize, usize, &[u8]) + Send + Sync>;

/// Memory a blob is read straight into instead of a pooled buffer: on unified memory, the
/// expert's mapped GPU slot (`gpu::slots`), so the bytes move once. Such a blob is handed to
/// nobody and cached nowhere else.
#[derive(Clone, Copy)]
pub struct ReadTarget {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: a target is plain memory that its maker keeps valid and untouched until the read has
// finished (`ReadTarget::new`); the read's pieces write disjoint ranges of it.
unsafe impl Send for ReadTarget {}
unsafe impl Sync for ReadTarget {}

impl ReadTarget {
    /// # Safety
    /// `ptr` must be valid for writes of `len` bytes (the blob stride), and neither used nor
    /// freed by anyone else until the read into it has finished (its layer's wait returned).
    pub unsafe fn new(ptr: *mut u8, len: usize) -> Self {
        ReadTarget { ptr, len }
    }
}

/// A finished read: the expert key, the verified blob (or why not), seconds from its first
/// piece's start to its last piece's end.
pub type ReadResult = (usize, Result<AlignedBuf, EngineError>, f64);

#[derive(Clone, Copy, PartialEq, Debug)]
pub enum Priority {
    /// A layer waits for it.
    Needed,
    /// Lookahead: a later layer will probably need it.
    Guess,
}

/// The store's locks guard plain bookkeeping that a panicking holder leaves consistent (reader
/// panics are caught per piece): a poisoned lock is still used.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The reader threads' queue: one entry per piece still to read (an entry names the blob; the
/// blob hands out its pieces in order).
pub struct ReadQueue {
    state: Mutex<QueueState>,
    ready: Condvar,
    /// Readers that may read guesses at once.
    guess_readers: usize,
}

#[derive(Default)]
struct QueueState {
    needed: VecDeque<Arc<BlobRead>>,
    guesses: VecDeque<Arc<BlobRead>>,
    /// Readers reading a guess's piece now.
    guessing: usize,
    closed: bool,
}

/// A piece's entry as a reader took it.
pub struct Taken {
    pub read: Arc<BlobRead>,
    from_guesses: bool,
}

impl ReadQueue {
    pub fn new(guess_readers: usize) -> Self {
        ReadQueue {
            state: Mutex::default(),
            ready: Condvar::new(),
            guess_readers: guess_readers.max(1),
        }
    }

    fn state(&self) -> MutexGuard<'_, QueueState> {
        lock(&self.state)
    }

    /// Queues every piece of `read` at its priority: needed reads in arrival order, guesses by
    /// the layer they are for (arrival order within one layer).
    pub fn push(&self, read: &Arc<BlobRead>) {
        let priority = read.state().priority;
        let mut q = self.state();
        let pieces = std::iter::repeat_n(read.clone(), read.pieces);
        match priority {
            Priority::Needed => q.needed.extend(pieces),
            // Nearest layer first: a deeper lookahead queues its far guesses before the next
            // layer's own guess comes, which then must not wait behind them (the far ones are
            // right less often, and needed later).
            Priority::Guess => {
                let at = (q.guesses.iter())
                    .rposition(|r| r.layer <= read.layer)
                    .map_or(0, |i| i + 1);
                let farther = q.guesses.len() - at;
                q.guesses.extend(pieces);
                // (In place: the new pieces move from the back to `at`.)
                if farther > 0 {
                    q.guesses.make_contiguous()[at..].rotate_right(read.pieces);
                }
            }
        }
        drop(q);
        self.ready.notify_all();
    }

    /// A guess becomes needed: its pieces not yet started move to the needed queue (behind
    /// the needed reads already there).
    pub fn promote(&self, read: &Arc<BlobRead>) {
        let left = read.promote();
        let mut q = self.state();
        q.guesses.retain(|r| !Arc::ptr_eq(r, read));
        q.needed.extend(std::iter::repeat_n(read.clone(), left));
        drop(q);
        self.ready.notify_all();
    }

    /// Abandons a guess and forgets its queued pieces.
    pub fn abandon(&self, read: &Arc<BlobRead>) -> Abandoned {
        let a = read.abandon();
        self.state().guesses.retain(|r| !Arc::ptr_eq(r, read));
        a
    }

    /// Abandons a guess, with its queued pieces, only if no reader has started it; false
    /// (nothing changed) once one has.
    pub fn cancel_unstarted(&self, read: &Arc<BlobRead>) -> bool {
        let cancelled = read.abandon_if(true).is_some();
        if cancelled {
            self.state().guesses.retain(|r| !Arc::ptr_eq(r, read));
        }
        cancelled
    }

    /// The next piece's entry: needed ones first; a guess only while fewer than
    /// `guess_readers` readers read guesses. Waits for one; None once closed.
    pub fn pop(&self) -> Option<Taken> {
        let mut q = self.state();
        loop {
            if q.closed {
                return None;
            }
            if let Some(taken) = self.next(&mut q) {
                return Some(taken);
            }
            q = self.ready.wait(q).unwrap_or_else(|e| e.into_inner());
        }
    }

    fn next(&self, q: &mut QueueState) -> Option<Taken> {
        if let Some(read) = q.needed.pop_front() {
            return Some(Taken {
                read,
                from_guesses: false,
            });
        }
        if q.guessing < self.guess_readers {
            let read = q.guesses.pop_front()?;
            q.guessing += 1;
            return Some(Taken {
                read,
                from_guesses: true,
            });
        }
        None
    }

    /// The reader is done with what `pop` gave it.
    pub fn done(&self, taken: Taken) {
        if taken.from_guesses {
            self.state().guessing -= 1;
            self.ready.notify_all();
        }
    }

    /// Wakes every reader to stop.
    pub fn close(&self) {
        self.state().closed = true;
        self.ready.notify_all();
    }
}
