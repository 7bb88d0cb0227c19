#!/usr/bin/env bash
# A build against another on the lent GPU machine, in one call: `smoe bench decode` on the
# Qwen3-30B-A3B q4 synthetic vault (dense tensors q4 too), resident (tg128, pp512) and streamed
# at --expert-cache 25 %, the two builds alternating (A B B A) so drift hits both alike.
#
#   scripts/ab-bench.sh pack OLD           # here: packs OLD as A (a smoe binary, or a git revision
#                                          # built in a scratch worktree), target/release/smoe as B
#   # device tool: carry [".gl", ".dev/ab.tar.xz"], run `bash scripts/ab-bench.sh run`
#
# Prints one line per run (decode and prefill tok/s: median, min, max) and keeps the JSON and
# logs under $OUT.
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-}
if [ "$mode" = pack ]; then
    old=${2:?usage: $0 pack OLD_SMOE_OR_REV}
    source scripts/device-debs.sh
    if [ ! -f "$old" ]; then
        # A revision: built in a scratch worktree, sharing this tree's target folder (the
        # dependencies are built once; the workspace's crates apart, by their path).
        rev=$(git rev-parse --verify "$old^{commit}")
        wt=/tmp/smoe-ab-$rev
        [ -d "$wt" ] || git worktree add -q --detach "$wt" "$rev"
        (cd "$wt" && cargo build --release -p smoe-cli --target-dir "$OLDPWD/target/ab-old")
        old=target/ab-old/release/smoe
    fi
    cargo build --release -p smoe-cli
    rm -rf .dev/ab && mkdir -p .dev/ab
    cp "$old" .dev/ab/smoe-a
    cp target/release/smoe .dev/ab/smoe-b
    strip .dev/ab/*
    tar cf - .dev/ab | xz -T2 --lzma2=preset=6,dict=192MiB > .dev/ab.tar.xz
    ls -la .dev/ab.tar.xz
elif [ "$mode" = run ]; then
    for f in .gl/*.deb; do dpkg -x "$f" /; done
    ldconfig >/dev/null 2>&1 || true
    export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
    export __EGL_VENDOR_LIBRARY_FILENAMES=/usr/local/nvidia/share/glvnd/egl_vendor.d/10_nvidia.json
    export SMOE_REQUIRE_GPU=1
    xz -dc .dev/ab.tar.xz | tar xf -
    OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
    q=/tmp/q30q4.smoe
    [ -e $q ] || .dev/ab/smoe-b synth --preset qwen3-30b-a3b --quant q4 --scout q4 -o $q 2>&1 | tail -1
    .dev/ab/smoe-b info 2>&1 | head -3
    resident="--tg 128 --pp 512 --reps 3 --backend gpu --json"
    streamed="--tg 64 --pp 512 --reps 2 --backend gpu --json --expert-cache 25% --no-profile"
    for ab in a b b a; do
        .dev/ab/smoe-$ab bench decode -m $q $resident > "$OUT/res_$ab.$$.$RANDOM.json" 2>>"$OUT/res_$ab.err"
    done
    for ab in a b b a; do
        .dev/ab/smoe-$ab bench decode -m $q $streamed > "$OUT/s25_$ab.$$.$RANDOM.json" 2>>"$OUT/s25_$ab.err"
    done
    python3 - "$OUT" <<'PY'
import glob, json, os, sys
out = sys.argv[1]
for f in sorted(glob.glob(out + '/*.json'), key=os.path.getmtime):
    try:
        d = json.load(open(f))
    except Exception as e:
        print(os.path.basename(f), 'no JSON:', e)
        continue
    t, p = d['decode_tok_per_s'], d.get('prefill_tok_per_s') or {}
    name = os.path.basename(f).split('.')[0]
    print(f"{name:6s} decode {t['median']:8.1f} ({t['min']:.1f}-{t['max']:.1f})  "
          f"prefill {p.get('median', 0):8.1f} ({p.get('min', 0):.1f}-{p.get('max', 0):.1f})")
PY
    for f in "$OUT"/*.err; do echo "== $f"; grep -i 'error\|warn' "$f" | sort | uniq -c | head -5; done
else
    echo "usage: $0 pack OLD_SMOE_OR_REV | run" >&2
    exit 2
fi
