//! A sequence's state: one entry per layer, of the kind the layer's mixer keeps
//! (`spec::StateKind`), with the positions consumed so far. Everything that moves a sequence
//! back — the server's prefix reuse, a discarded pass queued ahead, a rejected draft — goes
//! through `rewind`, which forgets positions where every layer's state allows it and otherwise
//! restores a snapshot or starts over: a state that cannot be truncated is never reused at the
//! wrong position.
//!
//! On the CPU each layer's state lives here (`LayerState`); on the GPU the KV cache lives in
//! device memory (`gpu::GpuKv`, created at the first pass) and only the positions live here.

use crate::error::EngineError;
use crate::spec::StateKind;

/// One layer's state on the CPU.
#[derive(Debug, Clone)]
pub enum LayerState {
    /// Keys and values, `[position * width + i]`, preallocated for the capacity.
    Kv {
        k: Vec<f32>,
        v: Vec<f32>,
        width: usize,
    },
    /// A fixed-size recurrent state (f32), rewritten by every position: it cannot be truncated,
    /// only snapshotted and restored.
    Recurrent(Vec<f32>),
}

impl LayerState {
    fn new(kind: StateKind, capacity: usize) -> Self {
        match kind {
            StateKind::Kv { width } => LayerState::Kv {
                k: vec![0.0; capacity * width],
                v: vec![0.0; capacity * width],
                width,
            },
            StateKind::Recurrent { floats } => LayerState::Recurrent(vec![0.0; floats]),
        }
    }
}

/// What `SeqState::snapshot` keeps: the position, and a copy of every state that truncation
/// cannot restore (KV positions before it are never rewritten, so they need no copy).
#[derive(Debug, Clone)]
pub struct Snapshot {
    len: usize,
    recurrent: Vec<(usize, Vec<f32>)>,
}

impl Snapshot {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

pub struct SeqState {
    kinds: Vec<StateKind>,
    /// Per layer on the CPU; empty for a GPU model (its state is in `gpu`).
    layers: Vec<LayerState>,
    capacity: usize,
    len: usize,
    /// Snapshots taken with `checkpoint`, by position (only kept where truncation is not
    /// possible: elsewhere `rewind` needs none).
    checkpoints: Vec<Snapshot>,
    /// A GPU model's KV cache in device memory, created at its first pass.
    pub(crate) gpu: Option<Box<crate::gpu::GpuKv>>,
}

impl SeqState {
    /// A CPU sequence with room for `capacity` positions.
    pub fn new(kinds: Vec<StateKind>, capacity: usize) -> Self {
        let layers = kinds
            .iter()
            .map(|&k| LayerState::new(k, capacity))
            .collect();
        Self::with_layers(kinds, layers, capacity)
    }

    /// A GPU model's sequence: no host copy of the state.
    pub(crate) fn on_gpu(kinds: Vec<StateKind>, capacity: usize) -> Self {
        Self::with_layers(kinds, vec![], capacity)
    }

    fn with_layers(kinds: Vec<StateKind>, layers: Vec<LayerState>, capacity: usize) -> Self {
        SeqState {
            kinds,
            layers,
            capacity,
            len: 0,
            checkpoints: vec![],
            gpu: None,
        }
    }

    /// Positions consumed so far.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Fails, rather than overwriting, when `n` more positions do not fit.
    pub fn check_room(&self, n: usize) -> Result<(), EngineError> {
        if self.len + n > self.capacity {
            return Err(EngineError::ContextFull {
                needed: self.len + n,
                capacity: self.capacity,
            });
        }
        Ok(())
    }

    /// After a pass wrote `n` more positions into every layer's state.
    pub(crate) fn advance(&mut self, n: usize) {
        self.len += n;
    }

    /// Layer `l`'s state (CPU).
    pub(crate) fn layer_mut(&mut self, l: usize) -> &mut LayerState {
        &mut self.layers[l]
    }

    /// Whether every layer can be moved back by forgetting positions.
    pub fn truncatable(&self) -> bool {
        self.kinds.iter().all(|k| k.truncatable())
    }

    /// The state at the current position, to `restore` later.
    pub fn snapshot(&self) -> Snapshot {
        let recurrent = (self.layers.iter().enumerate())
            .filter_map(|(l, s)| match s {
                LayerState::Recurrent(v) => Some((l, v.clone())),
                LayerState::Kv { .. } => None,
            })
            .collect();
        Snapshot {
            len: self.len,
            recurrent,
        }
    }

    /// Back to a snapshot of this sequence taken at or before the current position.
    pub fn restore(&mut self, snap: &Snapshot) {
        debug_assert!(snap.len <= self.len, "a snapshot from this sequence's past");
        for (l, v) in &snap.recurrent {
            if let LayerState::Recurrent(s) = &mut self.layers[*l] {
                s.copy_from_slice(v);
            }
        }
        self.len = snap.len;
        self.checkpoints.retain(|c| c.len <= snap.len);
    }

