#!/usr/bin/env python3
"""Tiny random MoE checkpoints (Qwen3-MoE, Mixtral, OLMoE, Qwen2-MoE) for smoe's tests, and their
transformers reference outputs.

The checkpoints are generated deterministically with integer-only arithmetic; the Rust crate
`crates/smoe-fixtures` generates byte-identical files (see tests/fixtures/README.md for the rules).

Commands:
  python scripts/fixtures.py write NAME DIR       write checkpoint NAME into DIR (needs numpy)
  python scripts/fixtures.py hash [NAME...]       print the sha256 of every file of each checkpoint
  python scripts/fixtures.py reference OUTDIR     transformers reference outputs, OUTDIR/NAME.json
                                                  (needs torch + transformers; CPU, float32, eager)
                                                  and OUTDIR/tokenizer-reference.json (copy it to
                                                  tests/fixtures/tokenizer/reference.json)
  python scripts/fixtures.py tokenizer            (re)train tests/fixtures/tokenizer/{tokenizer.json,
                                                  tokenizer_config.json,generation_config.json}
  python scripts/fixtures.py tokenizer-reference PATH   encodings + chat renderings only
"""

import datetime
import hashlib
import json
import os
import re
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(ROOT, "tests", "fixtures")
TOKENIZER_DIR = os.path.join(FIXTURES, "tokenizer")
TOKENIZER_FILES = ["generation_config.json", "tokenizer.json", "tokenizer_config.json"]

MASK64 = (1 << 64) - 1


# ----------------------------------------------------------------------------------------------
# integer arithmetic


def splitmix64(x):
    """splitmix64 of a Python int (mod 2^64)."""
    z = (x + 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def splitmix64_np(x):
    """splitmix64 of a uint64 array (numpy array arithmetic wraps mod 2^64)."""
    with np.errstate(over="ignore"):
        z = x + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def fnv1a64(data: bytes) -> int:
    h = 0xCBF29CE484222325
    for b in data:
        h ^= b
        h = (h * 0x100000001B3) & MASK64
    return h


def tensor_bytes_k(name: str, seed: int, n: int):
    """k_i = splitmix64(s + i) >> 56 for i in 0..n, s = fnv1a64(name) ^ seed."""
    s = fnv1a64(name.encode()) ^ (seed & MASK64)
    with np.errstate(over="ignore"):
        x = np.uint64(s) + np.arange(n, dtype=np.uint64)
    return (splitmix64_np(x) >> np.uint64(56)).astype(np.int32)


def scale_exponent(fan_in: int) -> int:
    """e such that 2^e = 2^round_half_up(log2(sqrt(3 / fan_in))), in integers only.

    round_half_up(x) = floor(x + 1/2) and x + 1/2 = log2(6 / fan_in) / 2, so
    e = floor(floor(log2(6 / fan_in)) / 2) = floor(-c / 2) where c = ceil(log2(fan_in / 6)) is the
    smallest integer with 6 * 2^c >= fan_in (fan_in > 6, so c >= 1)."""
    assert fan_in > 6
    c = 0
    while 6 * (1 << c) < fan_in:
        c += 1
    return (-c) // 2  # Python's // is floor division


def prompt_tokens(seed: int, n: int, vocab: int):
    return [splitmix64((seed + i) & MASK64) % vocab for i in range(n)]


# ----------------------------------------------------------------------------------------------
# specs and tensors


def load_specs():
    with open(os.path.join(FIXTURES, "specs.json")) as f:
        return json.load(f)


def get_spec(name):
    specs = load_specs()
    for s in specs["fixtures"]:
        if s["name"] == name:
            return s
    raise SystemExit(f"unknown fixture {name!r}; known: {[s['name'] for s in specs['fixtures']]}")


def num_experts(cfg):
    return cfg["num_experts"] if "num_experts" in cfg else cfg["num_local_experts"]


# What differs between the MoE families, as far as the checkpoint's tensors go (transformers 5.17's
# modeling_{qwen3_moe,mixtral,olmoe,qwen2_moe}.py):
#   moe:            the sparse block's module name in the hub checkpoint
#   experts:        the names of an expert's gate (silu), up and down projections
#   expert_width:   the config key of an expert's intermediate size
#   qk_norm:        None | "head" (RMSNorm over each head's head_dim) | "projection" (RMSNorm over the
#                   whole q projection, [num_heads*head_dim], and k projection, [num_kv_heads*head_dim])
#   qkv_bias:       q/k/v projections carry a bias (Qwen2-MoE: config.qkv_bias, default true; o_proj never)
#   shared_expert:  a shared expert MLP (shared_expert_intermediate_size) and its sigmoid gate [1, H]
#   dense_layers:   layers can be dense (mlp_only_layers, decoder_sparse_step); else every layer is sparse
FAMILIES = {
    "qwen3_moe": dict(
        moe="mlp", experts=("gate_proj", "up_proj", "down_proj"), expert_width="moe_intermediate_size",
        qk_norm="head", qkv_bias=False, shared_expert=False, dense_layers=True,
    ),
    "mixtral": dict(
        moe="block_sparse_moe", experts=("w1", "w3", "w2"), expert_width="intermediate_size",
        qk_norm=None, qkv_bias=False, shared_expert=False, dense_layers=False,
    ),
    "olmoe": dict(
        moe="mlp", experts=("gate_proj", "up_proj", "down_proj"), expert_width="intermediate_size",
        qk_norm="projection", qkv_bias=False, shared_expert=False, dense_layers=False,
    ),
    "qwen2_moe": dict(
        moe="mlp", experts=("gate_proj", "up_proj", "down_proj"), expert_width="moe_intermediate_size",
        qk_norm=None, qkv_bias=True, shared_expert=True, dense_layers=True,
    ),
}


def family(cfg):
    mt = cfg["model_type"]
    if mt not in FAMILIES:
        raise SystemExit(f"unsupported model_type {mt!r}; known: {sorted(FAMILIES)}")
    fam = FAMILIES[mt]
    if cfg.get("attention_bias"):
        raise SystemExit(f"{mt}: attention_bias true is not generated")
    if mt == "qwen2_moe":
        fam = dict(fam, qkv_bias=cfg.get("qkv_bias", True))
    return fam


def head_dim(cfg):
    return cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]


