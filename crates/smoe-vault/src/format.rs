//! On-disk layout of a `.smoe` vault (format v1). `docs/vault-format.md` is the prose version.
//!
//! ```text
//! [0, 64)          preamble (fixed, little-endian)
//! [16 KiB, ...)    scout section: dense tensors, each 256-byte aligned
//! [aligned 16 KiB) expert section: one blob per (layer, expert), 16 KiB aligned and padded
//! [..., file_len)  header: UTF-8 JSON (config, tokenizer, template, directory)
//! ```

use crate::config::{GenerationDefaults, ModelConfig};
use crate::quant::DType;
use serde::{Deserialize, Serialize};

pub const MAGIC: [u8; 8] = *b"SMOEVLT\0";
pub const VERSION_MAJOR: u16 = 1;
pub const VERSION_MINOR: u16 = 0;
pub const PREAMBLE_LEN: usize = 64;
/// Alignment of the first tensor, of the expert section and of every expert blob.
pub const BLOB_ALIGN: u64 = 16 * 1024;
/// Alignment of scout tensors (GPU upload and SIMD loads like it).
pub const TENSOR_ALIGN: u64 = 256;

/// The fixed 64 bytes at the start of the file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Preamble {
    pub major: u16,
    pub minor: u16,
    pub header_offset: u64,
    pub header_len: u64,
    pub header_xxh3: u64,
    pub file_len: u64,
}

impl Preamble {
    pub fn encode(&self) -> [u8; PREAMBLE_LEN] {
        let mut b = [0u8; PREAMBLE_LEN];
        b[0..8].copy_from_slice(&MAGIC);
        b[8..10].copy_from_slice(&self.major.to_le_bytes());
        b[10..12].copy_from_slice(&self.minor.to_le_bytes());
        // [12, 16): flags, zero in v1.
        b[16..24].copy_from_slice(&self.header_offset.to_le_bytes());
        b[24..32].copy_from_slice(&self.header_len.to_le_bytes());
        b[32..40].copy_from_slice(&self.header_xxh3.to_le_bytes());
        b[40..48].copy_from_slice(&self.file_len.to_le_bytes());
        b
    }

    /// Decodes and checks the magic; the version is checked by the reader (to word the error).
    pub fn decode(b: &[u8]) -> Result<Self, String> {
        if b.len() < PREAMBLE_LEN {
            return Err(format!(
                "file is {} bytes, shorter than the 64-byte preamble",
                b.len()
            ));
        }
        if b[0..8] != MAGIC {
            return Err("bad magic (this is not a .smoe file)".into());
        }
        let u16_at = |o: usize| u16::from_le_bytes([b[o], b[o + 1]]);
        let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().unwrap());
        Ok(Preamble {
            major: u16_at(8),
            minor: u16_at(10),
            header_offset: u64_at(16),
            header_len: u64_at(24),
            header_xxh3: u64_at(32),
            file_len: u64_at(40),
        })
    }
}

/// Checksums are XXH3-64 (seed 0), written as 16 lowercase hex digits so JSON readers that
/// parse numbers as doubles do not lose bits.
pub mod hex64 {
    use serde::{Deserialize, Deserializer, Serializer};
    pub fn serialize<S: Serializer>(v: &u64, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&format!("{v:016x}"))
    }
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
        let s = String::deserialize(d)?;
        u64::from_str_radix(&s, 16).map_err(serde::de::Error::custom)
    }
}

pub fn checksum(bytes: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(bytes)
}

/// A dense tensor of the scout section.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TensorEntry {
    pub name: String,
    pub dtype: DType,
    /// `[rows, cols]` for matrices, `[n]` for vectors.
    pub shape: Vec<usize>,
    pub offset: u64,
    pub length: u64,
    #[serde(with = "hex64")]
    pub xxh3: u64,
}

impl TensorEntry {
    pub fn rows_cols(&self) -> (usize, usize) {
        match self.shape.as_slice() {
            [n] => (1, *n),
            [r, c] => (*r, *c),
            _ => (0, 0),
        }
    }
}

/// One matrix inside every expert blob (the same for all blobs of a vault).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExpertPart {
    /// `gate_proj`, `up_proj` or `down_proj`.
    pub name: String,
    pub dtype: DType,
    pub shape: [usize; 2],
    /// Byte offset inside the blob.
    pub offset: u64,
    pub length: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExpertBlob {
    pub layer: usize,
    pub expert: usize,
    pub offset: u64,
    /// Checksum of the blob's `used_bytes` (not the padding).
    #[serde(with = "hex64")]
    pub xxh3: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExpertSection {
    /// Bytes of gate, up and down together.
    pub used_bytes: u64,
    /// Distance between consecutive blobs: `used_bytes` rounded up to 16 KiB.
    pub blob_stride: u64,
    pub parts: Vec<ExpertPart>,
    /// In (layer, expert) order.
    pub blobs: Vec<ExpertBlob>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct QuantInfo {
    pub experts: DType,
    pub scout: DType,
    pub group_size: usize,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TextInfo {
    /// The checkpoint's `tokenizer.json`, verbatim.
    pub tokenizer_json: Option<String>,
    /// From `tokenizer_config.json` (`chat_template`) or `chat_template.jinja`.
    pub chat_template: Option<String>,
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
}

/// The JSON header.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Header {
    pub config: ModelConfig,
    /// The original `config.json`, kept for reference and for later format readers.
    pub hf_config: serde_json::Value,
    pub text: TextInfo,
    pub generation: GenerationDefaults,
    pub quant: QuantInfo,
    pub tensors: Vec<TensorEntry>,
    pub experts: Option<ExpertSection>,
    /// Who wrote the file (`smoe <version>`).
    pub writer: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn preamble_round_trips() {
        let p = Preamble {
            major: 1,
            minor: 0,
            header_offset: 123456,
            header_len: 789,
            header_xxh3: u64::MAX - 5,
            file_len: 1 << 40,
        };
        assert_eq!(Preamble::decode(&p.encode()).unwrap(), p);
        let mut b = p.encode();
        b[0] = b'X';
        assert!(Preamble::decode(&b).unwrap_err().contains("magic"));
    }
}