    /// Remembers the current position as one `rewind` can return to where truncation is not
    /// possible (a prompt's end, before a draft). Nothing to keep where it is.
    pub fn checkpoint(&mut self) {
        if self.truncatable() || self.checkpoints.last().is_some_and(|c| c.len == self.len) {
            return;
        }
        self.checkpoints.push(self.snapshot());
    }

    /// Forgets the positions from `keep` on (keeping state for at most `keep` positions) and
    /// returns how many positions it kept: `keep` where every layer can be truncated; else the
    /// latest checkpoint at or before `keep`; else none (the caller feeds the tokens again).
    pub fn rewind(&mut self, keep: usize) -> usize {
        let keep = keep.min(self.len);
        if keep == self.len || self.truncatable() {
            self.len = keep;
            return keep;
        }
        match self.checkpoints.iter().rposition(|c| c.len <= keep) {
            Some(i) => {
                let snap = self.checkpoints[i].clone();
                self.restore(&snap);
            }
            None => self.clear(),
        }
        self.len
    }

    /// Back to the empty sequence.
    pub fn clear(&mut self) {
        self.len = 0;
        self.checkpoints.clear();
        for s in &mut self.layers {
            if let LayerState::Recurrent(v) = s {
                v.fill(0.0);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kv() -> StateKind {
        StateKind::Kv { width: 4 }
    }

    /// Feeds one position: KV layers write their row, recurrent ones fold the position in.
    fn feed(s: &mut SeqState, x: f32) {
        let pos = s.len();
        for l in 0..s.layers.len() {
            match s.layer_mut(l) {
                LayerState::Kv { k, v, width } => {
                    k[pos * *width..(pos + 1) * *width].fill(x);
                    v[pos * *width..(pos + 1) * *width].fill(-x);
                }
                LayerState::Recurrent(st) => st.iter_mut().for_each(|a| *a = *a * 0.5 + x),
            }
        }
        s.advance(1);
    }

    fn recurrent_of(s: &SeqState) -> Vec<f32> {
        match &s.layers[1] {
            LayerState::Recurrent(v) => v.clone(),
            LayerState::Kv { .. } => unreachable!(),
        }
    }

    #[test]
    fn kv_only_sequences_rewind_to_any_position() {
        let mut s = SeqState::new(vec![kv(), kv()], 8);
        (0..6).for_each(|i| feed(&mut s, i as f32));
        assert!(s.truncatable());
        assert_eq!(s.rewind(4), 4);
        assert_eq!(s.len(), 4);
        assert_eq!(s.rewind(9), 4, "never forward");
    }

    /// A recurrent layer cannot be truncated: a rewind lands on a checkpoint at or before the
    /// asked position, whose state equals a fresh run's there, or on the empty sequence —
    /// never on the state of a later position.
    #[test]
    fn untruncatable_state_is_restored_or_recomputed_never_misaligned() {
        let kinds = vec![kv(), StateKind::Recurrent { floats: 3 }];
        let mut s = SeqState::new(kinds.clone(), 16);
        assert!(!s.truncatable());
        (0..5).for_each(|i| feed(&mut s, i as f32));
        s.checkpoint();
        (5..9).for_each(|i| feed(&mut s, i as f32));
        // Keeping every position keeps the state as it is.
        let now = recurrent_of(&s);
        assert_eq!(s.rewind(9), 9);
        assert_eq!(recurrent_of(&s), now);
        // A prefix of 7 shared: the state at 7 is gone, the checkpoint at 5 is the latest.
        assert_eq!(s.rewind(7), 5);
        let mut fresh = SeqState::new(kinds.clone(), 16);
        (0..5).for_each(|i| feed(&mut fresh, i as f32));
        assert_eq!(recurrent_of(&s), recurrent_of(&fresh));
        // Continuing from there equals a fresh run.
        (5..7).for_each(|i| feed(&mut s, i as f32 + 0.25));
        (5..7).for_each(|i| feed(&mut fresh, i as f32 + 0.25));
        assert_eq!(recurrent_of(&s), recurrent_of(&fresh));
        // Before every checkpoint: start over.
        assert_eq!(s.rewind(3), 0);
        assert_eq!(recurrent_of(&s), vec![0.0; 3]);
    }

    #[test]
    fn snapshot_restore_round_trip_is_exact() {
        let mut s = SeqState::new(vec![kv(), StateKind::Recurrent { floats: 5 }], 8);
        (0..3).for_each(|i| feed(&mut s, 0.1 * i as f32));
        let snap = s.snapshot();
        let before = recurrent_of(&s);
        (3..6).for_each(|i| feed(&mut s, i as f32));
        assert_ne!(recurrent_of(&s), before);
        s.restore(&snap);
        assert_eq!(s.len(), 3);
        assert_eq!(recurrent_of(&s), before);
    }
}