def layer_is_sparse(cfg, layer):
    """Qwen-MoE's rule (not in mlp_only_layers, (layer+1) % decoder_sparse_step == 0); Mixtral and
    OLMoE have only sparse layers."""
    if not family(cfg)["dense_layers"]:
        return True
    mlp_only = cfg.get("mlp_only_layers") or []
    step = cfg.get("decoder_sparse_step", 1)
    return layer not in mlp_only and num_experts(cfg) > 0 and (layer + 1) % step == 0


def mlp_tensors(p, h, width, names=("gate_proj", "up_proj", "down_proj")):
    gate, up, down = names
    return [
        (p + gate + ".weight", [width, h], "matrix"),
        (p + up + ".weight", [width, h], "matrix"),
        (p + down + ".weight", [h, width], "matrix"),
    ]


def tensor_list(cfg):
    """[(name, shape, kind)] sorted by name; kind: embed | matrix | router | lm_head | norm | bias."""
    fam = family(cfg)
    h = cfg["hidden_size"]
    hd = head_dim(cfg)
    nh = cfg["num_attention_heads"]
    nkv = cfg["num_key_value_heads"]
    v = cfg["vocab_size"]
    tied = cfg.get("tie_word_embeddings", False)
    # A tied embedding is also the LM head, so it follows lm_head's rule: with scale 1 the self term
    # e_t . e_t dominates the logits and the model only copies its input token.
    out = [("model.embed_tokens.weight", [v, h], "lm_head" if tied else "embed"), ("model.norm.weight", [h], "norm")]
    if not tied:
        out.append(("lm_head.weight", [v, h], "lm_head"))
    for L in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{L}."
        out += [
            (p + "input_layernorm.weight", [h], "norm"),
            (p + "post_attention_layernorm.weight", [h], "norm"),
            (p + "self_attn.q_proj.weight", [nh * hd, h], "matrix"),
            (p + "self_attn.k_proj.weight", [nkv * hd, h], "matrix"),
            (p + "self_attn.v_proj.weight", [nkv * hd, h], "matrix"),
            (p + "self_attn.o_proj.weight", [h, nh * hd], "matrix"),
        ]
        if fam["qkv_bias"]:
            out += [
                (p + "self_attn.q_proj.bias", [nh * hd], "bias"),
                (p + "self_attn.k_proj.bias", [nkv * hd], "bias"),
                (p + "self_attn.v_proj.bias", [nkv * hd], "bias"),
            ]
        if fam["qk_norm"] == "head":
            out += [(p + "self_attn.q_norm.weight", [hd], "norm"), (p + "self_attn.k_norm.weight", [hd], "norm")]
        elif fam["qk_norm"] == "projection":
            out += [
                (p + "self_attn.q_norm.weight", [nh * hd], "norm"),
                (p + "self_attn.k_norm.weight", [nkv * hd], "norm"),
            ]
        if layer_is_sparse(cfg, L):
            m = p + fam["moe"] + "."
            width = cfg[fam["expert_width"]]
            out.append((m + "gate.weight", [num_experts(cfg), h], "router"))
            for E in range(num_experts(cfg)):
                out += mlp_tensors(f"{m}experts.{E}.", h, width, fam["experts"])
            if fam["shared_expert"]:
                out += mlp_tensors(m + "shared_expert.", h, cfg["shared_expert_intermediate_size"])
                # the shared expert's sigmoid gate follows the router rule (matrix scale * 4)
                out.append((m + "shared_expert_gate.weight", [1, h], "router"))
        else:
            out += mlp_tensors(p + "mlp.", h, cfg["intermediate_size"])
    out.sort(key=lambda t: t[0].encode())
    names = [t[0] for t in out]
    assert len(set(names)) == len(names), "duplicate tensor name"
    assert all((kind == "bias") == n.endswith(".bias") for n, _, kind in out)
    return out


