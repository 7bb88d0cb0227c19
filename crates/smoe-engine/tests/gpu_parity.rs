//! `--backend gpu` against transformers and against `--backend cpu`, on every fixture.
//!
//! bf16: the CPU's tolerances (|Δ log-prob| ≤ 0.02, the same argmax wherever transformers' top-2
//! margin exceeds 0.05), and the GPU's greedy tokens equal the CPU's for 32 steps up to the first
//! step whose reference margin is below 0.05. q4: GPU log-probs against the CPU's on the same q4
//! vault (same weights, so only the order of float additions differs).
//!
//! With no GPU adapter every test prints `skipped: no GPU adapter` and passes, unless
//! `SMOE_REQUIRE_GPU=1` (set by `.ci/run`), which turns that into a failure.

use smoe_engine::engine::{Backend, EngineOptions};
use smoe_engine::{Engine, Logits};
use smoe_vault::DType;

mod common;
use common::{assert_decode_matches_cpu, greedy, have_gpu, TempVault};

const MARGIN: f64 = 0.05;

/// Opening a fixture vault on a given backend (and checking it got that backend).
impl TempVault {
    fn open(&self, backend: Backend) -> Engine {
        let opts = EngineOptions {
            backend,
            prefill_chunk: 64,
            ..Default::default()
        };
        let e = Engine::open(&self.0, opts).expect("open");
        let want = if backend == Backend::Gpu {
            "gpu"
        } else {
            "cpu"
        };
        assert_eq!(e.model.backend(), want);
        e
    }
}

#[test]
fn bf16_gpu_matches_transformers_and_cpu_greedy() {
    if !have_gpu() {
        return;
    }
    for name in smoe_fixtures::names() {
        let v = TempVault::new(&name, DType::Bf16);
        let (gpu, cpu) = (v.open(Backend::Gpu), v.open(Backend::Cpu));
        let reference = smoe_fixtures::reference(&name);
        let (mut max_abs, mut agree, mut firm_total) = (0f64, 0, 0);
        for p in &reference.prompts {
            let r = gpu.logprobs(&p.prompt).expect("logprobs");
            assert_eq!(r.logprobs.len(), p.logprobs.len());
            for (a, b) in r.logprobs.iter().zip(&p.logprobs) {
                max_abs = max_abs.max((*a as f64 - b).abs());
            }
            for (i, (a, b)) in r.argmax.iter().zip(&p.argmax).enumerate() {
                if p.margin[i] > MARGIN {
                    firm_total += 1;
                    agree += (a == b) as usize;
                }
            }
            // Greedy: equal to the CPU's (and the reference's) up to the first fragile step.
            let g = &p.greedy;
            let steps = g.tokens.len().min(32);
            let firm = g.margins[..steps]
                .iter()
                .position(|m| *m < MARGIN)
                .unwrap_or(steps);
            let (tg, tc) = (
                greedy(&gpu, &p.prompt, steps),
                greedy(&cpu, &p.prompt, steps),
            );
            assert_eq!(
                &tg[..firm],
                &tc[..firm],
                "{name}: GPU and CPU greedy differ"
            );
            assert_eq!(
                &tg[..firm],
                &g.tokens[..firm],
                "{name}: GPU greedy vs reference"
            );
            let same = tg.iter().zip(&tc).take_while(|(a, b)| a == b).count();
            eprintln!(
                "{name} prompt {} ({} tokens): greedy GPU = CPU for {same}/{steps} steps ({firm} firm)",
                p.seed,
                p.prompt.len()
            );
        }
        eprintln!("{name} bf16 GPU: max |Δlogprob| {max_abs:.5}, argmax {agree}/{firm_total}");
        assert!(
            max_abs <= 0.02,
            "{name}: GPU max |Δ log-prob| {max_abs} > 0.02"
        );
        assert_eq!(
            agree, firm_total,
            "{name}: GPU argmax differs at a firm position"
        );
    }
}

