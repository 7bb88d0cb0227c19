//! Tiny random MoE checkpoints (Qwen3-MoE, Mixtral, OLMoE, Qwen2-MoE) in the Hugging Face hub
//! layout, and the reference outputs that Hugging Face transformers computed for them.
//!
//! The checkpoints are defined by `tests/fixtures/specs.json` and generated with integer-only
//! arithmetic, byte-identically to `scripts/fixtures.py` (see `tests/fixtures/README.md`). The
//! references (`tests/fixtures/reference/NAME.json`) were computed by transformers on CPU in
//! float32; their `meta.files_sha256` lets a test confirm it regenerated the same files.
//!
//! ```no_run
//! let dir = smoe_fixtures::checkpoint("tiny-tied").unwrap(); // cached under the temp dir
//! let r = smoe_fixtures::reference("tiny-tied");
//! assert_eq!(r.prompts[0].prompt.len(), 20);
//! # let _ = dir;
//! ```

use std::collections::BTreeMap;
use std::io;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::Value;
use smoe_vault::tensors::{layout, Tensor};
use smoe_vault::{Architecture, FfnKind, ModelConfig};

mod pyjson;
mod sha256;
pub use pyjson::{canonical_json, py_float_repr};
pub use sha256::sha256;

/// `tests/fixtures` of this repository.
pub const FIXTURES_DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures");

/// The tokenizer files copied into every checkpoint.
pub const TOKENIZER_FILES: [&str; 3] = [
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
];

pub fn fixtures_dir() -> PathBuf {
    PathBuf::from(FIXTURES_DIR)
}

/// An empty directory of a test's own under the temp dir, removed with everything in it when
/// dropped (tests run in parallel: the name carries the process id and a per-process counter).
pub struct ScratchDir(PathBuf);