def tensor_values(name, shape, kind, seed):
    """float32 values (all exactly representable in bf16 and f16)."""
    n = int(np.prod(shape))
    k = tensor_bytes_k(name, seed, n)
    if kind == "norm":
        vals = (((k >> 4) + 24).astype(np.float32)) / np.float32(32.0)  # 1 + ((k>>4) - 8) / 32
    elif kind == "bias":
        vals = (((k >> 4) - 8).astype(np.float32)) / np.float32(64.0)  # ((k>>4) - 8) / 64
    else:
        e = 0 if kind == "embed" else scale_exponent(shape[1])
        if kind in ("router", "lm_head"):
            e += 2  # scale * 4
        vals = (k - 128).astype(np.float32) * np.float32(2.0 ** (e - 7))  # (k-128)/128 * 2^e
    return vals.reshape(shape)


DTYPES = {"bf16": ("BF16", 2), "f16": ("F16", 2), "f32": ("F32", 4)}


def encode(vals, dtype):
    if dtype == "bf16":
        bits = vals.astype("<f4").view("<u4")
        assert not np.any(bits & 0xFFFF), "value not exactly representable in bf16"
        return (bits >> 16).astype("<u2").tobytes()
    if dtype == "f16":
        h = vals.astype("<f2")
        assert np.array_equal(h.astype(np.float32), vals), "value not exactly representable in f16"
        return h.tobytes()
    if dtype == "f32":
        return vals.astype("<f4").tobytes()
    raise ValueError(dtype)


# ----------------------------------------------------------------------------------------------
# file formats


def canonical_json(obj) -> bytes:
    """The one JSON text format of every generated .json file (the Rust crate emulates it)."""
    return (json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=True) + "\n").encode()


def safetensors_bytes(entries, dtype):
    """entries: [(name, shape, data bytes)] already sorted by name."""
    st_dtype, _ = DTYPES[dtype]
    parts = ['{"__metadata__":{"format":"pt"}']
    off = 0
    for name, shape, data in entries:
        dims = ",".join(str(d) for d in shape)
        parts.append(f'"{name}":{{"dtype":"{st_dtype}","shape":[{dims}],"data_offsets":[{off},{off + len(data)}]}}')
        off += len(data)
    header = (",".join(parts) + "}").encode()
    header += b" " * ((8 - len(header) % 8) % 8)
    return len(header).to_bytes(8, "little") + header + b"".join(d for _, _, d in entries)


def shard_file_name(i, shards):
    return "model.safetensors" if shards == 1 else f"model-{i + 1:05d}-of-{shards:05d}.safetensors"


