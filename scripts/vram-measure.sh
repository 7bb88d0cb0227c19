#!/usr/bin/env bash
# On the lent GPU machine: --vram-cache below --expert-cache (a host cache behind fewer VRAM
# slots) against --expert-cache alone, then the VRAM slots with all but ~9 GiB of the GPU held
# by another process (torch), with and without --vram-cache. Writes JSON and logs under $OUT
# and prints a line per run. docs/performance.md, "VRAM slots apart from the host cache".
#
#   scripts/device-pack.sh     # here; then with the device tool, carry
#                              # [".gl", ".dev/pack.tar.xz", ".dev/device.sh"] and run
#   bash .dev/device.sh "bash scripts/vram-measure.sh"
set -u
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
export SMOE_REQUIRE_GPU=1
q=/tmp/q.smoe
[ -e $q ] || smoe synth --preset qwen3-30b-a3b --quant q4 --scout q4 -o $q 2>&1 | tail -1
A="--tg 64 --pp 0 --reps 3 --no-profile --backend gpu --stats --json"
for i in 1 2; do
  smoe bench decode -m $q $A --expert-cache 25% > $OUT/c25_$i.json 2>$OUT/c25_$i.err
  smoe bench decode -m $q $A --expert-cache 100% --vram-cache 25% > $OUT/h100v25_$i.json 2>$OUT/h100v25_$i.err
done
B="smoe bench decode -m $q --tg 32 --pp 0 --reps 2 --no-profile --backend gpu --stats --json"
$B --expert-cache 100% > $OUT/free_auto.json 2>$OUT/free_auto.err
python3 -c "
import torch, time
free, total = torch.cuda.mem_get_info()
x = torch.empty(free - (9 << 30), dtype=torch.uint8, device='cuda')
print('held', x.numel() >> 30, 'GiB of', total >> 30, flush=True)
time.sleep(150)
" > $OUT/hog.txt 2>&1 &
sleep 20
nvidia-smi --query-gpu=memory.used,memory.total --format=csv >> $OUT/hog.txt
$B --expert-cache 100% > $OUT/hog_auto.json 2>$OUT/hog_auto.err
$B --expert-cache 100% --vram-cache 100% > $OUT/hog_explicit.json 2>$OUT/hog_explicit.err
$B --expert-cache 100% --vram-cache 25% > $OUT/hog_v25.json 2>$OUT/hog_v25.err
kill %1 2>/dev/null
python3 - <<'PY'
import json, glob, os
out = os.environ.get('OUT', '/tmp/out')
for f in sorted(glob.glob(out + '/*.json')):
    try:
        d = json.load(open(f))
    except Exception as e:
        print(os.path.basename(f), 'no JSON', e); continue
    v = d.get('vram_slots') or {}
    t = d['decode_tok_per_s']
    print(f"{os.path.basename(f):18s} tok/s median {t['median']:.2f} min {t['min']:.2f} max {t['max']:.2f}  slots {v.get('slots')} ({(v.get('slot_bytes') or 0)/2**30:.2f} GiB)  VRAM hit rate {v.get('hits',0)/max(1,v.get('hits',0)+v.get('misses',0)):.3f}  host hit rate {d.get('hit_rate', 0):.3f}  read {d['read_bytes_per_token']/2**20:.1f} MiB/token")
PY
for f in $OUT/*.err $OUT/hog.txt; do echo "== $f"; grep -iv "^\s*layer\|^\[" $f | tail -4; done
