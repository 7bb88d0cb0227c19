//! Sampling flags shared by `generate` and `chat`.

use smoe_engine::sampler::SamplerConfig;

#[derive(clap::Args, Clone, Debug, Default)]
pub struct SamplingArgs {
    /// Sampling temperature; 0 = greedy. Default: the model's generation_config.
    #[arg(long)]
    pub temperature: Option<f32>,
    /// Sample only among the K most likely tokens (0 or 1 with temperature 0: greedy).
    /// Default: the model's generation_config.
    #[arg(long, value_name = "K")]
    pub top_k: Option<usize>,
    /// Sample only among the most likely tokens whose probabilities add up to P (nucleus,
    /// 0 < P ≤ 1). Default: the model's generation_config.
    #[arg(long, value_name = "P")]
    pub top_p: Option<f32>,
    /// Drop tokens less likely than P times the most likely one (0 ≤ P ≤ 1). Default: the
    /// model's generation_config.
    #[arg(long, value_name = "P")]
    pub min_p: Option<f32>,
    /// Divide the logits of tokens already seen by R (> 1 discourages repeats; 1 = off).
    /// Default: the model's generation_config.
    #[arg(long, value_name = "R")]
    pub repetition_penalty: Option<f32>,
    /// Random seed for sampling (default: from the clock).
    #[arg(long)]
    pub seed: Option<u64>,
}

impl SamplingArgs {
    /// `base` (the model's defaults) with the given flags applied; the seed is left alone.
    pub fn apply(&self, mut s: SamplerConfig) -> SamplerConfig {
        if let Some(t) = self.temperature {
            s.temperature = t;
        }
        if let Some(k) = self.top_k {
            s.top_k = k;
        }
        if let Some(p) = self.top_p {
            s.top_p = p;
        }
        if let Some(p) = self.min_p {
            s.min_p = p;
        }
        if let Some(r) = self.repetition_penalty {
            s.repetition_penalty = r;
        }
        s
    }

    /// `--seed`, or a fresh one from the clock.
    pub fn seed(&self) -> u64 {
        self.seed.unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(0)
        })
    }
}
