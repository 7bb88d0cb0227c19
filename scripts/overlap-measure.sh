#!/usr/bin/env bash
# Session 23: overlapped decode (SMOE_OVERLAP_DECODE=1) against the fenced chain.
# Run on the device as: bash .dev/device.sh "bash scripts/overlap-measure.sh" (after scripts/device-pack.sh).
export SMOE_REQUIRE_GPU=1
L=$OUT/log.txt
{
smoe info 2>&1 | grep -iE "adapter|driver" | head -3
echo "== gpu_parity overlapped"; SMOE_OVERLAP_DECODE=1 .dev/bin/gpu_parity 2>&1 | grep -E "test |test result|FAILED|panicked|failed|gave up" | head -30
smoe synth --preset qwen3-30b-a3b --quant q4 --scout q4 -o /tmp/q.smoe 2>&1 | tail -1
for i in 1 2; do
  for o in 0 1 pad; do
    if [ $o = pad ]; then export SMOE_OVERLAP_PAD=500 SMOE_OVERLAP_DECODE=1; else export SMOE_OVERLAP_DECODE=$o; unset SMOE_OVERLAP_PAD; fi
    echo "== $o"; timeout 120 smoe bench decode -m /tmp/q.smoe --tg 128 --pp 0 --reps 3 --backend gpu 2>&1 | grep -E "decode |rror|gave" | head -5
  done
done
unset SMOE_OVERLAP_PAD SMOE_OVERLAP_DECODE
} > $L 2>&1
cat $L
