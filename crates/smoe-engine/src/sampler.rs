//! Picking the next token from logits, and cutting output at stop strings.
//!
//! The pipeline follows transformers' order so that the same settings give
//! the same distribution as the reference implementation: penalties
//! (repetition, presence, frequency), then temperature, top-k, top-p, min-p,
//! then one draw. The PRNG is our own xoshiro256** so that a seed reproduces
//! a generation on every platform and across dependency upgrades.
//!
//! Non-finite logits: NaN is treated as -inf (a broken row must not panic a
//! server). If a token has +inf it wins outright. If *no* token is finite,
//! `sample` and `argmax` return id 0 — the caller is expected to treat a
//! garbage row as a model fault; returning a valid id keeps the API total.

use serde::{Deserialize, Serialize};

use crate::tokenizer::TextError;

/// Sampling settings, named and defined as in the OpenAI / HF APIs.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct SamplerConfig {
    /// 0 = greedy (argmax).
    pub temperature: f32,
    /// Keep the k most likely tokens; 0 = off.
    pub top_k: usize,
    /// Nucleus: keep the smallest set with probability mass >= top_p; 1 = off.
    pub top_p: f32,
    /// Drop tokens with prob < min_p * max prob; 0 = off.
    pub min_p: f32,
    /// HF/CTRL repetition penalty on tokens seen in `history`; 1 = off.
    pub repetition_penalty: f32,
    /// OpenAI: subtracted once from every token seen in `history`.
    pub presence_penalty: f32,
    /// OpenAI: subtracted once per occurrence in `history`.
    pub frequency_penalty: f32,
    pub seed: u64,
}

impl Default for SamplerConfig {
    /// Qwen3's recommended non-thinking settings: chat users expect some
    /// variety; greedy decoding tends to loop.
    fn default() -> Self {
        SamplerConfig {
            temperature: 0.7,
            top_k: 20,
            top_p: 0.8,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: 0,
        }
    }
}

impl SamplerConfig {
    /// Deterministic argmax decoding, no penalties.
    pub fn greedy() -> Self {
        SamplerConfig {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            ..Default::default()
        }
    }

    /// Rejects settings that would make the distribution meaningless, with a
    /// message naming the parameter (for API error responses).
    pub fn validate(&self) -> Result<(), TextError> {
        let bad = |m: String| Err(TextError::InvalidSampling(m));
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return bad(format!(
                "temperature must be >= 0, got {}",
                self.temperature
            ));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad(format!("top_p must be in (0, 1], got {}", self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return bad(format!("min_p must be in [0, 1], got {}", self.min_p));
        }
        if !(self.repetition_penalty > 0.0 && self.repetition_penalty.is_finite()) {
            return bad(format!(
                "repetition_penalty must be > 0, got {}",
                self.repetition_penalty
            ));
        }
        for (name, v) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if !v.is_finite() {
                return bad(format!("{name} must be a finite number, got {v}"));
            }
        }
        Ok(())
    }
}

/// xoshiro256** seeded through splitmix64 (the reference recommendation),
/// so even seed 0 gives a well-mixed state.
#[derive(Clone, Debug)]
struct Rng([u64; 4]);

impl Rng {
    fn new(seed: u64) -> Self {
        let mut x = seed;
        let mut next = || {
            x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        };
        Rng([next(), next(), next(), next()])
    }

    fn next_u64(&mut self) -> u64 {
        let s = &mut self.0;
        let result = s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        result
    }

    /// Uniform in [0, 1) with 53 bits.
    fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

/// A stateful sampler: one per generation stream (it owns the PRNG state).
#[derive(Clone, Debug)]
pub struct Sampler {
    cfg: SamplerConfig,
    rng: Rng,
    /// Reused scratch buffers, to avoid allocating per token.
    cand: Vec<(u32, f32)>,
    probs: Vec<f64>,
}

impl Sampler {
    pub fn new(cfg: SamplerConfig) -> Self {
        let rng = Rng::new(cfg.seed);
        Sampler {
            cfg,
            rng,
            cand: Vec::new(),
            probs: Vec::new(),
        }
    }

    pub fn config(&self) -> &SamplerConfig {
        &self.cfg
    }

