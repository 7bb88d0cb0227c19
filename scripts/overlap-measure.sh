#!/usr/bin/env bash
# Session 23: overlapped decode (SMOE_OVERLAP_DECODE=1) against the fenced chain.
# Run on the device as: bash .dev/device.sh "bash scripts/overlap-measure.sh" (after scripts/device-pack.sh).
# Ordered so that a run cut short still answers the main question (speed, then correctness).
export SMOE_REQUIRE_GPU=1
L=$OUT/log.txt
bench() {
  export SMOE_OVERLAP_DECODE=$1
  echo "== $1 $(date +%T)"; timeout 100 smoe bench decode -m /tmp/q.smoe --tg 128 --pp 0 --reps 3 --backend gpu 2>&1 | grep -E "decode |rror|gave" | head -5
  unset SMOE_OVERLAP_DECODE
}
{
smoe info 2>&1 | grep -iE "adapter|driver" | head -3
date +%T; smoe synth --preset qwen3-30b-a3b --quant q4 --scout q4 -o /tmp/q.smoe 2>&1 | tail -1
bench 0; bench 1
echo "== gpu_parity overlapped $(date +%T)"; SMOE_OVERLAP_DECODE=1 timeout 120 .dev/bin/gpu_parity 2>&1 | grep -E "test |test result|FAILED|panicked|failed|gave up" | head -30
bench 0; bench 1
date +%T
} > $L 2>&1
cat $L
