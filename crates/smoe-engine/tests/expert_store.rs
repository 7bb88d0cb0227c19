//! The streaming expert store: tokens never depend on the cache size, stats add up, faults fail
//! the request (naming layer and expert) without poisoning the cache, profiles round-trip.

use smoe_engine::engine::EngineOptions;
use smoe_engine::store::{CacheBudget, StoreOptions, DEFAULT_READ_PIECE};
use smoe_engine::Engine;
use smoe_vault::DType;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

mod common;
use common::{check_deeper_guesses, deep_lookahead_store, greedy, TempVault};

fn open(path: &Path, budget: CacheBudget, profile: bool) -> Engine {
    open_with(
        path,
        budget,
        profile,
        smoe_engine::store::DEFAULT_READ_PIECE,
    )
}

fn open_with(path: &Path, budget: CacheBudget, profile: bool, read_piece: usize) -> Engine {
    let store = StoreOptions {
        vram_budget: None,
        vram_limit: None,
        budget,
        profile,
        read_threads: 4,
        read_piece,
        fault: None,
        tuning: Default::default(),
    };
    Engine::open(
        path,
        EngineOptions {
            store,
            ..Default::default()
        },
    )
    .unwrap()
}

#[test]
fn tokens_do_not_depend_on_the_cache() {
    for name in ["tiny-dense-mix", "tiny-qwen2moe", "tiny-yarn"] {
        let v = TempVault::new(name, DType::Q4);
        let path = v.path();
        let prompt: Vec<u32> = (3..50).collect();
        let resident = open(path, CacheBudget::Resident, false);
        let want_tokens = greedy(&resident, &prompt, 24);
        let want_lp = resident.logprobs(&prompt).unwrap().logprobs;
        // 16 KiB pieces: every blob of these fixtures is read by several readers at once.
        for (budget, piece) in [
            (CacheBudget::Bytes(0), DEFAULT_READ_PIECE),
            (CacheBudget::Bytes(0), 16 << 10),
            (CacheBudget::Fraction(0.25), DEFAULT_READ_PIECE),
            (CacheBudget::Fraction(0.25), 16 << 10),
            (CacheBudget::Fraction(1.0), DEFAULT_READ_PIECE),
        ] {
            let e = open_with(path, budget, false, piece);
            assert!(e.model.experts().is_streaming());
            assert_eq!(greedy(&e, &prompt, 24), want_tokens, "{name} {budget:?}");
            // Expert outputs are summed in a fixed order: identical, not merely close.
            assert_eq!(
                e.logprobs(&prompt).unwrap().logprobs,
                want_lp,
                "{name} {budget:?}"
            );
            let st = e.model.experts().stats().unwrap();
            assert!(st.total.misses > 0);
            match budget {
                CacheBudget::Bytes(0) => {
                    assert_eq!(st.total.hits, 0, "{name}: a zero budget keeps nothing");
                    assert_eq!(st.cache_bytes, 0);
                }
                CacheBudget::Fraction(f) if f == 1.0 => {
                    let c = e.model.config();
                    let experts = c.moe_layers().count() * c.num_experts;
                    assert!(
                        st.total.misses as usize <= experts,
                        "{name}: each expert is read at most once"
                    );
                    assert!(st.hit_rate > 0.5);
                }
                _ => assert!(st.cache_bytes <= st.cache_budget),
            }
            let stride = e.vault.expert_section().unwrap().blob_stride;
            if piece < DEFAULT_READ_PIECE {
                assert!(
                    stride > piece as u64,
                    "{name}: blobs of one piece test nothing here"
                );
            }
            // Every miss is one whole blob read; an unneeded lookahead read is a blob read in
            // part or whole (its pieces not started when it was dropped are never read).
            let t = &st.total;
            assert!(
                t.bytes_read >= t.misses * stride
                    && t.bytes_read <= (t.misses + t.prefetch_wasted) * stride,
                "{name} {budget:?}: {t:?}"
            );
            assert!(st.total.prefetched > 0, "{name}: lookahead reads were used");
        }
    }
}