def checkpoint_files(spec):
    """{file name: bytes} of the whole checkpoint."""
    cfg = spec["config"]
    dtype = spec["dtype"]
    shards = spec["shards"]
    _, width = DTYPES[dtype]
    tensors = tensor_list(cfg)
    sizes = [int(np.prod(shape)) * width for _, shape, _ in tensors]
    total = sum(sizes)
    files = {"config.json": canonical_json(cfg)}
    for f in TOKENIZER_FILES:
        with open(os.path.join(TOKENIZER_DIR, f), "rb") as fh:
            files[f] = fh.read()
    groups = [[] for _ in range(shards)]
    before = 0
    for (name, shape, kind), size in zip(tensors, sizes):
        shard = min(shards - 1, before * shards // total)
        groups[shard].append((name, shape, encode(tensor_values(name, shape, kind, spec["seed"]), dtype)))
        before += size
    weight_map = {}
    for i, entries in enumerate(groups):
        assert entries, "empty shard"
        fname = shard_file_name(i, shards)
        files[fname] = safetensors_bytes(entries, dtype)
        for name, _, _ in entries:
            weight_map[name] = fname
    if shards > 1:
        files["model.safetensors.index.json"] = canonical_json(
            {"metadata": {"total_size": total}, "weight_map": weight_map}
        )
    return files


def write_checkpoint(name, directory):
    os.makedirs(directory, exist_ok=True)
    files = checkpoint_files(get_spec(name))
    for fname, data in files.items():
        with open(os.path.join(directory, fname), "wb") as f:
            f.write(data)
    return files


def sha256_files(files):
    return {f: hashlib.sha256(d).hexdigest() for f, d in sorted(files.items())}


# ----------------------------------------------------------------------------------------------
# reference outputs (transformers)


def r6(x):
    v = round(float(x), 6)
    return 0.0 if v == 0 else v


EXPERT_RE = re.compile(
    r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight"
)


def loaded_tensor(sd, tname, cfg):
    """The loaded model's copy of hub tensor `tname`: transformers 5 fuses each sparse layer's
    experts into `mlp.experts.gate_up_proj` [E, 2*I, H] (gate rows first, then up) and
    `mlp.experts.down_proj` [E, H, I], and renames Mixtral's `block_sparse_moe.` to `mlp.`."""
    m = EXPERT_RE.fullmatch(tname)
    if m:
        L, E, proj = int(m[1]), int(m[2]), m[3]
        width = cfg[family(cfg)["expert_width"]]
        if proj in ("down_proj", "w2"):
            return f"model.layers.{L}.mlp.experts.down_proj", sd[f"model.layers.{L}.mlp.experts.down_proj"][E]
        key = f"model.layers.{L}.mlp.experts.gate_up_proj"
        gu = sd[key][E]
        return key, (gu[:width] if proj in ("gate_proj", "w1") else gu[width:])
    key = tname.replace(".block_sparse_moe.", ".mlp.")
    return key, sd[key]


ROUTER = {
    # read off transformers 5.17's *TopKRouter.forward; the softmax runs in float32
    "mixtral": lambda cfg: "softmax over all experts, top-k of the probabilities, divided by their sum "
    "(= softmax over the top-k logits); no norm_topk_prob option",
    "olmoe": lambda cfg: "softmax over all experts, top-k of the probabilities"
    + (", divided by their sum" if cfg.get("norm_topk_prob") else ", not renormalised (norm_topk_prob false)"),
    "qwen2_moe": lambda cfg: "softmax over all experts, top-k of the probabilities"
    + (", divided by their sum" if cfg.get("norm_topk_prob") else ", not renormalised (norm_topk_prob false)")
    + "; plus sigmoid(shared_expert_gate . x) * shared_expert(x)",
    "qwen3_moe": lambda cfg: "softmax over all experts, top-k of the probabilities"
    + (", divided by their sum" if cfg.get("norm_topk_prob") else ", not renormalised (norm_topk_prob false)"),
}


def attention_pattern(model, ids):
    """Per layer, the keys each query attended to (probability > 0), from eager attention's
    probabilities; returns the distinct patterns as sets of (query, key)."""
    import torch

    with torch.no_grad():
        out = model(torch.tensor([ids], dtype=torch.long), use_cache=False, output_attentions=True)
    patterns = []
    for att in out.attentions:  # [1, heads, q, k]
        visible = (att[0] > 0).all(dim=0)
        assert torch.equal(visible, (att[0] > 0).any(dim=0)), "heads differ in their mask"
        patterns.append(visible)
    return patterns


def reference(outdir):
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    os.makedirs(outdir, exist_ok=True)
    specs = load_specs()
    vocab_tok = specs["tokenizer_vocab"]
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    only = os.environ.get("FIXTURES_ONLY")  # comma-separated names, for quick runs
    for spec in specs["fixtures"]:
        name = spec["name"]
        if only and name not in only.split(","):
            continue
        cfg = spec["config"]
        mt = cfg["model_type"]
        with tempfile.TemporaryDirectory() as d:
            files = write_checkpoint(name, d)
            model, info = AutoModelForCausalLM.from_pretrained(
                d,
                dtype=torch.float32,
                attn_implementation="eager",
                experts_implementation="eager",
                output_loading_info=True,
            )
        model.eval()
        print(f"== {name}: {type(model).__name__}, loading info {info}")
        for key in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
            assert not info.get(key), f"{name}: {key} = {info.get(key)}"
        assert type(model).__name__ == cfg["architectures"][0], type(model).__name__
        mcfg = model.config
        assert mcfg.num_experts == num_experts(cfg), (mcfg.num_experts, num_experts(cfg))

        # every generated tensor arrived unchanged, and every parameter came from one of them
        sd = model.state_dict()
        checked = 0
        covered = set()
        for tname, shape, kind in tensor_list(cfg):
            want = torch.from_numpy(tensor_values(tname, shape, kind, spec["seed"]))
            key, got = loaded_tensor(sd, tname, cfg)
            assert torch.equal(got, want), f"{name}: {tname} differs after loading"
            covered.add(key)
            checked += 1
        if cfg.get("tie_word_embeddings"):
            assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
            covered.add("lm_head.weight")
        assert covered == set(sd), f"{name}: parameters not covered: {set(sd) - covered}"
        print(f"   {checked} tensors identical after loading; all {len(sd)} parameters covered")

        # dense and sparse layers where expected
        layers = []
        for L, layer in enumerate(model.model.layers):
            cls = type(layer.mlp).__name__
            kind = "sparse" if cls.endswith("SparseMoeBlock") else "dense"
            assert kind == "sparse" or cls.endswith("MLP"), cls
            expect = "sparse" if layer_is_sparse(cfg, L) else "dense"
            assert kind == expect, f"{name}: layer {L} is {kind}, expected {expect}"
            layers.append(kind)
        print(f"   layers: {layers}")

        rot = model.model.rotary_emb
        rope_type = rot.rope_type
        inv_freq = rot.inv_freq.detach().double().tolist()
        scaling = float(rot.attention_scaling)
        print(f"   rope_type {rope_type}, attention_scaling {scaling!r}, head_dim {2 * len(inv_freq)}")
        print(f"   inv_freq {[float(f'{x:.6g}') for x in inv_freq]}")
        expected_rope = (cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}).get("rope_type", "default")
        assert rope_type == expected_rope, (rope_type, expected_rope)
        assert 2 * len(inv_freq) == head_dim(cfg)

        def forward(ids):
            with torch.no_grad():
                out = model(torch.tensor([ids], dtype=torch.long), use_cache=False)
            return out.logits[0].double()

        prompt_ids = [prompt_tokens(p["seed"], p["len"], vocab_tok) for p in spec["prompts"]]
        longest = max(prompt_ids, key=len)

        def effect(change, restore):
            """max |Δ log-prob| of the prompts' tokens when a feature is switched off."""
            base = [torch.log_softmax(forward(ids), -1) for ids in prompt_ids]
            change()
            try:
                alt = [torch.log_softmax(forward(ids), -1) for ids in prompt_ids]
            finally:
                restore()
            worst = 0.0
            for ids, a, b in zip(prompt_ids, base, alt):
                t = torch.tensor(ids[1:])
                worst = max(worst, float((a[:-1].gather(1, t[:, None]) - b[:-1].gather(1, t[:, None])).abs().max()))
            return r6(worst)

        extra = {"model_type": mt, "router": ROUTER[mt](cfg)}
        # The attention mask each layer really used: with eager attention a masked key gets
        # probability exactly 0.
        n = len(longest)
        window = getattr(mcfg, "sliding_window", None)
        pats = attention_pattern(model, longest)
        qi = torch.arange(n)[:, None]
        kj = torch.arange(n)[None, :]
        causal = kj <= qi
        per_layer = []
        for L, vis in enumerate(pats):
            if torch.equal(vis, causal):
                per_layer.append("causal")
            elif window and torch.equal(vis, causal & (kj > qi - window)):
                per_layer.append(f"sliding {window}")
            else:
                raise AssertionError(f"{name}: layer {L} attention pattern is neither causal nor the window")
        applied = any(x != "causal" for x in per_layer)
        sw = {
            "config_sliding_window": cfg.get("sliding_window"),
            "config_use_sliding_window": cfg.get("use_sliding_window"),
            "applied": applied,
            "layers": per_layer,
            "checked_on_prompt_len": n,
        }
        if applied:
            sw["rule"] = f"query i attends key j iff i - {window} < j <= i ({window} keys including itself)"
            sw["keys_per_query_last"] = int(pats[0][-1].sum())
            saved = mcfg.sliding_window
            sw["effect_max_abs_logprob"] = effect(lambda: setattr(mcfg, "sliding_window", None),
                                                  lambda: setattr(mcfg, "sliding_window", saved))
        elif mt == "qwen2_moe" and cfg.get("sliding_window"):
            # use_sliding_window false: transformers ignores sliding_window. How much an engine that
            # applied it anyway would be off (the window switched on for every layer):
            saved = (mcfg.sliding_window, list(mcfg.layer_types))

            def on():
                mcfg.sliding_window = cfg["sliding_window"]
                mcfg.layer_types = ["sliding_attention"] * len(saved[1])

            def off():
                mcfg.sliding_window, mcfg.layer_types = saved[0], saved[1]

            sw["effect_if_applied_max_abs_logprob"] = effect(on, off)
        extra["sliding_window_applied"] = sw
        print(f"   sliding window: {sw}")

        if mt == "olmoe" and cfg.get("clip_qkv") is not None:
            clip = cfg["clip_qkv"]
            counts = {"q": 0, "k": 0, "v": 0}
            totals = {"q": 0, "k": 0, "v": 0}
            hooks = []

            def counter(which):
                def hook(mod, inp, out):  # runs before the in-place clamp_
                    counts[which] += int((out.abs() > clip).sum())
                    totals[which] += out.numel()
                return hook

            for layer in model.model.layers:
                a = layer.self_attn
                hooks += [a.q_norm.register_forward_hook(counter("q")), a.k_norm.register_forward_hook(counter("k")),
                          a.v_proj.register_forward_hook(counter("v"))]
            for ids in prompt_ids:
                forward(ids)
            for hk in hooks:
                hk.remove()
            extra["clipped_elements"] = {
                "clip_qkv": clip,
                "where": "q after q_norm, k after k_norm, v after v_proj; before the head split and RoPE",
                "counted_over": "both prompts, all layers (one forward pass each)",
                "clipped": counts,
                "total": totals,
                "effect_max_abs_logprob": effect(lambda: setattr(mcfg, "clip_qkv", None),
                                                 lambda: setattr(mcfg, "clip_qkv", clip)),
            }
            print(f"   clip_qkv: {extra['clipped_elements']}")

        if family(cfg)["shared_expert"]:
            gates = []
            hooks = [
                layer.mlp.shared_expert_gate.register_forward_hook(lambda m, i, o: gates.append(torch.sigmoid(o).flatten()))
                for layer in model.model.layers
                if hasattr(layer.mlp, "shared_expert_gate")
            ]
            for ids in prompt_ids:
                forward(ids)
            for hk in hooks:
                hk.remove()
            g = torch.cat(gates)
            extra["shared_expert_gate"] = {"sigmoid_min": r6(g.min()), "sigmoid_max": r6(g.max()), "sigmoid_mean": r6(g.mean())}

            def no_shared():
                for layer in model.model.layers:
                    if hasattr(layer.mlp, "shared_expert_gate"):
                        layer.mlp.shared_expert.down_proj.weight.data.mul_(0)

            saved = {L: layer.mlp.shared_expert.down_proj.weight.data.clone()
                     for L, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "shared_expert")}

            def restore():
                for L, w in saved.items():
                    model.model.layers[L].mlp.shared_expert.down_proj.weight.data.copy_(w)

            extra["shared_expert_gate"]["effect_max_abs_logprob"] = effect(no_shared, restore)
            print(f"   shared expert gate: {extra['shared_expert_gate']}")
        if family(cfg)["qkv_bias"]:
            def zero_bias():
                for layer in model.model.layers:
                    for proj in ("q_proj", "k_proj", "v_proj"):
                        getattr(layer.self_attn, proj).bias.data.mul_(0)
            saved_b = {(L, proj): getattr(layer.self_attn, proj).bias.data.clone()
                       for L, layer in enumerate(model.model.layers) for proj in ("q_proj", "k_proj", "v_proj")}

            def restore_b():
                for (L, proj), b in saved_b.items():
                    getattr(model.model.layers[L].self_attn, proj).bias.data.copy_(b)

            extra["qkv_bias_effect_max_abs_logprob"] = effect(zero_bias, restore_b)
            print(f"   qkv bias effect: {extra['qkv_bias_effect_max_abs_logprob']}")

        prompts = []
        for p, ids in zip(spec["prompts"], prompt_ids):
            logits = forward(ids)
            lp = torch.log_softmax(logits, dim=-1)
            top2 = torch.topk(logits, 2, dim=-1)
            entry = {
                "seed": p["seed"],
                "prompt": ids,
                "logprobs": [r6(lp[i, ids[i + 1]]) for i in range(len(ids) - 1)],
                "argmax": [int(t) for t in top2.indices[:, 0]],
                "margin": [r6(top2.values[i, 0] - top2.values[i, 1]) for i in range(len(ids))],
            }
            seq = list(ids)
            gtok, gmar = [], []
            for _ in range(32):
                last = forward(seq)[-1]
                t2 = torch.topk(last, 2)
                tok = int(t2.indices[0])
                gtok.append(tok)
                gmar.append(r6(t2.values[0] - t2.values[1]))
                seq.append(tok)
            assert gtok[0] == entry["argmax"][-1]
            entry["greedy"] = {"tokens": gtok, "margins": gmar}
            prompts.append(entry)
            small = sorted(entry["margin"])[:3]
            print(
                f"   prompt seed {p['seed']} len {len(ids)}: smallest margins {small}, "
                f"min greedy margin {min(gmar):.4f}, mean logprob {sum(entry['logprobs']) / (len(ids) - 1):.3f}, "
                f"distinct argmax {len(set(entry['argmax']))}"
            )
            print(f"   greedy {gtok}")

        hashes = sha256_files(files)
        meta = {
            "fixture": name,
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "date": date,
            "dtype_computed": "float32",
            "device": "cpu",
            "attn_implementation": "eager",
            "experts_implementation": "eager",
            "config_sha256": hashes["config.json"],
            "weights_sha256": {f: h for f, h in hashes.items() if f.endswith(".safetensors")},
            "files_sha256": hashes,
            "layers": layers,
            "rope": {"rope_type": rope_type, "attention_scaling": scaling, "inv_freq": inv_freq},
        }
        if mt != "qwen3_moe":
            # (the Qwen3-MoE references predate these fields; they are kept byte-identical)
            meta.update(extra)
        ref = {"meta": meta, "prompts": prompts}
        with open(os.path.join(outdir, f"{name}.json"), "w") as f:
            json.dump(ref, f, separators=(",", ":"))
            f.write("\n")
        print(f"   wrote {name}.json")

    if not only:
        tokenizer_reference(os.path.join(outdir, "tokenizer-reference.json"))


