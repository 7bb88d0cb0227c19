//! Batched forward passes (continuous batching) give each sequence what it would get alone.

use smoe_engine::engine::EngineOptions;
use smoe_engine::model::Scratch;
use smoe_engine::sampler::argmax;
use smoe_engine::{Engine, Logits};
use smoe_vault::DType;

mod common;
use common::TempVault;

fn engine(name: &str) -> Engine {
    // The mapping keeps the vault alive after its file is removed.
    Engine::open(
        TempVault::new(name, DType::Q8).path(),
        EngineOptions::default(),
    )
    .unwrap()
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn batched_decode_equals_sequential() {
    // Mixtral's sliding window and Qwen2-MoE's shared expert are per-row paths worth crossing.
    for name in ["tiny-dense-mix", "tiny-mixtral", "tiny-qwen2moe"] {
        let e = engine(name);
        let prompts: Vec<Vec<u32>> = vec![
            (1..40).collect(),
            (100..107).collect(),
            (200..260).collect(),
        ];
        let steps = 6;
        // Alone: greedy continuation, logits of every step.
        let mut alone = vec![];
        for p in &prompts {
            let mut s = e.session(p.len() + steps);
            let mut logits = s.feed(p, Logits::Last).unwrap();
            let mut seq = vec![];
            for _ in 0..steps {
                let id = argmax(&logits);
                seq.push((id, logits.clone()));
                logits = s.feed(&[id], Logits::Last).unwrap();
            }
            alone.push(seq);
        }
        // Together: all prompts prefilled in one pass, then every decode step batched.
        let mut sessions: Vec<_> = prompts.iter().map(|p| e.session(p.len() + steps)).collect();
        let mut scratch = Scratch::default();
        let runs: Vec<&[u32]> = prompts.iter().map(|p| p.as_slice()).collect();
        let want = vec![Logits::Last; prompts.len()];
        let mut refs: Vec<_> = sessions.iter_mut().collect();
        let mut logits = e
            .forward_batch(&mut refs, &runs, &want, &mut scratch)
            .unwrap();
        for step in 0..steps {
            let ids: Vec<u32> = logits.iter().map(|l| argmax(l)).collect();
            for (i, id) in ids.iter().enumerate() {
                let (want_id, want_logits) = &alone[i][step];
                let d = max_diff(&logits[i], want_logits);
                assert!(d < 2e-3, "{name} seq {i} step {step}: logits differ by {d}");
                assert_eq!(id, want_id, "{name} seq {i} step {step}");
            }
            let one: Vec<[u32; 1]> = ids.iter().map(|&id| [id]).collect();
            let runs: Vec<&[u32]> = one.iter().map(|r| r.as_slice()).collect();
            let mut refs: Vec<_> = sessions.iter_mut().collect();
            logits = e
                .forward_batch(&mut refs, &runs, &want, &mut scratch)
                .unwrap();
        }
        assert_eq!(sessions[1].tokens.len(), prompts[1].len() + steps);
    }
}

#[test]
fn a_prefill_chunk_can_join_decoding_sequences() {
    let e = engine("tiny-tied");
    let a: Vec<u32> = (10..30).collect();
    let b: Vec<u32> = (40..45).collect();
    let mut sa = e.session(64);
    let mut sb = e.session(64);
    sa.feed(&a, Logits::None).unwrap();
    // `a` decodes one token while `b` prefills five, in one pass.
    let mut scratch = Scratch::default();
    let out = e
        .forward_batch(
            &mut [&mut sa, &mut sb],
            &[&[7], &b],
            &[Logits::Last, Logits::All],
            &mut scratch,
        )
        .unwrap();
    assert_eq!(out[1].len(), 5 * e.model.config().vocab_size);
    let mut alone = e.session(64);
    let want_a = alone
        .feed(&[a.clone(), vec![7]].concat(), Logits::Last)
        .unwrap();
    assert!(max_diff(&out[0], &want_a) < 2e-3);
    let mut alone = e.session(64);
    let want_b = alone.feed(&b, Logits::All).unwrap();
    assert!(max_diff(&out[1], &want_b) < 2e-3);
}
