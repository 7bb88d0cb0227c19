//! Opening a vault: the file is memory-mapped; the scout section is used in place.

use crate::error::{Result, VaultError};
use crate::format::*;
use crate::quant::DType;
use memmap2::Mmap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// An open `.smoe` file.
#[derive(Clone)]
pub struct Vault {
    path: PathBuf,
    map: Arc<Mmap>,
    pub header: Arc<Header>,
    pub version: (u16, u16),
    /// XXH3-64 of the header bytes, from the preamble: identifies this vault's contents.
    pub header_xxh3: u64,
}

/// A tensor of the scout section, borrowed from the mapping (cheap to clone, `'static`).
#[derive(Clone)]
pub struct TensorData {
    map: Arc<Mmap>,
    pub entry: TensorEntry,
}

impl TensorData {
    pub fn bytes(&self) -> &[u8] {
        &self.map[self.entry.offset as usize..(self.entry.offset + self.entry.length) as usize]
    }
    pub fn dtype(&self) -> DType {
        self.entry.dtype
    }
    /// `(rows, cols)`; a vector is one row.
    pub fn rows_cols(&self) -> (usize, usize) {
        self.entry.rows_cols()
    }
    /// The values of a vector or matrix as f32 (for small tensors such as norm weights).
    pub fn to_f32(&self) -> Vec<f32> {
        let (rows, cols) = self.rows_cols();
        let stride = self.entry.dtype.row_stride(cols);
        let mut out = vec![0f32; rows * cols];
        for (r, o) in out.chunks_exact_mut(cols).enumerate() {
            crate::quant::dequantize_row(
                self.entry.dtype,
                &self.bytes()[r * stride..(r + 1) * stride],
                o,
            );
        }
        out
    }
}

impl Vault {
    pub fn open(path: &Path) -> Result<Self> {
        let fmt = |reason: String| VaultError::Format {
            path: path.to_path_buf(),
            reason,
        };
        let file = File::open(path).map_err(|e| VaultError::io(path, e))?;
        if file.metadata().is_ok_and(|m| m.is_dir()) {
            return Err(fmt(
                "it is a directory (a checkpoint directory converts with `smoe convert`)".into(),
            ));
        }
        // SAFETY: the mapping is read-only; a vault modified while open is outside our contract,
        // and every region we rely on is bounds- and checksum-checked.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| VaultError::io(path, e))?;
        let pre = Preamble::decode(&map).map_err(fmt)?;
        if pre.major != VERSION_MAJOR {
            return Err(fmt(format!(
                "format version {}.{} is not supported by this smoe (it reads {VERSION_MAJOR}.x); \
                 upgrade smoe or convert the model again",
                pre.major, pre.minor
            )));
        }
        let len = map.len() as u64;
        if len < pre.file_len {
            return Err(VaultError::Truncated {
                path: path.to_path_buf(),
                reason: format!("file has {len} bytes, the vault says {}", pre.file_len),
            });
        }
        let end = pre
            .header_offset
            .checked_add(pre.header_len)
            .filter(|e| *e <= len);
        let Some(end) = end else {
            return Err(fmt("header lies outside the file".into()));
        };
        let json = &map[pre.header_offset as usize..end as usize];
        if checksum(json) != pre.header_xxh3 {
            return Err(VaultError::Checksum {
                path: path.to_path_buf(),
                what: "the header".into(),
            });
        }
        let header: Header =
            serde_json::from_slice(json).map_err(|e| fmt(format!("header JSON: {e}")))?;
        let vault = Vault {
            path: path.to_path_buf(),
            map: Arc::new(map),
            header: Arc::new(header),
            version: (pre.major, pre.minor),
            header_xxh3: pre.header_xxh3,
        };
        vault.check_directory()?;
        Ok(vault)
    }

    /// Every tensor and blob must lie inside the file and have the size its shape implies.
    fn check_directory(&self) -> Result<()> {
        let len = self.map.len() as u64;
        let fmt = |reason: String| VaultError::Format {
            path: self.path.clone(),
            reason,
        };
        for t in &self.header.tensors {
            let (r, c) = t.rows_cols();
            if t.shape.is_empty()
                || t.shape.len() > 2
                || t.length != (r * t.dtype.row_stride(c)) as u64
            {
                return Err(fmt(format!("tensor {} has an inconsistent size", t.name)));
            }
            if t.offset + t.length > len {
                return Err(fmt(format!("tensor {} lies outside the file", t.name)));
            }
        }
        if let Some(x) = &self.header.experts {
            for p in &x.parts {
                let need = (p.shape[0] * p.dtype.row_stride(p.shape[1])) as u64;
                if p.length != need || p.offset + p.length > x.used_bytes {
                    return Err(fmt(format!(
                        "expert part {} has an inconsistent size",
                        p.name
                    )));
                }
            }
            for b in &x.blobs {
                if b.offset + x.used_bytes > len {
                    return Err(fmt(format!(
                        "expert blob of layer {} expert {} lies outside the file",
                        b.layer, b.expert
                    )));
                }
            }
        }
        Ok(())
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn file_len(&self) -> u64 {
        self.map.len() as u64
    }

    pub fn tensor(&self, name: &str) -> Result<TensorData> {
        let entry = self
            .header
            .tensors
            .iter()
            .find(|t| t.name == name)
            .ok_or_else(|| {
                VaultError::Tensor(format!("{}: tensor {name} is missing", self.path.display()))
            })?;
        Ok(TensorData {
            map: self.map.clone(),
            entry: entry.clone(),
        })
    }

    /// Recomputes a tensor's checksum.
    pub fn verify_tensor(&self, t: &TensorData) -> Result<()> {
        if checksum(t.bytes()) != t.entry.xxh3 {
            return Err(VaultError::Checksum {
                path: self.path.clone(),
                what: format!("tensor {}", t.entry.name),
            });
        }
        Ok(())
    }

    /// Verifies every scout tensor (in parallel).
    pub fn verify_scout(&self) -> Result<()> {
        use rayon::prelude::*;
        self.header.tensors.par_iter().try_for_each(|e| {
            let t = TensorData {
                map: self.map.clone(),
                entry: e.clone(),
            };
            self.verify_tensor(&t)
        })
    }

    pub fn expert_section(&self) -> Option<&ExpertSection> {
        self.header.experts.as_ref()
    }

    /// The directory entry of one expert blob.
    pub fn expert_entry(&self, layer: usize, expert: usize) -> Result<&ExpertBlob> {
        self.header
            .experts
            .as_ref()
            .and_then(|x| {
                x.blobs
                    .iter()
                    .find(|b| b.layer == layer && b.expert == expert)
            })
            .ok_or_else(|| {
                VaultError::Tensor(format!(
                    "{}: no blob for layer {layer} expert {expert}",
                    self.path.display()
                ))
            })
    }

    /// The used bytes of an expert blob, straight from the mapping (not verified).
    pub fn expert_bytes_mapped(&self, blob: &ExpertBlob) -> &[u8] {
        let used = self
            .header
            .experts
            .as_ref()
            .map(|x| x.used_bytes)
            .unwrap_or(0);
        &self.map[blob.offset as usize..(blob.offset + used) as usize]
    }

    /// Checks an expert blob's bytes against its checksum; the error names layer and expert.
    pub fn verify_expert(&self, blob: &ExpertBlob, bytes: &[u8]) -> Result<()> {
        if checksum(bytes) != blob.xxh3 {
            return Err(VaultError::Checksum {
                path: self.path.clone(),
                what: format!("expert blob of layer {} expert {}", blob.layer, blob.expert),
            });
        }
        Ok(())
    }
}
