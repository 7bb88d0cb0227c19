#!/usr/bin/env python3
"""Corpus, split and tokenizer for smoe's demo model (see docs/demo-model.md).

Runs on the development machine (no GPU, no torch): needs `apt-get`, `dpkg-deb`, numpy and the
`tokenizers` library.

    python3 scripts/demo_model/prepare.py [--work tmp/demo_model]

1. Fetches Debian's `python3.11-doc` package (the Python 3.11 documentation, PSF License) with
   `apt-get download` and reads the reStructuredText sources it ships under html/_sources.
2. Turns each source file (one document) into plain-ish text: roles, directives, labels and
   section underlines are rewritten or dropped; prose, examples and tables stay.
3. Splits by document: a document is held out when sha256(its path) mod 20 == 0 (about 5 %).
4. Trains a byte-level BPE tokenizer (Qwen2-style pre-tokenizer, 8192 ids including the three
   specials) on the training documents only, and writes tokenizer.json, tokenizer_config.json
   (ChatML chat template) and generation_config.json.
5. Tokenizes into WORK/device/ (what train.py reads on the device): train.npy and heldout.npy
   (uint16, each document followed by <|endoftext|>), the three tokenizer files and corpus.json;
   and writes the committed held-out slice tests/fixtures/demo/heldout.txt (about 40 KB taken
   from the held-out documents).
"""

import argparse
import glob
import hashlib
import json
import os
import re
import subprocess
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = "python3.11-doc"
PACKAGE_VERSION = "3.11.2-6+deb12u9"
SOURCES = "usr/share/doc/python3.11/html/_sources"
HELDOUT_MOD = 20
VOCAB_SIZE = 8192
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
SLICE_PATH = os.path.join(ROOT, "tests", "fixtures", "demo", "heldout.txt")
SLICE_BYTES = 40_000
SLICE_PER_DOC = 4_000

# Qwen2/Qwen3's pre-tokenizer split (as in tokenizer.json of the Qwen3 checkpoints).
QWEN_PRETOKENIZE = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# ------------------------------------------------------------------------------------------------
# corpus


def fetch(work):
    deb = os.path.join(work, f"{PACKAGE}_{PACKAGE_VERSION.replace(':', '%3a')}_all.deb")
    if not os.path.exists(deb):
        subprocess.run(["apt-get", "download", f"{PACKAGE}={PACKAGE_VERSION}"], cwd=work, check=True)
    root = os.path.join(work, "deb")
    if not os.path.isdir(os.path.join(root, SOURCES)):
        subprocess.run(["dpkg-deb", "-x", deb, root], check=True)
    return root


# Directives whose whole block (line + indented body) is dropped.
DROP_BLOCK = {
    "index", "toctree", "testsetup", "testcleanup", "include", "literalinclude", "image", "figure",
    "tabularcolumns", "only", "contents", "raw", "sectionauthor", "moduleauthor", "highlight",
    "currentmodule", "module", "audit-event", "productionlist", "program", "default-role",
}
# Directives replaced by their argument (API signatures and the like); the body stays.
SIGNATURE = {
    "function", "method", "attribute", "data", "class", "exception", "decorator", "classmethod",
    "staticmethod", "coroutinemethod", "coroutinefunction", "abstractmethod", "awaitablefunction",
    "opcode", "cmdoption", "envvar", "describe", "object", "pdbcommand", "option", "c:function",
    "c:type", "c:member", "c:macro", "c:var", "c:struct", "c:data",
}
# Directives replaced by a lead-in word.
LEAD = {
    "note": "Note:", "warning": "Warning:", "seealso": "See also:", "important": "Important:",
    "caution": "Caution:", "impl-detail": "CPython implementation detail:", "attention": "Attention:",
    "hint": "Hint:", "tip": "Tip:", "versionadded": "New in version {}.",
    "versionchanged": "Changed in version {}:", "deprecated": "Deprecated since version {}:",
    "deprecated-removed": "Deprecated since version {}:", "availability": "Availability: {}",
    "rubric": "{}", "topic": "{}", "sidebar": "{}",
}