# ----------------------------------------------------------------------------------------------
# tokenizer

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ADDED = ["<tool_call>", "</tool_call>", "<think>", "</think>"]
# Qwen2/Qwen3's pre-tokenization regex.
QWEN_PRETOKENIZE = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

CHAT_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == "user" or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set content = message.content if message.content is string else '' %}
        {%- if '</think>' in content %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {{- '<|im_start|>assistant\\n' + content }}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""


def tokenizer_corpus():
    """Docstrings of CPython's pure-Python standard library modules (PSF License), in file order."""
    import ast
    import sysconfig

    stdlib = sysconfig.get_paths()["stdlib"]
    texts = []
    for fname in sorted(os.listdir(stdlib)):
        if not fname.endswith(".py"):
            continue
        try:
            with open(os.path.join(stdlib, fname), encoding="utf-8") as f:
                tree = ast.parse(f.read())
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc:
                    texts.append(doc)
    return texts


def train_tokenizer():
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from tokenizers import processors, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_PRETOKENIZE), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    n_bpe = 1000 - len(SPECIALS) - len(ADDED)
    trainer = trainers.BpeTrainer(
        vocab_size=n_bpe,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    texts = tokenizer_corpus()
    tok.train_from_iterator(texts, trainer=trainer)
    assert tok.get_vocab_size() == n_bpe, tok.get_vocab_size()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED])
    assert tok.get_vocab_size() == 1000
    ids = {t: tok.token_to_id(t) for t in SPECIALS + ADDED}
    assert ids["<|endoftext|>"] == 993 and ids["</think>"] == 999, ids
    os.makedirs(TOKENIZER_DIR, exist_ok=True)
    # compact (pretty=False) keeps it well under 100 KB
    tok.save(os.path.join(TOKENIZER_DIR, "tokenizer.json"), pretty=False)

    added_decoder = {}
    for t in SPECIALS + ADDED:
        added_decoder[str(ids[t])] = {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": t in SPECIALS,
        }
    tok_cfg = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added_decoder,
        "additional_special_tokens": SPECIALS,
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 2048,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    gen_cfg = {
        "bos_token_id": ids["<|endoftext|>"],
        "do_sample": True,
        "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        "pad_token_id": ids["<|endoftext|>"],
        "temperature": 0.7,
        "top_k": 20,
        "top_p": 0.8,
        "transformers_version": "4.51.0",
    }
    with open(os.path.join(TOKENIZER_DIR, "tokenizer_config.json"), "wb") as f:
        f.write(canonical_json(tok_cfg))
    with open(os.path.join(TOKENIZER_DIR, "generation_config.json"), "wb") as f:
        f.write(canonical_json(gen_cfg))
    print(f"corpus: {len(texts)} docstrings, {sum(len(t) for t in texts)} characters")
    print(f"special ids: {ids}")
    print(f"tokenizer.json: {os.path.getsize(os.path.join(TOKENIZER_DIR, 'tokenizer.json'))} bytes")


