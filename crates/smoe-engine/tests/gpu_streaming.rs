//! `--backend gpu --expert-cache X`: each MoE layer keeps a few expert slots in VRAM, filled from
//! the streaming store as the router asks. Tokens and log-probs must not depend on the budget:
//! at 0 % (top-k slots per layer, nothing cached in host RAM), 25 % and 100 % tokens equal the
//! fully resident GPU run's and log-probs agree within float reordering.
//!
//! With no GPU adapter every test prints `skipped: no GPU adapter` and passes, unless
//! `SMOE_REQUIRE_GPU=1`, which turns that into a failure.

use smoe_compute::gpu::wgpu;
use smoe_engine::engine::{Backend, EngineOptions};
use smoe_engine::model::gpu_decoder::SlotStats;
use smoe_engine::store::{CacheBudget, Lookahead, StoreOptions, DEFAULT_READ_PIECE};
use smoe_engine::tuning::{Oracle, RouteOracle};
use smoe_engine::{Engine, Model, Tuning};
use smoe_vault::DType;
use std::path::Path;
use std::sync::Arc;

mod common;
#[path = "gpu_streaming/oracle.rs"]
mod oracle;
use common::{check_deeper_guesses, deep_lookahead_store, greedy, have_gpu, TempVault};

fn open(path: &Path, budget: CacheBudget) -> Engine {
    open_with(path, budget, DEFAULT_READ_PIECE, true)
}

fn open_with(path: &Path, budget: CacheBudget, read_piece: usize, mapped_slots: bool) -> Engine {
    open_traced(path, budget, read_piece, mapped_slots, None)
}

fn open_traced(
    path: &Path,
    budget: CacheBudget,
    read_piece: usize,
    mapped_slots: bool,
    route_oracle: Option<Arc<dyn RouteOracle>>,
) -> Engine {
    open_store(
        StoreOptions {
            budget,
            profile: false,
            read_threads: 4,
            read_piece,
            fault: None,
            tuning: Tuning {
                mapped_slots,
                route_oracle: route_oracle.map(Oracle),
                ..Default::default()
            },
            ..Default::default()
        },
        path,
    )
}

/// A Q4 vault of fixture `name`, and the fully resident GPU run's `n` greedy tokens after
/// `prompt`.
fn resident_greedy(name: &str, prompt: &[u32], n: usize) -> (TempVault, Vec<u32>) {
    let v = TempVault::new(name, DType::Q4);
    let want = greedy(&open(&v.0, CacheBudget::Resident), prompt, n);
    (v, want)
}

fn open_store(store: StoreOptions, path: &Path) -> Engine {
    let e = Engine::open(
        path,
        EngineOptions {
            backend: Backend::Gpu,
            prefill_chunk: 64,
            store,
            ..Default::default()
        },
    )
    .expect("open");
    assert_eq!(e.model.backend(), "gpu");
    e
}

