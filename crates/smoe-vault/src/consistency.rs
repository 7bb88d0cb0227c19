//! A vault's configuration checked against its own tensors, before anything is allocated from
//! it: a file that is well formed and correctly checksummed but whose configuration lies (a
//! vocabulary of 2⁴⁰, a billion layers, experts that are not there) is refused with one line
//! naming the contradiction. Loading a model runs it, and so does `smoe inspect --verify`.

use crate::config::ModelConfig;
use crate::error::{Result, VaultError};
use crate::reader::Vault;
use crate::tensors::{scout_layout, MlpPart};
use std::collections::HashMap;

impl Vault {
    /// Checks that the configuration describes the tensors the vault holds: counts first (so
    /// that nothing is sized from a number the file cannot back), then every tensor the
    /// configuration implies (`tensors::scout_layout`), by name and shape, and the experts'
    /// parts and blobs.
    pub fn check_layout(&self) -> Result<()> {
        let c = &self.header.config;
        let bad = |m: String| {
            Err(VaultError::Config(format!(
                "{}: vault config says {m}",
                self.path().display()
            )))
        };
        c.validate().map_err(|e| match e {
            VaultError::Config(m) | VaultError::Unsupported(m) => {
                VaultError::Config(format!("{}: vault config: {m}", self.path().display()))
            }
            other => other,
        })?;
        if c.rope.theta.is_nan() || c.rope.theta <= 0.0 {
            return bad(format!(
                "rope theta {}, which must be positive",
                c.rope.theta
            ));
        }
        if c.ffn.len() != c.num_layers {
            return bad(format!(
                "num_layers {} but lists {} feed-forward kinds",
                c.num_layers,
                c.ffn.len()
            ));
        }
        // Every layer has at least its two norms and four attention projections.
        let dense = self.header.tensors.len();
        if c.num_layers == 0 || c.num_layers.saturating_mul(6) > dense {
            return bad(format!(
                "num_layers {} but the vault holds {dense} dense tensors",
                c.num_layers
            ));
        }
        self.check_experts(c, &bad)?;
        let by_name: HashMap<&str, &crate::format::TensorEntry> = (self.header.tensors.iter())
            .map(|t| (t.name.as_str(), t))
            .collect();
        for t in scout_layout(c) {
            let name = t.id.name();
            let Some(e) = by_name.get(name.as_str()) else {
                return bad(format!("the model has {name}, which the vault lacks"));
            };
            if e.shape != t.shape {
                return bad(format!(
                    "{} (so {name} is {:?}), but {name} is {:?}",
                    implied_by(c, &t.shape, &e.shape),
                    t.shape,
                    e.shape
                ));
            }
        }
        Ok(())
    }

    /// The expert section against the configuration: one blob per (MoE layer, expert), and
    /// parts of the expert width.
    fn check_experts(&self, c: &ModelConfig, bad: &dyn Fn(String) -> Result<()>) -> Result<()> {
        let moe = c.moe_layers().count();
        let Some(x) = self.expert_section() else {
            if moe > 0 {
                return bad(format!(
                    "{moe} MoE layers, but the vault has no expert section"
                ));
            }
            return Ok(());
        };
        let want = moe.saturating_mul(c.num_experts);
        if x.blobs.len() != want {
            return bad(format!(
                "{moe} MoE layers of {} experts ({want} blobs), but the vault holds {} blobs",
                c.num_experts,
                x.blobs.len()
            ));
        }
        if let Some(b) =
            (x.blobs.iter()).find(|b| b.expert >= c.num_experts || b.layer >= c.num_layers)
        {
            return bad(format!(
                "{} layers of {} experts, but a blob is for layer {} expert {}",
                c.num_layers, c.num_experts, b.layer, b.expert
            ));
        }
        let (h, i) = (c.hidden_size, c.moe_intermediate_size);
        for p in MlpPart::ALL {
            let want = match p {
                MlpPart::Down => [h, i],
                _ => [i, h],
            };
            let part = x.parts.iter().find(|q| q.name == p.name());
            match part {
                Some(q) if q.shape == want => {}
                Some(q) => {
                    return bad(format!(
                        "hidden_size {h} and moe_intermediate_size {i} (so an expert's {} is {want:?}), but it is {:?}",
                        p.name(),
                        q.shape
                    ))
                }
                None => return bad(format!("experts with a {}, which the vault lacks", p.name())),
            }
        }
        Ok(())
    }
}

/// Which configured sizes a shape comes from, for the message: the dimensions that differ.
fn implied_by(c: &ModelConfig, want: &[usize], got: &[usize]) -> String {
    let names = [
        ("hidden_size", c.hidden_size),
        ("vocab_size", c.vocab_size),
        ("num_attention_heads*head_dim", c.num_heads * c.head_dim),
        ("num_key_value_heads*head_dim", c.num_kv_heads * c.head_dim),
        ("head_dim", c.head_dim),
        ("num_experts", c.num_experts),
        ("intermediate_size", c.intermediate_size),
        (
            "shared_expert_intermediate_size",
            c.shared_expert_intermediate_size,
        ),
    ];
    let mut said: Vec<String> = vec![];
    for (w, g) in want.iter().zip(got) {
        if w != g {
            if let Some((n, v)) = names.iter().find(|(_, v)| v == w) {
                let s = format!("{n} {v}");
                if !said.contains(&s) {
                    said.push(s);
                }
            }
        }
    }
    match said.is_empty() {
        true => "shapes the vault does not have".into(),
        false => said.join(" and "),
    }
}
