//! What the engine's integration tests share: fixture vaults, greedy decoding, GPU detection.
#![allow(dead_code)] // each test binary uses a different subset

use smoe_engine::engine::GenerateOptions;
use smoe_engine::sampler::SamplerConfig;
use smoe_engine::store::{CacheBudget, StoreOptions};
use smoe_engine::Engine;
use smoe_vault::import::{convert_to_path, ConvertOptions};
use smoe_vault::DType;
use std::path::{Path, PathBuf};

/// A fixture converted to a vault (experts in `quant`, scout bf16) at a path of its own; the vault
/// and any usage profile beside it are removed when dropped.
pub struct TempVault(pub PathBuf);

impl TempVault {
    pub fn new(name: &str, quant: DType) -> Self {
        // Unique per call: tests run in parallel and may convert the same fixture.
        static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let ck = smoe_fixtures::checkpoint(name).expect("fixture checkpoint");
        let out = std::env::temp_dir().join(format!(
            "smoe-test-{}-{n}-{name}-{quant}.smoe",
            std::process::id()
        ));
        let opts = ConvertOptions {
            experts: quant,
            scout: DType::Bf16,
        };
        convert_to_path(&ck, &out, opts, &mut |_: u64, _: &str| {}).expect("convert");
        TempVault(out)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempVault {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
        let _ = std::fs::remove_file(smoe_engine::store::profile::Profile::path_for(&self.0));
    }
}

/// `n` greedy tokens after `prompt`, no stop ids.
pub fn greedy(engine: &Engine, prompt: &[u32], n: usize) -> Vec<u32> {
    let opts = GenerateOptions {
        max_tokens: n,
        sampler: SamplerConfig::greedy(),
        stop_ids: vec![],
        stop_strings: vec![],
    };
    engine
        .session(prompt.len() + n)
        .generate(prompt, &opts, &mut |_| {})
        .expect("generate")
        .tokens
}

/// Whether this machine has a usable GPU; says so on stderr when it has none, and fails instead
/// when `SMOE_REQUIRE_GPU=1` (CI), so GPU tests can never skip silently there.
pub fn have_gpu() -> bool {
    match smoe_engine::gpu::context() {
        Ok(_) => true,
        Err(e) => {
            if std::env::var("SMOE_REQUIRE_GPU").is_ok_and(|v| v == "1") {
                panic!("SMOE_REQUIRE_GPU=1 but the GPU is unusable: {e}");
            }
            // Straight to stderr: libtest would swallow eprint! of a passing test.
            use std::io::Write;
            let _ = writeln!(std::io::stderr(), "skipped: no GPU adapter ({e})");
            false
        }
    }
}

/// Feeds `prompt` then `steps` tokens (the CPU's argmax each time) to a GPU and a CPU session of
/// `capacity` positions, asserting after every pass that the last row's logits agree to 1e-3 of
/// their largest magnitude: the sampling path, which reads logits back at every step.
pub fn assert_decode_matches_cpu(
    what: &str,
    gpu: &Engine,
    cpu: &Engine,
    prompt: &[u32],
    capacity: usize,
    steps: usize,
) {
    use smoe_engine::Logits;
    let (mut sg, mut sc) = (gpu.session(capacity), cpu.session(capacity));
    let mut lg = sg.feed(prompt, Logits::Last).unwrap();
    let mut lc = sc.feed(prompt, Logits::Last).unwrap();
    for step in 0..steps {
        assert_eq!(lg.len(), lc.len());
        let scale = lc.iter().fold(0f32, |m, x| m.max(x.abs()));
        let dev = lg
            .iter()
            .zip(&lc)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(
            dev <= 1e-3 * scale.max(1.0),
            "{what} capacity {capacity} step {step}: logits differ by {dev}"
        );
        let id = smoe_engine::sampler::argmax(&lc);
        lg = sg.feed(&[id], Logits::Last).unwrap();
        lc = sc.feed(&[id], Logits::Last).unwrap();
    }
}

/// Streaming with no cache (every expert read at every use) and a lookahead `depth` MoE layers
/// deep, keeping `top` experts per token beyond the next: the deep-lookahead tests' store.
pub fn deep_lookahead_store(depth: usize, top: Option<usize>) -> StoreOptions {
    StoreOptions {
        budget: CacheBudget::Bytes(0),
        profile: false,
        read_threads: 4,
        tuning: smoe_engine::Tuning {
            lookahead: smoe_engine::store::Lookahead {
                depth,
                top: top.unwrap_or(usize::MAX),
            },
            ..Default::default()
        },
        ..Default::default()
    }
}

/// A lookahead's guessed reads (used, wasted or cancelled) on fixture `name` (its vault at
/// `vault`), as `guessed(depth, top)` counts them: one MoE layer ahead, the same keeping each
/// token's best-ranked expert, three MoE layers ahead, and three keeping the best. Keeping the
/// best fewer reads less; where there are three MoE layers to guess, the deeper guesses read
/// more.
pub fn check_deeper_guesses(
    name: &str,
    vault: &Path,
    guessed: impl Fn(usize, Option<usize>) -> u64,
) {
    let [one, one_top1, three, three_top1] =
        [(1, None), (1, Some(1)), (3, None), (3, Some(1))].map(|(d, t)| guessed(d, t));
    let moe_layers = (smoe_vault::Vault::open(vault).unwrap().header.config)
        .moe_layers()
        .count();
    eprintln!(
        "{name}: guessed reads {one} one layer ahead ({one_top1} keeping the best), {three} three \
         ({three_top1} keeping the best)"
    );
    if moe_layers >= 2 {
        assert!(
            one > one_top1,
            "{name}: {one} guesses one layer ahead, {one_top1} keeping the best one"
        );
    }
    if moe_layers >= 3 {
        assert!(
            three > one,
            "{name}: {three} guesses at depth 3, {one} at 1"
        );
        assert!(
            three > three_top1,
            "{name}: {three} guesses at depth 3, {three_top1} keeping the best one"
        );
    }
}