#[test]
fn gpu_tokens_do_not_depend_on_the_expert_cache() {
    if !have_gpu() {
        return;
    }
    for name in ["tiny-dense-mix", "tiny-qwen2moe"] {
        let v = TempVault::new(name, DType::Q4);
        let prompt: Vec<u32> = (3..50).collect();
        let resident = open(&v.0, CacheBudget::Resident);
        assert!(!resident.model.experts().is_streaming());
        let want_tokens = greedy(&resident, &prompt, 24);
        let want_lp = resident.logprobs(&prompt).unwrap().logprobs;
        drop(resident);
        // 16 KiB pieces: the reader threads copy each blob into its VRAM slot piece by piece.
        // Slots filled through a mapping where the device allows (lavapipe and NVIDIA's
        // Vulkan driver do), and once through wgpu's staging memory instead.
        for (budget, piece, mapped) in [
            (CacheBudget::Bytes(0), 16 << 10, true),
            (CacheBudget::Fraction(0.25), DEFAULT_READ_PIECE, true),
            (CacheBudget::Fraction(0.25), 16 << 10, false),
            (CacheBudget::Fraction(1.0), 16 << 10, true),
        ] {
            let e = open_with(&v.0, budget, piece, mapped);
            assert!(e.model.experts().is_streaming(), "{name} {budget:?}");
            let stride = e.vault.expert_section().unwrap().blob_stride as usize;
            assert!(
                piece >= DEFAULT_READ_PIECE || stride > piece,
                "{name}: one piece"
            );
            let Model::Gpu(g) = &e.model else {
                unreachable!()
            };
            let before = g.slot_stats().expect("streaming");
            assert_eq!(greedy(&e, &prompt, 24), want_tokens, "{name} {budget:?}");
            // Decode runs through the MoE layers whose experts all sit in VRAM (the GPU maps
            // the router's choice to slots itself); every MoE layer stopping for the host, as
            // prompt batches do, gives the same tokens.
            let through = g.slot_stats().unwrap().run_through - before.run_through;
            if budget == CacheBudget::Fraction(1.0) {
                assert!(through > 0, "{name}: no layer ran through");
            }
            g.set_run_through(false);
            let before = g.slot_stats().unwrap();
            assert_eq!(
                greedy(&e, &prompt, 24),
                want_tokens,
                "{name} {budget:?}, stops"
            );
            assert_eq!(g.slot_stats().unwrap().run_through, before.run_through);
            g.set_run_through(true);
            // A speculative pass at each halt whose misses come from the disk (on by default
            // only on discrete GPUs; 3 MoE layers deep crosses the dense layers of
            // tiny-dense-mix) changes which reads start early, never the tokens.
            g.set_speculate(3);
            let before = g.slot_stats().unwrap();
            assert_eq!(
                greedy(&e, &prompt, 24),
                want_tokens,
                "{name} {budget:?}, speculative"
            );
            let after = g.slot_stats().unwrap();
            let speculated = after.speculated - before.speculated;
            eprintln!(
                "{name} {budget:?}: {speculated} speculative passes, {} guessed reads",
                after.spec_guesses - before.spec_guesses
            );
            if budget == CacheBudget::Bytes(0) {
                assert!(speculated > 0, "{name}: no speculative pass");
                // Its guesses, and the lookahead router's, are scored against the routing
                // that follows.
                let spec = after.spec_recall.expect("speculative guesses scored");
                let ahead = (e.model.experts().stats().unwrap().lookahead_recall)
                    .expect("lookahead guesses scored");
                eprintln!("{name}: recall speculative {spec:.3}, lookahead {ahead:.3}");
                assert!((0.0..=1.0).contains(&spec) && (0.0..=1.0).contains(&ahead));
            }
            g.set_speculate(0);
            // Guessed experts already in host memory placed in later layers' slots at each
            // halt change which layers halt, never the tokens.
            if budget == CacheBudget::Fraction(0.25) && mapped {
                let placed = g.slot_stats().unwrap().placed_ahead;
                g.set_fill_ahead(false);
                let before = g.slot_stats().unwrap().placed_ahead;
                assert_eq!(
                    greedy(&e, &prompt, 24),
                    want_tokens,
                    "{name} {budget:?}, no fill-ahead"
                );
                assert_eq!(g.slot_stats().unwrap().placed_ahead, before);
                g.set_fill_ahead(true);
                eprintln!("{name} {budget:?}: {placed} experts placed ahead");
            }
            eprintln!("{name} {budget:?}: {through} MoE layers ran through");
            let before = g.slot_stats().expect("streaming");
            let lp = e.logprobs(&prompt).unwrap().logprobs;
            assert_eq!(lp.len(), want_lp.len());
            let after = g.slot_stats().unwrap();
            let (stops, hit_stops) = (
                after.stops - before.stops,
                after.hit_stops - before.hit_stops,
            );
            assert!(after.hit_stops <= after.stops, "{name} {budget:?}");
            // With a slot per expert, the greedy run above already put the prompt's experts in
            // VRAM: no stop of the second run misses.
            if budget == CacheBudget::Fraction(1.0) {
                assert_eq!(hit_stops, stops, "{name} {budget:?}");
            }
            // The prompt's 47 tokens run in batches of 32 and 8 however few the slots (their
            // experts in rounds), and only the rest (7) a token at a time where the slots are
            // fewer than their experts: 9 batches at most, a stop per MoE layer each — not 47.
            let moe = e.model.config().moe_layers().count() as u64;
            assert!(stops <= moe * 9, "{name} {budget:?}: {stops} stops");
            let worst = lp
                .iter()
                .zip(&want_lp)
                .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            // Not bitwise: a small budget splits the prompt's last 7 tokens into single ones, and
            // a single token takes the fused-norm matvecs where a batch runs a separate RMSNorm
            // (same math, another order of float operations).
            assert!(worst <= 1e-4, "{name} {budget:?}: max |Δ log-prob| {worst}");
            let st = e.model.experts().stats().unwrap();
            assert!(st.total.misses > 0, "{name} {budget:?}: no reads");
            if budget != CacheBudget::Fraction(1.0) {
                // The lookahead (next MoE layer's router on this layer's input) started reads.
                let ahead = st.total.prefetched + st.total.prefetch_wasted;
                assert!(ahead > 0, "{name} {budget:?}: no lookahead reads");
            }
            let slots = g.slot_stats().expect("streaming");
            let info = smoe_engine::gpu::context().unwrap().info().clone();
            let mappable = info
                .features
                .contains(wgpu::Features::MAPPABLE_PRIMARY_BUFFERS);
            assert_eq!(slots.mapped, mapped && mappable, "{name} {budget:?}");
            // An NVIDIA GPU whose driver's libcuda loads (the H200): a CUDA context holds the
            // clock up while streaming; anything else (lavapipe in CI, Mesa's NVK without
            // libcuda) holds nothing.
            use smoe_compute::gpu::ClockHold;
            let held = ClockHold::applies(&info).is_ok() && ClockHold::driver_loads().is_ok();
            assert_eq!(slots.clocks_held, held, "{name} {budget:?}: {info:?}");
            // Unified memory (lavapipe in CI): disk reads land in the mapped slots, and the
            // store keeps no cache beside them.
            let unified = matches!(
                info.adapter.device_type,
                wgpu::DeviceType::IntegratedGpu | wgpu::DeviceType::Cpu
            );
            if slots.mapped && unified {
                assert!(
                    slots.landed > 0 && slots.landed <= slots.misses,
                    "{name} {budget:?}"
                );
                assert_eq!(st.total.hits, 0, "{name} {budget:?}: a host cache");
            } else {
                assert_eq!(slots.landed, 0, "{name} {budget:?}");
            }
            let (hits, misses) = (slots.hits, slots.misses);
            assert!(slots.stops > 0 && slots.pass_s >= slots.gpu_wait_s + slots.fill_s);
            eprintln!(
                "{name} {budget:?} (mapped {mapped}): max |Δlogprob| {worst:.1e}; VRAM slots {hits} hits, {misses} misses, {} read straight into a slot; host cache {} hits, {} misses",
                slots.landed, st.total.hits, st.total.misses
            );
            assert!(misses > 0);
            let c = e.model.config();
            let experts = (c.moe_layers().count() * c.num_experts) as u64;
            match budget {
                // One slot per expert: each is read from disk at most once.
                CacheBudget::Fraction(f) if f == 1.0 => {
                    assert!(misses <= experts, "{name}: {misses} > {experts}");
                    assert!(st.total.misses <= experts);
                }
                // top-k slots and no host cache: every VRAM miss is a disk read.
                CacheBudget::Bytes(0) => {
                    assert_eq!(st.total.hits, 0);
                    assert_eq!(st.total.misses, misses);
                }
                _ => {}
            }
            // (`bench decode` resets the counters after its warm-up.)
            let kept = g.slot_stats().unwrap();
            g.reset_slot_stats();
            let z = g.slot_stats().unwrap();
            let counts = |s: &SlotStats| {
                let n = [s.hits, s.misses, s.stops, s.hit_stops, s.run_through];
                n.into_iter().chain([s.speculated, s.spec_guesses])
            };
            assert!(counts(&z).all(|c| c == 0), "{name} {budget:?}: reset");
            assert!(z.spec_recall.is_none());
            assert!(counts(&kept).any(|c| c != 0));
        }
    }
}

