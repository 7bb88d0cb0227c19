#!/usr/bin/env bash
# Demo model, last step (docs/demo-model.md): assemble the checkpoint that train.py returned,
# convert it to bf16 / q8 / q4 / q2 vaults and the shipped one, and measure `smoe perplexity`
# of each on tests/fixtures/demo/heldout.txt.
#
#   scripts/demo_model/convert.sh RUN_DIR
#
# RUN_DIR holds train.py's output (config.json, model.safetensors.part*, results.json).
# Tokenizer files come from prepare.py's WORK/device. Needs target/release/smoe
# (cargo build --release -p smoe-cli). Writes WORK/checkpoint, WORK/vaults/*.smoe,
# WORK/vaults/perplexity.jsonl and models/demo-qwen3-moe.smoe (experts q4, scout q8).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
RUN=${1:?usage: convert.sh RUN_DIR}
WORK=${WORK:-$ROOT/tmp/demo_model}
SMOE=${SMOE:-$ROOT/target/release/smoe}
SLICE=$ROOT/tests/fixtures/demo/heldout.txt
CK=$WORK/checkpoint
V=$WORK/vaults
SHIPPED=$ROOT/models/demo-qwen3-moe.smoe

mkdir -p "$CK" "$V"
# shellcheck disable=SC2046
cat $(ls "$RUN"/model.safetensors.part* | sort -V) >"$CK/model.safetensors"
cp "$RUN/config.json" "$CK/"
cp "$WORK/device/tokenizer.json" "$WORK/device/tokenizer_config.json" "$WORK/device/generation_config.json" "$CK/"

for q in bf16 q8 q4 q2; do
  "$SMOE" convert "$CK" -o "$V/demo-$q.smoe" --quant "$q" --force
done
"$SMOE" convert "$CK" -o "$V/demo-q8-scoutq8.smoe" --quant q8 --scout q8 --force
"$SMOE" convert "$CK" -o "$SHIPPED" --quant q4 --scout q8 --force
ls -l "$V"/*.smoe "$SHIPPED"

: >"$V/perplexity.jsonl"
for f in "$V/demo-bf16.smoe" "$V/demo-q8.smoe" "$V/demo-q4.smoe" "$V/demo-q2.smoe" "$V/demo-q8-scoutq8.smoe" "$SHIPPED"; do
  for ctx in 512 256; do
    r=$("$SMOE" perplexity -m "$f" --file "$SLICE" --ctx "$ctx" --backend cpu --json)
    echo "{\"vault\": \"$(basename "$f")\", \"backend\": \"cpu\", \"result\": $r}" | tee -a "$V/perplexity.jsonl"
  done
done
