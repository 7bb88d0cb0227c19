use super::*;

#[test]
fn sha256_known_answers() {
    assert_eq!(
        sha256(b""),
        "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
    );
    assert_eq!(
        sha256(b"abc"),
        "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    );
    let long = b"abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq";
    assert_eq!(
        sha256(long),
        "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1"
    );
    assert_eq!(
        sha256(&[b'a'; 1000]),
        "41edece42d63e8d9bf515a9ba6932e1c20cbc9f5a5d134645adb5db1b9737ea3"
    );
}

#[test]
fn integer_arithmetic() {
    // splitmix64 reference values (seed 0 stream of the reference implementation)
    assert_eq!(splitmix64(0), 0xE220A8397B1DCDAF);
    assert_eq!(fnv1a64(b""), 0xCBF29CE484222325);
    assert_eq!(fnv1a64(b"a"), 0xAF63DC4C8601EC8C);
    assert_eq!(scale_exponent(192), -3); // sqrt(3/192) = 1/8 exactly
    assert_eq!(scale_exponent(384), -3); // log2 sqrt(3/384) = -3.5, rounds half up
    assert_eq!(scale_exponent(512), -4);
    assert_eq!(scale_exponent(128), -3);
}

#[test]
fn names_match_reference_files() {
    let mut files: Vec<String> = std::fs::read_dir(fixtures_dir().join("reference"))
        .expect("tests/fixtures/reference")
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter_map(|f| f.strip_suffix(".json").map(str::to_string))
        .collect();
    files.sort();
    let mut names = names();
    names.sort();
    assert_eq!(names, files);
    for name in &names {
        assert_eq!(&reference(name).meta.fixture, name);
    }
}

/// The crate regenerates exactly the files transformers loaded for the reference.
#[test]
fn regenerated_files_match_reference_hashes() {
    for name in names() {
        let meta = reference(&name).meta;
        let files = checkpoint_files(&spec(&name));
        let got: BTreeMap<String, String> =
            files.iter().map(|(f, b)| (f.clone(), sha256(b))).collect();
        assert_eq!(
            got, meta.files_sha256,
            "{name}: files differ from the reference's"
        );
        assert_eq!(got["config.json"], meta.config_sha256);
        for (f, h) in &meta.weights_sha256 {
            assert_eq!(&got[f], h, "{name}: {f}");
        }
    }
}

#[test]
fn write_checkpoint_writes_those_files() {
    let dir = crate::ScratchDir::new("write-checkpoint").unwrap();
    write_checkpoint("tiny-dense-mix", &dir).unwrap();
    let meta = reference("tiny-dense-mix").meta;
    let mut listed: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    listed.sort();
    assert_eq!(
        listed,
        meta.files_sha256.keys().cloned().collect::<Vec<_>>()
    );
    for (f, h) in &meta.files_sha256 {
        assert_eq!(&sha256(&std::fs::read(dir.join(f)).unwrap()), h, "{f}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
    // the cached copy too
    let cached = checkpoint("tiny-tied").unwrap();
    assert_eq!(checkpoint("tiny-tied").unwrap(), cached);
    let meta = reference("tiny-tied").meta;
    for (f, h) in &meta.files_sha256 {
        assert_eq!(&sha256(&std::fs::read(cached.join(f)).unwrap()), h, "{f}");
    }
}

#[test]
fn weights_exactly_representable() {
    for spec in specs().fixtures {
        for t in tensor_list(&spec.config) {
            let values = tensor_values(&t, spec.seed);
            assert_eq!(values.len(), t.numel());
            let (mut lo, mut hi) = (f32::MAX, f32::MIN);
            for &v in &values {
                assert_eq!(v.to_bits() & 0xFFFF, 0, "{}: {v} not exact in bf16", t.name);
                assert_eq!(
                    half::f16::from_f32(v).to_f32(),
                    v,
                    "{}: {v} not exact in f16",
                    t.name
                );
                lo = lo.min(v);
                hi = hi.max(v);
            }
            match t.kind {
                Kind::Norm => assert!(lo >= 0.75 && hi <= 1.21875, "{}", t.name),
                Kind::Bias => assert!(lo >= -0.125 && hi <= 0.109375, "{}", t.name),
                Kind::Embed => assert!(lo >= -1.0 && hi < 1.0, "{}", t.name),
                _ => {
                    let s = 2f32.powi(scale_exponent(t.shape[1]))
                        * if t.kind == Kind::Matrix { 1.0 } else { 4.0 };
                    assert!(lo >= -s && hi < s, "{}: [{lo}, {hi}] vs {s}", t.name);
                }
            }
            // a reasonably uniform spread: both signs, many distinct values
            assert!(lo < hi, "{}", t.name);
        }
    }
}

#[test]
fn layout_and_prompts_match_reference() {
    let specs = specs();
    for spec in &specs.fixtures {
        let r = reference(&spec.name);
        let layers: Vec<String> = (0..spec.config["num_hidden_layers"].as_u64().unwrap() as usize)
            .map(|l| {
                if layer_is_sparse(&spec.config, l) {
                    "sparse"
                } else {
                    "dense"
                }
                .to_string()
            })
            .collect();
        assert_eq!(layers, r.meta.layers, "{}", spec.name);
        assert!(
            layers.iter().any(|l| l == "sparse"),
            "{}: no sparse layer",
            spec.name
        );
        let want = prompts(&spec.name);
        assert_eq!(r.prompts.len(), want.len());
        for (p, ids) in r.prompts.iter().zip(&want) {
            assert_eq!(&p.prompt, ids, "{}: prompt ids", spec.name);
            let n = ids.len();
            assert!(ids.iter().all(|&t| (t as u64) < specs.tokenizer_vocab));
            assert_eq!(p.logprobs.len(), n - 1);
            assert_eq!(p.argmax.len(), n);
            assert_eq!(p.margin.len(), n);
            assert_eq!(p.greedy.tokens.len(), 32);
            assert_eq!(p.greedy.margins.len(), 32);
            assert_eq!(p.greedy.tokens[0], p.argmax[n - 1]);
            assert!(p.logprobs.iter().all(|&x| x <= 0.0 && x.is_finite()));
            assert!(p.margin.iter().chain(&p.greedy.margins).all(|&m| m >= 0.0));
            let vocab = spec.config["vocab_size"].as_u64().unwrap();
            assert!(p
                .argmax
                .iter()
                .chain(&p.greedy.tokens)
                .all(|&t| (t as u64) < vocab));
        }
        let rope = &r.meta.rope;
        let hd = head_dim(&spec.config);
        assert_eq!(rope.inv_freq.len(), hd / 2);
        let yarn = spec
            .config
            .get("rope_parameters")
            .and_then(|p| p.get("rope_type"))
            == Some(&Value::from("yarn"));
        assert_eq!(rope.rope_type, if yarn { "yarn" } else { "default" });
        assert_eq!(rope.attention_scaling != 1.0, yarn);
    }
}

#[test]
fn fixtures_cover_what_they_should() {
    let all = specs().fixtures;
    let dtypes: Vec<&str> = all.iter().map(|s| s.dtype.as_str()).collect();
    for d in ["bf16", "f16", "f32"] {
        assert!(dtypes.contains(&d), "no {d} fixture");
    }
    assert!(all.iter().any(|s| s.shards > 1));
    assert!(all
        .iter()
        .any(|s| s.config["tie_word_embeddings"] == Value::Bool(true)));
    for spec in &all {
        let layers = spec.config["num_hidden_layers"].as_u64().unwrap() as usize;
        let sparse = (0..layers)
            .filter(|&l| layer_is_sparse(&spec.config, l))
            .count();
        assert!(sparse > 0, "{}", spec.name);
    }
    assert!(all.iter().any(|s| {
        let layers = s.config["num_hidden_layers"].as_u64().unwrap() as usize;
        (0..layers).any(|l| !layer_is_sparse(&s.config, l))
    }));
}

#[test]
fn tokenizer_files_and_reference() {
    let tok: Value =
        serde_json::from_slice(&std::fs::read(tokenizer_dir().join("tokenizer.json")).unwrap())
            .unwrap();
    let added = tok["added_tokens"].as_array().unwrap();
    let id = |s: &str| {
        added.iter().find(|t| t["content"] == s).unwrap()["id"]
            .as_u64()
            .unwrap()
    };
    let cfg = &spec("tiny-tied").config;
    assert_eq!(cfg["bos_token_id"].as_u64().unwrap(), id("<|endoftext|>"));
    assert_eq!(cfg["eos_token_id"].as_u64().unwrap(), id("<|im_end|>"));
    let size = std::fs::metadata(tokenizer_dir().join("tokenizer.json"))
        .unwrap()
        .len();
    assert!(size < 100 * 1024, "tokenizer.json is {size} bytes");
    let r = tokenizer_reference();
    assert!(!r.encodings.is_empty() && !r.chats.is_empty());
    assert_eq!(
        r.meta["tokenizer_sha256"],
        sha256(&std::fs::read(tokenizer_dir().join("tokenizer.json")).unwrap())
    );
    let tc: Value = serde_json::from_slice(
        &std::fs::read(tokenizer_dir().join("tokenizer_config.json")).unwrap(),
    )
    .unwrap();
    assert!(tc["chat_template"]
        .as_str()
        .unwrap()
        .contains("<|im_start|>"));
}

fn shapes(name: &str) -> BTreeMap<String, (Vec<usize>, Kind)> {
    tensor_list(&spec(name).config)
        .into_iter()
        .map(|t| (t.name, (t.shape, t.kind)))
        .collect()
}

#[test]
fn family_tensor_names_and_shapes() {
    let m = shapes("tiny-mixtral");
    let l = "model.layers.0.";
    assert_eq!(
        m[&format!("{l}block_sparse_moe.gate.weight")],
        (vec![8, 256], Kind::Router)
    );
    assert_eq!(
        m[&format!("{l}block_sparse_moe.experts.7.w1.weight")].0,
        vec![128, 256]
    );
    assert_eq!(
        m[&format!("{l}block_sparse_moe.experts.7.w3.weight")].0,
        vec![128, 256]
    );
    assert_eq!(
        m[&format!("{l}block_sparse_moe.experts.7.w2.weight")].0,
        vec![256, 128]
    );
    assert!(!m
        .keys()
        .any(|k| k.contains("q_norm") || k.ends_with(".bias") || k.contains(".mlp.")));
    assert_eq!(m.len(), 3 + 4 * (2 + 4 + 1 + 8 * 3));

    let o = shapes("tiny-olmoe");
    assert_eq!(
        o[&format!("{l}self_attn.q_norm.weight")],
        (vec![192], Kind::Norm)
    ); // 4 heads * 48
    assert_eq!(
        o[&format!("{l}self_attn.k_norm.weight")],
        (vec![96], Kind::Norm)
    ); // 2 kv heads * 48
    assert_eq!(o[&format!("{l}self_attn.k_proj.weight")].0, vec![96, 192]);
    assert_eq!(
        o[&format!("{l}mlp.experts.15.gate_proj.weight")].0,
        vec![128, 192]
    );
    assert_eq!(o.len(), 3 + 3 * (2 + 4 + 2 + 1 + 16 * 3));

    let q = shapes("tiny-qwen2moe");
    assert_eq!(
        q[&format!("{l}self_attn.q_proj.bias")],
        (vec![256], Kind::Bias)
    );
    assert_eq!(q[&format!("{l}self_attn.k_proj.bias")].0, vec![128]);
    assert_eq!(q[&format!("{l}self_attn.v_proj.bias")].0, vec![128]);
    assert!(!q.contains_key(&format!("{l}self_attn.o_proj.bias")));
    assert_eq!(q[&format!("{l}mlp.gate_proj.weight")].0, vec![320, 256]); // layer 0 is dense
    let s = "model.layers.1.mlp.";
    assert_eq!(q[&format!("{s}gate.weight")], (vec![12, 256], Kind::Router));
    assert_eq!(
        q[&format!("{s}shared_expert_gate.weight")],
        (vec![1, 256], Kind::Router)
    );
    assert_eq!(
        q[&format!("{s}shared_expert.gate_proj.weight")].0,
        vec![192, 256]
    );
    assert_eq!(
        q[&format!("{s}shared_expert.down_proj.weight")].0,
        vec![256, 192]
    );
    assert_eq!(
        q[&format!("{s}experts.11.down_proj.weight")].0,
        vec![256, 128]
    );
    let (dense, sparse) = (2 + 4 + 3 + 3, 2 + 4 + 3 + 1 + 12 * 3 + 3 + 1);
    assert_eq!(q.len(), 3 + 2 * dense + 2 * sparse);
}

#[test]
fn family_reference_meta() {
    for name in names() {
        let spec = spec(&name);
        let meta = reference(&name).meta;
        let mt = spec.config["model_type"].as_str().unwrap();
        if mt == "qwen3_moe" {
            continue;
        }
        assert_eq!(meta.model_type.as_deref(), Some(mt));
        assert!(meta.router.is_some());
        let sw = meta
            .sliding_window_applied
            .as_ref()
            .expect("sliding_window_applied");
        let longest = spec.prompts.iter().map(|p| p.len).max().unwrap();
        match mt {
            "mixtral" => {
                let w = spec.config["sliding_window"].as_u64().unwrap() as usize;
                assert!(w < longest, "{name}: the window must be exercised");
                assert_eq!(sw["applied"], Value::Bool(true));
                assert_eq!(sw["keys_per_query_last"].as_u64(), Some(w as u64));
                assert!(sw["effect_max_abs_logprob"].as_f64().unwrap() > 0.1);
            }
            "olmoe" => {
                assert_eq!(sw["applied"], Value::Bool(false));
                let c = meta.clipped_elements.as_ref().expect("clipped_elements");
                assert_eq!(c["clip_qkv"], spec.config["clip_qkv"]);
                for k in ["q", "k", "v"] {
                    assert!(
                        c["clipped"][k].as_u64().unwrap() > 0,
                        "{name}: nothing clipped in {k}"
                    );
                }
                assert!(c["effect_max_abs_logprob"].as_f64().unwrap() > 0.1);
            }
            "qwen2_moe" => {
                assert_eq!(sw["applied"], Value::Bool(false));
                assert!(spec.config["sliding_window"].as_u64().unwrap() < longest as u64);
                assert!(meta.shared_expert_gate.is_some());
                assert!(meta.qkv_bias_effect_max_abs_logprob.unwrap() > 0.1);
            }
            _ => panic!("{name}: unexpected model_type {mt}"),
        }
    }
}

#[test]
fn every_family_has_a_fixture() {
    for f in FAMILIES {
        assert!(
            !names_of(&[f.model_type]).is_empty(),
            "no {} fixture",
            f.model_type
        );
    }
    assert_eq!(
        names_of(&["qwen3_moe"]),
        ["tiny-tied", "tiny-dense-mix", "tiny-yarn"]
    );
    assert_eq!(model_type("tiny-olmoe"), "olmoe");
}