TOKENIZER_TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces, trailing spaces   ",
    "Numbers: 12345 and 3.14159; symbols: $%^&*()[]{}",
    "def f(x):\n    return x * 2\n\n\nprint(f(21))",
    "caf\u00e9 na\u00efve r\u00e9sum\u00e9 (precomposed) vs cafe\u0301 (decomposed)",
    "\u4f60\u597d\uff0c\u4e16\u754c \U0001f600 \u00fcber",
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\nok\n</think>\n\nHello<|im_end|>",
    "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>",
    "It's, we're, they'll, I'd, you've, I'M",
    "tabs\tand\r\nwindows line endings\r\n",
    "",
]

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "The city, e.g. Paris"}},
            "required": ["city"],
        },
    },
}

CHATS = [
    {"messages": [{"role": "user", "content": "Hello!"}], "add_generation_prompt": True},
    {
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "<think>\nAdd them.\n</think>\n\n4"},
            {"role": "user", "content": "And 3+3?"},
        ],
        "add_generation_prompt": True,
    },
    {
        "messages": [{"role": "user", "content": "Hi"}],
        "add_generation_prompt": True,
        "enable_thinking": False,
    },
    {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
                ],
            },
            {"role": "tool", "content": "{\"temp_c\": 21}"},
            {"role": "tool", "content": "sunny"},
        ],
        "tools": [WEATHER_TOOL],
        "add_generation_prompt": True,
    },
    {
        "messages": [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi there."}],
        "add_generation_prompt": False,
    },
]


