//! A minimal safetensors reader over memory maps: headers are parsed and checked against the file
//! length (so a truncated download is caught before any conversion work), data is read in place.

use crate::error::{Result, VaultError};
use half::{bf16, f16};
use memmap2::Mmap;
use serde_json::Value;
use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SrcDType {
    F32,
    F16,
    Bf16,
}

impl SrcDType {
    pub fn size(self) -> usize {
        match self {
            SrcDType::F32 => 4,
            SrcDType::F16 | SrcDType::Bf16 => 2,
        }
    }
}

/// Where one tensor lives.
#[derive(Debug, Clone)]
pub struct SrcTensor {
    pub name: String,
    pub dtype: SrcDType,
    pub shape: Vec<usize>,
    pub file: usize,
    pub start: usize,
    pub end: usize,
}

/// All tensors of a checkpoint, possibly spread over shards.
pub struct TensorFiles {
    paths: Vec<PathBuf>,
    maps: Vec<Arc<Mmap>>,
    pub tensors: BTreeMap<String, SrcTensor>,
}

impl TensorFiles {
    pub fn open(paths: &[PathBuf]) -> Result<Self> {
        let mut tf = TensorFiles {
            paths: vec![],
            maps: vec![],
            tensors: BTreeMap::new(),
        };
        for p in paths {
            tf.add_file(p)?;
        }
        Ok(tf)
    }

    fn add_file(&mut self, path: &Path) -> Result<()> {
        let file = File::open(path).map_err(|e| VaultError::io(path, e))?;
        // SAFETY: read-only mapping of an input file; every range is checked against its length.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| VaultError::io(path, e))?;
        let trunc = |reason: String| VaultError::Truncated {
            path: path.to_path_buf(),
            reason,
        };
        if map.len() < 8 {
            return Err(trunc("shorter than the 8-byte safetensors length".into()));
        }
        let n = u64::from_le_bytes(map[0..8].try_into().unwrap()) as usize;
        if n > 100 << 20 {
            return Err(VaultError::Format {
                path: path.to_path_buf(),
                reason: "not a safetensors file (header length is absurd)".into(),
            });
        }
        if 8 + n > map.len() {
            return Err(trunc(format!(
                "header needs {} bytes, the file has {}",
                8 + n,
                map.len()
            )));
        }
        let header: BTreeMap<String, Value> =
            serde_json::from_slice(&map[8..8 + n]).map_err(|e| VaultError::Format {
                path: path.to_path_buf(),
                reason: format!("safetensors header: {e}"),
            })?;
        let idx = self.maps.len();
        let data_len = map.len() - 8 - n;
        for (name, v) in header {
            if name == "__metadata__" {
                continue;
            }
            let bad = |r: &str| VaultError::Format {
                path: path.to_path_buf(),
                reason: format!("tensor {name}: {r}"),
            };
            let dtype = match v.get("dtype").and_then(Value::as_str) {
                Some("F32") => SrcDType::F32,
                Some("F16") => SrcDType::F16,
                Some("BF16") => SrcDType::Bf16,
                Some(other) => {
                    return Err(VaultError::Unsupported(format!(
                        "{}: tensor {name} has dtype {other} (supported: BF16, F16, F32)",
                        path.display()
                    )))
                }
                None => return Err(bad("no dtype")),
            };
            let shape: Vec<usize> = v
                .get("shape")
                .and_then(Value::as_array)
                .ok_or_else(|| bad("no shape"))?
                .iter()
                .map(|d| d.as_u64().map(|x| x as usize))
                .collect::<Option<_>>()
                .ok_or_else(|| bad("bad shape"))?;
            let off = v
                .get("data_offsets")
                .and_then(Value::as_array)
                .ok_or_else(|| bad("no data_offsets"))?;
            let (s, e) = match (
                off.first().and_then(Value::as_u64),
                off.get(1).and_then(Value::as_u64),
            ) {
                (Some(s), Some(e)) if s <= e => (s as usize, e as usize),
                _ => return Err(bad("bad data_offsets")),
            };
            if e - s != shape.iter().product::<usize>() * dtype.size() {
                return Err(bad("data length does not match shape and dtype"));
            }
            if e > data_len {
                return Err(trunc(format!(
                    "tensor {name} ends at byte {} but the file has {}",
                    8 + n + e,
                    map.len()
                )));
            }
            self.tensors.insert(
                name.clone(),
                SrcTensor {
                    name,
                    dtype,
                    shape,
                    file: idx,
                    start: 8 + n + s,
                    end: 8 + n + e,
                },
            );
        }
        self.paths.push(path.to_path_buf());
        self.maps.push(Arc::new(map));
        Ok(())
    }

    pub fn get(&self, name: &str) -> Option<&SrcTensor> {
        self.tensors.get(name)
    }

    /// Rows `[r0, r1)` of a 1-D or 2-D tensor as f32 (a 1-D tensor is a single row).
    pub fn read_rows_f32(&self, t: &SrcTensor, r0: usize, r1: usize) -> Vec<f32> {
        let cols = *t.shape.last().unwrap_or(&1);
        let es = t.dtype.size();
        let bytes = &self.maps[t.file][t.start + r0 * cols * es..t.start + r1 * cols * es];
        match t.dtype {
            SrcDType::F32 => bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                .collect(),
            SrcDType::Bf16 => bytes
                .chunks_exact(2)
                .map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            SrcDType::F16 => bytes
                .chunks_exact(2)
                .map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
        }
    }

    pub fn path_of(&self, t: &SrcTensor) -> &Path {
        &self.paths[t.file]
    }
}