    /// Picks the next token. `logits` is modified in place (penalties,
    /// temperature). `history` is whatever the penalties should look at —
    /// transformers uses prompt + output for `repetition_penalty`, OpenAI
    /// only the output for presence/frequency; the caller chooses. Ids in
    /// `history` outside `logits` are ignored.
    pub fn sample(&mut self, logits: &mut [f32], history: &[u32]) -> u32 {
        for l in logits.iter_mut() {
            if l.is_nan() {
                *l = f32::NEG_INFINITY;
            }
        }
        self.apply_penalties(logits, history);
        let c = &self.cfg;
        if c.temperature <= 0.0 || c.top_k == 1 {
            return argmax(logits);
        }
        if let Some(i) = logits.iter().position(|&l| l == f32::INFINITY) {
            return i as u32;
        }
        let inv_t = 1.0 / c.temperature;
        self.cand.clear();
        self.cand.extend(
            logits
                .iter()
                .enumerate()
                .filter(|(_, l)| l.is_finite())
                .map(|(i, &l)| (i as u32, l * inv_t)),
        );
        if self.cand.is_empty() {
            return 0;
        }
        // Descending logit, ties by lower id: deterministic order.
        let order = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        if c.top_k > 0 && c.top_k < self.cand.len() {
            self.cand.select_nth_unstable_by(c.top_k - 1, order);
            self.cand.truncate(c.top_k);
        }
        self.cand.sort_unstable_by(order);
        let max = self.cand[0].1 as f64;
        self.probs.clear();
        self.probs
            .extend(self.cand.iter().map(|&(_, l)| (l as f64 - max).exp()));
        let total: f64 = self.probs.iter().sum();
        let mut keep = self.probs.len();
        if c.top_p < 1.0 {
            let target = c.top_p as f64 * total;
            let mut cum = 0.0;
            for (i, p) in self.probs.iter().enumerate() {
                cum += p;
                if cum >= target {
                    keep = i + 1;
                    break;
                }
            }
        }
        if c.min_p > 0.0 {
            // probs[0] is the max (unnormalised, = 1.0).
            let floor = c.min_p as f64 * self.probs[0];
            keep = keep.min(
                self.probs
                    .iter()
                    .take_while(|&&p| p >= floor)
                    .count()
                    .max(1),
            );
        }
        let kept = &self.probs[..keep];
        let mut u = self.rng.next_f64() * kept.iter().sum::<f64>();
        for (i, p) in kept.iter().enumerate() {
            if u < *p {
                return self.cand[i].0;
            }
            u -= p;
        }
        self.cand[keep - 1].0 // rounding fell off the end
    }

    fn apply_penalties(&self, logits: &mut [f32], history: &[u32]) {
        let c = &self.cfg;
        let rep = c.repetition_penalty != 1.0;
        if history.is_empty() || (!rep && c.presence_penalty == 0.0 && c.frequency_penalty == 0.0) {
            return;
        }
        let mut ids: Vec<u32> = history
            .iter()
            .copied()
            .filter(|&i| (i as usize) < logits.len())
            .collect();
        ids.sort_unstable();
        for run in ids.chunk_by(|a, b| a == b) {
            let l = &mut logits[run[0] as usize];
            if rep {
                // CTRL / transformers: push the token towards "less likely"
                // whatever the sign of its logit; once per distinct token.
                *l = if *l > 0.0 {
                    *l / c.repetition_penalty
                } else {
                    *l * c.repetition_penalty
                };
            }
            *l -= c.presence_penalty + c.frequency_penalty * run.len() as f32;
        }
    }
}

/// Index of the largest logit; ties go to the lowest id, NaN counts as -inf,
/// and an all -inf/NaN (or empty) row returns 0.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0usize;
    let mut best_v = f32::NEG_INFINITY;
    for (i, &l) in logits.iter().enumerate() {
        if l > best_v {
            best = i;
            best_v = l;
        }
    }
    best as u32
}

/// `(max, ln sum exp(l - max))` in f64, NaN treated as -inf. Kept as two
/// parts: `(l - max) - ln_sum` stays exact for huge logits where
/// `l - (max + ln_sum)` would cancel to 0.
fn log_sum_exp(logits: &[f32]) -> (f64, f64) {
    let max = logits
        .iter()
        .filter(|l| !l.is_nan())
        .fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
    if !max.is_finite() {
        return (max, 0.0);
    }
    let sum: f64 = logits
        .iter()
        .filter(|l| !l.is_nan())
        .map(|&l| (l as f64 - max).exp())
        .sum();
    (max, sum.ln())
}

fn log_prob(l: f32, (max, ln_sum): (f64, f64)) -> f32 {
    if l.is_nan() || !max.is_finite() {
        // Empty/degenerate row (or +inf): no meaningful distribution.
        return if l == f32::INFINITY {
            0.0
        } else {
            f32::NEG_INFINITY
        };
    }
    ((l as f64 - max) - ln_sum) as f32
}