DIRECTIVE = re.compile(r"^(\s*)\.\.\s+([A-Za-z:-]+)::\s*(.*)$")
ROLE = re.compile(r":[A-Za-z:+-]+:`([^`]+)`")
LINK = re.compile(r"`([^`<]+?)\s*<[^>]+>`__?")
REF = re.compile(r"`([^`]+)`__?")
LITERAL = re.compile(r"``(.+?)``")
SUBST = re.compile(r"\|(version|release|today)\|")
UNDERLINE = re.compile(r"^\s*([=\-~^*#+\"'`.:_])\1{2,}\s*$")
TABLE_RULE = re.compile(r"^\s*[=+\-| ]*[=+\-]{3,}[=+\-| ]*$")
OPTION_LINE = re.compile(r"^\s+:[A-Za-z -]+:(\s.*)?$")


def role_text(m):
    t = m.group(1)
    t = re.sub(r"\s*<[^>]*>$", "", t) if "<" in t and t.endswith(">") and not t.startswith("<") else t
    t = t.lstrip("!")
    if t.startswith("~"):
        t = t[1:].split(".")[-1]
    return t


def inline(line):
    line = ROLE.sub(role_text, line)
    line = LITERAL.sub(lambda m: m.group(1), line)
    line = LINK.sub(lambda m: m.group(1), line)
    line = REF.sub(lambda m: m.group(1), line)
    line = SUBST.sub("3.11", line)
    return line


def indent_of(line):
    return len(line) - len(line.lstrip(" "))


def clean(text):
    """reST source → text. Line-based; good enough for a language-model corpus."""
    out = []
    lines = text.replace("\t", "    ").split("\n")
    i = 0
    while i < len(lines):
        line = lines[i]
        m = DIRECTIVE.match(line)
        if m:
            ind, name, arg = len(m.group(1)), m.group(2), m.group(3).strip()
            body_start = i + 1
            # options directly under the directive line
            while body_start < len(lines) and OPTION_LINE.match(lines[body_start]):
                body_start += 1
            if name in DROP_BLOCK:
                j = body_start
                while j < len(lines) and (not lines[j].strip() or indent_of(lines[j]) > ind):
                    j += 1
                i = j
                continue
            if name in SIGNATURE:
                out.append(" " * ind + inline(arg))
            elif name in LEAD:
                fmt = LEAD[name]
                lead = fmt.format(inline(arg)) if "{}" in fmt else (fmt + (" " + inline(arg) if arg else ""))
                if lead.strip():
                    out.append(" " * ind + lead.strip())
            # other directives (code-block, doctest, testcode, list-table, ...): drop the line only
            i = body_start
            continue
        stripped = line.strip()
        if stripped.startswith(".. "):
            # labels (.. _x:), substitutions, footnotes and comments: drop with any indented body
            ind = indent_of(line)
            j = i + 1
            while j < len(lines) and (not lines[j].strip() or indent_of(lines[j]) > ind):
                if not lines[j].strip() and j + 1 < len(lines) and lines[j + 1].strip() and indent_of(lines[j + 1]) <= ind:
                    break
                j += 1
            i = j
            continue
        if stripped == "..":
            i += 1
            continue
        if UNDERLINE.match(line) or (TABLE_RULE.match(line) and set(stripped) <= set("=+-| ")):
            i += 1
            continue
        out.append(inline(line).rstrip())
        i += 1
    text = inline("\n".join(out))  # roles and literals that span lines
    text = re.sub(r"::\n", ":\n", text)  # "For example::" → "For example:"
    text = re.sub(r"\n\s*:\n", "\n", text)  # a lone "::" line
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip() + "\n"


def documents(root):
    base = os.path.join(root, SOURCES)
    paths = sorted(glob.glob(os.path.join(base, "**", "*.rst.txt"), recursive=True))
    docs = []
    for p in paths:
        rel = os.path.relpath(p, base)
        with open(p, encoding="utf-8") as f:
            t = clean(f.read())
        if len(t) >= 200:
            docs.append((rel, t))
    return docs


def is_heldout(rel):
    return int(hashlib.sha256(rel.encode()).hexdigest(), 16) % HELDOUT_MOD == 0


def slice_text(heldout_docs):
    """Up to SLICE_PER_DOC characters (whole paragraphs) from each held-out document in turn."""
    parts, total = [], 0
    for _, t in heldout_docs:
        paras, piece = t.split("\n\n"), []
        n = 0
        for p in paras:
            if n + len(p) > SLICE_PER_DOC and piece:
                break
            piece.append(p)
            n += len(p) + 2
        chunk = "\n\n".join(piece).strip()
        if total + len(chunk.encode()) > SLICE_BYTES:
            break
        parts.append(chunk)
        total += len(chunk.encode()) + 2
    return "\n\n".join(parts) + "\n"


