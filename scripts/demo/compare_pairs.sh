#!/usr/bin/env bash
# The demo pair's acceptance and speed-up table (scripts/demo/README.md, "Old and new pair"):
# HumanEval (held out), ONNX Runtime, one thread, 128 new tokens; B = 8, 12, 16, 24 with the b16
# drafter and 24 with the expanded b24 drafter, at T = 0, at T = 0.7 / top-p 0.8 and at T = 1.
# Run from the repository root; TARGET/B16/B24 default to the bundled pair, OUT to build/compare.
set -euo pipefail
TARGET=${TARGET:-trtspec/assets/demo-target}
B16=${B16:-trtspec/assets/demo-b16}
B24=${B24:-trtspec/assets/demo-b24}
OUT=${OUT:-build/compare}
LIMIT=${LIMIT:-40}
REPEATS=${REPEATS:-2}
mkdir -p "$OUT"

[ -f "$OUT/engine-b16/manifest.json" ] || trtspec --threads 1 build --backend onnxruntime --target "$TARGET" \
    --drafter "$B16" --block-sizes 8,12,16,24 -o "$OUT/engine-b16"
[ -f "$OUT/engine-b24/manifest.json" ] || trtspec --threads 1 build --backend onnxruntime --target "$TARGET" \
    --drafter "$B24" --block-sizes 24 -o "$OUT/engine-b24"

for setting in "0 1.0" "0.7 0.8" "1 1.0"; do
  read -r T P <<< "$setting"
  trtspec --threads 1 bench --engine "$OUT/engine-b16" --block-sizes 8,12,16,24 --temperature "$T" --top-p "$P" \
      --seed 0 --limit "$LIMIT" --repeats "$REPEATS" --max-new-tokens 128 --json "$OUT/b16-t$T.json"
  trtspec --threads 1 bench --engine "$OUT/engine-b24" --block-sizes 24 --temperature "$T" --top-p "$P" \
      --seed 0 --limit "$LIMIT" --repeats "$REPEATS" --max-new-tokens 128 --json "$OUT/b24-t$T.json"
done