/// A deeper lookahead (the routers of the next MoE layers guess too): the same tokens, more
/// guessed reads than one layer ahead, fewer when a guess keeps only its best-ranked expert per
/// token; a depth or top out of range fails the load, named.
#[test]
fn a_deeper_lookahead_reads_further_ahead_and_changes_no_token() {
    let store = deep_lookahead_store;
    let open_store = |path: &Path, store| {
        Engine::open(
            path,
            EngineOptions {
                store,
                ..Default::default()
            },
        )
    };
    for name in ["tiny-dense-mix", "tiny-qwen2moe"] {
        let v = TempVault::new(name, DType::Q4);
        let prompt: Vec<u32> = (3..40).collect();
        let want = greedy(&open(v.path(), CacheBudget::Resident, false), &prompt, 24);
        let guessed = |depth, top| {
            let e = open_store(v.path(), store(depth, top)).unwrap();
            assert_eq!(greedy(&e, &prompt, 24), want, "{name}, depth {depth}");
            let t = e.model.experts().stats().unwrap().total;
            t.prefetched + t.prefetch_wasted + t.prefetch_cancelled
        };
        check_deeper_guesses(name, v.path(), guessed);
    }
    let v = TempVault::new("tiny-qwen2moe", DType::Q4);
    for (depth, top, named) in [
        (0, None, "lookahead depth 0"),
        (5, None, "lookahead depth 5"),
        (2, Some(0), "lookahead top 0"),
    ] {
        let err = open_store(v.path(), store(depth, top))
            .err()
            .map(|e| e.to_string());
        assert!(err.as_ref().is_some_and(|e| e.contains(named)), "{err:?}");
    }
}

#[test]
fn a_failed_read_fails_the_request_names_the_expert_and_is_not_cached() {
    let v = TempVault::new("tiny-tied", DType::Q4);
    let path = v.path();
    let failing = Arc::new(AtomicBool::new(true));
    let flag = failing.clone();
    let fault: smoe_engine::store::FaultHook = Arc::new(move |layer, _expert| {
        (layer == 1 && flag.load(Ordering::SeqCst))
            .then(|| std::io::Error::other("injected I/O error"))
    });
    // Pieces of 16 KiB: the injected error hits a piece of a blob others are reading too.
    let e = open_with_fault(path, CacheBudget::Fraction(1.0), fault);
    let prompt: Vec<u32> = (10..30).collect();
    let err = e.logprobs(&prompt).unwrap_err().to_string();
    assert!(
        err.contains("of layer 1") && err.contains("injected I/O error"),
        "{err}"
    );
    // The same engine keeps serving once the device recovers, and gives the right answer.
    failing.store(false, Ordering::SeqCst);
    let got = e.logprobs(&prompt).unwrap().logprobs;
    let want = open(path, CacheBudget::Resident, false)
        .logprobs(&prompt)
        .unwrap()
        .logprobs;
    assert_eq!(got, want);
}

#[test]
fn a_corrupt_blob_is_reported_with_layer_and_expert() {
    let v = TempVault::new("tiny-tied", DType::Q4);
    let path = v.path();
    let v = smoe_vault::Vault::open(path).unwrap();
    let blob = v.expert_entry(2, 5).unwrap().offset as usize;
    drop(v);
    let mut bytes = std::fs::read(path).unwrap();
    bytes[blob + 7] ^= 0x55;
    std::fs::write(path, &bytes).unwrap();
    for budget in [CacheBudget::Bytes(0), CacheBudget::Resident] {
        let e = open(path, budget, false);
        // Enough tokens that every expert of layer 2 is used.
        let prompt: Vec<u32> = (0..400).map(|i| (i * 37 % 1000) as u32).collect();
        let err = e.logprobs(&prompt).unwrap_err().to_string();
        assert!(
            err.contains("layer 2 expert 5") && err.contains("checksum"),
            "{budget:?}: {err}"
        );
    }
}

#[test]
fn the_profile_is_saved_and_preloads_the_next_start() {
    let v = TempVault::new("tiny-dense-mix", DType::Q4);
    let path = v.path();
    let prompt: Vec<u32> = (5..60).collect();
    {
        let e = open(path, CacheBudget::Fraction(0.5), true);
        e.logprobs(&prompt).unwrap();
        e.model.experts().save_profile().unwrap();
    }
    let profile = smoe_engine::store::profile::Profile::path_for(path);
    assert!(profile.exists());
    let e = open(path, CacheBudget::Fraction(0.5), true);
    let mut calls = 0;
    let loaded = e.model.experts().preload(&mut |_, _| calls += 1).unwrap();
    assert!(loaded > 0 && calls == loaded);
    e.model.experts().reset_stats();
    e.logprobs(&prompt).unwrap();
    let st = e.model.experts().stats().unwrap();
    assert!(st.total.hits > 0, "preloaded experts are hits");
    // Without profiles nothing is preloaded.
    let e = open(path, CacheBudget::Fraction(0.5), false);
    assert_eq!(e.model.experts().preload(&mut |_, _| {}).unwrap(), 0);
}

type ReadLog = Arc<std::sync::Mutex<Vec<(usize, usize)>>>;

