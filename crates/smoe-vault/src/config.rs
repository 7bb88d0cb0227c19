//! The model configuration stored in a vault, normalised from Hugging Face `config.json`.
//!
//! Hub checkpoints and newer transformers spell the same things differently (`num_experts` vs
//! `num_local_experts`, `rope_theta` + `rope_scaling` vs `rope_parameters`); this module accepts
//! both and stores one spelling, so the engine never looks at raw JSON.

use crate::VaultError;
use serde::{Deserialize, Serialize};
use serde_json::Value;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Architecture {
    Qwen3Moe,
    Qwen2Moe,
    Mixtral,
    Olmoe,
}

impl Architecture {
    pub const ALL: [Architecture; 4] = [
        Architecture::Qwen3Moe,
        Architecture::Qwen2Moe,
        Architecture::Mixtral,
        Architecture::Olmoe,
    ];

    pub fn hf_class(self) -> &'static str {
        match self {
            Architecture::Qwen3Moe => "Qwen3MoeForCausalLM",
            Architecture::Qwen2Moe => "Qwen2MoeForCausalLM",
            Architecture::Mixtral => "MixtralForCausalLM",
            Architecture::Olmoe => "OlmoeForCausalLM",
        }
    }

    pub const fn model_type(self) -> &'static str {
        match self {
            Architecture::Qwen3Moe => "qwen3_moe",
            Architecture::Qwen2Moe => "qwen2_moe",
            Architecture::Mixtral => "mixtral",
            Architecture::Olmoe => "olmoe",
        }
    }
}

/// Where attention normalises queries and keys (after projection, before RoPE).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum QkNorm {
    None,
    /// RMSNorm over each head's `head_dim` values (Qwen3).
    PerHead,
    /// RMSNorm over the whole q (or k) projection (OLMoE).
    Full,
}

