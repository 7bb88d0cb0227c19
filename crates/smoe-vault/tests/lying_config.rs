//! A vault that is well formed and correctly checksummed but whose configuration contradicts
//! its tensors is refused by `Vault::check_layout` with one line naming the contradiction —
//! never a panic, an abort or an allocation sized from the lie.

use smoe_vault::format::{checksum, Header, Preamble, PREAMBLE_LEN};
use smoe_vault::synth::{preset, synth, SynthOptions};
use smoe_vault::{DType, GenerationDefaults, ModelConfig, Vault, VaultWriter};
use std::path::{Path, PathBuf};

/// A tiny synthetic vault in memory.
fn tiny() -> Vec<u8> {
    let cfg = preset("tiny").unwrap();
    let opts = SynthOptions {
        experts: DType::Q4,
        scout: DType::Q8,
        router_skew: 0.0,
        seed: 1,
    };
    let w = VaultWriter::new(std::io::Cursor::new(Vec::new()), Path::new("t.smoe")).unwrap();
    let text = Default::default();
    let gen = GenerationDefaults::default();
    let (_, out) = synth(&cfg, opts, text, gen, w, &mut |_| {}).unwrap();
    out.into_inner()
}

/// `vault` with its header's configuration edited: the new header appended, the preamble
/// pointing at it with its checksum — a file as consistent as the writer would make it.
fn with_config(vault: &[u8], edit: impl FnOnce(&mut ModelConfig), path: &Path) {
    let pre = Preamble::decode(vault).unwrap();
    let at = pre.header_offset as usize..(pre.header_offset + pre.header_len) as usize;
    let mut header: Header = serde_json::from_slice(&vault[at]).unwrap();
    edit(&mut header.config);
    let json = serde_json::to_vec(&header).unwrap();
    let mut bytes = vault.to_vec();
    let offset = bytes.len() as u64;
    bytes.extend_from_slice(&json);
    let pre = Preamble {
        header_offset: offset,
        header_len: json.len() as u64,
        header_xxh3: checksum(&json),
        file_len: bytes.len() as u64,
        ..pre
    };
    bytes[..PREAMBLE_LEN].copy_from_slice(&pre.encode());
    std::fs::write(path, bytes).unwrap();
}

#[test]
fn configurations_that_lie_are_refused_with_one_line() {
    let vault = tiny();
    let dir = std::env::temp_dir().join(format!("smoe-lying-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path: PathBuf = dir.join("v.smoe");
    with_config(&vault, |_| {}, &path);
    Vault::open(&path).unwrap().check_layout().unwrap();
    type Edit = fn(&mut ModelConfig);
    let lies: [(&str, Edit, &str); 9] = [
        (
            "vocab",
            |c| c.vocab_size = 1 << 40,
            "vocab_size 1099511627776",
        ),
        (
            "layers",
            |c| c.num_layers = 1 << 30,
            "num_layers 1073741824",
        ),
        (
            "hidden",
            |c| c.hidden_size = 1 << 31,
            "hidden_size 2147483648",
        ),
        ("no experts", |c| c.num_experts = 0, "num_experts_per_tok"),
        ("head_dim", |c| c.head_dim = 0, "head_dim 0"),
        (
            "top-k",
            |c| c.num_experts_per_tok = 99,
            "num_experts_per_tok 99",
        ),
        ("theta", |c| c.rope.theta = -1.0, "rope theta -1"),
        ("experts", |c| c.num_experts = 8, "the vault holds 64 blobs"),
        (
            "kv heads",
            |c| c.num_kv_heads = 1,
            "num_key_value_heads*head_dim 64",
        ),
    ];
    for (what, edit, says) in lies {
        with_config(&vault, edit, &path);
        let e = match Vault::open(&path).and_then(|v| v.check_layout()) {
            Ok(()) => panic!("{what}: accepted"),
            Err(e) => e.to_string(),
        };
        assert!(e.contains(says), "{what}: {e}");
        assert!(!e.contains('\n'), "{what}: more than one line: {e}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