/// A store with one reader thread that logs each read (layer, expert) and takes `ms` for it.
fn slow_logged_store(v: &TempVault, ms: u64) -> (smoe_engine::store::Experts, ReadLog) {
    let reads = ReadLog::default();
    let log = reads.clone();
    let fault: smoe_engine::store::FaultHook = Arc::new(move |layer, expert| {
        log.lock().unwrap().push((layer, expert));
        std::thread::sleep(std::time::Duration::from_millis(ms));
        None
    });
    let opts = StoreOptions {
        vram_budget: None,
        vram_limit: None,
        budget: CacheBudget::Fraction(1.0),
        profile: false,
        read_threads: 1,
        read_piece: DEFAULT_READ_PIECE,
        fault: Some(fault),
        tuning: Default::default(),
    };
    let vault = smoe_vault::Vault::open(v.path()).unwrap();
    let experts = smoe_engine::store::Experts::open(&vault, &opts).unwrap();
    (experts, reads)
}

/// A lookahead guess the layer turns out not to need is dropped unread when its read has not
/// started: one reader thread held 300 ms by the first read, so the other three guesses are still
/// queued when the layer asks for expert 0 only.
#[test]
fn wrong_lookahead_guesses_are_dropped_unread() {
    let v = TempVault::new("tiny-tied", DType::Q4);
    let (experts, reads) = slow_logged_store(&v, 300);
    experts.prefetch(0, &[0, 1, 2, 3]);
    let mut got = vec![];
    experts
        .for_each_blob(0, &[0], (None, &[]), &mut |e, bytes| {
            got.push((e, bytes.len()))
        })
        .unwrap();
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].0, 0);
    // Let the reader drain its queue: the dropped guesses must not be read.
    std::thread::sleep(std::time::Duration::from_millis(400));
    assert_eq!(*reads.lock().unwrap(), vec![(0, 0)]);
    let st = experts.stats().unwrap();
    assert_eq!(st.total.prefetched, 1, "{st:?}");
    assert_eq!(st.total.prefetch_cancelled, 3, "{st:?}");
    assert_eq!(st.total.prefetch_wasted, 0, "{st:?}");
    assert_eq!(st.total.bytes_read as usize, got[0].1, "{st:?}");
}

/// A layer that ran without asking for its experts (on the GPU: all it chose sat in VRAM)
/// drops its guesses no reader has started: they are never read. The one being read stays a
/// guess its layer can still use, and reads started as needed and other layers' guesses are
/// untouched. (One reader, each read held 200 ms.)
#[test]
fn a_layer_that_ran_drops_its_queued_guesses() {
    let v = TempVault::new("tiny-tied", DType::Q4);
    let (experts, reads) = slow_logged_store(&v, 200);
    assert_eq!(experts.prefetch(0, &[0, 1, 2]), 3);
    // Once the one reader has started guess 0.
    wait_for_a_read(&reads);
    assert_eq!(experts.fetch_early(0, &[3]), 1);
    assert_eq!(experts.prefetch(1, &[0]), 1);
    experts.drop_guesses(0);
    experts
        .for_each_blob(1, &[0], (None, &[]), &mut |_, _| {})
        .unwrap();
    experts
        .for_each_blob(0, &[0, 3], (None, &[]), &mut |_, _| {})
        .unwrap();
    std::thread::sleep(std::time::Duration::from_millis(300));
    let mut read = reads.lock().unwrap().clone();
    read.sort_unstable();
    assert_eq!(read, vec![(0, 0), (0, 3), (1, 0)]);
    let st = experts.stats().unwrap();
    assert_eq!(st.per_layer[0].prefetch_cancelled, 2, "{st:?}");
    assert_eq!(st.per_layer[0].prefetch_wasted, 0, "{st:?}");
    assert_eq!(st.per_layer[0].prefetched, 1, "{st:?}");
    assert_eq!(st.per_layer[1].prefetched, 1, "{st:?}");
}

