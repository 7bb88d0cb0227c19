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

use super::aligned::AlignedBuf;
use crate::error::EngineError;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Instant;

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

/// Blob-sized read buffers for reuse. Getting 2.5 MiB of aligned, zeroed memory from the OS
/// costs page faults and a memset (with its unmapping, about 1 ms per miss on the H200 host,
/// measured as time the GPU path's router stops spent outside reads and uploads), and the
/// store needs one per read: evicted cache entries, dropped guesses and failed reads come back
/// here instead, and while the cache grows (nothing evicted to recycle) a thread of its own
/// (`fill`) keeps spares ready, so that a reader does not stop reading to allocate.
pub struct BufPool {
    len: usize,
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

/// One blob being read, in pieces the reader threads take in order.
pub struct BlobRead {
    pub key: usize,
    pub layer: usize,
    pub expert: usize,
    pub blob: usize,
    pub offset: u64,
    /// Started as a lookahead guess (not as a read some layer was known to need).
    pub guess: bool,
    len: usize,
    piece: usize,
    pieces: usize,
    state: Mutex<ReadState>,
    done: Condvar,
    /// Where the buffer goes when the read is dropped without handing it on.
    pool: Arc<BufPool>,
    /// Gets each piece as it is read (`PieceSink`).
    pub sink: Option<PieceSink>,
    /// Read into this memory instead of a pooled buffer (`ReadTarget`).
    pub target: Option<ReadTarget>,
}

impl Drop for BlobRead {
    fn drop(&mut self) {
        let buf = self
            .state
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .buf
            .take();
        if let Some(buf) = buf {
            self.pool.give(buf);
        }
    }
}

// SAFETY: the pieces handed out point into the `AlignedBuf` held by `state`, which is neither
// moved out nor freed while a reader holds a piece (see `ReadState::buf`); each piece's range
// is handed to one reader.
unsafe impl Send for BlobRead {}
unsafe impl Sync for BlobRead {}

struct ReadState {
    /// Taken from the pool by the first reader (off the layer's thread: a fresh buffer costs
    /// page faults). Handed on only when `unfinished` is 0 (no reader is writing into it) and
    /// the blob is whole; otherwise it goes back to the pool with the read.
    buf: Option<AlignedBuf>,
    /// The next piece to hand out (`pieces`: none left).
    next: usize,
    /// Pieces handed out or still to hand out that have not finished.
    unfinished: usize,
    /// Pieces read successfully.
    read: usize,
    failed: Option<String>,
    priority: Priority,
    abandoned: bool,
    started: Option<Instant>,
    result: Option<ReadResult>,
}

/// What abandoning a guess found.
pub enum Abandoned {
    /// No piece was started: nothing of it is read.
    Cancelled,
    /// Pieces are being read; the rest are dropped (a whole blob read meanwhile is cached by
    /// its last reader).
    InFlight,
    /// Already read.
    Done(ReadResult),
}

/// What a finished piece leaves to its reader.
pub enum Finished {
    /// Other pieces are still out, or a dropped guess is incomplete.
    Nothing,
    /// The blob is whole (or failed) and nobody waits for it any more: the reader decides
    /// what to keep.
    Unneeded(ReadResult),
}

impl BlobRead {
    /// A read of the pool's buffer length (a multiple of 16 KiB) at `offset`, in pieces of
    /// `piece` bytes (a multiple of 16 KiB).
    pub fn new(
        (key, layer, expert, blob): (usize, usize, usize, usize),
        offset: u64,
        piece: usize,
        (priority, sink, target): (Priority, Option<PieceSink>, Option<ReadTarget>),
        pool: &Arc<BufPool>,
    ) -> Arc<Self> {
        let len = pool.len;
        assert!(
            target.is_none_or(|t| t.len == len),
            "a read target holds one blob"
        );
        let pieces = len.div_ceil(piece).max(1);
        Arc::new(BlobRead {
            key,
            layer,
            expert,
            blob,
            offset,
            guess: priority == Priority::Guess,
            len,
            piece,
            pieces,
            state: Mutex::new(ReadState {
                buf: None,
                next: 0,
                unfinished: pieces,
                read: 0,
                failed: None,
                priority,
                abandoned: false,
                started: None,
                result: None,
            }),
            done: Condvar::new(),
            pool: pool.clone(),
            sink,
            target,
        })
    }

