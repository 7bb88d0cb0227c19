#!/usr/bin/env python3
"""Train smoe's demo model: a small Qwen3-MoE on the Python 3.11 documentation (docs/demo-model.md).

Runs on a CUDA machine with torch + transformers (5.x) + tokenizers + safetensors + numpy, on the
inputs that prepare.py wrote (train.npy, heldout.npy, tokenizer files):

    python3 scripts/demo_model/train.py --data tmp/demo_model/device --out OUTDIR
    python3 scripts/demo_model/train.py --smoke ...      # tiny sizes, seconds, every code path

What it does, in one process:
1. builds `Qwen3MoeForCausalLM` from the config below (random init, fp32 master weights);
2. trains with bf16 autocast, AdamW and a warmup + cosine schedule, for at most --time-budget
   seconds of loop time or --max-epochs passes over the training tokens, whichever ends first;
   evaluates the held-out loss every --eval-every steps and keeps the best weights;
3. rounds the weights to bf16 and writes a hub-style checkpoint: config.json, model.safetensors
   with the hub's per-expert names (model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight; the
   fused gate_up_proj [E, 2I, H] of transformers 5 is split: gate = rows [0, I), up = [I, 2I)),
   tokenizer files and generation_config.json;
4. reloads that checkpoint with `from_pretrained` and checks that its held-out loss equals the
   trained model's;
5. held-out perplexity of tests/fixtures/demo/heldout.txt with the windowing of `smoe perplexity`
   (non-overlapping windows of --ctx tokens, each scored on its own), in fp32 and in bf16;
6. greedy continuations of a few prompts (to compare with `smoe generate --temperature 0`).

Outputs: the checkpoint in --ckpt (default OUTDIR/checkpoint); OUTDIR/results.json (the numbers
above and the training curve); with --split (default 15 MiB), also OUTDIR/config.json and
OUTDIR/model.safetensors.partN, for transports with a file-size cap (`cat` the parts back).
"""

import argparse
import json
import math
import os
import shutil
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SLICE = os.path.join(ROOT, "tests", "fixtures", "demo", "heldout.txt")
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "generation_config.json"]

# Hub-style config.json (the spelling of Qwen/Qwen3-30B-A3B's); the model is built from it too.
MODEL = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "vocab_size": 8192,
    "hidden_size": 384,
    "num_hidden_layers": 6,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "intermediate_size": 768,  # unused: every layer is MoE (kept for configs that read it)
    "moe_intermediate_size": 192,
    "num_experts": 16,
    "num_experts_per_tok": 4,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "max_position_embeddings": 2048,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "use_sliding_window": False,
    "sliding_window": None,
    "max_window_layers": 6,
    "tie_word_embeddings": True,
    "initializer_range": 0.02,
    "router_aux_loss_coef": 0.001,
    "output_router_logits": False,
    "use_cache": True,
    "bos_token_id": 8189,
    "eos_token_id": 8189,
    "torch_dtype": "bfloat16",
}

SMOKE_MODEL = dict(
    MODEL,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
    intermediate_size=128,
    moe_intermediate_size=64,
    num_experts=4,
    num_experts_per_tok=2,
    max_window_layers=2,
)

PROMPTS = [
    "The Python standard library",
    "A list comprehension is",
    "To open a file for reading,",
    "Exceptions are",
]


def log(*a):
    print(*a, flush=True)


# ------------------------------------------------------------------------------------------------
# evaluation


def windows_of(ids, ctx):
    """`smoe perplexity`'s windows: ids.chunks(ctx), keeping those of at least 2 tokens."""
    return [ids[i : i + ctx] for i in range(0, len(ids), ctx) if len(ids[i : i + ctx]) >= 2]


