//! Full-size vaults with random weights and exactly a real model's shapes, for benchmarks.
//!
//! Codes are random bytes and scales are set so activations keep a sensible size, so a vault is
//! written about as fast as the disk takes it. `router_skew` makes expert popularity follow a
//! Zipf-like law: the residual stream carries a constant channel (dimension 0 of the embedding is
//! 1 and no layer writes to it), and each router row adds `−skew · ln(rank)` along that channel,
//! so expert `rank` is picked roughly ∝ rank^−skew. The realised popularity is what the bench and
//! `smoe profile` report.

use crate::config::{FfnKind, GenerationDefaults, ModelConfig, QkNorm, Rope};
use crate::error::Result;
use crate::format::{Header, QuantInfo, TextInfo};
use crate::import::hf::expert_parts;
use crate::quant::{quantize_matrix, DType};
use crate::tensors::{scout_layout, MlpPart, Tensor, TensorSpec};
use crate::writer::VaultWriter;
use half::f16;
use std::io::{Seek, Write};

/// Shapes of the models we stand in for.
pub fn preset(name: &str) -> Option<ModelConfig> {
    let (layers, hidden, heads, kv, head_dim, experts, top_k, moe_inter, vocab) = match name {
        "qwen3-30b-a3b" => (48, 2048, 32, 4, 128, 128, 8, 768, 151936),
        "qwen3-235b-a22b" => (94, 4096, 64, 4, 128, 128, 8, 1536, 151936),
        // Small enough for tests and quick trials, same structure.
        "tiny" => (4, 256, 4, 2, 64, 16, 4, 128, 8192),
        _ => return None,
    };
    Some(ModelConfig {
        architecture: crate::Architecture::Qwen3Moe,
        vocab_size: vocab,
        hidden_size: hidden,
        num_layers: layers,
        num_heads: heads,
        num_kv_heads: kv,
        head_dim,
        intermediate_size: 0,
        moe_intermediate_size: moe_inter,
        num_experts: experts,
        num_experts_per_tok: top_k,
        norm_topk_prob: true,
        rms_norm_eps: 1e-6,
        rope: Rope {
            theta: 1e6,
            yarn: None,
        },
        max_position_embeddings: 40960,
        tie_word_embeddings: false,
        ffn: vec![FfnKind::Moe; layers],
        qk_norm: QkNorm::PerHead,
        qkv_bias: false,
        clip_qkv: None,
        sliding_window: None,
        shared_expert_intermediate_size: 0,
    })
}

pub const PRESETS: [&str; 3] = ["qwen3-30b-a3b", "qwen3-235b-a22b", "tiny"];

/// xorshift64*: fast, deterministic, good enough for random weights.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545F4914F6CDD1D)
    }
    /// Uniform in [-1, 1).
    fn uniform(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
    fn fill(&mut self, out: &mut [u8]) {
        for c in out.chunks_mut(8) {
            let v = self.next().to_le_bytes();
            c.copy_from_slice(&v[..c.len()]);
        }
    }
}

/// Random rows in storage type `dtype` whose values are about ±`scale`: quantized types get
/// random codes and a fixed scale, others go through the quantizer.
fn random_matrix(rng: &mut Rng, dtype: DType, rows: usize, cols: usize, scale: f32) -> Vec<u8> {
    if !dtype.is_quantized() {
        let v: Vec<f32> = (0..rows * cols).map(|_| rng.uniform() * scale).collect();
        return quantize_matrix(dtype, &v, rows, cols);
    }
    let stride = dtype.row_stride(cols);
    let code_bytes = dtype.code_bytes(cols);
    let groups = cols / crate::quant::GROUP;
    let levels = match dtype {
        DType::Q8 => 127.0,
        DType::Q4 => 8.0,
        _ => 2.0,
    };
    let d = f16::from_f32(scale / levels).to_bits().to_le_bytes();
    let m = f16::from_f32(-scale).to_bits().to_le_bytes();
    let mut out = vec![0u8; rows * stride];
    for row in out.chunks_mut(stride) {
        rng.fill(&mut row[..code_bytes]);
        if dtype == DType::Q8 {
            // Keep codes inside [-127, 127].
            for b in &mut row[..code_bytes] {
                if *b == 0x80 {
                    *b = 0x81;
                }
            }
        }
        let params = &mut row[code_bytes..];
        for g in 0..groups {
            if dtype == DType::Q2 {
                params[4 * g..4 * g + 2].copy_from_slice(&d);
                params[4 * g + 2..4 * g + 4].copy_from_slice(&m);
            } else {
                params[2 * g..2 * g + 2].copy_from_slice(&d);
            }
        }
    }
    out
}