impl ScratchDir {
    pub fn new(name: &str) -> io::Result<Self> {
        static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let d =
            std::env::temp_dir().join(format!("smoe-scratch-{}-{n}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d)?;
        Ok(ScratchDir(d))
    }
}

impl std::ops::Deref for ScratchDir {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

impl AsRef<Path> for ScratchDir {
    fn as_ref(&self) -> &Path {
        &self.0
    }
}

impl AsRef<std::ffi::OsStr> for ScratchDir {
    fn as_ref(&self) -> &std::ffi::OsStr {
        self.0.as_os_str()
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// `tests/fixtures/tokenizer`: tokenizer.json, tokenizer_config.json, generation_config.json and
/// reference.json (encodings and chat-template renderings by transformers).
pub fn tokenizer_dir() -> PathBuf {
    fixtures_dir().join("tokenizer")
}

// ---------------------------------------------------------------------------------------------
// integer arithmetic

pub fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

pub fn fnv1a64(data: &[u8]) -> u64 {
    let mut h: u64 = 0xCBF2_9CE4_8422_2325;
    for &b in data {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01B3);
    }
    h
}

/// e with 2^e = 2^round_half_up(log2(sqrt(3 / fan_in))), in integers: floor(-c / 2) where c is
/// the smallest integer with 6 * 2^c >= fan_in (requires fan_in > 6).
pub fn scale_exponent(fan_in: usize) -> i32 {
    assert!(fan_in > 6, "fan_in must be > 6");
    let mut c: i32 = 0;
    while 6usize << c < fan_in {
        c += 1;
    }
    (-c).div_euclid(2)
}

/// Prompt token ids: splitmix64(seed + i) % vocab.
pub fn prompt_tokens(seed: u64, len: usize, vocab: u64) -> Vec<u32> {
    (0..len as u64)
        .map(|i| (splitmix64(seed.wrapping_add(i)) % vocab) as u32)
        .collect()
}

// ---------------------------------------------------------------------------------------------
// specs

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Specs {
    /// Prompt ids are drawn below this (the tokenizer's size; the models' vocab is larger).
    pub tokenizer_vocab: u64,
    pub fixtures: Vec<Spec>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Spec {
    pub name: String,
    pub seed: u64,
    /// bf16 | f16 | f32
    pub dtype: String,
    pub shards: usize,
    pub prompts: Vec<PromptSpec>,
    /// config.json, written as is.
    pub config: Value,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct PromptSpec {
    pub seed: u64,
    pub len: usize,
}

pub fn specs() -> Specs {
    let path = fixtures_dir().join("specs.json");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("parsing {}: {e}", path.display()))
}

pub fn spec(name: &str) -> Spec {
    specs()
        .fixtures
        .into_iter()
        .find(|s| s.name == name)
        .unwrap_or_else(|| panic!("unknown fixture {name:?}; known: {:?}", names()))
}

/// The fixtures' names, in specs.json order.
pub fn names() -> Vec<String> {
    specs().fixtures.into_iter().map(|s| s.name).collect()
}

/// The fixtures of the given model_type(s) (e.g. `names_of(&["qwen3_moe"])`), in specs.json order.
pub fn names_of(model_types: &[&str]) -> Vec<String> {
    specs()
        .fixtures
        .into_iter()
        .filter(|s| model_types.contains(&model_type_of(&s.config)))
        .map(|s| s.name)
        .collect()
}

/// The model_type of fixture `name` ("qwen3_moe", "mixtral", "olmoe", "qwen2_moe").
pub fn model_type(name: &str) -> String {
    model_type_of(&spec(name).config).to_string()
}

fn model_type_of(cfg: &Value) -> &str {
    cfg.get("model_type")
        .and_then(Value::as_str)
        .expect("config.json: model_type")
}

/// The prompts of fixture `name` as token ids.
pub fn prompts(name: &str) -> Vec<Vec<u32>> {
    let specs = specs();
    let spec = specs
        .fixtures
        .iter()
        .find(|s| s.name == name)
        .expect("known fixture");
    spec.prompts
        .iter()
        .map(|p| prompt_tokens(p.seed, p.len, specs.tokenizer_vocab))
        .collect()
}

// ---------------------------------------------------------------------------------------------
// tensors

/// How a tensor's values are generated (see `tensor_values`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// scale 1
    Embed,
    /// scale 2^e(fan_in)
    Matrix,
    /// scale 2^e(fan_in) * 4; routers and Qwen2-MoE's shared_expert_gate
    Router,
    /// scale 2^e(fan_in) * 4; also a tied embedding (it is the LM head too)
    LmHead,
    /// 1 + ((k >> 4) - 8) / 32
    Norm,
    /// ((k >> 4) - 8) / 64 (tensors named `*.bias`)
    Bias,
}

impl Kind {
    /// The value rule of tensor `id` of a model whose embedding is (`tied`) or is not the LM head.
    fn of(id: Tensor, tied: bool) -> Kind {
        match id {
            Tensor::Embed if tied => Kind::LmHead,
            Tensor::Embed => Kind::Embed,
            Tensor::LmHead => Kind::LmHead,
            Tensor::InputNorm(_) | Tensor::PostNorm(_) | Tensor::QkNorm(..) | Tensor::FinalNorm => {
                Kind::Norm
            }
            Tensor::Bias(..) => Kind::Bias,
            // the shared expert's sigmoid gate follows the router rule (matrix scale * 4)
            Tensor::Router(_) | Tensor::SharedGate(_) => Kind::Router,
            Tensor::Proj(..)
            | Tensor::OProj(_)
            | Tensor::Mlp(..)
            | Tensor::Shared(..)
            | Tensor::Expert(..) => Kind::Matrix,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorSpec {
    /// The hub checkpoint's name.
    pub name: String,
    pub shape: Vec<usize>,
    pub kind: Kind,
}

impl TensorSpec {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// A model family the fixtures cover, by `config.json`'s model_type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Family {
    pub model_type: &'static str,
    pub architecture: Architecture,
}

const fn family_of(architecture: Architecture) -> Family {
    Family {
        model_type: architecture.model_type(),
        architecture,
    }
}

/// Every family smoe supports; what differs between their checkpoints (module and projection
/// names, q/k norm shapes, biases, shared expert, dense layers) is `smoe_vault::tensors`' table,
/// which `scripts/fixtures.py` spells out again in its own `FAMILIES`.
pub const FAMILIES: [Family; 4] = [
    family_of(Architecture::ALL[0]),
    family_of(Architecture::ALL[1]),
    family_of(Architecture::ALL[2]),
    family_of(Architecture::ALL[3]),
];

/// `config.json` as smoe reads it; panics on a config smoe rejects.
fn model_config(cfg: &Value) -> ModelConfig {
    ModelConfig::from_hf(cfg).unwrap_or_else(|e| panic!("config.json: {e}"))
}

/// `head_dim`, or hidden_size / num_attention_heads.
pub fn head_dim(cfg: &Value) -> usize {
    model_config(cfg).head_dim
}

/// Qwen-MoE's rule: sparse iff not in mlp_only_layers and (layer + 1) % decoder_sparse_step == 0;
/// Mixtral and OLMoE have only sparse layers.
pub fn layer_is_sparse(cfg: &Value, layer: usize) -> bool {
    model_config(cfg).ffn[layer] == FfnKind::Moe
}

/// Every tensor of the checkpoint (`smoe_vault::tensors::layout` under the hub's names), sorted
/// by name (byte order).
pub fn tensor_list(cfg: &Value) -> Vec<TensorSpec> {
    let c = model_config(cfg);
    let mut out: Vec<TensorSpec> = layout(&c)
        .into_iter()
        .map(|t| TensorSpec {
            name: t.id.hub_name(c.architecture),
            shape: t.shape,
            kind: Kind::of(t.id, c.tie_word_embeddings),
        })
        .collect();
    out.sort_by(|a, b| a.name.as_bytes().cmp(b.name.as_bytes()));
    assert!(
        out.windows(2).all(|w| w[0].name != w[1].name),
        "duplicate tensor name"
    );
    assert!(out
        .iter()
        .all(|t| (t.kind == Kind::Bias) == t.name.ends_with(".bias")));
    out
}

/// The tensor's values (row-major), all exactly representable in bf16 and f16.
pub fn tensor_values(t: &TensorSpec, seed: u64) -> Vec<f32> {
    let s = fnv1a64(t.name.as_bytes()) ^ seed;
    let k = (0..t.numel() as u64).map(move |i| (splitmix64(s.wrapping_add(i)) >> 56) as i32);
    match t.kind {
        Kind::Norm => k.map(|k| ((k >> 4) + 24) as f32 / 32.0).collect(),
        Kind::Bias => k.map(|k| ((k >> 4) - 8) as f32 / 64.0).collect(),
        kind => {
            let mut e = if kind == Kind::Embed {
                0
            } else {
                scale_exponent(t.shape[1])
            };
            if matches!(kind, Kind::Router | Kind::LmHead) {
                e += 2;
            }
            let step = 2f32.powi(e - 7); // (k - 128) / 128 * 2^e
            k.map(|k| (k - 128) as f32 * step).collect()
        }
    }
}

/// safetensors dtype name and bytes per element.
pub fn dtype_info(dtype: &str) -> (&'static str, usize) {
    match dtype {
        "bf16" => ("BF16", 2),
        "f16" => ("F16", 2),
        "f32" => ("F32", 4),
        _ => panic!("unknown dtype {dtype:?}"),
    }
}

/// Little-endian bytes in `dtype`; panics if a value is not exactly representable.
pub fn encode(values: &[f32], dtype: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(values.len() * dtype_info(dtype).1);
    for &v in values {
        match dtype {
            "bf16" => {
                let bits = v.to_bits();
                assert_eq!(bits & 0xFFFF, 0, "{v} is not exact in bf16");
                out.extend_from_slice(&((bits >> 16) as u16).to_le_bytes());
            }
            "f16" => {
                let h = half::f16::from_f32(v);
                assert_eq!(h.to_f32(), v, "{v} is not exact in f16");
                out.extend_from_slice(&h.to_le_bytes());
            }
            "f32" => out.extend_from_slice(&v.to_le_bytes()),
            _ => panic!("unknown dtype {dtype:?}"),
        }
    }
    out
}

/// A safetensors file: `{"__metadata__":{"format":"pt"},NAME:{...},...}` (compact, entries in
/// the given order, which is name order), padded with spaces to a multiple of 8, then the data.
pub fn safetensors_bytes(entries: &[(&TensorSpec, Vec<u8>)], dtype: &str) -> Vec<u8> {
    let st = dtype_info(dtype).0;
    let mut header = String::from(r#"{"__metadata__":{"format":"pt"}"#);
    let mut off = 0usize;
    for (t, data) in entries {
        let dims: Vec<String> = t.shape.iter().map(|d| d.to_string()).collect();
        header.push_str(&format!(
            r#","{}":{{"dtype":"{}","shape":[{}],"data_offsets":[{},{}]}}"#,
            t.name,
            st,
            dims.join(","),
            off,
            off + data.len()
        ));
        off += data.len();
    }
    header.push('}');
    let pad = (8 - header.len() % 8) % 8;
    header.push_str(&" ".repeat(pad));
    let mut out = Vec::with_capacity(8 + header.len() + off);
    out.extend_from_slice(&(header.len() as u64).to_le_bytes());
    out.extend_from_slice(header.as_bytes());
    for (_, data) in entries {
        out.extend_from_slice(data);
    }
    out
}

pub fn shard_file_name(i: usize, shards: usize) -> String {
    if shards == 1 {
        "model.safetensors".into()
    } else {
        format!("model-{:05}-of-{:05}.safetensors", i + 1, shards)
    }
}

/// Every file of the checkpoint: (file name, bytes), sorted by file name.
pub fn checkpoint_files(spec: &Spec) -> Vec<(String, Vec<u8>)> {
    let cfg = &spec.config;
    let width = dtype_info(&spec.dtype).1;
    let tensors = tensor_list(cfg);
    let total: usize = tensors.iter().map(|t| t.numel() * width).sum();
    let mut files: BTreeMap<String, Vec<u8>> = BTreeMap::new();
    files.insert("config.json".into(), canonical_json(cfg).into_bytes());
    for f in TOKENIZER_FILES {
        let path = tokenizer_dir().join(f);
        let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        files.insert(f.into(), bytes);
    }
    // tensor i goes to shard floor(bytes before it * shards / total)
    let shards = spec.shards;
    let mut groups: Vec<Vec<(&TensorSpec, Vec<u8>)>> = (0..shards).map(|_| Vec::new()).collect();
    let mut before = 0usize;
    for t in &tensors {
        let shard = (before * shards / total).min(shards - 1);
        groups[shard].push((t, encode(&tensor_values(t, spec.seed), &spec.dtype)));
        before += t.numel() * width;
    }
    let mut weight_map = serde_json::Map::new();
    for (i, entries) in groups.iter().enumerate() {
        assert!(!entries.is_empty(), "empty shard");
        let fname = shard_file_name(i, shards);
        for (t, _) in entries {
            weight_map.insert(t.name.clone(), Value::String(fname.clone()));
        }
        files.insert(fname, safetensors_bytes(entries, &spec.dtype));
    }
    if shards > 1 {
        let index = serde_json::json!({
            "metadata": {"total_size": total},
            "weight_map": Value::Object(weight_map),
        });
        files.insert(
            "model.safetensors.index.json".into(),
            canonical_json(&index).into_bytes(),
        );
    }
    files.into_iter().collect()
}

/// Writes checkpoint `name` into `dir` (created if missing): the same bytes as
/// `python scripts/fixtures.py write NAME DIR`.
pub fn write_checkpoint(name: &str, dir: &Path) -> io::Result<()> {
    std::fs::create_dir_all(dir)?;
    for (fname, bytes) in checkpoint_files(&spec(name)) {
        std::fs::write(dir.join(fname), bytes)?;
    }
    Ok(())
}

/// Checkpoint `name` written once under the system temp dir (keyed by the fixture definition and
/// the tokenizer files, and written to a scratch dir then renamed, so concurrent tests are safe);
/// returns its directory.
pub fn checkpoint(name: &str) -> io::Result<PathBuf> {
    let spec = spec(name);
    let mut key = serde_json::to_vec(&spec).expect("spec serializes");
    for f in TOKENIZER_FILES {
        key.extend(std::fs::read(tokenizer_dir().join(f))?);
    }
    let root = std::env::temp_dir().join("smoe-fixtures");
    let dir = root.join(format!("{name}-{:016x}", fnv1a64(&key)));
    if dir.join(".complete").exists() {
        return Ok(dir);
    }
    std::fs::create_dir_all(&root)?;
    // unique per process and call: tests of one process run on several threads
    static SCRATCH: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = SCRATCH.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let scratch = root.join(format!(".{name}-{}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&scratch);
    write_checkpoint(name, &scratch)?;
    std::fs::write(scratch.join(".complete"), b"")?;
    match std::fs::rename(&scratch, &dir) {
        Ok(()) => Ok(dir),
        Err(_) if dir.join(".complete").exists() => {
            let _ = std::fs::remove_dir_all(&scratch);
            Ok(dir)
        }
        Err(e) => Err(e),
    }
}

// ---------------------------------------------------------------------------------------------
// references

/// `tests/fixtures/reference/NAME.json`, written by `python scripts/fixtures.py reference`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Reference {
    pub meta: Meta,
    pub prompts: Vec<PromptReference>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Meta {
    pub fixture: String,
    pub transformers: String,
    pub torch: String,
    pub date: String,
    /// float32: the model ran in float32 on CPU, eager attention, eager experts.
    pub dtype_computed: String,
    pub device: String,
    pub attn_implementation: String,
    pub experts_implementation: String,
    pub config_sha256: String,
    /// sha256 of each safetensors file.
    pub weights_sha256: BTreeMap<String, String>,
    /// sha256 of every file of the checkpoint.
    pub files_sha256: BTreeMap<String, String>,
    /// "sparse" | "dense", per layer, as transformers built them.
    pub layers: Vec<String>,
    pub rope: RopeReference,
    /// The fields below are in the references of the non-Qwen3 families only (the Qwen3-MoE
    /// references predate them).
    ///
    /// `config.json`'s model_type.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_type: Option<String>,
    /// How transformers' router turns the logits into expert weights, in words.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub router: Option<String>,
    /// The attention mask each layer really used (read off eager attention's probabilities on the
    /// longest prompt): `applied`, `layers` ("causal" | "sliding W"), `rule`, and the effect of the
    /// window (`effect_max_abs_logprob`: switched off; `effect_if_applied_max_abs_logprob`: what an
    /// engine that wrongly applied a configured-but-disabled window would be off by).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sliding_window_applied: Option<Value>,
    /// OLMoE's clip_qkv: `clip_qkv`, `clipped` {q, k, v} elements beyond ±clip_qkv, `total`, and
    /// `effect_max_abs_logprob` (clip switched off).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub clipped_elements: Option<Value>,
    /// Qwen2-MoE: the range of sigmoid(shared_expert_gate . x) over the prompts, and the effect of
    /// dropping the shared expert.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shared_expert_gate: Option<Value>,
    /// Qwen2-MoE: max |Δ log-prob| with the q/k/v biases zeroed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub qkv_bias_effect_max_abs_logprob: Option<f64>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RopeReference {
    /// "default" | "yarn"
    pub rope_type: String,
    /// cos and sin are multiplied by this (yarn: 0.1 ln(factor) + 1).
    pub attention_scaling: f64,
    /// head_dim / 2 inverse frequencies, as transformers computed them (float32, widened).
    pub inv_freq: Vec<f64>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct PromptReference {
    pub seed: u64,
    /// token ids (n)
    pub prompt: Vec<u32>,
    /// n - 1 values: log p(prompt[i + 1] | prompt[..=i]), rounded to 6 decimals
    pub logprobs: Vec<f64>,
    /// n values: argmax of the logits at each position
    pub argmax: Vec<u32>,
    /// n values: top-1 minus top-2 logit at each position (a small margin makes argmax fragile)
    pub margin: Vec<f64>,
    pub greedy: Greedy,
}

/// 32 greedy tokens after the prompt (each from a full forward pass, no cache).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Greedy {
    pub tokens: Vec<u32>,
    /// top-1 minus top-2 logit at each step
    pub margins: Vec<f64>,
}

pub fn reference_path(name: &str) -> PathBuf {
    fixtures_dir()
        .join("reference")
        .join(format!("{name}.json"))
}

pub fn reference(name: &str) -> Reference {
    let path = reference_path(name);
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("parsing {}: {e}", path.display()))
}

/// `tests/fixtures/tokenizer/reference.json`: encodings by `tokenizers` (checked equal to
/// transformers' AutoTokenizer) and chat-template renderings by transformers.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct TokenizerReference {
    pub meta: BTreeMap<String, String>,
    pub encodings: Vec<EncodingReference>,
    pub chats: Vec<ChatReference>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct EncodingReference {
    pub text: String,
    pub ids: Vec<u32>,
    pub decoded: String,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ChatReference {
    /// OpenAI-style messages, as passed to apply_chat_template
    pub messages: Vec<Value>,
    #[serde(default)]
    pub tools: Option<Vec<Value>>,
    pub add_generation_prompt: bool,
    #[serde(default)]
    pub enable_thinking: Option<bool>,
    /// the template's output
    pub rendered: String,
    /// `rendered` encoded without added special tokens
    pub ids: Vec<u32>,
}

pub fn tokenizer_reference() -> TokenizerReference {
    let path = tokenizer_dir().join("reference.json");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("parsing {}: {e}", path.display()))
}

#[cfg(test)]
mod tests;
