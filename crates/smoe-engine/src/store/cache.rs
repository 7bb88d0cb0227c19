//! Which expert blobs stay in memory: a byte budget, frequency-with-decay eviction, and a pinned
//! hot set that eviction never touches.

use super::aligned::AlignedBuf;
use std::collections::HashMap;
use std::sync::Arc;

/// Per-step decay of an expert's use count: ~70-step half-life, long enough to keep a topic's
/// experts, short enough to follow a change of topic.
const DECAY: f64 = 0.99;

pub struct ExpertCache {
    budget: u64,
    used: u64,
    entries: HashMap<usize, Entry>,
    /// Decayed use count and the step it was last brought up to date, per expert key.
    score: Vec<(f64, u64)>,
    step: u64,
    /// Buffers evicted or refused by `insert`, for the store to reuse (`take_released`).
    released: Vec<Arc<AlignedBuf>>,
}

struct Entry {
    buf: Arc<AlignedBuf>,
    pinned: bool,
}

impl ExpertCache {
    pub fn new(budget: u64, n_keys: usize) -> Self {
        ExpertCache {
            budget,
            used: 0,
            entries: HashMap::new(),
            score: vec![(0.0, 0); n_keys],
            step: 0,
            released: vec![],
        }
    }

    pub fn budget(&self) -> u64 {
        self.budget
    }

    pub fn used(&self) -> u64 {
        self.used
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn contains(&self, key: usize) -> bool {
        self.entries.contains_key(&key)
    }

    /// One decode step (or prefill chunk) has passed: older uses weigh less.
    pub fn tick(&mut self) {
        self.step += 1;
    }

    fn decayed(&self, key: usize) -> f64 {
        let (s, at) = self.score[key];
        s * DECAY.powi((self.step - at) as i32)
    }

    /// Records a use and returns the cached blob, if any.
    pub fn touch(&mut self, key: usize) -> Option<Arc<AlignedBuf>> {
        self.score[key] = (self.decayed(key) + 1.0, self.step);
        self.entries.get(&key).map(|e| e.buf.clone())
    }

    /// Keeps `buf` if it fits the budget, evicting colder unpinned blobs that nobody is using.
    /// Returns whether it was kept.
    /// What `insert` evicted or refused since the last call: blob-sized buffers to reuse.
    pub fn take_released(&mut self) -> Vec<Arc<AlignedBuf>> {
        std::mem::take(&mut self.released)
    }

    pub fn insert(&mut self, key: usize, buf: Arc<AlignedBuf>, pinned: bool) -> bool {
        let size = buf.len() as u64;
        if size > self.budget || self.entries.contains_key(&key) {
            self.released.push(buf);
            return false;
        }
        while self.used + size > self.budget {
            let victim = self
                .entries
                .iter()
                .filter(|(_, e)| !e.pinned && Arc::strong_count(&e.buf) == 1)
                .map(|(&k, _)| (k, self.decayed(k)))
                .filter(|&(_, s)| pinned || s <= self.decayed(key))
                .min_by(|a, b| a.1.total_cmp(&b.1));
            match victim {
                Some((k, _)) => {
                    let e = self.entries.remove(&k).unwrap();
                    self.used -= e.buf.len() as u64;
                    self.released.push(e.buf);
                }
                // Everything resident is hotter (or in use): do not displace it.
                None => {
                    self.released.push(buf);
                    return false;
                }
            }
        }
        self.used += size;
        self.entries.insert(key, Entry { buf, pinned });
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn blob() -> Arc<AlignedBuf> {
        Arc::new(AlignedBuf::new(16384).unwrap())
    }

    #[test]
    fn evicts_the_coldest_and_respects_pins_and_budget() {
        let mut c = ExpertCache::new(3 * 16384, 10);
        for k in [0, 1, 2] {
            c.touch(k);
            assert!(c.insert(k, blob(), k == 0));
        }
        // Key 1 is used a lot, key 2 once; key 0 is pinned.
        for _ in 0..5 {
            c.tick();
            c.touch(1);
        }
        c.touch(3);
        c.touch(3);
        assert!(c.insert(3, blob(), false));
        assert!(c.contains(0) && c.contains(1) && c.contains(3) && !c.contains(2));
        assert_eq!(c.used(), 3 * 16384);
        assert_eq!(c.take_released().len(), 1, "the evicted buffer, to reuse");
        // A cold newcomer does not displace hotter blobs.
        c.touch(4);
        assert!(!c.insert(4, blob(), false));
        assert_eq!(c.take_released().len(), 1, "the refused buffer, to reuse");
        // A zero budget keeps nothing.
        let mut z = ExpertCache::new(0, 2);
        assert!(!z.insert(0, blob(), false));
    }

    #[test]
    fn blobs_in_use_are_not_evicted() {
        let mut c = ExpertCache::new(16384, 3);
        c.touch(0);
        assert!(c.insert(0, blob(), false));
        let held = c.touch(0).unwrap();
        for _ in 0..3 {
            c.touch(1);
        }
        assert!(!c.insert(1, blob(), false));
        drop(held);
        assert!(c.insert(1, blob(), false));
    }
}
