#!/usr/bin/env bash
# Overlapped decode (SMOE_OVERLAP_DECODE=1) against the fenced chain: tg128 off / on, the GPU
# tests with the mode on (gpu_parity) and with it off (gpu_kernels, gpu_parity: every
# passthrough kernel's bindings are now ranked as wgpu's layout numbers them), tg128 again.
# Run on the device as: bash .dev/device.sh "bash scripts/overlap-measure.sh" (after scripts/device-pack.sh).
export SMOE_REQUIRE_GPU=1
L=$OUT/log.txt
bench() {
  echo "== tg128 mode $1 $(date +%T)"
  SMOE_OVERLAP_DECODE=$1 timeout 100 smoe bench decode -m /tmp/q.smoe --tg 128 --pp 0 --reps 3 --backend gpu 2>&1 | grep -E "decode |rror|gave" | head -5
}
tests() {
  echo "== $1 mode $2 $(date +%T)"
  SMOE_OVERLAP_DECODE=$2 timeout 150 .dev/bin/$1 2>&1 | grep -E "test result|FAILED|panicked|failed|gave up" | head -12
}
{
smoe info 2>&1 | grep -iE "adapter|driver" | head -2
smoe synth --preset qwen3-30b-a3b --quant q4 --scout q4 -o /tmp/q.smoe 2>&1 | tail -1
bench 0; bench 1
tests gpu_parity 1
bench 0; bench 1
tests gpu_parity 0
tests gpu_kernels 0
date +%T
} > $L 2>&1
cat $L