#[derive(Debug, Clone, Copy)]
pub struct SynthOptions {
    pub experts: DType,
    pub scout: DType,
    pub router_skew: f32,
    pub seed: u64,
}

/// `√(3 / fan_in)`: a matrix of values uniform in ±that keeps a product about as large as its
/// input.
fn scale(fan_in: usize) -> f32 {
    (3.0 / fan_in as f32).sqrt()
}

/// Zeroes row 0 of a matrix in storage type `dtype`: a matrix that writes to the residual stream
/// writes nothing to the constant channel.
fn zero_first_row(m: &mut [u8], dtype: DType, cols: usize) {
    m[..dtype.row_stride(cols)].fill(0);
}

/// One dense tensor's bytes in its storage type `dtype`. Draws from `rng` in the table's order;
/// `order` (experts by popularity rank) is reshuffled at each router, so each layer has its own
/// popular experts.
fn dense_tensor(
    spec: &TensorSpec,
    dtype: DType,
    router_skew: f32,
    rng: &mut Rng,
    order: &mut [usize],
) -> Vec<u8> {
    let (rows, cols) = spec.rows_cols();
    match spec.id {
        Tensor::InputNorm(_) | Tensor::PostNorm(_) | Tensor::QkNorm(..) | Tensor::FinalNorm => {
            quantize_matrix(dtype, &vec![1.0; cols], 1, cols)
        }
        Tensor::Bias(..) => quantize_matrix(dtype, &vec![0.0; cols], 1, cols),
        Tensor::Embed => {
            // Dimension 0 is the constant channel that carries the router skew.
            let mut embed = vec![0f32; rows * cols];
            for (i, v) in embed.iter_mut().enumerate() {
                *v = if i % cols == 0 { 1.0 } else { rng.uniform() };
            }
            quantize_matrix(dtype, &embed, rows, cols)
        }
        Tensor::OProj(_) => {
            // Row 0 (the constant channel) is zero.
            let mut o = vec![0f32; rows * cols];
            for v in o.iter_mut().skip(cols) {
                *v = rng.uniform() * scale(cols) * 0.5;
            }
            quantize_matrix(dtype, &o, rows, cols)
        }
        Tensor::Router(_) => {
            // Random rows plus −skew·ln(rank) along the constant channel.
            for i in (1..order.len()).rev() {
                order.swap(i, (rng.next() % (i as u64 + 1)) as usize);
            }
            let mut router = vec![0f32; rows * cols];
            for (e, row) in router.chunks_mut(cols).enumerate() {
                for v in row.iter_mut() {
                    *v = rng.uniform() * scale(cols);
                }
                let rank = order[e] + 1;
                // After RMSNorm the constant channel is 1/rms(embedding) = √3 (uniform ±1 rows):
                // divide it out so the logit bias is −skew·ln(rank) against O(1) noise.
                row[0] = -router_skew * (rank as f32).ln() / 3f32.sqrt();
            }
            quantize_matrix(dtype, &router, rows, cols)
        }
        Tensor::LmHead => random_matrix(rng, dtype, rows, cols, scale(cols) * 4.0),
        Tensor::Mlp(_, MlpPart::Down) | Tensor::Shared(_, MlpPart::Down) => {
            let mut m = random_matrix(rng, dtype, rows, cols, scale(cols));
            zero_first_row(&mut m, dtype, cols);
            m
        }
        Tensor::Proj(..) | Tensor::Mlp(..) | Tensor::Shared(..) | Tensor::SharedGate(_) => {
            random_matrix(rng, dtype, rows, cols, scale(cols))
        }
        Tensor::Expert(..) => unreachable!("routed experts are written as blobs"),
    }
}

