//! What the expert store did: hits, misses, bytes, and where the time went.

use serde::Serialize;

#[derive(Debug, Clone, Default, Serialize)]
pub struct LayerStats {
    pub hits: u64,
    pub misses: u64,
    pub bytes_read: u64,
    /// Misses whose read was started a layer early (lookahead).
    pub prefetched: u64,
    /// Lookahead reads of experts the layer did not use.
    pub prefetch_wasted: u64,
    /// Lookahead guesses the layer did not need, dropped before their read started.
    pub prefetch_cancelled: u64,
    /// Summed time of the reads themselves (they overlap each other and compute).
    pub read_seconds: f64,
    /// Time the compute thread waited for a read to finish.
    pub io_wait_seconds: f64,
    /// Time spent computing this layer's experts.
    pub compute_seconds: f64,
    /// The lookahead guesses for this layer, scored against what it used: how well one layer's
    /// input predicts the next layer's routing, whatever the cache held.
    pub lookahead: Recall,
}

/// Guesses scored against what was then used: experts used while a guess for them existed,
/// and how many of those the guess named.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Recall {
    pub checked: u64,
    pub named: u64,
}

impl Recall {
    /// One guess against the distinct experts `used`.
    pub fn of<T: PartialEq>(guess: &[T], used: &[T]) -> Self {
        Recall {
            checked: used.len() as u64,
            named: used.iter().filter(|e| guess.contains(e)).count() as u64,
        }
    }

    pub fn add(&mut self, o: Recall) {
        self.checked += o.checked;
        self.named += o.named;
    }

    /// The share of the used experts the guesses named (None: nothing checked).
    pub fn share(&self) -> Option<f64> {
        (self.checked > 0).then(|| self.named as f64 / self.checked as f64)
    }
}

impl LayerStats {
    fn add(&mut self, o: &LayerStats) {
        self.hits += o.hits;
        self.misses += o.misses;
        self.bytes_read += o.bytes_read;
        self.prefetched += o.prefetched;
        self.prefetch_wasted += o.prefetch_wasted;
        self.prefetch_cancelled += o.prefetch_cancelled;
        self.read_seconds += o.read_seconds;
        self.io_wait_seconds += o.io_wait_seconds;
        self.compute_seconds += o.compute_seconds;
        self.lookahead.add(o.lookahead);
    }
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct StoreStats {
    pub total: LayerStats,
    pub hit_rate: f64,
    /// Of the experts the layers used, the share the previous MoE layer's lookahead named
    /// (`total.lookahead`; None where nothing was checked).
    pub lookahead_recall: Option<f64>,
    /// Bytes read ÷ time the reader threads were busy (aggregate throughput of the device).
    pub read_gb_per_s: f64,
    /// Reads (pieces) in flight on average while at least one was: how deep a queue the disk
    /// saw during that busy time (at most the reader threads).
    pub read_depth: f64,
    pub cache_bytes: u64,
    /// Read buffers a reader had to allocate itself (no spare was ready), and the seconds it
    /// spent on that instead of reading.
    pub buffer_allocs: u64,
    pub buffer_alloc_seconds: f64,
    pub cache_budget: u64,
    pub direct_io: bool,
    pub per_layer: Vec<LayerStats>,
}

impl StoreStats {
    pub fn new(layers: usize) -> Self {
        StoreStats {
            per_layer: vec![LayerStats::default(); layers],
            ..Default::default()
        }
    }

    /// Recomputes the totals and ratios from the per-layer numbers.
    pub fn finish(&mut self, wall_read_seconds: f64) {
        let mut t = LayerStats::default();
        for l in &self.per_layer {
            t.add(l);
        }
        let uses = t.hits + t.misses;
        self.hit_rate = if uses > 0 {
            t.hits as f64 / uses as f64
        } else {
            0.0
        };
        self.read_gb_per_s = if wall_read_seconds > 0.0 {
            t.bytes_read as f64 / wall_read_seconds / 1e9
        } else {
            0.0
        };
        self.lookahead_recall = t.lookahead.share();
        self.total = t;
    }

    pub fn reset(&mut self) {
        let n = self.per_layer.len();
        *self = StoreStats {
            cache_budget: self.cache_budget,
            direct_io: self.direct_io,
            ..StoreStats::new(n)
        };
    }
}

#[cfg(test)]
mod tests {
    use super::Recall;

    #[test]
    fn recall_is_the_share_of_used_experts_a_guess_named() {
        let mut r = Recall::default();
        assert_eq!(r.share(), None, "nothing checked");
        r.add(Recall::of(&[1u32, 2, 3, 4], &[2, 4, 6, 8]));
        r.add(Recall::of(&[5u32], &[5, 7]));
        assert_eq!((r.checked, r.named), (6, 3));
        assert_eq!(r.share(), Some(0.5));
    }
}