#[test]
fn q4_gpu_log_probs_match_q4_cpu() {
    if !have_gpu() {
        return;
    }
    let mut worst = 0f64;
    for name in smoe_fixtures::names() {
        let v = TempVault::new(&name, DType::Q4);
        let (gpu, cpu) = (v.open(Backend::Gpu), v.open(Backend::Cpu));
        let mut max_abs = 0f64;
        for p in &smoe_fixtures::reference(&name).prompts {
            let (rg, rc) = (
                gpu.logprobs(&p.prompt).unwrap(),
                cpu.logprobs(&p.prompt).unwrap(),
            );
            for (a, b) in rg.logprobs.iter().zip(&rc.logprobs) {
                max_abs = max_abs.max((a - b).abs() as f64);
            }
        }
        eprintln!("{name} q4: GPU vs CPU max |Δlogprob| {max_abs:.2e}");
        worst = worst.max(max_abs);
    }
    eprintln!("q4 GPU vs CPU, all fixtures: max |Δlogprob| {worst:.2e}");
    assert!(worst <= 0.02, "q4 GPU vs CPU: max |Δ log-prob| {worst}");
}

/// The sampling path: the last row's logits read back at every decode step, against the CPU's.
#[test]
fn decode_logits_match_cpu() {
    if !have_gpu() {
        return;
    }
    let name = &smoe_fixtures::names()[0];
    let v = TempVault::new(name, DType::Q8);
    let (gpu, cpu) = (v.open(Backend::Gpu), v.open(Backend::Cpu));
    let prompt = &smoe_fixtures::reference(name).prompts[0].prompt;
    // Small and large caches: beyond 512 positions decoding splits the context over several
    // workgroups, whose partial results all layers share in one scratch buffer.
    for capacity in [prompt.len() + 8, 1500] {
        assert_decode_matches_cpu(name, &gpu, &cpu, prompt, capacity, 8);
    }
}

/// Greedy chains (the GPU feeds its own argmax to the next pass, queued before the host reads
/// it) against one pass and one read per token: the same ids, an early stop leaves the session
/// where it should be (continuing gives the same tokens), and a full cache ends the chain.
#[test]
fn greedy_chain_matches_token_by_token() {
    if !have_gpu() {
        return;
    }
    for name in smoe_fixtures::names() {
        for dtype in [DType::Bf16, DType::Q4] {
            let v = TempVault::new(&name, dtype);
            let gpu = v.open(Backend::Gpu);
            assert!(
                gpu.model.chains_greedy(),
                "{name}: resident GPU models chain"
            );
            let prompt = &smoe_fixtures::reference(&name).prompts[0].prompt;
            let n = 12;
            // Reference: one forward_greedy and one wait per token.
            let mut r = gpu.session(prompt.len() + n + 1);
            let mut want = vec![r.feed_greedy(prompt).unwrap()];
            for _ in 1..n {
                let last = *want.last().unwrap();
                want.push(r.feed_greedy(&[last]).unwrap());
            }
            // Chained, stopping after 4 ids, then going on.
            let mut s = gpu.session(prompt.len() + n + 1);
            let first = s.feed_greedy(prompt).unwrap();
            let mut got = vec![first];
            s.decode_greedy(first, n, &mut |id| {
                got.push(id);
                Ok(got.len() < 5)
            })
            .unwrap();
            assert_eq!(got.len(), 5);
            assert_eq!(s.tokens.len(), prompt.len() + 4, "{name}: fed after a stop");
            assert_eq!(s.state.len(), s.tokens.len());
            let last = *got.last().unwrap();
            s.decode_greedy(last, n - 5, &mut |id| {
                got.push(id);
                Ok(true)
            })
            .unwrap();
            assert_eq!(got, want, "{name} {dtype}: chained vs token by token");
            assert_eq!(s.tokens.len(), prompt.len() + n - 1);
            // A cache with room for 3 more positions: 3 more ids, then the chain ends.
            let mut c = gpu.session(prompt.len() + 3);
            let first = c.feed_greedy(prompt).unwrap();
            let mut short = vec![first];
            c.decode_greedy(first, 100, &mut |id| {
                short.push(id);
                Ok(true)
            })
            .unwrap();
            assert_eq!(short, want[..4], "{name} {dtype}: chain in a small cache");
            assert_eq!(c.state.len(), prompt.len() + 3);
        }
    }
}