/// log P(id) under softmax(logits), numerically stable. Out-of-range ids and
/// NaN logits give -inf.
pub fn log_softmax_at(logits: &[f32], id: u32) -> f32 {
    match logits.get(id as usize) {
        Some(&l) => log_prob(l, log_sum_exp(logits)),
        None => f32::NEG_INFINITY,
    }
}

/// The k most likely tokens with their log-probabilities, most likely first
/// (ties: lower id first). For OpenAI-style `top_logprobs`.
pub fn top_logprobs(logits: &[f32], k: usize) -> Vec<(u32, f32)> {
    let lse = log_sum_exp(logits);
    let mut v: Vec<(u32, f32)> = logits
        .iter()
        .enumerate()
        .map(|(i, &l)| (i as u32, if l.is_nan() { f32::NEG_INFINITY } else { l }))
        .collect();
    let order = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
    if k < v.len() && k > 0 {
        v.select_nth_unstable_by(k - 1, order);
    }
    v.truncate(k);
    v.sort_unstable_by(order);
    v.into_iter().map(|(i, l)| (i, log_prob(l, lse))).collect()
}

/// What [`StopStrings::push`] lets through.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StopOutput {
    /// Text that is safe to show now (may be empty).
    pub text: String,
    /// Index into the stop list of the stop string that ended generation.
    pub stopped: Option<usize>,
}

/// Cuts generated text at the first stop string, across delta boundaries.
///
/// A stop string can arrive split over several deltas ("<|e", "nd|>"), so we
/// hold back the longest tail that could still begin one; everything before
/// that tail can be emitted. Once a stop string is found, the text before it
/// is emitted, the stop string and anything after it are dropped, and later
/// pushes return nothing.
#[derive(Clone, Debug)]
pub struct StopStrings {
    stops: Vec<String>,
    pending: String,
    stopped: Option<usize>,
}

impl StopStrings {
    /// Empty stop strings are ignored (they would match everywhere).
    pub fn new(stops: Vec<String>) -> Self {
        StopStrings {
            stops,
            pending: String::new(),
            stopped: None,
        }
    }

    pub fn stopped(&self) -> Option<usize> {
        self.stopped
    }

    pub fn push(&mut self, delta: &str) -> StopOutput {
        if self.stopped.is_some() {
            return StopOutput {
                text: String::new(),
                stopped: self.stopped,
            };
        }
        self.pending.push_str(delta);
        // Earliest match wins; for equal starts, the longest stop string.
        let hit = self
            .stops
            .iter()
            .enumerate()
            .filter(|(_, s)| !s.is_empty())
            .filter_map(|(i, s)| {
                self.pending
                    .find(s.as_str())
                    .map(|at| (at, std::cmp::Reverse(s.len()), i))
            })
            .min();
        if let Some((at, _, i)) = hit {
            self.stopped = Some(i);
            let text = self.pending[..at].to_string();
            self.pending.clear();
            return StopOutput {
                text,
                stopped: Some(i),
            };
        }
        // Hold back the longest suffix that is a proper prefix of a stop.
        let hold_from = self
            .pending
            .char_indices()
            .map(|(i, _)| i)
            .find(|&i| {
                let tail = &self.pending[i..];
                self.stops
                    .iter()
                    .any(|s| s.len() > tail.len() && s.starts_with(tail))
            })
            .unwrap_or(self.pending.len());
        let text = self.pending[..hold_from].to_string();
        self.pending.drain(..hold_from);
        StopOutput {
            text,
            stopped: None,
        }
    }

