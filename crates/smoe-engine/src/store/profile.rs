//! Expert usage saved beside the vault (`M.smoe.profile`), so the next start can preload the
//! experts this user actually uses.

use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Profile {
    /// The vault header's checksum: a profile of another vault is ignored.
    pub vault_header_xxh3: String,
    pub layers: usize,
    pub experts: usize,
    /// `counts[layer][expert]`: tokens routed to the expert, summed over all runs.
    pub counts: Vec<Vec<u64>>,
}

impl Profile {
    pub fn path_for(vault: &Path) -> PathBuf {
        let mut p = vault.as_os_str().to_owned();
        p.push(".profile");
        PathBuf::from(p)
    }

    pub fn empty(header_xxh3: String, layers: usize, experts: usize) -> Self {
        Profile {
            vault_header_xxh3: header_xxh3,
            layers,
            experts,
            counts: vec![vec![0; experts]; layers],
        }
    }

    /// The profile at `path` if it exists and belongs to this vault.
    pub fn load(path: &Path, header_xxh3: &str, layers: usize, experts: usize) -> Option<Self> {
        let text = std::fs::read_to_string(path).ok()?;
        let p: Profile = serde_json::from_str(&text).ok()?;
        let fits = p.vault_header_xxh3 == header_xxh3
            && p.layers == layers
            && p.experts == experts
            && p.counts.len() == layers
            && p.counts.iter().all(|r| r.len() == experts);
        if !fits {
            tracing::warn!(
                "{}: profile belongs to another vault; ignored",
                path.display()
            );
        }
        fits.then_some(p)
    }

    /// Written to a temporary name and renamed, so a crash never leaves half a profile.
    pub fn save(&self, path: &Path) -> std::io::Result<()> {
        let tmp = path.with_extension("profile.partial");
        std::fs::write(&tmp, serde_json::to_vec(self)?)?;
        std::fs::rename(&tmp, path)
    }

    pub fn merge(&mut self, counts: &[u64]) {
        for (l, row) in self.counts.iter_mut().enumerate() {
            for (e, c) in row.iter_mut().enumerate() {
                *c += counts[l * self.experts + e];
            }
        }
    }

    /// (layer, expert) pairs, most used first (ties by position, so the order is stable).
    pub fn hottest(&self) -> Vec<(usize, usize)> {
        let mut v: Vec<(usize, usize, u64)> = self
            .counts
            .iter()
            .enumerate()
            .flat_map(|(l, r)| r.iter().enumerate().map(move |(e, &c)| (l, e, c)))
            .filter(|x| x.2 > 0)
            .collect();
        v.sort_by(|a, b| b.2.cmp(&a.2).then((a.0, a.1).cmp(&(b.0, b.1))));
        v.into_iter().map(|(l, e, _)| (l, e)).collect()
    }
}