/// A lookahead over several MoE layers (`Tuning::lookahead`): each decode layer
/// predicts the next three MoE layers' experts and the host starts reading the deeper guesses
/// too — more guessed reads than a one-layer lookahead, the same tokens; fewer when each guess
/// keeps only its token's best-ranked expert (`Lookahead::top`; the slot maps then halt only for
/// those).
#[test]
fn a_deeper_lookahead_reads_further_ahead_and_changes_no_token() {
    if !have_gpu() {
        return;
    }
    for name in ["tiny-dense-mix", "tiny-qwen2moe"] {
        let prompt: Vec<u32> = (3..40).collect();
        let (v, want) = resident_greedy(name, &prompt, 24);
        let guessed = |depth: usize, top: Option<usize>| {
            let e = open_store(deep_lookahead_store(depth, top), &v.0);
            let Model::Gpu(g) = &e.model else {
                unreachable!()
            };
            g.set_speculate(0);
            e.model.experts().reset_stats();
            assert_eq!(greedy(&e, &prompt, 24), want, "{name}, depth {depth}");
            let t = e.model.experts().stats().unwrap().total;
            t.prefetched + t.prefetch_wasted + t.prefetch_cancelled
        };
        check_deeper_guesses(name, &v.0, guessed);
    }
    let v = TempVault::new("tiny-qwen2moe", DType::Q4);
    let bad = StoreOptions {
        budget: CacheBudget::Bytes(0),
        tuning: Tuning {
            lookahead: Lookahead {
                depth: 9,
                ..Default::default()
            },
            ..Default::default()
        },
        ..Default::default()
    };
    let err = Engine::open(
        &v.0,
        EngineOptions {
            backend: Backend::Gpu,
            store: bad,
            ..Default::default()
        },
    );
    assert!(err.is_err_and(|e| e.to_string().contains("lookahead depth")));
}

