//! The model families smoe runs, each as a short description over the shared blocks of
//! `spec`. A family says which blocks its layers use; the numbers come from the configuration.
//! Adding a family is adding a function here (and its `Architecture` in smoe-vault): see
//! `docs/architecture.md`.

use crate::spec::{self, decoder, gqa, layer, mlp, moe, Ffn, Mixer, ModelSpec};
use smoe_vault::{Architecture, FfnKind, ModelConfig};

/// The description of the model a configuration names.
pub fn describe(c: &ModelConfig) -> ModelSpec {
    match c.architecture {
        Architecture::Qwen3Moe => qwen3_moe(c),
        Architecture::Qwen2Moe => qwen2_moe(c),
        Architecture::Mixtral => mixtral(c),
        Architecture::Olmoe => olmoe(c),
    }
}

/// The FFN of layer `l`: routed experts where the configuration puts them, else a dense MLP.
fn ffn(c: &ModelConfig, l: usize, routed: impl FnOnce() -> spec::Moe) -> Ffn {
    match c.ffn[l] {
        FfnKind::Moe => Ffn::Moe(routed()),
        FfnKind::Dense => Ffn::Dense(mlp(l)),
    }
}

/// Qwen3-MoE: GQA with q and k normalised per head; softmax top-k experts (renormalised when
/// `norm_topk_prob`); dense MLPs in `mlp_only_layers`.
pub fn qwen3_moe(c: &ModelConfig) -> ModelSpec {
    let layers = (0..c.num_layers).map(|l| {
        let attn = gqa(c, l).with_qk_norm(l, true);
        layer(
            l,
            Mixer::Attention(attn),
            ffn(c, l, || moe(c, l, c.norm_topk_prob)),
        )
    });
    decoder(c, layers.collect())
}

/// Qwen2-MoE: GQA with biased q, k, v; routed experts plus a sigmoid-gated shared expert.
pub fn qwen2_moe(c: &ModelConfig) -> ModelSpec {
    let layers = (0..c.num_layers).map(|l| {
        let attn = if c.qkv_bias {
            gqa(c, l).with_qkv_bias(l)
        } else {
            gqa(c, l)
        };
        let routed = || {
            let m = moe(c, l, c.norm_topk_prob);
            match c.shared_expert_intermediate_size {
                0 => m,
                _ => m.with_gated_shared(l),
            }
        };
        layer(l, Mixer::Attention(attn), ffn(c, l, routed))
    });
    decoder(c, layers.collect())
}

/// Mixtral: GQA with a sliding window; every layer routed, top-k always renormalised.
pub fn mixtral(c: &ModelConfig) -> ModelSpec {
    let layers = (0..c.num_layers).map(|l| {
        let attn = spec::Attention {
            window: c.sliding_window,
            ..gqa(c, l)
        };
        layer(l, Mixer::Attention(attn), ffn(c, l, || moe(c, l, true)))
    });
    decoder(c, layers.collect())
}

/// OLMoE: GQA with q and k normalised over the whole projection, then clipped.
pub fn olmoe(c: &ModelConfig) -> ModelSpec {
    let layers = (0..c.num_layers).map(|l| {
        let attn = spec::Attention {
            clip: c.clip_qkv,
            ..gqa(c, l).with_qk_norm(l, false)
        };
        layer(
            l,
            Mixer::Attention(attn),
            ffn(c, l, || moe(c, l, c.norm_topk_prob)),
        )
    });
    decoder(c, layers.collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use smoe_vault::tensors::{scout_layout, Tensor};

    fn config(arch: Architecture) -> ModelConfig {
        let mut c = smoe_vault::synth::preset("tiny").expect("tiny preset");
        c.architecture = arch;
        match arch {
            Architecture::Qwen2Moe => {
                c.qkv_bias = true;
                c.shared_expert_intermediate_size = 64;
                c.qk_norm = smoe_vault::config::QkNorm::None;
            }
            Architecture::Olmoe => {
                c.qk_norm = smoe_vault::config::QkNorm::Full;
                c.clip_qkv = Some(8.0);
            }
            Architecture::Mixtral => {
                c.qk_norm = smoe_vault::config::QkNorm::None;
                c.sliding_window = Some(16);
            }
            Architecture::Qwen3Moe => {}
        }
        c
    }

    /// The description reads exactly the dense tensors the vault's table lists for the same
    /// configuration: no tensor the importer writes is ignored, none the executors read is
    /// missing.
    #[test]
    fn every_family_reads_exactly_the_tables_dense_tensors() {
        for arch in Architecture::ALL {
            let c = config(arch);
            let mut read = describe(&c).tensors();
            let mut table: Vec<Tensor> = scout_layout(&c).into_iter().map(|t| t.id).collect();
            if c.tie_word_embeddings {
                read.retain(|t| *t != Tensor::LmHead);
            }
            read.sort_by_key(|t| t.name());
            read.dedup();
            table.sort_by_key(|t| t.name());
            assert_eq!(read, table, "{arch:?}");
        }
    }
}