/// Writes a random vault of shape `cfg`; `progress(bytes)` after each tensor or blob.
/// `text` and `generation` give the vault a tokenizer and chat template (e.g. another vault's),
/// so the server and chat can drive it; ids beyond that tokenizer simply have no text.
pub fn synth<W: Write + Seek>(
    cfg: &ModelConfig,
    opts: SynthOptions,
    text: TextInfo,
    generation: GenerationDefaults,
    mut w: VaultWriter<W>,
    progress: &mut dyn FnMut(u64),
) -> Result<(u64, W)> {
    let mut rng = Rng(opts.seed | 1);
    let mut order: Vec<usize> = (0..cfg.num_experts).collect();
    for spec in scout_layout(cfg) {
        let dtype = spec.storage.dtype(opts.scout, opts.experts);
        let bytes = dense_tensor(&spec, dtype, opts.router_skew, &mut rng, &mut order);
        w.add_tensor(&spec.id.name(), dtype, &spec.shape, &bytes)?;
        progress(bytes.len() as u64);
    }
    let parts = expert_parts(cfg, opts.experts);
    let used = parts.iter().map(|p| p.offset + p.length).max().unwrap_or(0) as usize;
    if cfg.moe_layers().next().is_some() {
        w.begin_experts(parts.clone())?;
    }
    // Blobs are generated in parallel batches (each expert from its own seed) and written in
    // order: the disk, not the random number generator, sets the pace.
    use rayon::prelude::*;
    for l in cfg.moe_layers() {
        for e0 in (0..cfg.num_experts).step_by(32) {
            let e1 = (e0 + 32).min(cfg.num_experts);
            let blobs: Vec<Vec<u8>> = (e0..e1)
                .into_par_iter()
                .map(|e| {
                    let mut rng = Rng(opts.seed.wrapping_mul(0x9E3779B97F4A7C15)
                        ^ ((l as u64) << 32 | e as u64)
                        | 1);
                    let mut blob = vec![0u8; used];
                    for (p, part) in parts.iter().zip(MlpPart::ALL) {
                        let (rows, cols) = (p.shape[0], p.shape[1]);
                        let mut m = random_matrix(&mut rng, p.dtype, rows, cols, scale(cols));
                        if part == MlpPart::Down {
                            // Experts write nothing to the constant channel either.
                            zero_first_row(&mut m, p.dtype, cols);
                        }
                        blob[p.offset as usize..(p.offset + p.length) as usize].copy_from_slice(&m);
                    }
                    blob
                })
                .collect();
            for (i, blob) in blobs.iter().enumerate() {
                w.add_expert(l, e0 + i, blob)?;
                progress(used as u64);
            }
        }
    }
    let header = Header {
        config: cfg.clone(),
        hf_config: serde_json::json!({"synthetic": true, "router_skew": opts.router_skew, "seed": opts.seed}),
        text,
        generation,
        quant: QuantInfo {
            experts: opts.experts,
            scout: opts.scout,
            group_size: crate::quant::GROUP,
        },
        tensors: vec![],
        experts: None,
        writer: format!("smoe {} synth", env!("CARGO_PKG_VERSION")),
    };
    w.finish(header)
}

/// Bytes the vault will hold (for the progress bar).
pub fn estimate_bytes(cfg: &ModelConfig, opts: SynthOptions) -> u64 {
    let dense: u64 = scout_layout(cfg)
        .iter()
        .map(|t| t.bytes(t.storage.dtype(opts.scout, opts.experts)))
        .sum();
    let parts = expert_parts(cfg, opts.experts);
    let blob = parts.iter().map(|p| p.offset + p.length).max().unwrap_or(0);
    dense + (cfg.moe_layers().count() * cfg.num_experts) as u64 * blob
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The whole vault `synth` writes for the tiny preset, hashed.
    fn tiny_vault_hash(scout: DType, experts: DType, router_skew: f32, seed: u64) -> (u64, u64) {
        let cfg = preset("tiny").unwrap();
        let opts = SynthOptions {
            experts,
            scout,
            router_skew,
            seed,
        };
        let out = std::io::Cursor::new(Vec::new());
        let w = VaultWriter::new(out, std::path::Path::new("tiny.smoe")).unwrap();
        let mut reported = 0;
        let (len, out) = synth(
            &cfg,
            opts,
            TextInfo::default(),
            GenerationDefaults::default(),
            w,
            &mut |n| reported += n,
        )
        .unwrap();
        let bytes = out.into_inner();
        assert_eq!(len, bytes.len() as u64);
        // The progress bar's total is what progress reports.
        assert_eq!(estimate_bytes(&cfg, opts), reported);
        (len, xxhash_rust::xxh3::xxh3_64(&bytes))
    }

    /// A synthetic vault is a function of its options: these hashes were taken before `synth`
    /// read its tensor list from `tensors::scout_layout`, and must not change.
    #[test]
    fn tiny_vaults_are_byte_identical_across_versions() {
        let cases = [
            (DType::Bf16, DType::Q4, 1.0, 7),
            (DType::Q8, DType::Q8, 0.0, 1),
            (DType::Bf16, DType::Bf16, 0.5, 42),
            (DType::Q8, DType::Q2, 1.5, 3),
        ];
        let want = [
            (14232164, 5980314568221799587),
            (12708367, 3339891945077716947),
            (22620784, 1963189859133708580),
            (7465462, 13526353753610993819),
        ];
        for ((scout, experts, skew, seed), want) in cases.into_iter().zip(want) {
            let got = tiny_vault_hash(scout, experts, skew, seed);
            assert_eq!(
                got, want,
                "{scout} scout, {experts} experts, skew {skew}, seed {seed}"
            );
        }
    }
}