@torch.no_grad()
def score(model, ids, ctx, dtype, batch=64, autocast=False):
    """Sum of NLL (nats) and count over tokens 1..len of each window; windows scored independently.

    dtype: the dtype the logits are computed in (model weights must already be in it unless
    autocast, which runs an fp32 model under bf16 autocast as in training)."""
    was_training = model.training
    model.eval()
    dev = next(model.parameters()).device
    ws = windows_of(list(ids), ctx)
    full = [w for w in ws if len(w) == ctx]
    rest = [w for w in ws if len(w) != ctx]
    total, count = 0.0, 0
    groups = [full[i : i + batch] for i in range(0, len(full), batch)] + [[w] for w in rest]
    for g in groups:
        x = torch.tensor(g, dtype=torch.long, device=dev)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast and dev.type == "cuda"):
            logits = model(input_ids=x).logits
        lp = F.cross_entropy(
            logits[:, :-1].float().reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum"
        )
        total += lp.item()
        count += x.shape[0] * (x.shape[1] - 1)
    model.train(was_training)
    return total, count


def ppl_of(total, count):
    return {"nll": total / count, "perplexity": math.exp(total / count), "tokens": count}


@torch.no_grad()
def greedy(model, ids, n):
    model.eval()
    dev = next(model.parameters()).device
    x = torch.tensor([ids], dtype=torch.long, device=dev)
    out = []
    for _ in range(n):
        nxt = int(model(input_ids=x).logits[0, -1].float().argmax())
        out.append(nxt)
        x = torch.cat([x, torch.tensor([[nxt]], device=dev)], dim=1)
    return out


# ------------------------------------------------------------------------------------------------
# checkpoint


def hub_state_dict(model, cfg):
    """transformers-5 parameter names → the hub's, bf16, experts split per expert."""
    I = cfg["moe_intermediate_size"]
    out = {}
    for name, t in model.state_dict().items():
        t = t.detach()
        if name == "lm_head.weight" and cfg["tie_word_embeddings"]:
            continue
        if name.endswith("mlp.experts.gate_up_proj"):
            p = name[: -len("gate_up_proj")]
            E, twoI, H = t.shape
            assert twoI == 2 * I, (name, t.shape)
            for e in range(E):
                out[f"{p}{e}.gate_proj.weight"] = t[e, :I, :]
                out[f"{p}{e}.up_proj.weight"] = t[e, I:, :]
            continue
        if name.endswith("mlp.experts.down_proj"):
            p = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{p}{e}.down_proj.weight"] = t[e]
            continue
        out[name] = t
    return {k: v.to(torch.bfloat16).contiguous().cpu() for k, v in out.items()}


def expected_names(cfg):
    """The tensors `smoe convert` expects (crates/smoe-vault/src/import/hf.rs)."""
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if not cfg["tie_word_embeddings"]:
        names.add("lm_head.weight")
    for l in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{l}"
        names |= {f"{p}.{n}.weight" for n in [
            "input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
            "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm", "self_attn.k_norm", "mlp.gate"]}
        for e in range(cfg["num_experts"]):
            names |= {f"{p}.mlp.experts.{e}.{n}.weight" for n in ["gate_proj", "up_proj", "down_proj"]}
    return names


def save_checkpoint(model, cfg, data_dir, ck_dir):
    from safetensors.torch import save_file
    import transformers

    os.makedirs(ck_dir, exist_ok=True)
    sd = hub_state_dict(model, cfg)
    exp = expected_names(cfg)
    assert set(sd) == exp, (sorted(set(sd) - exp)[:5], sorted(exp - set(sd))[:5])
    save_file(sd, os.path.join(ck_dir, "model.safetensors"), metadata={"format": "pt"})
    c = dict(cfg)
    c["transformers_version"] = transformers.__version__
    with open(os.path.join(ck_dir, "config.json"), "w") as f:
        json.dump(c, f, indent=2)
        f.write("\n")
    for name in TOKENIZER_FILES:
        shutil.copy(os.path.join(data_dir, name), os.path.join(ck_dir, name))
    return sum(v.numel() for v in sd.values())


# ------------------------------------------------------------------------------------------------
# training


def lr_at(step, progress, a):
    if step < a.warmup:
        return a.lr * (step + 1) / a.warmup
    p = min(max(progress, 0.0), 1.0)
    return a.min_lr + 0.5 * (a.lr - a.min_lr) * (1 + math.cos(math.pi * p))


