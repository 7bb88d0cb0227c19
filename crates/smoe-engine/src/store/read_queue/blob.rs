//! One blob's read: the pieces the reader threads take from it in order, the buffer they write
//! into, and the result its layer waits for. A guess can be abandoned (its unstarted pieces
//! dropped) or promoted to a needed read while its pieces are out.

use super::{lock, BufPool, PieceSink, Priority, ReadResult, ReadTarget};
use crate::error::EngineError;
use crate::store::aligned::AlignedBuf;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Instant;

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
    pub(super) pieces: usize,
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

pub(super) struct ReadState {
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
    pub(super) priority: Priority,
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

    pub(super) fn state(&self) -> MutexGuard<'_, ReadState> {
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
    pub(super) fn abandon_if(&self, unstarted_only: bool) -> Option<Abandoned> {
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
    pub(super) fn promote(&self) -> usize {
        let mut s = self.state();
        if s.priority == Priority::Needed {
            // Already queued as needed (read early): its pieces are in that queue.
            return 0;
        }
        s.priority = Priority::Needed;
        self.pieces - s.next
    }
}
