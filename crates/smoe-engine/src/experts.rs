//! Routed experts memory-mapped from the vault (the resident path, and the blob index the
//! streaming store in `store/` uses). Every blob is checked against its checksum the first time
//! it is used; a mismatch fails the request with the layer and expert named.

use smoe_compute::cpu::QMatRef;
use smoe_vault::format::ExpertPart;
use smoe_vault::{Vault, VaultError};
use std::sync::atomic::{AtomicBool, Ordering};

pub struct ExpertStore {
    vault: Vault,
    parts: Vec<ExpertPart>,
    n_experts: usize,
    /// `layer * n_experts + expert` → index into the vault's blob list.
    index: Vec<Option<usize>>,
    verified: Vec<AtomicBool>,
}

/// One expert's three matrices.
pub struct Expert<'a> {
    pub gate: QMatRef<'a>,
    pub up: QMatRef<'a>,
    pub down: QMatRef<'a>,
}

impl ExpertStore {
    pub fn new(vault: &Vault) -> Result<Self, VaultError> {
        let cfg = &vault.header.config;
        let n_experts = cfg.num_experts;
        let mut index = vec![None; cfg.num_layers * n_experts];
        let (parts, blobs) = match vault.expert_section() {
            Some(x) => (x.parts.clone(), x.blobs.as_slice()),
            None => (vec![], &[][..]),
        };
        for (i, b) in blobs.iter().enumerate() {
            if b.layer < cfg.num_layers && b.expert < n_experts {
                index[b.layer * n_experts + b.expert] = Some(i);
            }
        }
        for l in cfg.moe_layers() {
            for e in 0..n_experts {
                if index[l * n_experts + e].is_none() {
                    return Err(VaultError::Tensor(format!(
                        "vault has no blob for layer {l} expert {e}"
                    )));
                }
            }
        }
        for name in ["gate_proj", "up_proj", "down_proj"] {
            if cfg.moe_layers().next().is_some() && !parts.iter().any(|p| p.name == name) {
                return Err(VaultError::Tensor(format!(
                    "vault expert layout lacks {name}"
                )));
            }
        }
        let verified = (0..blobs.len()).map(|_| AtomicBool::new(false)).collect();
        Ok(ExpertStore {
            vault: vault.clone(),
            parts,
            n_experts,
            index,
            verified,
        })
    }

    /// One expert's blob bytes (mapped), verified on first use.
    pub fn blob_bytes(&self, layer: usize, expert: usize) -> Result<&[u8], VaultError> {
        let i = self.index[layer * self.n_experts + expert].ok_or_else(|| {
            VaultError::Tensor(format!("no expert blob for layer {layer} expert {expert}"))
        })?;
        let blob = &self.vault.expert_section().unwrap().blobs[i];
        let bytes = self.vault.expert_bytes_mapped(blob);
        if !self.verified[i].load(Ordering::Relaxed) {
            self.vault.verify_expert(blob, bytes)?;
            self.verified[i].store(true, Ordering::Relaxed);
        }
        Ok(bytes)
    }

    /// The index of (layer, expert) in the vault's blob list.
    pub fn blob_index(&self, layer: usize, expert: usize) -> Option<usize> {
        self.index[layer * self.n_experts + expert]
    }

    pub fn parts(&self) -> &[ExpertPart] {
        &self.parts
    }
}

impl<'a> Expert<'a> {
    /// The three matrices inside one blob's bytes, as the vault's part table places them.
    pub fn from_blob(parts: &[ExpertPart], bytes: &'a [u8]) -> Self {
        let part = |name: &str| {
            let p = parts
                .iter()
                .find(|p| p.name == name)
                .expect("part checked at load");
            let b = &bytes[p.offset as usize..(p.offset + p.length) as usize];
            QMatRef::new(p.dtype, p.shape[0], p.shape[1], b)
        };
        Expert {
            gate: part("gate_proj"),
            up: part("up_proj"),
            down: part("down_proj"),
        }
    }
}
