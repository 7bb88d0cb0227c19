//! Hugging Face checkpoint directory → `.smoe` vault, streaming tensor by tensor.

use super::safetensors::{SrcTensor, TensorFiles};
use crate::config::{GenerationDefaults, ModelConfig};
use crate::error::{Result, VaultError};
use crate::format::*;
use crate::quant::{quantize_matrix, DType};
use crate::tensors::{layout, scout_layout, MlpPart, Tensor};
use crate::writer::VaultWriter;
use serde_json::Value;
use std::path::{Path, PathBuf};

/// What `smoe convert` was asked for.
#[derive(Debug, Clone, Copy)]
pub struct ConvertOptions {
    pub experts: DType,
    pub scout: DType,
}

/// Layout of gate, up and down inside a blob (in `MlpPart::ALL` order): gate and up adjacent
/// (one [2I, H] matrix for a fused kernel), down at the next 256-byte boundary.
pub fn expert_parts(c: &ModelConfig, dtype: DType) -> Vec<ExpertPart> {
    let (h, i) = (c.hidden_size, c.moe_intermediate_size);
    let gate_len = (i * dtype.row_stride(h)) as u64;
    let down_len = (h * dtype.row_stride(i)) as u64;
    MlpPart::ALL
        .map(|p| {
            let (shape, offset, length) = match p {
                MlpPart::Gate => ([i, h], 0, gate_len),
                MlpPart::Up => ([i, h], gate_len, gate_len),
                MlpPart::Down => (
                    [h, i],
                    (2 * gate_len).next_multiple_of(TENSOR_ALIGN),
                    down_len,
                ),
            };
            ExpertPart {
                name: p.name().into(),
                dtype,
                shape,
                offset,
                length,
            }
        })
        .into()
}

/// A checkpoint directory, opened and checked.
pub struct HfCheckpoint {
    pub dir: PathBuf,
    pub hf_config: Value,
    pub config: ModelConfig,
    pub text: TextInfo,
    pub generation: GenerationDefaults,
    pub files: TensorFiles,
}

fn read_json(path: &Path) -> Result<Value> {
    let s = std::fs::read_to_string(path).map_err(|e| VaultError::io(path, e))?;
    serde_json::from_str(&s)
        .map_err(|e| VaultError::Config(format!("{}: invalid JSON: {e}", path.display())))
}

fn read_json_opt(path: &Path) -> Result<Option<Value>> {
    if path.exists() {
        read_json(path).map(Some)
    } else {
        Ok(None)
    }
}

/// `bos_token` may be a string or `{"content": ...}`.
fn token_string(v: Option<&Value>) -> Option<String> {
    match v? {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content").and_then(Value::as_str).map(str::to_string),
        _ => None,
    }
}

impl HfCheckpoint {
    pub fn open(dir: &Path) -> Result<Self> {
        if !dir.is_dir() {
            return Err(VaultError::Config(format!(
                "{}: not a directory",
                dir.display()
            )));
        }
        let cfg_path = dir.join("config.json");
        if !cfg_path.exists() {
            return Err(VaultError::Config(format!(
                "{}: no config.json (not a Hugging Face checkpoint)",
                dir.display()
            )));
        }
        let hf_config = read_json(&cfg_path)?;
        let config = ModelConfig::from_hf(&hf_config).map_err(|e| match e {
            VaultError::Config(m) => VaultError::Config(format!("{}: {m}", cfg_path.display())),
            other => other,
        })?;
        let tok_cfg = read_json_opt(&dir.join("tokenizer_config.json"))?;
        let tokenizer_json = match std::fs::read_to_string(dir.join("tokenizer.json")) {
            Ok(s) => Some(s),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => return Err(VaultError::io(dir.join("tokenizer.json"), e)),
        };
        let template_file = std::fs::read_to_string(dir.join("chat_template.jinja")).ok();
        let template_cfg = tok_cfg
            .as_ref()
            .and_then(|t| t.get("chat_template"))
            .and_then(|t| match t {
                Value::String(s) => Some(s.clone()),
                // A list of named templates: take "default".
                Value::Array(a) => a
                    .iter()
                    .find(|x| x.get("name").and_then(Value::as_str) == Some("default"))
                    .and_then(|x| x.get("template"))
                    .and_then(Value::as_str)
                    .map(str::to_string),
                _ => None,
            });
        let text = TextInfo {
            tokenizer_json,
            chat_template: template_file.or(template_cfg),
            bos_token: token_string(tok_cfg.as_ref().and_then(|t| t.get("bos_token"))),
            eos_token: token_string(tok_cfg.as_ref().and_then(|t| t.get("eos_token"))),
        };
        let gen_cfg = read_json_opt(&dir.join("generation_config.json"))?;
        let generation = GenerationDefaults::from_hf(&hf_config, gen_cfg.as_ref());
        let files = TensorFiles::open(&safetensors_files(dir)?)?;
        let ck = HfCheckpoint {
            dir: dir.to_path_buf(),
            hf_config,
            config,
            text,
            generation,
            files,
        };
        ck.check_tensors()?;
        Ok(ck)
    }

