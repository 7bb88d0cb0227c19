//! Writer ↔ reader round trips and the ways a vault file can be damaged.

use smoe_fixtures::ScratchDir;
use smoe_vault::config::{GenerationDefaults, ModelConfig};
use smoe_vault::format::*;
use smoe_vault::quant::{quantize_matrix, DType};
use smoe_vault::{Vault, VaultError, VaultWriter};
use std::io::{Cursor, Seek, SeekFrom, Write};
use std::path::Path;

fn config() -> ModelConfig {
    ModelConfig::from_hf(&serde_json::json!({
        "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 100, "hidden_size": 64,
        "num_attention_heads": 1, "num_key_value_heads": 1, "head_dim": 64, "num_hidden_layers": 1,
        "moe_intermediate_size": 64, "num_experts": 2, "num_experts_per_tok": 1}))
    .unwrap()
}

fn header() -> Header {
    Header {
        config: config(),
        hf_config: serde_json::json!({}),
        text: TextInfo::default(),
        generation: GenerationDefaults::default(),
        quant: QuantInfo {
            experts: DType::Q4,
            scout: DType::Bf16,
            group_size: 64,
        },
        tensors: vec![],
        experts: None,
        writer: "test".into(),
    }
}

fn values(n: usize, seed: f32) -> Vec<f32> {
    (0..n).map(|i| (i as f32 * 0.37 + seed).sin()).collect()
}

/// Writes a small vault: one bf16 matrix, one f32 vector, two q4 expert blobs.
fn write_vault(path: &Path) -> (Vec<u8>, Vec<Vec<u8>>) {
    let mut w = VaultWriter::create(path).unwrap();
    let m = quantize_matrix(DType::Bf16, &values(3 * 64, 1.0), 3, 64);
    w.add_tensor("m", DType::Bf16, &[3, 64], &m).unwrap();
    let v = quantize_matrix(DType::F32, &values(64, 2.0), 1, 64);
    w.add_tensor("v", DType::F32, &[64], &v).unwrap();
    let part = ExpertPart {
        name: "gate_proj".into(),
        dtype: DType::Q4,
        shape: [5, 128],
        offset: 0,
        length: 5 * 80,
    };
    w.begin_experts(vec![part]).unwrap();
    let blobs: Vec<Vec<u8>> = (0..2)
        .map(|e| quantize_matrix(DType::Q4, &values(5 * 128, e as f32), 5, 128))
        .collect();
    for (e, b) in blobs.iter().enumerate() {
        w.add_expert(0, e, b).unwrap();
    }
    w.finish(header()).unwrap();
    (m, blobs)
}

#[test]
fn round_trip() {
    let dir = ScratchDir::new("format").unwrap();
    let p = dir.join("a.smoe");
    let (m, blobs) = write_vault(&p);
    let v = Vault::open(&p).unwrap();
    assert_eq!(v.version, (1, 0));
    let t = v.tensor("m").unwrap();
    assert_eq!(t.bytes(), &m[..]);
    assert_eq!(t.entry.offset % 256, 0);
    assert_eq!(v.tensor("v").unwrap().to_f32(), values(64, 2.0));
    v.verify_scout().unwrap();
    let x = v.expert_section().unwrap();
    assert_eq!(x.blob_stride, 16384);
    for (e, b) in blobs.iter().enumerate() {
        let entry = v.expert_entry(0, e).unwrap();
        assert_eq!(entry.offset % 16384, 0);
        let bytes = v.expert_bytes_mapped(entry);
        assert_eq!(bytes, &b[..]);
        v.verify_expert(entry, bytes).unwrap();
    }
    assert!(v.tensor("nope").is_err());
}

#[test]
fn damage_is_detected() {
    let dir = ScratchDir::new("format").unwrap();
    let p = dir.join("a.smoe");
    write_vault(&p);
    let good = std::fs::read(&p).unwrap();

    // A flipped bit in a tensor: the checksum names it.
    let v = Vault::open(&p).unwrap();
    let off = v.tensor("m").unwrap().entry.offset as usize;
    let mut bad = good.clone();
    bad[off + 3] ^= 1;
    std::fs::write(&p, &bad).unwrap();
    let v = Vault::open(&p).unwrap();
    let e = v.verify_scout().unwrap_err().to_string();
    assert!(e.contains("tensor m"), "{e}");

    // A flipped bit in an expert blob: the error names layer and expert.
    let mut bad = good.clone();
    let blob1 = Vault::open(&p).unwrap().expert_entry(0, 1).unwrap().offset as usize;
    bad[blob1] ^= 0x80;
    std::fs::write(&p, &bad).unwrap();
    let v = Vault::open(&p).unwrap();
    let entry = v.expert_entry(0, 1).unwrap();
    let e = v
        .verify_expert(entry, v.expert_bytes_mapped(entry))
        .unwrap_err()
        .to_string();
    assert!(e.contains("layer 0 expert 1"), "{e}");

    // Truncated.
    std::fs::write(&p, &good[..good.len() - 100]).unwrap();
    assert!(matches!(Vault::open(&p), Err(VaultError::Truncated { .. })));

    // A future major version is refused with a clear message.
    let mut bad = good.clone();
    bad[8] = 2;
    std::fs::write(&p, &bad).unwrap();
    let e = Vault::open(&p).err().unwrap().to_string();
    assert!(e.contains("version 2.0 is not supported"), "{e}");

    // Not a vault at all.
    std::fs::write(
        &p,
        b"hello world, this is certainly not a vault file at all; 64+ bytes long....",
    )
    .unwrap();
    assert!(Vault::open(&p).err().unwrap().to_string().contains("magic"));

    // Header damage.
    let mut bad = good.clone();
    let n = bad.len();
    bad[n - 5] ^= 1;
    std::fs::write(&p, &bad).unwrap();
    assert!(matches!(Vault::open(&p), Err(VaultError::Checksum { .. })));
}

/// A writer that runs out of space after `left` bytes, like a full disk.
struct FullDisk {
    inner: Cursor<Vec<u8>>,
    left: usize,
}

impl Write for FullDisk {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        if b.len() > self.left {
            return Err(std::io::Error::from_raw_os_error(28));
        }
        self.left -= b.len();
        self.inner.write(b)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Seek for FullDisk {
    fn seek(&mut self, p: SeekFrom) -> std::io::Result<u64> {
        self.inner.seek(p)
    }
}

#[test]
fn full_disk_is_reported_as_such() {
    let out = FullDisk {
        inner: Cursor::new(vec![]),
        left: 20000,
    };
    let mut w = VaultWriter::new(out, Path::new("out.smoe")).unwrap();
    let m = vec![0u8; 8192];
    let e = w.add_tensor("m", DType::Bf16, &[64, 64], &m).unwrap_err();
    assert!(matches!(e, VaultError::DiskFull { .. }), "{e}");
    assert!(e.to_string().contains("disk full"), "{e}");
}