    /// Generation ended without a stop string: release what was held back.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(temperature: f32, top_k: usize, top_p: f32, min_p: f32, seed: u64) -> SamplerConfig {
        SamplerConfig {
            temperature,
            top_k,
            top_p,
            min_p,
            seed,
            ..SamplerConfig::greedy()
        }
    }

    fn draws(c: SamplerConfig, logits: &[f32], n: usize) -> Vec<u32> {
        let mut s = Sampler::new(c);
        (0..n)
            .map(|_| s.sample(&mut logits.to_vec(), &[]))
            .collect()
    }

    const L: [f32; 6] = [1.0, 3.0, 2.5, -1.0, 3.0, 0.5];

    #[test]
    fn greedy_and_argmax() {
        assert_eq!(argmax(&L), 1); // tie 1 vs 4: lowest id
        assert_eq!(draws(SamplerConfig::greedy(), &L, 3), vec![1, 1, 1]);
        assert_eq!(argmax(&[f32::NAN, 2.0, f32::NAN]), 1);
        assert_eq!(argmax(&[f32::NAN, f32::NEG_INFINITY]), 0);
        assert_eq!(argmax(&[]), 0);
        let mut all_bad = [f32::NAN; 4];
        assert_eq!(
            Sampler::new(cfg(1.0, 0, 1.0, 0.0, 1)).sample(&mut all_bad, &[]),
            0
        );
        let mut inf = [0.0, f32::INFINITY, f32::NAN];
        assert_eq!(
            Sampler::new(cfg(1.0, 0, 1.0, 0.0, 1)).sample(&mut inf, &[]),
            1
        );
    }

    #[test]
    fn truncations_collapse_to_greedy() {
        let l = [1.0, 2.0, 4.0, 3.0, 0.0];
        assert!(draws(cfg(1.5, 1, 1.0, 0.0, 7), &l, 200)
            .iter()
            .all(|&t| t == 2));
        assert!(draws(cfg(1.5, 0, 1e-6, 0.0, 7), &l, 200)
            .iter()
            .all(|&t| t == 2));
        assert!(draws(cfg(1.5, 0, 1.0, 1.0, 7), &l, 200)
            .iter()
            .all(|&t| t == 2));
        // top_k = 2 only ever yields the two best.
        let got = draws(cfg(5.0, 2, 1.0, 0.0, 7), &l, 500);
        assert!(got.iter().all(|&t| t == 2 || t == 3) && got.contains(&3));
    }

    #[test]
    fn min_p_and_top_p_cut_the_tail() {
        // probs ~ [0.5, 0.25, 0.125, 0.125] at T=1.
        let l = [0.0, -(2f32.ln()), -(4f32.ln()), -(4f32.ln())];
        let got = draws(cfg(1.0, 0, 1.0, 0.3, 3), &l, 2000);
        assert!(
            got.iter().all(|&t| t <= 1) && got.contains(&1),
            "min_p keeps p >= 0.15"
        );
        let got = draws(cfg(1.0, 0, 0.7, 0.0, 3), &l, 2000);
        assert!(
            got.iter().all(|&t| t <= 1) && got.contains(&1),
            "top_p=0.7 keeps 0.5+0.25"
        );
        // 0.76 needs a third token; of the tied pair, the lower id is kept.
        let got = draws(cfg(1.0, 0, 0.76, 0.0, 3), &l, 2000);
        assert!(got.contains(&2) && !got.contains(&3));
        let got = draws(cfg(1.0, 0, 0.9, 0.0, 3), &l, 2000);
        assert!(got.contains(&3));
    }

    #[test]
    fn seeded_determinism() {
        let a = draws(cfg(1.0, 0, 1.0, 0.0, 42), &L, 300);
        assert_eq!(a, draws(cfg(1.0, 0, 1.0, 0.0, 42), &L, 300));
        assert_ne!(a, draws(cfg(1.0, 0, 1.0, 0.0, 43), &L, 300));
        // Pin the PRNG: splitmix64(0) first output, a published test vector.
        let mut x = 0u64;
        x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = x;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        assert_eq!(Rng::new(0).0[0], z ^ (z >> 31));
        assert_eq!(Rng::new(0).0[0], 0xE220_A839_7B1D_CDAF);
    }

    #[test]
    fn temperature_one_matches_softmax_chi_square() {
        let l = [0.0f32, 1.0, 2.0, 0.5];
        let n = 40_000;
        let mut counts = [0usize; 4];
        for t in draws(cfg(1.0, 0, 1.0, 0.0, 9), &l, n) {
            counts[t as usize] += 1;
        }
        let chi2: f64 = (0..4)
            .map(|i| {
                let e = log_softmax_at(&l, i as u32).exp() as f64 * n as f64;
                (counts[i] as f64 - e).powi(2) / e
            })
            .sum();
        // 3 degrees of freedom: P(chi2 > 16.27) = 0.001.
        assert!(chi2 < 16.27, "chi2 {chi2}, counts {counts:?}");
    }

    #[test]
    fn penalties() {
        // Token 0 barely wins; having seen it flips the choice to 1.
        let l = [2.0f32, 1.9, -1.0];
        let mut s = Sampler::new(SamplerConfig {
            repetition_penalty: 1.2,
            ..SamplerConfig::greedy()
        });
        assert_eq!(s.sample(&mut l.clone(), &[]), 0);
        let mut x = l;
        assert_eq!(s.sample(&mut x, &[0, 0, 2, 99]), 1);
        assert_eq!(x, [2.0 / 1.2, 1.9, -1.2]); // once per distinct id, sign-aware
        let mut s = Sampler::new(SamplerConfig {
            presence_penalty: 0.5,
            frequency_penalty: 0.25,
            ..SamplerConfig::greedy()
        });
        let mut x = l;
        s.sample(&mut x, &[0, 0, 2]);
        assert_eq!(x, [2.0 - 0.5 - 0.5, 1.9, -1.0 - 0.5 - 0.25]);
    }

    #[test]
    fn logprob_helpers() {
        let l = [1.0f32, 2.0, 3.0, f32::NAN];
        let z: f64 = [1.0f64, 2.0, 3.0].iter().map(|v| v.exp()).sum();
        assert!((log_softmax_at(&l, 2) as f64 - (3.0 - z.ln())).abs() < 1e-6);
        assert_eq!(log_softmax_at(&l, 3), f32::NEG_INFINITY);
        assert_eq!(log_softmax_at(&l, 9), f32::NEG_INFINITY);
        // Huge logits must not overflow.
        assert!((log_softmax_at(&[1e30, 1e30], 0) - (-(2f32.ln()))).abs() < 1e-6);
        let top = top_logprobs(&[0.5, 3.0, 3.0, -2.0], 3);
        assert_eq!(top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![1, 2, 0]);
        assert!(top[0].1 < 0.0 && (top[0].1 - top[1].1).abs() < 1e-7);
        assert_eq!(top_logprobs(&l, 10).len(), 4);
        assert!(top_logprobs(&l, 0).is_empty());
        assert_eq!(log_softmax_at(&[f32::NAN, f32::NAN], 0), f32::NEG_INFINITY);
        assert_eq!(log_softmax_at(&[], 0), f32::NEG_INFINITY);
    }

    #[test]
    fn config_defaults_and_validation() {
        let d = SamplerConfig::default();
        assert_eq!(
            (d.temperature, d.top_k, d.top_p, d.min_p),
            (0.7, 20, 0.8, 0.0)
        );
        assert!(d.validate().is_ok() && SamplerConfig::greedy().validate().is_ok());
        let err = SamplerConfig {
            top_p: 0.0,
            ..d.clone()
        }
        .validate()
        .unwrap_err();
        assert!(err.to_string().contains("top_p"), "{err}");
        assert!(SamplerConfig {
            temperature: f32::NAN,
            ..d.clone()
        }
        .validate()
        .is_err());
        let c: SamplerConfig = serde_json::from_str(r#"{"temperature": 0.2}"#).unwrap();
        assert_eq!(
            c,
            SamplerConfig {
                temperature: 0.2,
                ..SamplerConfig::default()
            }
        );
    }

    fn run(stops: &[&str], deltas: &[&str]) -> (Vec<String>, Option<usize>, String) {
        let mut s = StopStrings::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = Vec::new();
        for d in deltas {
            let o = s.push(d);
            out.push(o.text);
            if o.stopped.is_some() {
                break;
            }
        }
        (out, s.stopped(), s.finish())
    }

    #[test]
    fn stop_strings_across_deltas() {
        let (out, hit, rest) = run(&["<|end|>"], &["Hello <|", "e", "nd|> trailing"]);
        assert_eq!(out, vec!["Hello ", "", ""]);
        assert_eq!((hit, rest.as_str()), (Some(0), ""));
        // A false start is released once it cannot match any more.
        let (out, hit, _) = run(&["<|end|>"], &["a<|e", "x b"]);
        assert_eq!((out.concat().as_str(), hit), ("a<|ex b", None));
        // No stop: finish() flushes the held-back tail.
        let (out, hit, rest) = run(&["STOP"], &["abc ST"]);
        assert_eq!((out.concat() + &rest, hit), ("abc ST".to_string(), None));
        // Earliest match wins; multi-byte text is cut on char boundaries.
        let (out, hit, _) = run(&["world", "o w"], &["héllo w", "orld"]);
        assert_eq!((out.concat().as_str(), hit), ("héll", Some(1)));
        let (out, hit, _) = run(&["中文"], &["这是中", "文本"]);
        assert_eq!((out.concat().as_str(), hit), ("这是", Some(0)));
        // Pushing after a stop yields nothing; empty stops never match.
        let mut s = StopStrings::new(vec!["".into(), "x".into()]);
        assert_eq!(
            s.push("ab"),
            StopOutput {
                text: "ab".into(),
                stopped: None
            }
        );
        assert_eq!(s.push("cxd").text, "c");
        assert_eq!(
            s.push("more"),
            StopOutput {
                text: String::new(),
                stopped: Some(1)
            }
        );
    }
}