    /// Missing, extra or misshapen tensors are reported before anything is written.
    fn check_tensors(&self) -> Result<()> {
        let c = &self.config;
        let expected: Vec<(String, Vec<usize>)> = layout(c)
            .into_iter()
            .map(|t| (t.id.hub_name(c.architecture), t.shape))
            .collect();
        let mut missing = vec![];
        for (name, shape) in &expected {
            match self.files.get(name) {
                None => missing.push(name.clone()),
                Some(t) if &t.shape != shape => {
                    return Err(VaultError::Tensor(format!(
                        "{}: tensor {name} has shape {:?}, expected {:?} from config.json",
                        self.files.path_of(t).display(),
                        t.shape,
                        shape
                    )))
                }
                Some(_) => {}
            }
        }
        if !missing.is_empty() {
            return Err(VaultError::Tensor(format!(
                "{}: {} tensor(s) missing, e.g. {}",
                self.dir.display(),
                missing.len(),
                missing[..missing.len().min(3)].join(", ")
            )));
        }
        let known: std::collections::HashSet<&str> =
            expected.iter().map(|(n, _)| n.as_str()).collect();
        // A tied checkpoint may still carry lm_head.weight (a copy of the embedding).
        let extra: Vec<&String> = self
            .files
            .tensors
            .keys()
            .filter(|n| !known.contains(n.as_str()))
            .filter(|n| !(c.tie_word_embeddings && *n == "lm_head.weight"))
            .collect();
        if !extra.is_empty() {
            let list: Vec<&str> = extra.iter().take(3).map(|s| s.as_str()).collect();
            return Err(VaultError::Tensor(format!(
                "{}: {} unexpected tensor(s) for {}, e.g. {}",
                self.dir.display(),
                extra.len(),
                c.architecture.hf_class(),
                list.join(", ")
            )));
        }
        Ok(())
    }

    /// Total source bytes (for progress).
    pub fn source_bytes(&self) -> u64 {
        self.files
            .tensors
            .values()
            .map(|t| (t.end - t.start) as u64)
            .sum()
    }
}

/// Whether `name` is one plain file name (what a shard index may name): not empty, not `.` or
/// `..`, no path separator.
fn is_plain_file_name(name: &str) -> bool {
    !name.is_empty() && name != "." && name != ".." && !name.contains(['/', '\\'])
}