def tokenizer_reference(path):
    """Encodings (tokenizers and transformers' AutoTokenizer) and chat template renderings."""
    import tokenizers
    import transformers
    from transformers import AutoTokenizer

    raw = tokenizers.Tokenizer.from_file(os.path.join(TOKENIZER_DIR, "tokenizer.json"))
    with tempfile.TemporaryDirectory() as d:
        for f in TOKENIZER_FILES:
            with open(os.path.join(TOKENIZER_DIR, f), "rb") as src, open(os.path.join(d, f), "wb") as dst:
                dst.write(src.read())
        hf = AutoTokenizer.from_pretrained(d)
    print(f"== tokenizer: {type(hf).__name__}, {len(hf)} tokens")
    encodings = []
    for text in TOKENIZER_TEXTS:
        ids = raw.encode(text, add_special_tokens=False).ids
        ids_hf = hf.encode(text, add_special_tokens=False)
        assert ids == ids_hf, (text, ids, ids_hf)
        dec = raw.decode(ids, skip_special_tokens=False)
        encodings.append({"text": text, "ids": ids, "decoded": dec})
    chats = []
    for chat in CHATS:
        kwargs = {k: v for k, v in chat.items() if k != "messages"}
        text = hf.apply_chat_template(chat["messages"], tokenize=False, **kwargs)
        ids = raw.encode(text, add_special_tokens=False).ids
        chats.append({**chat, "rendered": text, "ids": ids})
    ref = {
        "meta": {
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
            "tokenizer_class": type(hf).__name__,
            "tokenizer_sha256": hashlib.sha256(open(os.path.join(TOKENIZER_DIR, "tokenizer.json"), "rb").read()).hexdigest(),
        },
        "encodings": encodings,
        "chats": chats,
    }
    with open(path, "w") as f:
        json.dump(ref, f, indent=1, ensure_ascii=False)
        f.write("\n")
    print(f"   wrote {os.path.basename(path)}")


# ----------------------------------------------------------------------------------------------


def main(argv):
    if len(argv) >= 2 and argv[1] == "write" and len(argv) == 4:
        files = write_checkpoint(argv[2], argv[3])
        for f, d in files.items():
            print(f"{len(d):>10}  {f}")
    elif len(argv) >= 2 and argv[1] == "hash":
        names = argv[2:] or [s["name"] for s in load_specs()["fixtures"]]
        for name in names:
            for f, h in sha256_files(checkpoint_files(get_spec(name))).items():
                print(f"{h}  {name}/{f}")
    elif len(argv) == 3 and argv[1] == "reference":
        reference(argv[2])
    elif len(argv) == 2 and argv[1] == "tokenizer":
        train_tokenizer()
    elif len(argv) == 3 and argv[1] == "tokenizer-reference":
        tokenizer_reference(argv[2])
    else:
        print(__doc__)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
