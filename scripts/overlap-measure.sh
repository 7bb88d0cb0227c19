#!/usr/bin/env bash
# Overlapped decode (SMOE_OVERLAP_DECODE=1) against the fenced chain: tg128 off / on, and on
# with only dispatches of at most N workgroups overlapped (SMOE_OVERLAP_MAX_GROUPS=N), then
# gpu_parity with the best.
# Run on the device as: bash .dev/device.sh "bash scripts/overlap-measure.sh" (after scripts/device-pack.sh).
export SMOE_REQUIRE_GPU=1
L=$OUT/log.txt
bench() {
  echo "== tg128 mode $1 max groups ${2:-all} $(date +%T)"
  SMOE_OVERLAP_DECODE=$1 SMOE_OVERLAP_MAX_GROUPS=$2 timeout 100 smoe bench decode -m /tmp/q.smoe --tg 128 --pp 0 --reps 3 --backend gpu 2>&1 | grep -E "decode |rror|gave" | head -5
}
{
smoe info 2>&1 | grep -iE "adapter|driver" | head -2
smoe synth --preset qwen3-30b-a3b --quant q4 --scout q4 -o /tmp/q.smoe 2>&1 | tail -1
bench 0; bench 1 40; bench 1 300; bench 1 600; bench 1 ""; bench 0
echo "== gpu_parity mode 1 max 40 $(date +%T)"
SMOE_OVERLAP_DECODE=1 SMOE_OVERLAP_MAX_GROUPS=40 timeout 100 .dev/bin/gpu_parity 2>&1 | grep -E "test result|FAILED|panicked" | head -8
date +%T
} > $L 2>&1
cat $L