/// Faults on the GPU streaming path: an I/O error while filling VRAM slots fails the request
/// with the layer named, no slot keeps a failed expert, and the same engine then serves the
/// request correctly (equal to the resident run); a corrupt blob is named by layer and expert.
#[test]
fn gpu_streaming_faults_fail_the_request_and_nothing_stays_cached() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    if !have_gpu() {
        return;
    }
    let v = TempVault::new("tiny-tied", DType::Q4);
    let failing = Arc::new(AtomicBool::new(true));
    let flag = failing.clone();
    let fault: smoe_engine::store::FaultHook = Arc::new(move |layer, _expert| {
        (layer == 1 && flag.load(Ordering::SeqCst))
            .then(|| std::io::Error::other("injected I/O error"))
    });
    let store = StoreOptions {
        budget: CacheBudget::Fraction(0.25),
        profile: false,
        read_threads: 2,
        read_piece: DEFAULT_READ_PIECE,
        fault: Some(fault),
        ..Default::default()
    };
    let opts = EngineOptions {
        backend: Backend::Gpu,
        store,
        ..Default::default()
    };
    let e = Engine::open(&v.0, opts).expect("open");
    assert_eq!(e.model.backend(), "gpu");
    let prompt: Vec<u32> = (10..30).collect();
    let err = e.logprobs(&prompt).unwrap_err().to_string();
    assert!(
        err.contains("of layer 1") && err.contains("injected I/O error"),
        "{err}"
    );
    failing.store(false, Ordering::SeqCst);
    let got = e.logprobs(&prompt).unwrap().logprobs;
    let want = open(&v.0, CacheBudget::Resident)
        .logprobs(&prompt)
        .unwrap()
        .logprobs;
    let worst = got
        .iter()
        .zip(&want)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    assert!(worst <= 1e-4, "after the fault: max |Δ log-prob| {worst}");

    // A corrupt blob: the checksum names it, with the cache at its smallest.
    let vault = smoe_vault::Vault::open(&v.0).unwrap();
    let blob = vault.expert_entry(2, 5).unwrap().offset as usize;
    drop(vault);
    let mut bytes = std::fs::read(&v.0).unwrap();
    bytes[blob + 7] ^= 0x55;
    std::fs::write(&v.0, &bytes).unwrap();
    let e = open(&v.0, CacheBudget::Bytes(0));
    let prompt: Vec<u32> = (0..400).map(|i| (i * 37 % 1000) as u32).collect();
    let err = e.logprobs(&prompt).unwrap_err().to_string();
    assert!(
        err.contains("layer 2 expert 5") && err.contains("checksum"),
        "{err}"
    );
}