/// The shards named by `model.safetensors.index.json`, else `model.safetensors`, else every
/// `*.safetensors` in the directory.
fn safetensors_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let index = dir.join("model.safetensors.index.json");
    if index.exists() {
        let v = read_json(&index)?;
        let map = v
            .get("weight_map")
            .and_then(Value::as_object)
            .ok_or_else(|| VaultError::Config(format!("{}: no weight_map", index.display())))?;
        let mut files: Vec<String> = map
            .values()
            .filter_map(Value::as_str)
            .map(str::to_string)
            .collect();
        files.sort();
        files.dedup();
        // A shard is a file name inside the checkpoint: no absolute path, no `..`, no folder.
        if let Some(f) = files.iter().find(|f| !is_plain_file_name(f)) {
            return Err(VaultError::Config(format!(
                "{}: shard '{f}' is not a file name inside the checkpoint directory",
                index.display()
            )));
        }
        let paths: Vec<PathBuf> = files.iter().map(|f| dir.join(f)).collect();
        if let Some(p) = paths.iter().find(|p| !p.exists()) {
            return Err(VaultError::Config(format!(
                "{}: shard listed in the index is missing",
                p.display()
            )));
        }
        return Ok(paths);
    }
    let single = dir.join("model.safetensors");
    if single.exists() {
        return Ok(vec![single]);
    }
    let mut all: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| VaultError::io(dir, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    all.sort();
    if all.is_empty() {
        return Err(VaultError::Config(format!(
            "{}: no .safetensors files",
            dir.display()
        )));
    }
    Ok(all)
}

/// Progress reports: bytes of source consumed so far, and what is being converted.
pub trait Progress {
    fn advance(&mut self, bytes: u64, what: &str);
}

impl<F: FnMut(u64, &str)> Progress for F {
    fn advance(&mut self, bytes: u64, what: &str) {
        self(bytes, what)
    }
}

/// Rows per chunk when streaming a tensor: about 64 MiB of f32 at a time.
fn chunk_rows(cols: usize) -> usize {
    ((64usize << 20) / (cols.max(1) * 4)).max(1)
}

fn write_tensor<W: std::io::Write + std::io::Seek>(
    w: &mut VaultWriter<W>,
    files: &TensorFiles,
    t: &SrcTensor,
    name: &str,
    dtype: DType,
    progress: &mut dyn Progress,
) -> Result<()> {
    let (rows, cols) = match t.shape.as_slice() {
        [n] => (1, *n),
        [r, c] => (*r, *c),
        _ => {
            return Err(VaultError::Tensor(format!(
                "tensor {} is not 1-D or 2-D",
                t.name
            )))
        }
    };
    dtype
        .check_cols(cols)
        .map_err(|m| VaultError::Unsupported(format!("tensor {}: {m}", t.name)))?;
    w.begin_tensor(name, dtype, &t.shape)?;
    let step = chunk_rows(cols);
    let mut r0 = 0;
    while r0 < rows {
        let r1 = (r0 + step).min(rows);
        let x = files.read_rows_f32(t, r0, r1);
        w.tensor_data(&quantize_matrix(dtype, &x, r1 - r0, cols))?;
        progress.advance(((r1 - r0) * cols * t.dtype.size()) as u64, &t.name);
        r0 = r1;
    }
    w.end_tensor()
}