def param_groups(model, wd):
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}]


def pick_experts_impl(model, batch_fn, dev):
    """Time a few training steps with each experts implementation; keep the fastest that works."""
    if dev.type != "cuda":
        model.set_experts_implementation("eager")
        return "eager", {}
    timings = {}
    for impl in ["grouped_mm", "eager"]:
        try:
            model.set_experts_implementation(impl)
            for i in range(6):
                if i == 2:
                    torch.cuda.synchronize()
                    t = time.time()
                x = batch_fn()
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = model(input_ids=x, labels=x, output_router_logits=True).loss
                loss.backward()
            torch.cuda.synchronize()
            timings[impl] = (time.time() - t) / 4
            if not math.isfinite(loss.item()):
                raise RuntimeError(f"loss {loss.item()}")
        except Exception as e:  # noqa: BLE001 - any failure just rules the implementation out
            log(f"experts implementation {impl}: failed: {type(e).__name__}: {str(e)[:300]}")
        finally:
            model.zero_grad(set_to_none=True)
    assert timings, "no experts implementation works"
    best = min(timings, key=timings.get)
    model.set_experts_implementation(best)
    log(f"experts implementation: {best} (s/step: {json.dumps({k: round(v, 4) for k, v in timings.items()})})")
    return best, timings


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=os.path.join(ROOT, "tmp", "demo_model", "device"))
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(ROOT, "tmp", "demo_model", "out"))
    ap.add_argument("--ckpt", help="checkpoint directory (default OUT/checkpoint)")
    ap.add_argument("--smoke", action="store_true", help="tiny model, a few seconds: exercises every path")
    ap.add_argument("--time-budget", type=float, default=300.0, help="seconds of training loop")
    ap.add_argument("--max-epochs", type=float, default=8.0)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1.5e-3)
    ap.add_argument("--min-lr", type=float, default=1.5e-4)
    ap.add_argument("--warmup", type=int, default=60)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--log-every", type=int, default=20)
    ap.add_argument("--ctx", type=int, default=512, help="window of the perplexity evaluations")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--split", type=int, default=15 * 1024 * 1024, help="part size for model.safetensors (0: none)")
    a = ap.parse_args()

    from tokenizers import Tokenizer
    import transformers
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = SMOKE_MODEL if a.smoke else MODEL
    if a.smoke:
        a.time_budget, a.max_epochs, a.eval_every, a.log_every = min(a.time_budget, 8.0), 0.05, 5, 2
        a.batch, a.seq_len, a.warmup = 4, 64, 2
    torch.manual_seed(a.seed)
    np.random.seed(a.seed)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    os.makedirs(a.out, exist_ok=True)
    log(f"torch {torch.__version__}, transformers {transformers.__version__}, device {dev}"
        + (f" ({torch.cuda.get_device_name()})" if dev.type == "cuda" else ""))

    train = torch.from_numpy(np.load(os.path.join(a.data, "train.npy")).astype(np.int64)).to(dev)
    held = np.load(os.path.join(a.data, "heldout.npy")).astype(np.int64).tolist()
    if a.smoke:
        held = held[:2000]
    n_train = train.numel()
    log(f"train tokens {n_train}, held-out tokens {len(held)}")

    hf_cfg = Qwen3MoeConfig(**{k: v for k, v in cfg.items() if k not in ("architectures", "torch_dtype")})
    model = Qwen3MoeForCausalLM(hf_cfg).to(dev)
    attn = model.model.layers[0].self_attn
    assert attn.head_dim == cfg["head_dim"], attn.head_dim
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr(), "embeddings not tied"
    n_params = sum(p.numel() for p in model.parameters())
    log(f"parameters: {n_params} ({n_params * 2 / 1e6:.1f} MB in bf16)")

    L = a.seq_len
    gen = torch.Generator(device=dev)
    gen.manual_seed(a.seed)

    def batch_fn():
        starts = torch.randint(0, n_train - L - 1, (a.batch,), device=dev, generator=gen)
        return train[starts[:, None] + torch.arange(L, device=dev)[None, :]]

    impl, impl_timings = pick_experts_impl(model, batch_fn, dev)
    opt = torch.optim.AdamW(
        param_groups(model, a.weight_decay), lr=a.lr, betas=(0.9, 0.95), eps=1e-8,
        fused=dev.type == "cuda",
    )
    max_tokens = a.max_epochs * n_train
    curve, best = [], {"loss": float("inf"), "step": -1, "state": None}
    step, tokens, acc_loss, acc_aux, acc_n = 0, 0, 0.0, 0.0, 0
    t_start = time.time()
    t_log, tok_log = t_start, 0
    model.train()

    def evaluate():
        s, c = score(model, held, a.seq_len, torch.bfloat16, autocast=True)
        loss = s / c
        if loss < best["loss"]:
            best.update(loss=loss, step=step, state={k: v.detach().clone() for k, v in model.state_dict().items()})
        return loss

    while True:
        elapsed = time.time() - t_start
        progress = max(elapsed / a.time_budget, tokens / max_tokens)
        if progress >= 1.0:
            break
        lr = lr_at(step, progress, a)
        for g in opt.param_groups:
            g["lr"] = lr
        x = batch_fn()
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            out = model(input_ids=x, labels=x, output_router_logits=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        tokens += x.numel()
        aux = out.aux_loss.detach().float() if out.aux_loss is not None else torch.zeros((), device=dev)
        acc_loss += (out.loss.detach().float() - cfg["router_aux_loss_coef"] * aux)
        acc_aux += aux
        acc_n += 1
        if step % a.log_every == 0 or step % a.eval_every == 0:
            now = time.time()
            row = {
                "step": step,
                "tokens": tokens,
                "epoch": round(tokens / n_train, 3),
                "time_s": round(now - t_start, 1),
                "lr": lr,
                "train_loss": (acc_loss / acc_n).item(),
                "aux_loss": (acc_aux / acc_n).item(),
                "tok_per_s": round((tokens - tok_log) / (now - t_log)),
            }
            acc_loss, acc_aux, acc_n = 0.0, 0.0, 0
            if step % a.eval_every == 0:
                row["heldout_loss"] = evaluate()
            t_log, tok_log = time.time(), tokens
            curve.append(row)
            log(json.dumps(row))
    train_time = time.time() - t_start
    row = {"step": step, "tokens": tokens, "epoch": round(tokens / n_train, 3), "time_s": round(train_time, 1),
           "heldout_loss": evaluate()}
    curve.append(row)
    log(json.dumps(row))
    log(f"training: {step} steps, {tokens} tokens, {train_time:.1f} s; best held-out loss {best['loss']:.4f} at step {best['step']}")
    model.load_state_dict(best["state"])
    del best["state"]

    # ---- bf16-rounded weights: what the checkpoint holds
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    model.set_experts_implementation("eager")
    held_fp32 = ppl_of(*score(model, held, a.ctx, torch.float32))
    log(f"held-out (bf16-rounded weights, fp32 compute, ctx {a.ctx}): {held_fp32}")

    ck = a.ckpt or os.path.join(a.out, "checkpoint")
    n_saved = save_checkpoint(model, cfg, a.data, ck)
    log(f"checkpoint: {ck} ({n_saved} parameters)")
    results = {
        "smoke": a.smoke,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
        "config": cfg,
        "parameters": n_params,
        "args": vars(a),
        "experts_implementation": impl,
        "experts_impl_s_per_step": impl_timings,
        "train_tokens": n_train,
        "heldout_tokens": len(held),
        "steps": step,
        "tokens_seen": tokens,
        "epochs": tokens / n_train,
        "train_time_s": train_time,
        "best_step": best["step"],
        "best_heldout_loss_bf16_autocast": best["loss"],
        "heldout_after_bf16_rounding_fp32": held_fp32,
        "curve": curve,
        "errors": [],
    }

    def write_results():
        with open(os.path.join(a.out, "results.json"), "w") as f:
            json.dump(results, f, indent=2)

    write_results()
    if a.split:  # first, so that the checkpoint comes back whatever happens below
        shutil.copy(os.path.join(ck, "config.json"), os.path.join(a.out, "config.json"))
        with open(os.path.join(ck, "model.safetensors"), "rb") as f:
            i = 0
            while chunk := f.read(a.split):
                with open(os.path.join(a.out, f"model.safetensors.part{i}"), "wb") as g:
                    g.write(chunk)
                i += 1

    def stage(name, fn):
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - record, keep going: the run is not repeatable cheaply
            import traceback

            traceback.print_exc()
            results["errors"].append(f"{name}: {type(e).__name__}: {e}")
            write_results()
            return None

    # ---- reload and compare
    del opt
    state = {}

    def reload():
        re_model, info = Qwen3MoeForCausalLM.from_pretrained(ck, dtype=torch.float32, output_loading_info=True)
        re_model = re_model.to(dev)
        re_model.set_experts_implementation("eager")
        info = {k: [str(x) for x in v] for k, v in info.items()}
        log(f"from_pretrained loading info: { {k: v[:5] for k, v in info.items()} }")
        re_fp32 = ppl_of(*score(re_model, held, a.ctx, torch.float32))
        log(f"held-out after reload (fp32): {re_fp32}")
        diff = abs(re_fp32["nll"] - held_fp32["nll"])
        with torch.no_grad():
            x = torch.tensor([held[: a.ctx]], device=dev)
            logit_diff = (re_model(input_ids=x).logits - model(input_ids=x).logits).abs().max().item()
        ok = diff < 1e-4 and not info.get("unexpected_keys") and not [
            k for k in info.get("missing_keys", []) if k != "lm_head.weight"]
        log(f"reload check: |Δ held-out nll| = {diff:.3g}, max |Δ logit| = {logit_diff:.3g}: {'OK' if ok else 'MISMATCH'}")
        results["reload"] = {"heldout": re_fp32, "abs_nll_diff": diff, "max_abs_logit_diff": logit_diff,
                             "loading_info": info, "ok": ok}
        state["model"] = re_model

    stage("reload", reload)
    if "model" not in state:  # fall back to the trained model (same weights) for the numbers below
        state["model"] = model
    m = state["model"]
    m.set_experts_implementation("eager")

    # ---- perplexity of the committed slice, smoe's windowing; greedy samples
    tok = Tokenizer.from_file(os.path.join(ck, "tokenizer.json"))
    with open(SLICE, encoding="utf-8") as f:
        slice_ids = tok.encode(f.read(), add_special_tokens=False).ids
    results["slice"] = {"file": os.path.relpath(SLICE, ROOT), "tokens": len(slice_ids), "perplexity": {}}
    results["heldout"] = {}
    ctxs = sorted({a.ctx, 256})

    def ppl(kind, dtype):
        results["slice"]["perplexity"][kind] = {str(c): ppl_of(*score(m, slice_ids, c, dtype)) for c in ctxs}
        results["heldout"][kind] = ppl_of(*score(m, held, a.ctx, dtype))
        log(f"{kind}: slice {json.dumps(results['slice']['perplexity'][kind])}; held-out {json.dumps(results['heldout'][kind])}")

    stage("ppl fp32", lambda: ppl("fp32", torch.float32))

    def samples():
        results["greedy"] = []
        for p in PROMPTS:
            ids = tok.encode(p, add_special_tokens=False).ids
            g = greedy(m, ids, 8 if a.smoke else 60)
            results["greedy"].append({"prompt": p, "prompt_ids": ids, "greedy_ids": g,
                                      "text": tok.decode(g, skip_special_tokens=False)})
            log(f"greedy fp32: {p!r} -> {results['greedy'][-1]['text']!r}")

    stage("greedy", samples)
    m.to(torch.bfloat16)
    stage("ppl bf16", lambda: ppl("bf16", torch.bfloat16))
    write_results()
    log("done")


if __name__ == "__main__":
    sys.exit(main())