/// A saved usage profile preloads each MoE layer's VRAM slots with its hottest experts: the
/// next start's first pass finds experts in the slots, and what it computes with them equals
/// the resident run (the preloaded bytes are the right ones).
#[test]
fn a_saved_profile_preloads_the_vram_slots() {
    if !have_gpu() {
        return;
    }
    let v = TempVault::new("tiny-qwen2moe", DType::Q4);
    let prompt: Vec<u32> = (3..40).collect();
    let want = open(&v.0, CacheBudget::Resident)
        .logprobs(&prompt)
        .unwrap()
        .logprobs;
    let with_profile = |budget| {
        let store = StoreOptions {
            budget,
            profile: true,
            read_threads: 4,
            read_piece: DEFAULT_READ_PIECE,
            fault: None,
            ..Default::default()
        };
        let opts = EngineOptions {
            backend: Backend::Gpu,
            store,
            ..Default::default()
        };
        Engine::open(&v.0, opts).expect("open")
    };
    let budget = CacheBudget::Fraction(0.5);
    let first = with_profile(budget);
    assert_eq!(
        first.model.preload(&mut |_, _| {}).unwrap(),
        0,
        "no profile yet"
    );
    first.logprobs(&prompt).unwrap();
    first.model.experts().save_profile().unwrap();
    drop(first);

    let e = with_profile(budget);
    let mut calls = 0;
    let loaded = e.model.preload(&mut |_, _| calls += 1).unwrap();
    let Model::Gpu(g) = &e.model else {
        unreachable!()
    };
    let c = e.model.config();
    assert!(
        loaded >= c.moe_layers().count(),
        "{loaded} experts preloaded"
    );
    assert!(calls > 0);
    assert_eq!(g.slot_stats().unwrap().misses, 0, "counters start afresh");
    // One token: with empty slots every expert it routes to would miss.
    e.logprobs(&prompt[..1]).unwrap();
    let s = g.slot_stats().unwrap();
    assert!(
        s.hits > 0,
        "the first pass found no preloaded expert: {s:?}"
    );
    let got = e.logprobs(&prompt).unwrap().logprobs;
    let worst = got
        .iter()
        .zip(&want)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    assert!(worst <= 1e-4, "after preloading: max |Δ log-prob| {worst}");
}

