#!/usr/bin/env bash
# Session 25: why overlapped decode (SMOE_OVERLAP_DECODE=1) gives other greedy tokens than the
# fenced chain. Runs 1-3 of this session: twins with wgpu's barriers pass
# (SMOE_OVERLAP_FENCED=1); unfenced twins fail whenever twins wait on each other, whatever the
# bindings' decorations (Coherent, Volatile, NonWritable dropped, every kernel Coherent).
# This run: the wants recorded and the counters (SMOE_OVERLAP_STATS=1: workgroups that waited,
# polls; run 4: none waited, none gave up even with SMOE_OVERLAP_SPIN=16), and now every
# count-in, the largest want and the largest count a first poll saw.
# Run on the device as: bash .dev/device.sh "bash scripts/overlap-diagnose.sh" (after scripts/device-pack.sh).
export SMOE_REQUIRE_GPU=1
L=$OUT/log.txt
{
smoe info 2>&1 | grep -iE "adapter|driver" | head -2
echo "== stats $(date +%T)"
SMOE_OVERLAP_DECODE=1 SMOE_OVERLAP_STATS=1 timeout 60 .dev/bin/gpu_parity greedy_chain --nocapture > $OUT/stats.txt 2>&1
grep -E "overlap want" $OUT/stats.txt | head -40
grep -E "overlap stats|test result|left:|right:" $OUT/stats.txt | head -12
echo "== stats fenced $(date +%T)"
SMOE_OVERLAP_DECODE=1 SMOE_OVERLAP_FENCED=1 SMOE_OVERLAP_STATS=1 timeout 60 .dev/bin/gpu_parity greedy_chain --nocapture 2>&1 | grep -E "overlap stats|test result" | head -6
smoe synth --preset qwen3-30b-a3b --quant q4 --scout q4 -o /tmp/q.smoe 2>&1 | tail -1
echo "== bench stats $(date +%T)"
SMOE_OVERLAP_DECODE=1 SMOE_OVERLAP_STATS=1 timeout 100 smoe bench decode -m /tmp/q.smoe --tg 128 --pp 0 --reps 1 --backend gpu > $OUT/bench.txt 2>&1
grep -E "overlap stats|decode  " $OUT/bench.txt | tail -5
date +%T
} > $L 2>&1
cat $L
