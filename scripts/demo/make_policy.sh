#!/usr/bin/env bash
# BlockPilot for the demo pair, end to end: prompts -> engine -> labels -> policy -> evaluation.
# Run from the repository root after `pip install -e ".[onnx]"`. Training prompts are documented
# standard-library functions the target never saw (scripts/demo/policy_prompts.py, checked
# disjoint from HumanEval); HumanEval is only ever used for evaluation.
set -euo pipefail
WORK=${WORK:-build/blockpilot}
ENGINE=${ENGINE:-build/engine-small}
THREADS=${THREADS:-1}
TRAIN_PROMPTS=${TRAIN_PROMPTS:-240}
EVAL_PROMPTS=${EVAL_PROMPTS:-164}  # HumanEval prompts labelled for the held-out evaluation (164 = all)
BENCH_PROMPTS=${BENCH_PROMPTS:-80}
ENGINE_SIZES=${ENGINE_SIZES:-6,8,12,16}  # spans the demo pair's sweet spot (B=12..24 has no per-prompt gap)
SIZES=${SIZES:-$ENGINE_SIZES,6:12,6:16}   # the policy's candidates: fixed sizes and growing blocks
BENCH_SIZES=${BENCH_SIZES:-6,6:12,6:16,auto}
TEMPERATURES=${TEMPERATURES:-0 1}  # each gets its own labels, policy and evaluation
TOP_P=${TOP_P:-1.0}                # nucleus mass at T > 0 (Qwen3's non-thinking setting: T=0.7, top-p 0.8)
NOISE=${NOISE:-1}                  # 0 skips step 7 (the T=1 seed-noise check)
mkdir -p "$WORK"

# 1. Training prompts (a fixed choice, ordered by content hash).
[ -f "$WORK/policy-prompts.jsonl" ] || python scripts/demo/policy_prompts.py -o "$WORK/policy-prompts.jsonl"

# 2. The compiled engine the labels are measured on (per-cycle costs are backend-specific).
[ -f "$ENGINE/manifest.json" ] || trtspec --threads "$THREADS" build --block-sizes "$ENGINE_SIZES" -o "$ENGINE"

for T in $TEMPERATURES; do
  # 3. Labels: every prompt at AR and every block size, fixed seeds; then held-out HumanEval labels.
  trtspec --threads "$THREADS" label-blocks --engine "$ENGINE" --prompts "$WORK/policy-prompts.jsonl" \
      --limit "$TRAIN_PROMPTS" --block-sizes "$SIZES" --temperature "$T" --top-p "$TOP_P" --seed 0 -o "$WORK/labels-train-t$T.jsonl"
  trtspec --threads "$THREADS" label-blocks --engine "$ENGINE" --prompts humaneval --limit "$EVAL_PROMPTS" \
      --block-sizes "$SIZES" --temperature "$T" --top-p "$TOP_P" --seed 0 -o "$WORK/labels-humaneval-t$T.jsonl"
  # 4. The policy (feature sets, and AR as a candidate or not, compared by cross-validation on the
  #    training labels only).
  trtspec --threads "$THREADS" train-policy "$WORK/labels-train-t$T.jsonl" --ablation --ar auto -o "$WORK/policy-t$T"
  # 5. Held-out evaluation: each fixed B, BlockPilot, the per-prompt oracle (modelled and measured).
  trtspec --threads "$THREADS" eval-policy --policy "$WORK/policy-t$T" --labels "$WORK/labels-humaneval-t$T.jsonl" \
      --json "$WORK/eval-t$T.json"
  # 6. Measured through the runtime, the policy (auto) beside fixed and growing blocks on 80 prompts.
  trtspec --threads "$THREADS" bench --engine "$ENGINE" --policy "$WORK/policy-t$T" --block-sizes "$BENCH_SIZES" \
      --temperature "$T" --top-p "$TOP_P" --limit "$BENCH_PROMPTS" --repeats 2 --json "$WORK/bench-t$T.json"
done

[ "$NOISE" = 1 ] || exit 0
# 7. Is the T=1 oracle gap a property of the prompts, or of the seeds? The same prompts with other
#    seeds: each run's per-prompt best sizes applied to the other run.
trtspec --threads "$THREADS" label-blocks --engine "$ENGINE" --prompts humaneval --limit "$EVAL_PROMPTS" \
    --block-sizes "$ENGINE_SIZES" --temperature 1 --seed 1000 -o "$WORK/labels-humaneval-t1-seed1000.jsonl"
python scripts/demo/label_noise.py "$WORK/labels-humaneval-t1.jsonl" "$WORK/labels-humaneval-t1-seed1000.jsonl" \
    --json "$WORK/noise-t1.json"