/// `--vram-cache` apart from `--expert-cache`: a host cache of every expert behind VRAM slots
/// for a quarter of them (filled through wgpu's staging memory, as on a discrete GPU, so that
/// the host keeps a cache of its own even on lavapipe's unified memory) gives the resident
/// run's tokens, reads no expert from the disk twice, and serves the slots' later misses from
/// host memory.
#[test]
fn a_host_cache_larger_than_the_vram_slots() {
    if !have_gpu() {
        return;
    }
    let prompt: Vec<u32> = (3..50).collect();
    let (v, want) = resident_greedy("tiny-qwen2moe", &prompt, 24);
    let e = open_store(
        StoreOptions {
            budget: CacheBudget::Fraction(1.0),
            vram_budget: Some(CacheBudget::Fraction(0.25)),
            profile: false,
            tuning: Tuning {
                mapped_slots: false,
                ..Default::default()
            },
            ..Default::default()
        },
        &v.0,
    );
    let Model::Gpu(g) = &e.model else {
        unreachable!()
    };
    let cfg = &e.vault.header.config;
    let sec = e.vault.expert_section().unwrap();
    let (n, k, moe) = (
        cfg.num_experts,
        cfg.num_experts_per_tok,
        cfg.moe_layers().count(),
    );
    let st = g.slot_stats().expect("streaming");
    assert_eq!(st.slots, (n / 4).max(k), "a quarter of {n} experts");
    assert_eq!(st.slot_bytes, (st.slots * moe) as u64 * sec.blob_stride);
    assert!(st.slots < n, "the slots must hold fewer than every expert");
    assert_eq!(greedy(&e, &prompt, 24), want);
    let slots = g.slot_stats().unwrap();
    let host = e.model.experts().stats().expect("a host cache");
    let blobs = sec.blobs.len() as u64;
    assert!(
        host.total.bytes_read <= blobs * sec.blob_stride,
        "the host cache holds every expert: none is read twice ({} bytes of {blobs} blobs)",
        host.total.bytes_read
    );
    assert!(
        host.total.hits > 0 && slots.misses > host.total.misses,
        "VRAM misses served from host memory: {} slot misses, host {} hits / {} misses",
        slots.misses,
        host.total.hits,
        host.total.misses
    );
}

/// VRAM expert slots that do not fit in GPU memory (a test hook stands in for the device's
/// limit): without `--vram-cache` the load tries half as many until they fit, and the tokens
/// are the resident run's; with it, the load fails and says to give a smaller one; and a VRAM
/// budget with a resident host budget streams.
#[test]
fn slots_that_do_not_fit_are_halved_unless_the_vram_budget_was_given() {
    if !have_gpu() {
        return;
    }
    let prompt: Vec<u32> = (3..50).collect();
    let (v, want) = resident_greedy("tiny-qwen2moe", &prompt, 16);
    let vault = smoe_vault::Vault::open(&v.0).unwrap();
    let cfg = &vault.header.config;
    let sec = vault.expert_section().unwrap();
    let per_slot = sec.blob_stride * cfg.moe_layers().count() as u64;
    let (n, k) = (cfg.num_experts, cfg.num_experts_per_tok);
    // Room for 40 % of the experts' slots: every expert does not fit, half does not, a
    // quarter does.
    let limit = (n as u64 * per_slot) * 2 / 5;
    let mut fits = n;
    while fits as u64 * per_slot > limit {
        fits = (fits / 2).max(k);
    }
    assert!(fits < n / 2, "the test needs two retries: {fits} of {n}");
    let store = |vram_budget| StoreOptions {
        budget: CacheBudget::Fraction(1.0),
        vram_budget,
        vram_limit: Some(limit),
        profile: false,
        tuning: Tuning {
            mapped_slots: false,
            ..Default::default()
        },
        ..Default::default()
    };
    let e = open_store(store(None), &v.0);
    let Model::Gpu(g) = &e.model else {
        unreachable!()
    };
    assert_eq!(g.slot_stats().unwrap().slots, fits);
    assert_eq!(greedy(&e, &prompt, 16), want);
    drop(e);
    let opts = |store| EngineOptions {
        backend: Backend::Gpu,
        prefill_chunk: 64,
        store,
        ..Default::default()
    };
    let err = Engine::open(&v.0, opts(store(Some(CacheBudget::Fraction(1.0)))))
        .err()
        .expect("the slots of every expert exceed the limit");
    let msg = err.to_string();
    assert!(
        msg.contains("out of memory") && msg.contains("--vram-cache"),
        "{msg}"
    );
    // Room for fewer than top-k slots: nothing to retry, and the error says what to do.
    let tiny = StoreOptions {
        vram_limit: Some(per_slot * k as u64 - 1),
        ..store(None)
    };
    let err = Engine::open(&v.0, opts(tiny))
        .err()
        .expect("not even top-k slots fit");
    assert!(err.to_string().contains("--backend cpu"), "{err}");
    // A VRAM budget with a resident host streams, the host cache taking what RAM holds.
    let e = open_store(
        StoreOptions {
            budget: CacheBudget::Resident,
            vram_limit: None,
            ..store(Some(CacheBudget::Fraction(0.25)))
        },
        &v.0,
    );
    assert!(e.model.experts().is_streaming());
    let Model::Gpu(g) = &e.model else {
        unreachable!()
    };
    assert_eq!(g.slot_stats().unwrap().slots, (n / 4).max(k));
    assert_eq!(greedy(&e, &prompt, 16), want);
}

