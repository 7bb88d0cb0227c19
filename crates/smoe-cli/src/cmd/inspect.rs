//! `smoe inspect`: what is inside a vault.

use crate::common::{human_bytes, progress_bar};
use anyhow::{Context, Result};
use smoe_vault::Vault;
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct Args {
    /// The .smoe vault to describe.
    vault: PathBuf,
    /// Check the configuration against the tensors (as loading does), then recompute every
    /// checksum (scout tensors and expert blobs).
    #[arg(long)]
    verify: bool,
    /// List every expert blob, not just a summary.
    #[arg(long)]
    experts: bool,
    /// Print the header as JSON (without the tokenizer text).
    #[arg(long)]
    json: bool,
}

pub fn run(a: Args) -> Result<()> {
    let v = Vault::open(&a.vault).context("cannot open the vault")?;
    let h = &v.header;
    if a.json {
        let mut j = serde_json::to_value(&**h)?;
        if let Some(t) = j.get_mut("text").and_then(|t| t.get_mut("tokenizer_json")) {
            if !t.is_null() {
                *t = serde_json::Value::String("<omitted>".into());
            }
        }
        println!("{}", serde_json::to_string_pretty(&j)?);
    } else {
        let c = &h.config;
        println!(
            "file        {} ({}), format {}.{}, written by {}",
            a.vault.display(),
            human_bytes(v.file_len()),
            v.version.0,
            v.version.1,
            h.writer
        );
        println!(
            "model       {} — {} layers, hidden {}, heads {}/{} (kv), head_dim {}, vocab {}",
            c.architecture.hf_class(),
            c.num_layers,
            c.hidden_size,
            c.num_heads,
            c.num_kv_heads,
            c.head_dim,
            c.vocab_size
        );
        println!(
            "experts     {} per MoE layer, top-{}, width {}, norm_topk_prob {}; MoE layers {:?}",
            c.num_experts,
            c.num_experts_per_tok,
            c.moe_intermediate_size,
            c.norm_topk_prob,
            c.moe_layers().collect::<Vec<_>>()
        );
        println!(
            "dense mlp   width {}; rope theta {}{}; tied embeddings {}; max positions {}",
            c.intermediate_size,
            c.rope.theta,
            c.rope
                .yarn
                .as_ref()
                .map(|y| format!(
                    ", yarn ×{} from {}",
                    y.factor, y.original_max_position_embeddings
                ))
                .unwrap_or_default(),
            c.tie_word_embeddings,
            c.max_position_embeddings
        );
        println!(
            "quant       experts {}, scout {}, group {}",
            h.quant.experts, h.quant.scout, h.quant.group_size
        );
        println!(
            "text        tokenizer {}, chat template {}, eos {:?}",
            if h.text.tokenizer_json.is_some() {
                "yes"
            } else {
                "no"
            },
            if h.text.chat_template.is_some() {
                "yes"
            } else {
                "no"
            },
            h.generation.eos_token_ids
        );
        let scout: u64 = h.tensors.iter().map(|t| t.length).sum();
        println!(
            "\nscout tensors: {} ({})",
            h.tensors.len(),
            human_bytes(scout)
        );
        println!(
            "  {:<52} {:>5} {:>14} {:>12} {:>16}",
            "name", "type", "shape", "bytes", "xxh3"
        );
        for t in &h.tensors {
            println!(
                "  {:<52} {:>5} {:>14} {:>12} {:>16x}",
                t.name,
                t.dtype.name(),
                format!("{:?}", t.shape),
                t.length,
                t.xxh3
            );
        }
        if let Some(x) = &h.experts {
            println!(
                "\nexpert blobs: {} × {} used / {} stride = {}",
                x.blobs.len(),
                human_bytes(x.used_bytes),
                human_bytes(x.blob_stride),
                human_bytes(x.blob_stride * x.blobs.len() as u64)
            );
            for p in &x.parts {
                println!(
                    "  part {:<10} {:>5} {:?} at +{} ({} bytes)",
                    p.name,
                    p.dtype.name(),
                    p.shape,
                    p.offset,
                    p.length
                );
            }
            if a.experts {
                for b in &x.blobs {
                    println!(
                        "  layer {:>3} expert {:>4} at {:>14} xxh3 {:016x}",
                        b.layer, b.expert, b.offset, b.xxh3
                    );
                }
            }
        }
    }
    if a.verify {
        // The same consistency checks as loading, then every checksum.
        v.check_layout()?;
        v.verify_scout()?;
        if let Some(x) = v.expert_section() {
            let pb = progress_bar(x.used_bytes * x.blobs.len() as u64, "verifying");
            for b in &x.blobs {
                v.verify_expert(b, v.expert_bytes_mapped(b))?;
                pb.inc(x.used_bytes);
            }
            pb.finish_and_clear();
        }
        eprintln!("all checksums match");
    }
    Ok(())
}