    fn state(&self) -> MutexGuard<'_, ReadState> {
        lock(&self.state)
    }

    /// Hands the next unread piece to a reader: its index, file offset and destination, or
    /// why it cannot be read (no memory for the buffer: finish it with that error). None when
    /// no piece is left (all taken, the read failed, or the guess was dropped).
    // (Each piece's slice is handed out once, under the lock: readers hold disjoint parts of
    // one buffer, which `&self` cannot express — see the SAFETY note below.)
    #[allow(clippy::type_complexity, clippy::mut_from_ref)]
    pub fn take_piece(&self) -> Option<Result<(usize, u64, &mut [u8]), String>> {
        let mut s = self.state();
        if s.next == self.pieces {
            return None;
        }
        let i = s.next;
        s.next += 1;
        s.started.get_or_insert_with(Instant::now);
        if s.buf.is_none() {
            s.buf = match self.target {
                // SAFETY: `ReadTarget::new`'s promise: valid and ours until the read finishes.
                Some(t) => Some(unsafe { AlignedBuf::borrowed(t.ptr, t.len) }),
                None => self.pool.take(),
            };
        }
        let Some(buf) = s.buf.as_mut() else {
            return Some(Err("out of memory for the read buffer".into()));
        };
        let start = i * self.piece;
        let len = self.piece.min(self.len - start);
        // SAFETY: piece i's range is in bounds, handed out once (under the lock), and the
        // buffer stays where it is until this piece is finished (`unfinished` counts it).
        let dst = unsafe { std::slice::from_raw_parts_mut(buf.as_mut_ptr().add(start), len) };
        Some(Ok((i, self.offset + start as u64, dst)))
    }

    /// A reader is done with a piece. When it was the last one out, the blob is verified by
    /// `verify` (outside the lock) and handed to the waiting layer, or back to the reader when
    /// nobody waits any more.
    pub fn finish_piece(
        &self,
        ok: Result<(), String>,
        verify: impl FnOnce(AlignedBuf) -> Result<AlignedBuf, EngineError>,
    ) -> Finished {
        let (buf, failed, started) = {
            let mut s = self.state();
            match ok {
                Ok(()) => s.read += 1,
                Err(e) => {
                    // Nothing more of a failed blob is read.
                    s.failed.get_or_insert(e);
                    s.unfinished -= self.pieces - s.next;
                    s.next = self.pieces;
                }
            }
            s.unfinished -= 1;
            if s.unfinished > 0 {
                return Finished::Nothing;
            }
            let failed = s.failed.take();
            // A failed read or an incomplete dropped guess keeps its buffer (for the pool).
            let buf = match failed.is_none() && s.read == self.pieces {
                true => s.buf.take(),
                false => None,
            };
            (buf, failed, s.started)
        };
        let secs = started.map_or(0.0, |t| t.elapsed().as_secs_f64());
        let result = match (failed, buf) {
            (Some(reason), _) => Err(EngineError::ExpertRead {
                layer: self.layer,
                expert: self.expert,
                reason,
            }),
            (None, Some(buf)) => verify(buf),
            // A dropped guess, incomplete: nothing to keep.
            (None, None) => return Finished::Nothing,
        };
        let r = (self.key, result, secs);
        let mut s = self.state();
        if s.abandoned {
            return Finished::Unneeded(r);
        }
        s.result = Some(r);
        self.done.notify_all();
        Finished::Nothing
    }

    /// Whether the blob is read (or failed), so that `wait` would not block.
    pub fn is_done(&self) -> bool {
        self.state().result.is_some()
    }