/// The GPU's free memory, which `auto` VRAM slots stay within: Vulkan's memory budget where
/// the driver offers it (NVIDIA's on the device machine; lavapipe in CI if its Mesa has it),
/// else NVIDIA's CUDA driver, and known on NVIDIA's driver either way. A buffer this process
/// allocates counts against the Vulkan budget.
#[test]
fn the_free_gpu_memory_is_known_and_counts_our_buffers() {
    if !have_gpu() {
        return;
    }
    let ctx = smoe_engine::gpu::context().unwrap();
    let adapter = &ctx.info().adapter;
    let nvidia = adapter.vendor == 0x10de && smoe_compute::gpu::ClockHold::driver_loads().is_ok();
    if nvidia {
        let (free, total) = smoe_compute::gpu::nvidia_memory(adapter).unwrap();
        assert!(free > 0 && free <= total, "{free} of {total}");
    }
    let asked = std::time::Instant::now();
    let room = match ctx.memory_room() {
        Ok(room) => room,
        Err(why) => {
            assert!(!nvidia, "{adapter:?}: {why}");
            return;
        }
    };
    eprintln!("{room}, asked in {:?}", asked.elapsed());
    assert!(room.free > 0 && room.free <= room.total, "{room:?}");
    let Ok(before) = ctx.vulkan_budget() else {
        return;
    };
    let bytes = 256u64 << 20;
    let buf = ctx.storage_buffer("budget probe", bytes);
    ctx.queue.write_buffer(&buf, bytes - 4, &[1; 4]);
    ctx.queue.submit([]);
    let _ = ctx.device.poll(wgpu::PollType::wait_indefinitely());
    let after = ctx.vulkan_budget().unwrap();
    assert!(
        after.free + bytes / 2 <= before.free,
        "a {bytes}-byte buffer: {before} → {after}"
    );
    drop(buf);
}

/// A resident model whose experts do not fit in the GPU's free memory (the test hook stands in
/// for NVIDIA's count, which elsewhere is unknown) is streamed instead: a host cache behind as
/// many VRAM slots as fit, and the resident run's tokens.
#[test]
fn resident_experts_beyond_the_free_vram_are_streamed() {
    if !have_gpu() {
        return;
    }
    let v = TempVault::new("tiny-qwen2moe", DType::Q4);
    let prompt: Vec<u32> = (3..50).collect();
    let resident = open(&v.0, CacheBudget::Resident);
    assert!(!resident.model.experts().is_streaming());
    let want = greedy(&resident, &prompt, 16);
    drop(resident);
    let vault = smoe_vault::Vault::open(&v.0).unwrap();
    let sec = vault.expert_section().unwrap();
    let limit = sec.blob_stride * sec.blobs.len() as u64 * 2 / 5;
    let e = open_store(
        StoreOptions {
            budget: CacheBudget::Resident,
            vram_limit: Some(limit),
            profile: false,
            tuning: Tuning {
                mapped_slots: false,
                ..Default::default()
            },
            ..Default::default()
        },
        &v.0,
    );
    assert!(e.model.experts().is_streaming(), "switched to streaming");
    let Model::Gpu(g) = &e.model else {
        unreachable!()
    };
    let st = g.slot_stats().expect("streaming");
    assert!(
        st.slot_bytes <= limit,
        "{} slot bytes, limit {limit}",
        st.slot_bytes
    );
    assert_eq!(greedy(&e, &prompt, 16), want);
}
