//! Streaming vault writer: tensors and blobs go to disk as they are produced, so converting a
//! model never needs more memory than its largest chunk.

use crate::error::{Result, VaultError};
use crate::format::*;
use crate::quant::DType;
use std::fs::File;
use std::io::{BufWriter, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use xxhash_rust::xxh3::Xxh3;

pub struct VaultWriter<W: Write + Seek> {
    out: W,
    path: PathBuf,
    pos: u64,
    tensors: Vec<TensorEntry>,
    experts: Option<ExpertSection>,
    open_tensor: Option<(TensorEntry, Xxh3)>,
}

impl VaultWriter<BufWriter<File>> {
    /// Creates (truncates) `path`. The caller decides whether to write to a temporary name.
    pub fn create(path: &Path) -> Result<Self> {
        let f = File::create(path).map_err(|e| VaultError::io(path, e))?;
        Self::new(BufWriter::with_capacity(8 << 20, f), path)
    }
}

impl<W: Write + Seek> VaultWriter<W> {
    pub fn new(mut out: W, path: &Path) -> Result<Self> {
        let path = path.to_path_buf();
        // Placeholder preamble and zero fill up to the first aligned byte.
        out.write_all(&vec![0u8; BLOB_ALIGN as usize])
            .map_err(|e| VaultError::io(&path, e))?;
        Ok(VaultWriter {
            out,
            path,
            pos: BLOB_ALIGN,
            tensors: vec![],
            experts: None,
            open_tensor: None,
        })
    }

    fn write(&mut self, bytes: &[u8]) -> Result<()> {
        self.out
            .write_all(bytes)
            .map_err(|e| VaultError::io(&self.path, e))?;
        self.pos += bytes.len() as u64;
        Ok(())
    }

    fn pad_to(&mut self, align: u64) -> Result<()> {
        let target = self.pos.next_multiple_of(align);
        let zeros = vec![0u8; (target - self.pos) as usize];
        self.write(&zeros)
    }

    /// Starts a scout tensor whose bytes arrive in one or more `tensor_data` calls.
    pub fn begin_tensor(&mut self, name: &str, dtype: DType, shape: &[usize]) -> Result<()> {
        assert!(
            self.open_tensor.is_none() && self.experts.is_none(),
            "tensors precede experts"
        );
        self.pad_to(TENSOR_ALIGN)?;
        let entry = TensorEntry {
            name: name.to_string(),
            dtype,
            shape: shape.to_vec(),
            offset: self.pos,
            length: 0,
            xxh3: 0,
        };
        self.open_tensor = Some((entry, Xxh3::new()));
        Ok(())
    }

    pub fn tensor_data(&mut self, bytes: &[u8]) -> Result<()> {
        let (entry, hash) = self.open_tensor.as_mut().expect("begin_tensor first");
        entry.length += bytes.len() as u64;
        hash.update(bytes);
        self.write(bytes)
    }

    pub fn end_tensor(&mut self) -> Result<()> {
        let (mut entry, hash) = self.open_tensor.take().expect("begin_tensor first");
        let (rows, cols) = entry.rows_cols();
        let expected = (rows * entry.dtype.row_stride(cols)) as u64;
        if entry.length != expected {
            return Err(VaultError::Tensor(format!(
                "internal: tensor {} has {} bytes, expected {expected}",
                entry.name, entry.length
            )));
        }
        entry.xxh3 = hash.digest();
        self.tensors.push(entry);
        Ok(())
    }

    pub fn add_tensor(
        &mut self,
        name: &str,
        dtype: DType,
        shape: &[usize],
        bytes: &[u8],
    ) -> Result<()> {
        self.begin_tensor(name, dtype, shape)?;
        self.tensor_data(bytes)?;
        self.end_tensor()
    }

    /// Starts the expert section; every blob then holds `parts` at their offsets.
    pub fn begin_experts(&mut self, parts: Vec<ExpertPart>) -> Result<()> {
        let used = parts.iter().map(|p| p.offset + p.length).max().unwrap_or(0);
        self.pad_to(BLOB_ALIGN)?;
        self.experts = Some(ExpertSection {
            used_bytes: used,
            blob_stride: used.next_multiple_of(BLOB_ALIGN),
            parts,
            blobs: vec![],
        });
        Ok(())
    }

    /// Appends one expert blob (exactly `used_bytes` long), padded to 16 KiB.
    pub fn add_expert(&mut self, layer: usize, expert: usize, blob: &[u8]) -> Result<()> {
        let sec = self.experts.as_ref().expect("begin_experts first");
        assert_eq!(blob.len() as u64, sec.used_bytes, "expert blob size");
        let entry = ExpertBlob {
            layer,
            expert,
            offset: self.pos,
            xxh3: checksum(blob),
        };
        self.write(blob)?;
        self.pad_to(BLOB_ALIGN)?;
        self.experts.as_mut().unwrap().blobs.push(entry);
        Ok(())
    }

    /// Writes the header and the preamble; returns the file length and the flushed output.
    pub fn finish(mut self, mut header: Header) -> Result<(u64, W)> {
        header.tensors = std::mem::take(&mut self.tensors);
        header.experts = self.experts.take();
        self.pad_to(16)?;
        let json =
            serde_json::to_vec(&header).map_err(|e| VaultError::Tensor(format!("header: {e}")))?;
        let header_offset = self.pos;
        self.write(&json)?;
        let pre = Preamble {
            major: VERSION_MAJOR,
            minor: VERSION_MINOR,
            header_offset,
            header_len: json.len() as u64,
            header_xxh3: checksum(&json),
            file_len: self.pos,
        };
        let io = |e| VaultError::io(&self.path, e);
        self.out.seek(SeekFrom::Start(0)).map_err(io)?;
        self.out.write_all(&pre.encode()).map_err(io)?;
        self.out.flush().map_err(io)?;
        Ok((pre.file_len, self.out))
    }
}