/// A dropped sequence's GPU KV cache is reused by the next sequence of the same capacity (no
/// set-up), and what the previous sequence left in it never shows: the same prompt gives the
/// same tokens and log-probs on a fresh cache and on a reused one.
#[test]
fn reused_kv_caches_give_fresh_results() {
    if !have_gpu() {
        return;
    }
    let name = &smoe_fixtures::names()[0];
    let v = TempVault::new(name, DType::Q4);
    let gpu = v.open(Backend::Gpu);
    let smoe_engine::Model::Gpu(g) = &gpu.model else {
        unreachable!("opened on the GPU")
    };
    let prompts = &smoe_fixtures::reference(name).prompts;
    let (p, other) = (&prompts[0].prompt, &prompts[1].prompt);
    let cap = 200;
    let run = |prompt: &[u32]| {
        let mut s = gpu.session(cap);
        let lp = s.feed(prompt, Logits::All).unwrap();
        let first = smoe_engine::sampler::argmax(&lp[lp.len() - gpu.model.config().vocab_size..]);
        let mut toks = vec![first];
        s.decode_greedy(first, 16, &mut |id| {
            toks.push(id);
            Ok(true)
        })
        .unwrap();
        (lp, toks)
    };
    let kept = g.kept_kv_caches();
    let fresh = run(p);
    assert_eq!(g.kept_kv_caches(), kept + 1, "the dropped cache is kept");
    // Another sequence dirties the kept cache (taken and given back: still one kept).
    run(other);
    assert_eq!(g.kept_kv_caches(), kept + 1, "the kept cache was reused");
    let reused = run(p);
    assert_eq!(reused.1, fresh.1, "tokens on a reused cache");
    assert_eq!(reused.0, fresh.0, "log-probs on a reused cache");
    // A different capacity gets its own cache; at most KEEP are kept.
    for c in 0..6 {
        let mut s = gpu.session(cap + 1 + c);
        s.feed(&p[..4], Logits::None).unwrap();
    }
    assert!(g.kept_kv_caches() <= 4);
}

/// `Tuning::fused_router` takes effect: on (the default), where tails fuse, a decoded token's
/// router runs in its o projection's last workgroups ("o proj + router"); off, the router has a
/// dispatch of its own after the o projection: one dispatch more per MoE layer and token, the
/// same logits.
#[test]
fn the_fused_router_switch_changes_the_decode_layers_dispatches() {
    use smoe_engine::store::StoreOptions;
    use std::collections::BTreeMap;
    if !have_gpu() {
        return;
    }
    let name = &smoe_fixtures::names_of(&["qwen3_moe"])[0];
    let v = TempVault::new(name, DType::Q8);
    let moe_layers = (smoe_vault::Vault::open(&v.0).unwrap().header.config)
        .moe_layers()
        .count() as u64;
    let tokens = [3u32, 1, 4, 1, 5];
    // (dispatches per step over the tokens' passes, the last pass's logits)
    let run = |fused_router: bool| {
        let store = StoreOptions {
            tuning: smoe_engine::Tuning {
                fused_router,
                ..Default::default()
            },
            ..Default::default()
        };
        let opts = EngineOptions {
            backend: Backend::Gpu,
            store,
            ..Default::default()
        };
        let e = Engine::open(&v.0, opts).expect("open");
        e.model.profile_start(true).ok()?;
        let mut s = e.session(tokens.len());
        let mut logits = vec![];
        for t in tokens {
            logits = s.feed(&[t], Logits::Last).unwrap();
        }
        let p = e.model.profile_take().expect("profiling");
        let steps: BTreeMap<&str, u64> = p.steps.iter().map(|(l, _, n)| (*l, *n)).collect();
        Some((steps, logits))
    };
    let Some((fused, fused_logits)) = run(true) else {
        eprintln!("skipped: no timestamps inside passes on this adapter");
        return;
    };
    let (plain, plain_logits) = run(false).unwrap();
    let per_layer = moe_layers * tokens.len() as u64;
    let ctx = smoe_engine::gpu::context().unwrap();
    if ctx.fused_tails() {
        assert_eq!(fused.get("o proj + router"), Some(&per_layer), "{fused:?}");
        assert_eq!(fused.get("router"), None, "{fused:?}");
    }
    assert_eq!(plain.get("o proj + router"), None, "{plain:?}");
    assert_eq!(plain.get("router"), Some(&per_layer), "{plain:?}");
    let total = |m: &BTreeMap<&str, u64>| m.values().sum::<u64>();
    let extra = if ctx.fused_tails() { per_layer } else { 0 };
    assert_eq!(total(&plain), total(&fused) + extra, "{plain:?} {fused:?}");
    let dev = (plain_logits.iter().zip(&fused_logits)).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    assert!(dev < 1e-3, "logits differ by {dev}");
}
