//! The routing oracle's hook (`Tuning::route_oracle`), driven by an in-memory trace.

use super::*;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

/// The engine's oracle hook as this test drives it: it records the decode MoE layers' choices,
/// or replays them `depth` layers ahead until the run departs (smoe's own, reading and writing
/// a trace file, is in smoe-cli's `route_trace`).
struct TraceOracle {
    events: Mutex<Vec<(usize, Vec<u32>)>>,
    /// Replaying, this many MoE layers ahead; `None`: recording.
    depth: Option<usize>,
    cursor: Mutex<usize>,
    lost: AtomicBool,
}

impl TraceOracle {
    fn new(events: Vec<(usize, Vec<u32>)>, depth: Option<usize>) -> Arc<Self> {
        Arc::new(TraceOracle {
            events: Mutex::new(events),
            depth,
            cursor: Mutex::new(0),
            lost: AtomicBool::new(false),
        })
    }
}

impl RouteOracle for TraceOracle {
    fn used(&self, layer: usize, ids: &[u32]) -> Result<(), smoe_engine::EngineError> {
        let mut events = self.events.lock().unwrap();
        if self.depth.is_none() {
            events.push((layer, ids.to_vec()));
            return Ok(());
        }
        let mut c = self.cursor.lock().unwrap();
        match events.get(*c) {
            Some((l, e)) if *l == layer && e[..] == *ids => *c += 1,
            _ => self.lost.store(true, Ordering::Relaxed),
        }
        Ok(())
    }

    fn ahead(&self) -> Vec<(usize, Vec<u32>)> {
        let Some(depth) = self.depth.filter(|_| !self.lost.load(Ordering::Relaxed)) else {
            return vec![];
        };
        let events = self.events.lock().unwrap();
        let c = *self.cursor.lock().unwrap();
        // Up to the next use of a layer already listed.
        let mut seen = vec![];
        (events.iter().skip(c).take(depth))
            .take_while(|(l, _)| {
                let new = !seen.contains(l);
                seen.push(*l);
                new
            })
            .cloned()
            .collect()
    }

    fn replays(&self) -> bool {
        self.depth.is_some()
    }
}

/// The routing oracle (a measurement of the I/O bound, `Tuning::route_oracle`): a run records each
/// decode MoE layer's choice; replaying that trace, the decoder reads the true experts of the
/// next layers ahead instead of guessing — the same tokens, reads started ahead, none wasted.
/// At each halt the blobs it has read for later layers go into their slots too (fill-ahead),
/// so fewer layers halt than without that; the counts of misses stay those of reads.
#[test]
fn a_replayed_routing_trace_reads_ahead_and_changes_no_token() {
    if !have_gpu() {
        return;
    }
    let v = TempVault::new("tiny-qwen2moe", DType::Q4);
    // One prompt token: every pass is a decode batch, so every MoE layer is traced.
    let prompt = [5u32];
    let recorder = TraceOracle::new(vec![], None);
    let rec = open_traced(
        &v.0,
        CacheBudget::Bytes(0),
        DEFAULT_READ_PIECE,
        true,
        Some(recorder.clone()),
    );
    let want = greedy(&rec, &prompt, 24);
    drop(rec);
    let trace = recorder.events.lock().unwrap().clone();
    assert!(trace.len() >= 24, "{} traced layers", trace.len());
    let replayed = |fill_ahead: bool| {
        let oracle = TraceOracle::new(trace.clone(), Some(3));
        let e = open_traced(
            &v.0,
            CacheBudget::Bytes(0),
            DEFAULT_READ_PIECE,
            true,
            Some(oracle),
        );
        let Model::Gpu(g) = &e.model else {
            unreachable!()
        };
        g.set_fill_ahead(fill_ahead);
        assert_eq!(greedy(&e, &prompt, 24), want, "fill-ahead {fill_ahead}");
        let slots = g.slot_stats().unwrap();
        let store = e.model.experts().stats().unwrap().total;
        eprintln!(
            "replay, fill-ahead {fill_ahead}: {} oracle reads, {} misses ({} from disk), {} stops, {} placed ahead",
            slots.oracle_reads, slots.misses, store.misses, slots.stops, slots.placed_ahead
        );
        // No host cache: every VRAM miss, placed ahead or at a stop, is one disk read.
        assert_eq!(slots.misses, store.misses, "fill-ahead {fill_ahead}");
        (e, slots)
    };
    let (_, without) = replayed(false);
    assert_eq!(without.placed_ahead, 0);
    let (e, slots) = replayed(true);
    assert!(slots.placed_ahead > 0, "nothing placed ahead");
    assert!(
        slots.stops < without.stops,
        "{} stops with fill-ahead, {} without",
        slots.stops,
        without.stops
    );
    let store = e.model.experts().stats().unwrap().total;
    assert!(slots.oracle_reads > 0, "the oracle started no read");
    // Its guesses replace the decoder's own, and every one is used.
    assert_eq!(slots.spec_guesses, 0);
    assert_eq!(store.prefetched, 0, "lookahead guesses while replaying");
    assert_eq!(store.prefetch_wasted + store.prefetch_cancelled, 0);
    // A run that departs from the trace (another prompt) decodes as it would without one.
    let other = [7u32];
    let free = open(&v.0, CacheBudget::Resident);
    assert_eq!(greedy(&e, &other, 8), greedy(&free, &other, 8));
}