/// Waits until the logged store's reader has started a read (it logs as it starts).
fn wait_for_a_read(reads: &ReadLog) {
    let t = std::time::Instant::now();
    while reads.lock().unwrap().is_empty() {
        assert!(t.elapsed().as_secs() < 10, "the reader never started");
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}

/// Layer 0 takes experts 3 and 4, then layer 1 its guesses 0, 1 and 2 (still wanted); with one
/// reader, whose first read was guess 0, the reads ran in the order: guess 0, the two layer-0
/// reads, the other guesses.
fn layer_0_then_the_guesses(experts: &smoe_engine::store::Experts, reads: &ReadLog) {
    let mut got = vec![];
    experts
        .for_each_blob(0, &[3, 4], (None, &[]), &mut |e, _| got.push(e))
        .unwrap();
    got.sort_unstable();
    assert_eq!(got, vec![3, 4]);
    experts
        .for_each_blob(1, &[0, 1, 2], (None, &[]), &mut |_, _| {})
        .unwrap();
    assert_eq!(
        *reads.lock().unwrap(),
        vec![(1, 0), (0, 3), (0, 4), (1, 1), (1, 2)]
    );
}

/// Needed reads go before lookahead guesses: with one reader (which may read one guess at a
/// time) and every piece held 250 ms, the layer's two misses are read right after the guess
/// piece already started, ahead of the two guesses still queued, which follow.
#[test]
fn needed_reads_overtake_queued_guesses() {
    let v = TempVault::new("tiny-tied", DType::Q4);
    let (experts, reads) = slow_logged_store(&v, 250);
    experts.prefetch(1, &[0, 1, 2]);
    // Once the reader has started the first guess (it logs as it starts).
    wait_for_a_read(&reads);
    layer_0_then_the_guesses(&experts, &reads);
    let st = experts.stats().unwrap();
    assert_eq!(st.total.prefetched, 3, "{st:?}");
    assert_eq!(st.total.prefetch_wasted + st.total.prefetch_cancelled, 0);
}

/// Reads started early for a layer that certainly needs them (`fetch_early`, the GPU's
/// speculative pass) are needed reads: they overtake queued guesses, stay pending until read,
/// and count as misses, not as lookahead reads used.
#[test]
fn reads_started_early_are_needed_reads() {
    let v = TempVault::new("tiny-tied", DType::Q4);
    let (experts, reads) = slow_logged_store(&v, 250);
    assert_eq!(experts.prefetch(1, &[0, 1, 2]), 3, "reads started");
    assert_eq!(experts.prefetch(1, &[1, 2]), 0, "already coming");
    wait_for_a_read(&reads);
    experts.fetch_early(0, &[3, 4]);
    assert_eq!(experts.pending(0, &[3, 4, 5]), vec![3, 4, 5]);
    layer_0_then_the_guesses(&experts, &reads);
    assert_eq!(experts.pending(0, &[3, 4, 5]), vec![5], "read and cached");
    let st = experts.stats().unwrap();
    assert_eq!(st.per_layer[0].misses, 2, "{st:?}");
    assert_eq!(st.per_layer[0].prefetched, 0, "{st:?}");
    assert_eq!(st.total.prefetched, 3, "{st:?}");
}

/// An engine on `path` whose store reads through `fault`: 2 readers, 16 KiB pieces.
fn open_with_fault(
    path: &Path,
    budget: CacheBudget,
    fault: smoe_engine::store::FaultHook,
) -> Engine {
    let store = StoreOptions {
        vram_budget: None,
        vram_limit: None,
        budget,
        profile: false,
        read_threads: 2,
        read_piece: 16 << 10,
        fault: Some(fault),
        tuning: Default::default(),
    };
    let opts = EngineOptions {
        store,
        ..Default::default()
    };
    Engine::open(path, opts).unwrap()
}

/// The streaming store of `v` with every expert cacheable, 3 readers and 16 KiB pieces; with
/// its vault and blob stride.
fn store_of_pieces(v: &TempVault) -> (smoe_vault::Vault, smoe_engine::store::Experts, usize) {
    let opts = StoreOptions {
        vram_budget: None,
        vram_limit: None,
        budget: CacheBudget::Fraction(1.0),
        profile: false,
        read_threads: 3,
        read_piece: 16 << 10,
        fault: None,
        tuning: Default::default(),
    };
    let vault = smoe_vault::Vault::open(v.path()).unwrap();
    let experts = smoe_engine::store::Experts::open(&vault, &opts).unwrap();
    let stride = vault.expert_section().unwrap().blob_stride as usize;
    (vault, experts, stride)
}

/// With a piece sink (what the GPU backend copies into VRAM slots from the reader threads),
/// every piece of each blob read afresh reaches the sink exactly once and together they are
/// the blob; `f` gets only the hits and the lookahead reads; the blobs are cached as usual.
#[test]
fn a_piece_sink_gets_every_piece_of_the_blobs_read_afresh() {
    use smoe_engine::store::PieceSink;
    use std::collections::BTreeMap;
    use std::sync::Mutex;
    let v = TempVault::new("tiny-tied", DType::Q4);
    let (_vault, experts, stride) = store_of_pieces(&v);
    assert!(stride > 16 << 10, "blobs of several pieces");
    let pieces: Arc<Mutex<BTreeMap<(usize, usize), Vec<u8>>>> = Arc::default();
    let into = pieces.clone();
    let sink: PieceSink = Arc::new(move |e, at, bytes| {
        let old = into.lock().unwrap().insert((e, at), bytes.to_vec());
        assert!(old.is_none(), "piece {at} of expert {e} twice");
    });
    // Expert 2 is cached first, expert 5 read ahead: only 0 and 7 are read afresh.
    experts
        .for_each_blob(1, &[2], (None, &[]), &mut |_, _| {})
        .unwrap();
    experts.prefetch(1, &[5]);
    let mut whole = vec![];
    experts
        .for_each_blob(1, &[0, 2, 5, 7], (Some(&sink), &[]), &mut |e, _| {
            whole.push(e)
        })
        .unwrap();
    whole.sort_unstable();
    assert_eq!(whole, vec![2, 5]);
    let pieces = pieces.lock().unwrap();
    for e in [0, 7] {
        let mut blob = vec![];
        for ((x, at), bytes) in pieces.iter() {
            if *x == e {
                assert_eq!(*at, blob.len(), "pieces in order, none missing");
                blob.extend_from_slice(bytes);
            }
        }
        assert_eq!(blob.len(), stride);
        let mut cached = vec![];
        experts
            .for_each_blob(1, &[e], (None, &[]), &mut |_, b| cached = b.to_vec())
            .unwrap();
        assert_eq!(
            blob, cached,
            "expert {e}: the sink saw the blob that was cached"
        );
    }
    assert_eq!(pieces.keys().filter(|(e, _)| *e != 0 && *e != 7).count(), 0);
}

/// Read targets (what a mapped GPU slot on unified memory gives the store): a blob read afresh
/// lands in its target, verified there, and is neither handed to `f` nor cached; a blob the
/// store has already goes to `f` as usual. The targets here are deliberately not 4 KiB
/// aligned (direct I/O refuses such memory: those reads go through the page cache instead).
#[test]
fn reads_land_in_their_targets() {
    use smoe_engine::store::ReadTarget;
    let v = TempVault::new("tiny-tied", DType::Q4);
    let (vault, experts, stride) = store_of_pieces(&v);
    experts
        .for_each_blob(1, &[2], (None, &[]), &mut |_, _| {})
        .unwrap();
    let mut mem = vec![0xAAu8; 3 * stride + 64];
    let base = mem.as_mut_ptr();
    // SAFETY: two disjoint blob-sized ranges of `mem`, untouched until the call returns.
    let targets = [0usize, 7].map(|e| {
        let at = 8 + if e == 0 { 0 } else { stride + 24 };
        (e, unsafe { ReadTarget::new(base.add(at), stride) })
    });
    let mut handed = vec![];
    experts
        .for_each_blob(1, &[0, 2, 7], (None, &targets), &mut |e, _| handed.push(e))
        .unwrap();
    assert_eq!(handed, vec![2], "only the cached blob goes to f");
    for (e, at) in [(0, 8), (7, stride + 32)] {
        let got = &mem[at..at + stride];
        let want = vault.expert_bytes_mapped(vault.expert_entry(1, e).unwrap());
        assert_eq!(&got[..want.len()], want, "expert {e} landed whole");
    }
    // Not cached: asking again reads it afresh (into a buffer of the store's, handed to f).
    let before = experts.stats().unwrap().total.misses;
    let mut again = vec![];
    experts
        .for_each_blob(1, &[0], (None, &[]), &mut |e, _| again.push(e))
        .unwrap();
    assert_eq!(again, vec![0]);
    assert_eq!(experts.stats().unwrap().total.misses, before + 1);
}

/// A reader thread that panics mid-read (here: the fault hook) fails its blob's request with
/// the expert named instead of leaving the layer waiting for a piece that never finishes.
#[test]
fn a_panicking_reader_fails_the_request_instead_of_hanging() {
    let v = TempVault::new("tiny-tied", DType::Q4);
    let fault: smoe_engine::store::FaultHook = Arc::new(|layer, expert| {
        assert!(layer != 1, "injected panic reading expert {expert}");
        None
    });
    let e = open_with_fault(v.path(), CacheBudget::Bytes(0), fault);
    let prompt: Vec<u32> = (10..30).collect();
    // On its own thread, so that a hang fails the test instead of stalling the suite.
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(e.logprobs(&prompt).map(|_| ()).map_err(|e| e.to_string()));
    });
    let got = rx.recv_timeout(std::time::Duration::from_secs(60));
    let err = got.expect("the request hung").unwrap_err();
    assert!(
        err.contains("of layer 1") && err.contains("panicked"),
        "{err}"
    );
}