/// YaRN parameters, as transformers' `_compute_yarn_parameters` reads them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Yarn {
    pub factor: f64,
    pub original_max_position_embeddings: usize,
    pub beta_fast: f64,
    pub beta_slow: f64,
    /// Scale applied to cos/sin; derived from `factor` (and mscale) when the config omits it.
    pub attention_factor: f64,
    pub truncate: bool,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Rope {
    pub theta: f64,
    pub yarn: Option<Yarn>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FfnKind {
    Dense,
    Moe,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    pub architecture: Architecture,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    /// Width of the dense MLP layers.
    pub intermediate_size: usize,
    /// Width of one routed expert.
    pub moe_intermediate_size: usize,
    pub num_experts: usize,
    pub num_experts_per_tok: usize,
    pub norm_topk_prob: bool,
    pub rms_norm_eps: f64,
    pub rope: Rope,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    /// Dense or MoE feed-forward, per layer (from `mlp_only_layers` and `decoder_sparse_step`).
    pub ffn: Vec<FfnKind>,
    pub qk_norm: QkNorm,
    /// Biases on the q, k and v projections (Qwen2-MoE).
    #[serde(default)]
    pub qkv_bias: bool,
    /// Clamp q, k and v to ±clip after projection and norm (OLMoE).
    #[serde(default)]
    pub clip_qkv: Option<f32>,
    /// Attend only to the last `sliding_window` positions, the current one included (Mixtral).
    #[serde(default)]
    pub sliding_window: Option<usize>,
    /// Width of the always-on shared expert, gated by a sigmoid (Qwen2-MoE); 0 = none.
    #[serde(default)]
    pub shared_expert_intermediate_size: usize,
}

impl ModelConfig {
    /// Parses a Hugging Face `config.json`.
    pub fn from_hf(v: &Value) -> Result<Self, VaultError> {
        let bad = |msg: String| VaultError::Config(msg);
        let archs: Vec<&str> = v
            .get("architectures")
            .and_then(Value::as_array)
            .map(|a| a.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        let model_type = v.get("model_type").and_then(Value::as_str).unwrap_or("");
        let architecture = Architecture::ALL
            .into_iter()
            .find(|a| archs.contains(&a.hf_class()) || model_type == a.model_type())
            .ok_or_else(|| {
                let what = archs.first().copied().unwrap_or(if model_type.is_empty() {
                    "unknown"
                } else {
                    model_type
                });
                let supported: Vec<&str> = Architecture::ALL.iter().map(|a| a.hf_class()).collect();
                VaultError::Unsupported(format!(
                    "architecture '{what}' is not supported (supported: {})",
                    supported.join(", ")
                ))
            })?;
        let req = |k: &str| -> Result<usize, VaultError> {
            v.get(k)
                .and_then(Value::as_u64)
                .map(|x| x as usize)
                .ok_or_else(|| bad(format!("config.json: missing or non-integer '{k}'")))
        };
        let opt_usize = |k: &str| v.get(k).and_then(Value::as_u64).map(|x| x as usize);
        let hidden_size = req("hidden_size")?;
        let num_heads = req("num_attention_heads")?;
        let num_layers = req("num_hidden_layers")?;
        let num_kv_heads = opt_usize("num_key_value_heads").unwrap_or(num_heads);
        let head_dim = opt_usize("head_dim").unwrap_or(hidden_size / num_heads.max(1));
        let num_experts = opt_usize("num_experts")
            .or_else(|| opt_usize("num_local_experts"))
            .ok_or_else(|| {
                bad("config.json: missing 'num_experts' (or 'num_local_experts')".into())
            })?;
        use Architecture::*;
        // Mixtral and OLMoE have only MoE layers, whose width is `intermediate_size`.
        let all_moe = matches!(architecture, Mixtral | Olmoe);
        let decoder_sparse_step = if all_moe {
            1
        } else {
            opt_usize("decoder_sparse_step").unwrap_or(1).max(1)
        };
        let mlp_only: Vec<usize> = if all_moe {
            vec![]
        } else {
            v.get("mlp_only_layers")
                .and_then(Value::as_array)
                .map(|a| {
                    a.iter()
                        .filter_map(Value::as_u64)
                        .map(|x| x as usize)
                        .collect()
                })
                .unwrap_or_default()
        };
        let ffn = (0..num_layers)
            .map(|l| {
                if !mlp_only.contains(&l) && num_experts > 0 && (l + 1) % decoder_sparse_step == 0 {
                    FfnKind::Moe
                } else {
                    FfnKind::Dense
                }
            })
            .collect();
        let max_position_embeddings = opt_usize("max_position_embeddings").unwrap_or(32768);
        let flag = |k: &str| v.get(k).and_then(Value::as_bool);
        let unsupported = |what: &str| {
            Err(VaultError::Unsupported(format!(
                "{what} is not supported for {}",
                architecture.model_type()
            )))
        };
        // Qwen2-MoE biases q/k/v only (`qkv_bias`, default true); `attention_bias` elsewhere
        // would also bias o_proj, which no supported checkpoint uses.
        let qkv_bias = architecture == Qwen2Moe && flag("qkv_bias").unwrap_or(true);
        if architecture != Qwen2Moe && flag("attention_bias") == Some(true) {
            return unsupported("attention_bias=true");
        }
        let sliding_window = match architecture {
            Mixtral => opt_usize("sliding_window"),
            _ if flag("use_sliding_window") == Some(true) => {
                return unsupported("use_sliding_window=true")
            }
            _ => None,
        };
        if let Some(act) = v.get("hidden_act").and_then(Value::as_str) {
            if act != "silu" {
                return Err(VaultError::Unsupported(format!(
                    "hidden_act '{act}' (only silu)"
                )));
            }
        }
        let intermediate = opt_usize("intermediate_size").unwrap_or(0);
        let cfg = ModelConfig {
            architecture,
            vocab_size: req("vocab_size")?,
            hidden_size,
            num_layers,
            num_heads,
            num_kv_heads,
            head_dim,
            intermediate_size: if all_moe { 0 } else { intermediate },
            moe_intermediate_size: if all_moe {
                intermediate
            } else {
                opt_usize("moe_intermediate_size").unwrap_or(0)
            },
            num_experts,
            num_experts_per_tok: opt_usize("num_experts_per_tok").unwrap_or(0),
            // Mixtral always renormalises the top-k probabilities.
            norm_topk_prob: architecture == Mixtral || flag("norm_topk_prob").unwrap_or(false),
            rms_norm_eps: v
                .get("rms_norm_eps")
                .and_then(Value::as_f64)
                .unwrap_or(1e-6),
            rope: parse_rope(v, max_position_embeddings)?,
            max_position_embeddings,
            tie_word_embeddings: flag("tie_word_embeddings").unwrap_or(false),
            ffn,
            qk_norm: match architecture {
                Qwen3Moe => QkNorm::PerHead,
                Olmoe => QkNorm::Full,
                Qwen2Moe | Mixtral => QkNorm::None,
            },
            qkv_bias,
            clip_qkv: if architecture == Olmoe {
                v.get("clip_qkv").and_then(Value::as_f64).map(|x| x as f32)
            } else {
                None
            },
            sliding_window,
            shared_expert_intermediate_size: if architecture == Qwen2Moe {
                opt_usize("shared_expert_intermediate_size").unwrap_or(0)
            } else {
                0
            },
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Structural checks that the engine relies on.
    pub fn validate(&self) -> Result<(), VaultError> {
        let bad = |m: String| Err(VaultError::Config(m));
        if self.num_heads == 0
            || self.num_kv_heads == 0
            || !self.num_heads.is_multiple_of(self.num_kv_heads)
        {
            return bad(format!(
                "num_attention_heads ({}) must be a positive multiple of num_key_value_heads ({})",
                self.num_heads, self.num_kv_heads
            ));
        }
        if !self.head_dim.is_multiple_of(2) || self.head_dim == 0 {
            return bad(format!("head_dim {} must be even", self.head_dim));
        }
        let has_moe = self.ffn.contains(&FfnKind::Moe);
        if has_moe && (self.num_experts_per_tok == 0 || self.num_experts_per_tok > self.num_experts)
        {
            return bad(format!(
                "num_experts_per_tok {} must be in 1..={}",
                self.num_experts_per_tok, self.num_experts
            ));
        }
        if has_moe && self.moe_intermediate_size == 0 {
            return bad("moe_intermediate_size is missing".into());
        }
        if self.ffn.contains(&FfnKind::Dense) && self.intermediate_size == 0 {
            return bad("intermediate_size is missing but the model has dense MLP layers".into());
        }
        for (what, d) in [
            ("hidden_size", self.hidden_size),
            (
                "num_attention_heads*head_dim",
                self.num_heads * self.head_dim,
            ),
            (
                "moe_intermediate_size",
                if has_moe {
                    self.moe_intermediate_size
                } else {
                    64
                },
            ),
            (
                "intermediate_size",
                if self.ffn.contains(&FfnKind::Dense) {
                    self.intermediate_size
                } else {
                    64
                },
            ),
            (
                "shared_expert_intermediate_size",
                if has_moe {
                    self.shared_expert_intermediate_size
                } else {
                    0
                },
            ),
        ] {
            if d % 64 != 0 {
                return Err(VaultError::Unsupported(format!(
                    "{what} = {d} is not a multiple of 64 (quantization groups are 64 wide)"
                )));
            }
        }
        Ok(())
    }

    pub fn moe_layers(&self) -> impl Iterator<Item = usize> + '_ {
        self.ffn
            .iter()
            .enumerate()
            .filter(|(_, k)| **k == FfnKind::Moe)
            .map(|(l, _)| l)
    }
}

fn parse_rope(v: &Value, max_pos: usize) -> Result<Rope, VaultError> {
    // Newer transformers: everything in `rope_parameters`; hub checkpoints: `rope_theta` + `rope_scaling`.
    let params = v.get("rope_parameters").filter(|p| p.is_object());
    let scaling = params.or_else(|| v.get("rope_scaling").filter(|p| p.is_object()));
    let theta = params
        .and_then(|p| p.get("rope_theta"))
        .or_else(|| v.get("rope_theta"))
        .and_then(Value::as_f64)
        .unwrap_or(10000.0);
    let Some(s) = scaling else {
        return Ok(Rope { theta, yarn: None });
    };
    let kind = s
        .get("rope_type")
        .or_else(|| s.get("type"))
        .and_then(Value::as_str)
        .unwrap_or("default");
    match kind {
        "default" => Ok(Rope { theta, yarn: None }),
        "yarn" => {
            let f = |k: &str| s.get(k).and_then(Value::as_f64);
            let original = s
                .get("original_max_position_embeddings")
                .or_else(|| v.get("original_max_position_embeddings"))
                .and_then(Value::as_u64)
                .map(|x| x as usize)
                .unwrap_or(max_pos);
            let factor = f("factor").unwrap_or(max_pos as f64 / original as f64);
            let get_mscale = |scale: f64, m: f64| {
                if scale <= 1.0 {
                    1.0
                } else {
                    0.1 * m * scale.ln() + 1.0
                }
            };
            let attention_factor = match (f("attention_factor"), f("mscale"), f("mscale_all_dim")) {
                (Some(a), _, _) => a,
                (None, Some(m), Some(mad)) if m != 0.0 && mad != 0.0 => {
                    get_mscale(factor, m) / get_mscale(factor, mad)
                }
                _ => get_mscale(factor, 1.0),
            };
            Ok(Rope {
                theta,
                yarn: Some(Yarn {
                    factor,
                    original_max_position_embeddings: original,
                    beta_fast: f("beta_fast").filter(|x| *x != 0.0).unwrap_or(32.0),
                    beta_slow: f("beta_slow").filter(|x| *x != 0.0).unwrap_or(1.0),
                    attention_factor,
                    truncate: s.get("truncate").and_then(Value::as_bool).unwrap_or(true),
                }),
            })
        }
        other => Err(VaultError::Unsupported(format!(
            "rope type '{other}' (supported: default, yarn)"
        ))),
    }
}

/// Sampling defaults and special tokens from `generation_config.json` / `config.json`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct GenerationDefaults {
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<usize>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub do_sample: Option<bool>,
}

impl GenerationDefaults {
    /// `generation_config` wins over `config` where both speak.
    pub fn from_hf(config: &Value, generation: Option<&Value>) -> Self {
        let ids = |v: &Value| -> Vec<u32> {
            match v {
                Value::Number(n) => n.as_u64().map(|x| vec![x as u32]).unwrap_or_default(),
                Value::Array(a) => a
                    .iter()
                    .filter_map(Value::as_u64)
                    .map(|x| x as u32)
                    .collect(),
                _ => vec![],
            }
        };
        let pick = |k: &str| {
            generation
                .and_then(|g| g.get(k))
                .filter(|x| !x.is_null())
                .or_else(|| config.get(k))
        };
        let f = |k: &str| {
            generation
                .and_then(|g| g.get(k))
                .and_then(Value::as_f64)
                .map(|x| x as f32)
        };
        let mut eos = pick("eos_token_id").map(ids).unwrap_or_default();
        // Some checkpoints list a different eos in each file; honour both.
        if let Some(more) = config.get("eos_token_id").map(ids) {
            for id in more {
                if !eos.contains(&id) {
                    eos.push(id);
                }
            }
        }
        GenerationDefaults {
            bos_token_id: pick("bos_token_id")
                .and_then(Value::as_u64)
                .map(|x| x as u32),
            eos_token_ids: eos,
            temperature: f("temperature"),
            top_p: f("top_p"),
            top_k: generation
                .and_then(|g| g.get("top_k"))
                .and_then(Value::as_u64)
                .map(|x| x as usize),
            min_p: f("min_p"),
            repetition_penalty: f("repetition_penalty"),
            do_sample: generation
                .and_then(|g| g.get("do_sample"))
                .and_then(Value::as_bool),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn base() -> Value {
        json!({"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 1000,
               "hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
               "num_hidden_layers": 4, "intermediate_size": 256, "moe_intermediate_size": 64,
               "num_experts": 8, "num_experts_per_tok": 2, "rope_theta": 1e6})
    }

    #[test]
    fn sparse_layers_follow_transformers_rule() {
        let mut v = base();
        v["decoder_sparse_step"] = json!(2);
        v["mlp_only_layers"] = json!([3]);
        let c = ModelConfig::from_hf(&v).unwrap();
        assert_eq!(
            c.ffn,
            vec![FfnKind::Dense, FfnKind::Moe, FfnKind::Dense, FfnKind::Dense]
        );
        assert_eq!(
            c.rope,
            Rope {
                theta: 1e6,
                yarn: None
            }
        );
    }

    #[test]
    fn new_style_keys_are_read() {
        let mut v = base();
        v.as_object_mut().unwrap().remove("num_experts");
        v.as_object_mut().unwrap().remove("rope_theta");
        v["num_local_experts"] = json!(16);
        v["rope_parameters"] = json!({"rope_type": "yarn", "rope_theta": 5e5, "factor": 4.0,
                                      "original_max_position_embeddings": 64});
        let c = ModelConfig::from_hf(&v).unwrap();
        assert_eq!(c.num_experts, 16);
        let y = c.rope.yarn.unwrap();
        assert_eq!(c.rope.theta, 5e5);
        assert!((y.attention_factor - (0.1 * 4f64.ln() + 1.0)).abs() < 1e-12);
    }

    #[test]
    fn bad_configs_are_refused_with_reasons() {
        let mut v = base();
        v["architectures"] = json!(["LlamaForCausalLM"]);
        v["model_type"] = json!("llama");
        let e = ModelConfig::from_hf(&v).unwrap_err().to_string();
        assert!(e.contains("LlamaForCausalLM"), "{e}");
        let mut v = base();
        v["hidden_size"] = json!(100);
        let e = ModelConfig::from_hf(&v).unwrap_err().to_string();
        assert!(e.contains("multiple of 64"), "{e}");
        let mut v = base();
        v["num_experts_per_tok"] = json!(9);
        assert!(ModelConfig::from_hf(&v).is_err());
    }

    #[test]
    fn generation_defaults_merge_eos() {
        let g = GenerationDefaults::from_hf(
            &json!({"eos_token_id": 2, "bos_token_id": 1}),
            Some(&json!({"eos_token_id": [3, 2], "temperature": 0.6, "top_k": 20})),
        );
        assert_eq!(g.eos_token_ids, vec![3, 2]);
        assert_eq!(g.bos_token_id, Some(1));
        assert_eq!(g.top_k, Some(20));
    }
}