# ------------------------------------------------------------------------------------------------
# tokenizer


def train_tokenizer(texts, outdir):
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
    n_bpe = VOCAB_SIZE - len(SPECIALS)
    trainer = trainers.BpeTrainer(
        vocab_size=n_bpe,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(texts, trainer=trainer)
    assert tok.get_vocab_size() == n_bpe, tok.get_vocab_size()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    assert tok.get_vocab_size() == VOCAB_SIZE
    ids = {t: tok.token_to_id(t) for t in SPECIALS}
    os.makedirs(outdir, exist_ok=True)
    tok.save(os.path.join(outdir, "tokenizer.json"), pretty=False)
    tok_cfg = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(ids[t]): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                          "single_word": False, "special": True}
            for t in SPECIALS
        },
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|endoftext|>",
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
        "eos_token_id": [ids["<|endoftext|>"], ids["<|im_end|>"]],
        "pad_token_id": ids["<|endoftext|>"],
        "temperature": 0.7,
        "top_k": 40,
        "top_p": 0.9,
        "repetition_penalty": 1.1,
    }
    for name, obj in [("tokenizer_config.json", tok_cfg), ("generation_config.json", gen_cfg)]:
        with open(os.path.join(outdir, name), "w") as f:
            json.dump(obj, f, indent=2, sort_keys=True)
            f.write("\n")
    return tok, ids


def write_device_inputs(work, tok_dir, tr, he, info):
    """WORK/device: what the training call on the device needs (carried there, see train.py)."""
    dev = os.path.join(work, "device")
    os.makedirs(dev, exist_ok=True)
    np.save(os.path.join(dev, "train.npy"), tr)
    np.save(os.path.join(dev, "heldout.npy"), he)
    for name in ["tokenizer.json", "tokenizer_config.json", "generation_config.json"]:
        with open(os.path.join(tok_dir, name), "rb") as src, open(os.path.join(dev, name), "wb") as dst:
            dst.write(src.read())
    with open(os.path.join(dev, "corpus.json"), "w") as f:
        json.dump(info, f, indent=2)


def encode_docs(tok, docs, eot):
    out = []
    encs = tok.encode_batch_fast([t for _, t in docs], add_special_tokens=False)
    for e in encs:
        out.extend(e.ids)
        out.append(eot)
    return np.asarray(out, dtype=np.uint16)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default=os.path.join(ROOT, "tmp", "demo_model"))
    a = ap.parse_args()
    os.makedirs(a.work, exist_ok=True)
    root = fetch(a.work)
    docs = documents(root)
    train = [d for d in docs if not is_heldout(d[0])]
    held = [d for d in docs if is_heldout(d[0])]
    tok, ids = train_tokenizer([t for _, t in train], os.path.join(a.work, "tokenizer"))
    tr = encode_docs(tok, train, ids["<|endoftext|>"])
    he = encode_docs(tok, held, ids["<|endoftext|>"])
    with open(os.path.join(a.work, "corpus_train.txt"), "w") as f:
        f.write("\n<|endoftext|>\n".join(t for _, t in train))
    with open(os.path.join(a.work, "corpus_heldout.txt"), "w") as f:
        f.write("\n<|endoftext|>\n".join(t for _, t in held))
    os.makedirs(os.path.dirname(SLICE_PATH), exist_ok=True)
    sl = slice_text(held)
    with open(SLICE_PATH, "w") as f:
        f.write(sl)
    slice_ids = tok.encode(sl, add_special_tokens=False).ids
    info = {
        "package": PACKAGE,
        "package_version": PACKAGE_VERSION,
        "documents": len(docs),
        "train_documents": len(train),
        "heldout_documents": [r for r, _ in held],
        "train_chars": sum(len(t) for _, t in train),
        "heldout_chars": sum(len(t) for _, t in held),
        "train_tokens": int(tr.size),
        "heldout_tokens": int(he.size),
        "slice_bytes": len(sl.encode()),
        "slice_tokens": len(slice_ids),
        "special_ids": ids,
    }
    write_device_inputs(a.work, os.path.join(a.work, "tokenizer"), tr, he, info)
    print(json.dumps({k: v for k, v in info.items() if k != "heldout_documents"}, indent=2))
    print("held out:", ", ".join(r for r, _ in held))


if __name__ == "__main__":
    sys.exit(main())