    /// Waits until the blob is read (or failed).
    pub fn wait(&self) -> ReadResult {
        let mut s = self.state();
        loop {
            if let Some(r) = s.result.take() {
                return r;
            }
            s = self.done.wait(s).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// A guess the layer turned out not to need: its pieces not yet started are dropped.
    pub fn abandon(&self) -> Abandoned {
        self.abandon_if(false)
            .expect("abandoned whether started or not")
    }

    /// `abandon`, or with `unstarted_only` only if no reader has started it (None, and nothing
    /// changed, if one has).
    fn abandon_if(&self, unstarted_only: bool) -> Option<Abandoned> {
        let mut s = self.state();
        let started = s.next > 0;
        // (A read with a result was started.)
        if unstarted_only && started {
            return None;
        }
        if let Some(r) = s.result.take() {
            return Some(Abandoned::Done(r));
        }
        s.abandoned = true;
        s.unfinished -= self.pieces - s.next;
        s.next = self.pieces;
        Some(match started {
            true => Abandoned::InFlight,
            false => Abandoned::Cancelled,
        })
    }

    /// A guess the layer needs after all: its remaining pieces, to queue as needed.
    fn promote(&self) -> usize {
        let mut s = self.state();
        if s.priority == Priority::Needed {
            // Already queued as needed (read early): its pieces are in that queue.
            return 0;
        }
        s.priority = Priority::Needed;
        self.pieces - s.next
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    const KIB16: usize = 16 * 1024;

    fn read_in(pool: &Arc<BufPool>, key: usize, priority: Priority) -> Arc<BlobRead> {
        BlobRead::new((key, 0, key, key), 0, KIB16, (priority, None, None), pool)
    }

    fn read(key: usize, pieces: usize, priority: Priority) -> Arc<BlobRead> {
        read_in(&Arc::new(BufPool::new(pieces * KIB16, 4)), key, priority)
    }

    fn finish(r: &BlobRead, ok: bool) -> Finished {
        let res = if ok { Ok(()) } else { Err("bad".into()) };
        r.finish_piece(res, Ok)
    }

    #[test]
    fn needed_pieces_go_first_and_guesses_are_capped() {
        let q = ReadQueue::new(1);
        let g = read(1, 2, Priority::Guess);
        let n = read(2, 2, Priority::Needed);
        q.push(&g);
        q.push(&n);
        let a = q.pop().unwrap();
        let b = q.pop().unwrap();
        assert_eq!((a.read.key, b.read.key), (2, 2));
        let c = q.pop().unwrap();
        assert_eq!(c.read.key, 1);
        // One guess reader is busy: the next guess piece waits until it is done.
        let st = q.state();
        assert_eq!((st.guessing, st.guesses.len()), (1, 1));
        drop(st);
        q.done(c);
        let d = q.pop().unwrap();
        assert_eq!(d.read.key, 1);
        q.done(a);
        q.done(b);
        q.done(d);
    }

    #[test]
    fn guesses_for_nearer_layers_are_read_first() {
        let q = ReadQueue::new(8);
        let pool = Arc::new(BufPool::new(KIB16, 4));
        let guess = |key, layer| {
            BlobRead::new(
                (key, layer, key, key),
                0,
                KIB16,
                (Priority::Guess, None, None),
                &pool,
            )
        };
        // Pushed as a deeper lookahead pushes them (one layer's far guesses before a later
        // layer's near ones): taken by layer, in push order within a layer.
        for (key, layer) in [(1, 5), (2, 7), (3, 6), (4, 5), (5, 9), (6, 2)] {
            q.push(&guess(key, layer));
        }
        let order: Vec<usize> = (0..6).map(|_| q.pop().unwrap().read.key).collect();
        assert_eq!(order, [6, 1, 4, 3, 2, 5]);
    }

    #[test]
    fn a_blob_is_handed_over_when_its_last_piece_ends() {
        let r = read(7, 3, Priority::Needed);
        let pieces: Vec<(usize, u64, usize)> = (0..3)
            .map(|_| {
                let (i, off, dst) = r.take_piece().unwrap().unwrap();
                dst.fill(i as u8 + 1);
                (i, off, dst.len())
            })
            .collect();
        assert_eq!(
            pieces,
            vec![
                (0, 0, KIB16),
                (1, KIB16 as u64, KIB16),
                (2, 2 * KIB16 as u64, KIB16)
            ]
        );
        assert!(r.take_piece().is_none());
        assert!(matches!(finish(&r, true), Finished::Nothing));
        assert!(matches!(finish(&r, true), Finished::Nothing));
        assert!(matches!(finish(&r, true), Finished::Nothing));
        let (key, buf, _) = r.wait();
        let buf = buf.unwrap();
        assert_eq!(key, 7);
        assert_eq!(buf.as_slice()[0], 1);
        assert_eq!(buf.as_slice()[2 * KIB16], 3);
    }

    #[test]
    fn a_failed_piece_stops_the_rest_and_fails_the_blob() {
        let r = read(3, 4, Priority::Needed);
        let _ = r.take_piece().unwrap();
        let _ = r.take_piece().unwrap();
        assert!(matches!(finish(&r, false), Finished::Nothing));
        assert!(r.take_piece().is_none(), "nothing more is read");
        assert!(matches!(finish(&r, true), Finished::Nothing));
        assert!(r.wait().1.is_err());
    }

    #[test]
    fn an_abandoned_guess_stops_and_a_promoted_one_jumps_the_queue() {
        let q = ReadQueue::new(4);
        let never = read(1, 3, Priority::Guess);
        q.push(&never);
        assert!(matches!(q.abandon(&never), Abandoned::Cancelled));
        assert!(never.take_piece().is_none());
        // Started, then abandoned: the piece out finishes, the blob is incomplete, dropped.
        let half = read(2, 3, Priority::Guess);
        let _ = half.take_piece().unwrap();
        assert!(matches!(half.abandon(), Abandoned::InFlight));
        assert!(half.take_piece().is_none());
        assert!(matches!(finish(&half, true), Finished::Nothing));
        // Abandoned while its last piece was out: whole, so its reader gets it to keep.
        let late = read(3, 1, Priority::Guess);
        let _ = late.take_piece().unwrap();
        assert!(matches!(late.abandon(), Abandoned::InFlight));
        assert!(matches!(
            finish(&late, true),
            Finished::Unneeded((3, Ok(_), _))
        ));
        // A guess promoted ahead of later guesses.
        let other = read(4, 1, Priority::Guess);
        let wanted = read(5, 2, Priority::Guess);
        q.push(&other);
        q.push(&wanted);
        q.promote(&wanted);
        assert_eq!(q.pop().unwrap().read.key, 5);
        assert_eq!(q.pop().unwrap().read.key, 5);
        assert_eq!(q.pop().unwrap().read.key, 4);
        q.close();
        assert!(q.pop().is_none());
    }

    #[test]
    fn buffers_of_reads_not_handed_on_go_back_to_the_pool() {
        let pool = Arc::new(BufPool::new(2 * KIB16, 2));
        assert!(pool.top_up(), "a spare is allocated");
        assert!(!pool.top_up(), "up to half of `keep`");
        let r = read_in(&pool, 1, Priority::Guess);
        assert!(matches!(r.abandon(), Abandoned::Cancelled));
        drop(r);
        assert_eq!(pool.spare(), 1, "a cancelled guess took no buffer");
        let r = read_in(&pool, 2, Priority::Needed);
        let _ = r.take_piece().unwrap();
        assert_eq!(pool.spare(), 0, "reused by the first piece");
        assert!(matches!(finish(&r, false), Finished::Nothing));
        assert!(r.wait().1.is_err());
        drop(r);
        assert_eq!(pool.spare(), 1, "a failed read");
        let r = read_in(&pool, 3, Priority::Needed);
        for _ in 0..2 {
            let _ = r.take_piece().unwrap();
        }
        finish(&r, true);
        finish(&r, true);
        let buf = r.wait().1.unwrap();
        drop(r);
        assert_eq!(pool.spare(), 0, "a whole blob is handed on, not pooled");
        pool.give_shared(Arc::new(buf));
        pool.give(AlignedBuf::new(2 * KIB16).unwrap());
        pool.give(AlignedBuf::new(2 * KIB16).unwrap());
        assert_eq!(pool.spare(), 2, "at most `keep` wait");
        assert_eq!(pool.inline_allocs().0, 0, "every take found a spare");
    }

    #[test]
    fn the_pools_thread_keeps_spares_ready_and_ends_with_the_pool() {
        let pool = Arc::new(BufPool::new(KIB16, 8));
        let weak = Arc::downgrade(&pool);
        let filler = std::thread::spawn(move || BufPool::fill(weak));
        let ready = |n: usize| {
            let until = Instant::now() + std::time::Duration::from_secs(10);
            while pool.spare() < n && Instant::now() < until {
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            pool.spare()
        };
        assert_eq!(ready(4), 4, "half of `keep` allocated ahead");
        let taken: Vec<_> = (0..4).map(|_| pool.take().unwrap()).collect();
        assert_eq!(ready(4), 4, "refilled after the takes");
        assert_eq!(pool.inline_allocs().0, 0);
        drop(taken);
        drop(pool);
        filler.join().unwrap();
    }
}
