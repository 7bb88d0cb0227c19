#!/usr/bin/env bash
# On the lent GPU machine: how deep should the streaming lookahead guess? One device session
# synthesizes the q4 30B-A3B vault, records its routing at 100 %, then at 25 % and 50 % budgets
# runs, alternating, the default (one MoE layer ahead), SMOE_LOOKAHEAD_DEPTH=4 with and without
# SMOE_LOOKAHEAD_TOP=4, and the routing oracle (perfect guesses four layers ahead), then prints
# a few lines per run (tok/s, ratio to the I/O bound, MiB read and needed per token, recalls;
# then where the passes' time went, the disk's idle time, and busy × precise × speed).
#
#   scripts/device-pack.sh     # here; then with the device tool, carry
#                              # [".gl", ".dev/pack.tar.xz", ".dev/device.sh"] and run
#   bash .dev/device.sh "LIMIT=300 bash scripts/lookahead-measure.sh [NAME=ENV ...]"
#
# A variant can run another build: pack its `smoe` as an extra directory
# (`scripts/device-pack.sh .dev/base`) and name it `base=PATH=\$PWD/.dev/base:\$PATH`.
# VAULT and PRESET (default /tmp/q.smoe, qwen3-30b-a3b) pick the vault to synthesize; LIMIT
# (seconds, default 300) stops starting runs, so partial results come back; everything
# goes to $OUT/lookahead.txt (raw JSON) and $OUT/summary.txt. See docs/performance.md ("How
# predictable is this vault's routing?").
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export SMOE_REQUIRE_GPU=1
T0=$(date +%s)
el() { echo $(($(date +%s) - T0)); }
raw=$OUT/lookahead.txt
q=${VAULT:-/tmp/q.smoe}
[ -e $q ] || smoe synth --preset ${PRESET:-qwen3-30b-a3b} --quant q4 --scout q4 -o $q 2>&1 | tail -1 >>"$raw"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >>"$raw" 2>&1
A="--tg 64 --pp 0 --reps 1 --no-profile --backend gpu --stats --json"
SMOE_ROUTE_TRACE=record:/tmp/trace smoe bench decode -m $q $A --expert-cache 100% >/dev/null 2>&1
one() {
    local name=$1
    shift
    [ "$(el)" -gt "${LIMIT:-300}" ] && return
    echo "=== $name t=$(el)" >>"$raw"
    "$@" >>"$raw" 2>/tmp/err || tail -3 /tmp/err >>"$raw"
}
B="smoe bench decode -m $q $A --expert-cache"
# Variants: NAME=ENV (space-separated VAR=VALUE pairs, may be empty), run alternating twice per
# budget (BUDGETS, default "25 50"); the default list is the deep-lookahead comparison.
[ $# -gt 0 ] || set -- default= depth4=SMOE_LOOKAHEAD_DEPTH=4 \
    "depth4_top4=SMOE_LOOKAHEAD_DEPTH=4 SMOE_LOOKAHEAD_TOP=4" oracle4=SMOE_ROUTE_TRACE=replay:/tmp/trace:4
for round in 1 2; do
    for b in ${BUDGETS:-25 50}; do
        for v in "$@"; do
            one "${v%%=*}_$b" env ${v#*=} $B $b%
        done
    done
done
python3 - "$raw" >"$OUT/summary.txt" <<'PY'
import json, re, sys
text = open(sys.argv[1]).read()
for block in re.split(r'^=== ', text, flags=re.M)[1:]:
    name, _, rest = block.partition('\n')
    m = re.search(r'^\{.*\}$', rest, re.M)
    if not m:
        print(name, '| no result |', rest[:200].replace('\n', ' '))
        continue
    d = json.loads(m.group(0))
    f = lambda x: 'n/a' if x is None else f'{x:.3f}'
    mib = 2 ** 20
    print(f"{name:22s} tok/s {d['decode_tok_per_s']['median']:6.2f}  ÷ I/O bound {f(d['decode_over_io_bound'])}"
          f"  disk {f(d['disk_direct_read_gb_per_s'])} GB/s  read {d['read_bytes_per_token'] / mib:6.1f}"
          f" needed {d['miss_bytes_per_token'] / mib:6.1f} MiB/token  lookahead recall {f(d['lookahead_recall'])}"
          f"  speculative recall {f(d['speculative_recall'])}  hit rate {d['hit_rate']:.3f}"
          f"  stops {d['vram_slots']['stops']}  fill {d['vram_slots']['fill_s']:.2f} s"
          f"  guessed reads {d['lookahead_reads']} ({d['lookahead_unused']} unused,"
          f" {d.get('lookahead_dropped', 'n/a')} dropped)")
    # Where the passes' time went (s): reads waited for, whole blobs copied into slots, slot
    # buffers mapped and unmapped, the GPU waited for at the stops, all passes.
    v = d['vram_slots']
    print(f"{'':22s} io wait {d['io_wait_s']:.2f}  upload {v['upload_s']:.2f}  map {v.get('map_s', float('nan')):.2f}"
          f"  gpu wait {v['gpu_wait_s']:.2f}  passes {v['pass_s']:.2f}  reads {d['read_gb_per_s']:.2f} GB/s"
          f"  placed ahead {v.get('placed_ahead', 0)} ({v.get('ahead_s', 0):.2f} s)")
    # The disk's idle time (no read in flight) in the passes, their GPU waits and their fills.
    i = v.get('disk_idle')
    if i:
        print(f"{'':22s} disk idle {i['pass_s']:.2f} (in GPU waits {i['gpu_wait_s']:.2f}, fills {i['fill_s']:.2f},"
              f" elsewhere {i['pass_s'] - i['gpu_wait_s'] - i['fill_s']:.2f})")
    # The share of the bound as busy × precise × speed (the bench's own split).
    k = d.get('io_bound_factors')
    if k:
        print(f"{'':22s} = busy {k['busy']:.3f} × precise {k['precise']:.3f} × speed {k['speed']:.3f}"
              f" ({d.get('read_depth') or 0:.2f} reads in flight while busy)")
PY
cat "$OUT/summary.txt"
echo "done in $(el) s"
