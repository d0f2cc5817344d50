#!/usr/bin/env bash
# DBloom for the demo pair, end to end: preflight -> expand-block -> preflight -> compare -> bench.
# Run from the repository root after `pip install -e ".[onnx]"` and `make_drafter.sh` steps 1-2
# (the training data in $WORK/drafter-data.jsonl). HumanEval is only used for evaluation.
set -euo pipefail
WORK=${WORK:-build/demo}
OUT=${OUT:-build/dbloom}
THREADS=${THREADS:-1}
EXPANDED=${EXPANDED:-$WORK/demo-b24}   # the expanded drafter; the bundled name demo-b24 skips training
mkdir -p "$OUT"
run() { trtspec --threads "$THREADS" "$@"; }

# 1. Is the block horizon capping demo-b16? Decoded (histogram, ceiling, stranded estimate) and
#    teacher-forced (the same contexts for every drafter); and b16 run naively at B=24.
run preflight --drafter demo-b16 --block-size 16 --json "$OUT/pre-b16-16.json" --plot "$OUT/pre-b16-16.png"
run preflight --drafter demo-b16 --block-size 24 --json "$OUT/pre-b16-24.json"
run preflight --drafter demo-b16 --block-size 16 --teacher-forced --json "$OUT/tf-b16-16.json"
run preflight --drafter demo-b16 --block-size 24 --teacher-forced --json "$OUT/tf-b16-24.json"

# 2. Post-train to B=24 (the recipe of make_drafter.sh step 4; stages resume if interrupted).
[ "$EXPANDED" = demo-b24 ] || [ -f "$EXPANDED/config.json" ] || run expand-block --drafter demo-b16 --to 24 --data "$WORK/drafter-data.jsonl" \
    --steps 300 --continue-steps 100 --stages 2 --lr 1e-4 --batch-size 8 --anchors 16 \
    --distill 5 --settle-steps 100 -o "$EXPANDED"

# 3. The expanded drafter at B=24, decoded and teacher-forced.
run preflight --drafter "$EXPANDED" --block-size 24 --json "$OUT/pre-b24-24.json" --plot "$OUT/pre-b24-24.png"
run preflight --drafter "$EXPANDED" --block-size 24 --teacher-forced --json "$OUT/tf-b24-24.json"

# 4. Per prompt and per position: b16 at 16, b16 at 24, expanded at 24.
python scripts/demo/compare_dbloom.py "$OUT/pre-b16-16.json" "$OUT/pre-b16-24.json" "$OUT/pre-b24-24.json" \
    > "$OUT/compare-decoded.json"
python scripts/demo/compare_dbloom.py "$OUT/tf-b16-16.json" "$OUT/tf-b16-24.json" "$OUT/tf-b24-24.json" \
    > "$OUT/compare-teacher-forced.json"

# 5. Measured speed-up over AR through compiled graphs (each run measures its own AR baseline).
run build --drafter demo-b16 --block-sizes 16,24 --backend onnxruntime -o "$OUT/engine-b16"
run build --drafter "$EXPANDED" --block-sizes 24 --backend onnxruntime -o "$OUT/engine-b24"
run bench --engine "$OUT/engine-b16" --block-sizes 16,24 --limit 80 --repeats 2 --json "$OUT/bench-b16.json"
run bench --engine "$OUT/engine-b24" --block-sizes 24 --limit 80 --repeats 2 --json "$OUT/bench-b24.json"