/// Converts an opened checkpoint into a vault written through `w`.
pub fn convert<W: std::io::Write + std::io::Seek>(
    ck: &HfCheckpoint,
    opts: ConvertOptions,
    mut w: VaultWriter<W>,
    progress: &mut dyn Progress,
) -> Result<(u64, W)> {
    use rayon::prelude::*;
    if !matches!(opts.scout, DType::Bf16 | DType::Q8) {
        return Err(VaultError::Unsupported(format!(
            "scout type {} (use bf16 or q8)",
            opts.scout
        )));
    }
    if opts.experts == DType::F32 {
        return Err(VaultError::Unsupported(
            "expert type f32 (use bf16, q8, q4 or q2)".into(),
        ));
    }
    let c = &ck.config;
    // The checkpoint's tensor of `id`, present and of the right shape since `open` checked.
    let source = |id: Tensor| {
        ck.files
            .get(&id.hub_name(c.architecture))
            .expect("checked at open")
    };
    for spec in scout_layout(c) {
        let dtype = spec.storage.dtype(opts.scout, opts.experts);
        let name = spec.id.name();
        write_tensor(&mut w, &ck.files, source(spec.id), &name, dtype, progress)?;
    }
    let parts = expert_parts(c, opts.experts);
    let used = parts.iter().map(|p| p.offset + p.length).max().unwrap_or(0) as usize;
    if c.moe_layers().next().is_some() {
        w.begin_experts(parts.clone())?;
    }
    // Quantize a batch of experts in parallel, write them in order.
    const BATCH: usize = 16;
    for l in c.moe_layers() {
        for e0 in (0..c.num_experts).step_by(BATCH) {
            let e1 = (e0 + BATCH).min(c.num_experts);
            let blobs: Vec<Vec<u8>> = (e0..e1)
                .into_par_iter()
                .map(|e| {
                    let mut blob = vec![0u8; used];
                    for (p, part) in parts.iter().zip(MlpPart::ALL) {
                        let t = source(Tensor::Expert(l, e, part));
                        let x = ck.files.read_rows_f32(t, 0, p.shape[0]);
                        let q = quantize_matrix(p.dtype, &x, p.shape[0], p.shape[1]);
                        blob[p.offset as usize..(p.offset + p.length) as usize].copy_from_slice(&q);
                    }
                    blob
                })
                .collect();
            for (i, blob) in blobs.iter().enumerate() {
                w.add_expert(l, e0 + i, blob)?;
                let src: u64 = MlpPart::ALL
                    .iter()
                    .map(|&p| {
                        let t = source(Tensor::Expert(l, e0 + i, p));
                        (t.end - t.start) as u64
                    })
                    .sum();
                progress.advance(src, &format!("layer {l} experts"));
            }
        }
    }
    let header = Header {
        config: c.clone(),
        hf_config: ck.hf_config.clone(),
        text: ck.text.clone(),
        generation: ck.generation.clone(),
        quant: QuantInfo {
            experts: opts.experts,
            scout: opts.scout,
            group_size: crate::quant::GROUP,
        },
        tensors: vec![],
        experts: None,
        writer: format!("smoe {}", env!("CARGO_PKG_VERSION")),
    };
    w.finish(header)
}

/// Converts `dir` into `out`, writing to `out.partial` and renaming at the end so a failed or
/// interrupted conversion never leaves a file that looks complete.
pub fn convert_to_path(
    dir: &Path,
    out: &Path,
    opts: ConvertOptions,
    progress: &mut dyn Progress,
) -> Result<u64> {
    let ck = HfCheckpoint::open(dir)?;
    convert_checkpoint_to_path(&ck, out, opts, progress)
}

pub fn convert_checkpoint_to_path(
    ck: &HfCheckpoint,
    out: &Path,
    opts: ConvertOptions,
    progress: &mut dyn Progress,
) -> Result<u64> {
    let mut tmp = out.as_os_str().to_owned();
    tmp.push(".partial");
    let tmp = PathBuf::from(tmp);
    let result = (|| {
        let w = VaultWriter::create(&tmp)?;
        let (len, buf) = convert(ck, opts, w, progress)?;
        let file = buf
            .into_inner()
            .map_err(|e| VaultError::io(&tmp, e.into_error()))?;
        file.sync_all().map_err(|e| VaultError::io(&tmp, e))?;
        std::fs::rename(&tmp, out).map_err(|e| VaultError::io(out, e))?;
        Ok(len)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A shard index may only name files inside the checkpoint: a path out of it is refused
    /// before anything is opened.
    #[test]
    fn shard_index_paths_stay_inside_the_checkpoint() {
        let dir = std::env::temp_dir().join(format!("smoe-shards-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for bad in [
            "../../../../etc/passwd",
            "/etc/passwd",
            "sub/x.safetensors",
            "..",
        ] {
            let index = serde_json::json!({"weight_map": {"a": bad}});
            std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
            let e = safetensors_files(&dir).unwrap_err().to_string();
            assert!(e.contains("not a file name inside"), "{bad}: {e}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(is_plain_file_name("model-00001-of-00002.safetensors"));
    }
}
