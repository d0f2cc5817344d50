#!/usr/bin/env bash
# The SmolLM2-135M-Instruct drafter (shipped as trtspec/assets/smollm2-b16), every step, with the
# product's own commands. Run from the repository root after the README's install. Every step
# resumes from what is committed under data/smollm2/ (prompts, response shards, the training
# checkpoint in parts), so a run cut off at any moment loses at most one shard or one chunk of
# training; rerun the script to go on. Timings and token counts: docs/training.md.
#
#   SHARDS=12 CHUNK_MINUTES=30 bash scripts/drafter/recipe.sh
set -euo pipefail
TARGET=${TARGET:-smollm2}
DATA=${DATA:-data/smollm2}
WORK=${WORK:-build/smollm2}
THREADS=${THREADS:-2}
POLICY_PROMPTS=${POLICY_PROMPTS:-64}  # the last N prompts (and stubs) label BlockPilot's policy (step 6): no shard holds them
SHARDS=${SHARDS:-}             # stop generating after this many shards exist (default: every prompt but those)
SHARD_SIZE=${SHARD_SIZE:-128}
POLICY_SIZES=${POLICY_SIZES:-4,8,16}  # the policy's candidates besides AR
POLICY_TOKENS=${POLICY_TOKENS:-64}    # new tokens per labelled decode
POLICY_STEPS=${POLICY_STEPS:-600}     # the policy's training steps (each of the cross-validation's fits too)
SHIP_POLICY=${SHIP_POLICY:-1}         # 0: ship the drafter without a BlockPilot policy (step 6 skipped)
INT4_POLICY=${INT4_POLICY:-1}         # 0: skip step 7 (the policy for the pair's 4-bit engines)
# Bare function stubs to complete (def line and docstring), all trained on: the standard library's
# (stubs.jsonl) and, unless STUB_MODULES is empty, those of the packages it names (stubs-packages.jsonl).
STUB_MODULES=${STUB_MODULES-networkx,sympy,scipy.stats,scipy.special,scipy.signal,scipy.optimize,scipy.linalg,numpy,click}
# A third set (stubs-more.jsonl), unless MORE_STUB_MODULES is empty: the functions of further modules that
# neither set above holds (prompts.py --exclude).
MORE_STUB_MODULES=${MORE_STUB_MODULES-scipy.ndimage,scipy.interpolate,scipy.integrate,scipy.sparse,scipy.sparse.linalg,scipy.fft,scipy.cluster.hierarchy,scipy.spatial.distance,scipy.io,numpy.ma,numpy.lib,numpy.polynomial.polynomial,torch.nn.functional,torch.nn.init,torch.functional,onnx.helper,onnx.numpy_helper,sympy.ntheory,sympy.combinatorics,sympy.geometry,sympy.matrices,sympy.solvers,sympy.polys,mpmath,networkx.generators,networkx.algorithms,matplotlib.pyplot,hypothesis.strategies,pyparsing,PIL.Image,jinja2,tqdm}
# A fourth (stubs-submodules.jsonl), unless SUBMODULE_STUB_PACKAGES is empty: every public submodule of these
# packages (prompts.py --modules pkg.*), again only functions no earlier set holds.
SUBMODULE_STUB_PACKAGES=${SUBMODULE_STUB_PACKAGES-sympy,networkx,scipy,matplotlib,mpmath,PIL,pygments,rich,jinja2,click,dateutil,packaging,attr,jsonschema,yaml,fsspec,tomlkit,sortedcontainers,huggingface_hub,onnx,hypothesis,pyparsing,markdown_it,starlette,requests,urllib3,aiohttp,tqdm}
# A fifth (stubs-libraries.jsonl), unless LIBRARY_STUB_PACKAGES is empty: every public submodule of further
# installed libraries (the test extra's), again only functions no earlier set holds.
LIBRARY_STUB_PACKAGES=${LIBRARY_STUB_PACKAGES-torch,pydantic,fastapi,cryptography,psutil,typer,uvicorn,websockets,accelerate,yarl,anyio,gguf,onnxscript,onnx_ir,prometheus_client,_pytest,virtualenv,distlib,platformdirs,filelock,smart_open,fontTools,contourpy,wrapt,google.protobuf,zmq,gevent,tritonclient,fire,multidict,charset_normalizer,idna,dotenv,watchfiles,termcolor,shellingham,safetensors,tokenizers,openai,httpx,aiohttp,huggingface_hub,transformers.utils,transformers.generation,ray.util,ray.data,ml_dtypes,opentelemetry,google.auth,sh,colorful}
MAX_NEW_TOKENS=${MAX_NEW_TOKENS:-256}
SAMPLED_EVERY=${SAMPLED_EVERY:-4}  # every N-th shard samples at T = 1, the rest are greedy
STEPS=${STEPS:-800}            # the run's length (the cosine schedule's horizon)
LAYERS=${LAYERS:-2}            # drafter decoder layers
LR=${LR:-1e-3}
CHUNK_MINUTES=${CHUNK_MINUTES:-30}
MASK=${MASK:-16}               # <empty_output>: a special token SmolLM2 never writes, used as DFlash's mask
NUM_FEATURES=${NUM_FEATURES:-3}   # target layers the drafter taps (DFlash's default spread)
HELD_OUT=${HELD_OUT:-32}       # held-out prompts the acceptance curve decodes
DRAFT_VOCAB=${DRAFT_VOCAB:-8192}  # the loss ranks the K most frequent response ids (steps ~2.4x faster); 0: all
SHIP_TO=${SHIP_TO:-trtspec/assets/smollm2-b16}
INIT_FROM=${INIT_FROM:-}       # continue from a drafter (e.g. the shipped one) on new data, a new run
mkdir -p "$WORK"

# 1. Prompts: code and chat requests in the chat template, none from HumanEval (the script refuses).
[ -f "$DATA/prompts.jsonl" ] || python scripts/drafter/prompts.py --target "$TARGET" -o "$DATA/prompts.jsonl"
#    And functions as bare stubs (def line and docstring), the form a function to complete comes in.
STUB_SETS=(stubs)
[ -f "$DATA/stubs.jsonl" ] || python scripts/drafter/prompts.py --target "$TARGET" --form stubs --max-prompt-tokens 320 \
    -o "$DATA/stubs.jsonl"
if [ -n "$STUB_MODULES" ]; then
    STUB_SETS+=(stubs-packages)
    [ -f "$DATA/stubs-packages.jsonl" ] || python scripts/drafter/prompts.py --target "$TARGET" --form stubs \
        --modules "$STUB_MODULES" --max-prompt-tokens 320 -o "$DATA/stubs-packages.jsonl"
fi
# further_stub_set NAME MODULES: a set of MODULES' functions that no earlier set holds (none if MODULES is empty).
further_stub_set() {
    [ -n "$2" ] || return 0
    local earlier=() set
    for set in "${STUB_SETS[@]}"; do earlier+=(--exclude "$DATA/$set.jsonl"); done
    STUB_SETS+=("$1")
    [ -f "$DATA/$1.jsonl" ] || python scripts/drafter/prompts.py --target "$TARGET" --form stubs --modules "$2" \
        --max-prompt-tokens 320 "${earlier[@]}" -o "$DATA/$1.jsonl"
}
with_submodules() { [ -z "$1" ] || echo "$1" | sed 's/\([^,]*\)/\1.*/g'; }  # pkg -> pkg.*: it and its public submodules
further_stub_set stubs-more "$MORE_STUB_MODULES"
further_stub_set stubs-submodules "$(with_submodules "$SUBMODULE_STUB_PACKAGES")"
further_stub_set stubs-libraries "$(with_submodules "$LIBRARY_STUB_PACKAGES")"

# 2. The target's own responses, 128 prompts a shard; every 4th shard sampled at T = 1. Generation
#    stops before the last POLICY_PROMPTS prompts: BlockPilot's labels (step 6) are decoded on those.
PROMPTS=$(wc -l < "$DATA/prompts.jsonl")
SHARDS=${SHARDS:-$(( (PROMPTS - POLICY_PROMPTS) / SHARD_SIZE ))}
python scripts/drafter/generate.py --target "$TARGET" --prompts "$DATA/prompts.jsonl" -o "$DATA/responses" \
    --threads "$THREADS" --shard-size "$SHARD_SIZE" --max-new-tokens "$MAX_NEW_TOKENS" \
    --sampled-every "$SAMPLED_EVERY" --shards "$SHARDS"
#    The fourth stub set likewise stops before its last POLICY_PROMPTS stubs: the policy's stubs (the
#    same ones whatever sets come after it; the last set where it is left out).
POLICY_STUBS=stubs-submodules
[[ " ${STUB_SETS[*]} " == *" $POLICY_STUBS "* ]] || POLICY_STUBS=${STUB_SETS[-1]}
for set in "${STUB_SETS[@]}"; do
    LIMIT=()
    [ "$set" != "$POLICY_STUBS" ] || LIMIT=(--shards $(( ($(wc -l < "$DATA/$set.jsonl") - POLICY_PROMPTS) / SHARD_SIZE )))
    python scripts/drafter/generate.py --target "$TARGET" --prompts "$DATA/$set.jsonl" -o "$DATA/responses-$set" \
        --threads "$THREADS" --shard-size "$SHARD_SIZE" --max-new-tokens "$MAX_NEW_TOKENS" --sampled-every "$SAMPLED_EVERY" \
        "${LIMIT[@]}"
done

# 3. The training file: every shard but shard-0000, whose prompts are held out for the curve, and the
#    stubs' shards. A run's data is fixed (the checkpoint records its digest), so TRAIN_SHARDS and
#    TRAIN_STUB_SHARDS pin which shards a run trains on; a later run on more data starts from this
#    one's drafter (--init-from).
#    Shards are gzip-compressed JSONL (shard-NNNN.jsonl.gz); the training file is plain.
HELD_OUT_SHARD="$DATA/responses/shard-0000.jsonl.gz"
TRAIN_SHARDS=${TRAIN_SHARDS:-$(ls "$DATA"/responses/shard-*.jsonl.gz | tail -n +2 | wc -l)}
stub_shards() { for set in "${STUB_SETS[@]}"; do ls "$DATA/responses-$set"/shard-*.jsonl.gz; done; }  # the sets in order
TRAIN_STUB_SHARDS=${TRAIN_STUB_SHARDS:-$(stub_shards | wc -l)}
{ ls "$DATA"/responses/shard-*.jsonl.gz | tail -n +2 | head -n "$TRAIN_SHARDS"
  stub_shards | head -n "$TRAIN_STUB_SHARDS"; } | xargs zcat > "$WORK/train.jsonl"

# 3b. The draft vocabulary's counts over the training responses: the K ids the drafter learns to
#     propose among are the K most frequent here (the curve and the shipped drafter use these counts).
trtspec draft-vocab --target "$TARGET" --data "$WORK/train.jsonl" -o "$WORK/draft_vocab"
if [ "$DRAFT_VOCAB" -gt 0 ]; then VOCAB=(--draft-vocab "$DRAFT_VOCAB"); else VOCAB=(); fi

# 4. DFlash training at B = 16: two drafter layers over three target taps, started as copies of the
#    target's last two layers (from random weights the first 250 steps reached tau 1.23 only), bfloat16 autocast where
#    the CPU has AMX; resumed from the committed checkpoint, saved back after every chunk. The target's
#    features of each sequence are kept in $WORK/features (local, ~3.5 KB a token): a later run, or a
#    restarted chunk, reads them instead of running the target over the sequence again.
#    The committed checkpoint is restored only into the run it belongs to (RUN names the data,
#    start and options): a new run (other shards, INIT_FROM, STEPS...) starts afresh.
if [ -n "$INIT_FROM" ]; then START=(--init-from "$INIT_FROM"); else START=(--layers-from-target); fi
RUN="shards=$TRAIN_SHARDS stubs=$TRAIN_STUB_SHARDS init=${INIT_FROM:-target-layers} steps=$STEPS lr=$LR layers=$LAYERS vocab=$DRAFT_VOCAB"
# A work directory another run left behind is cleared: its checkpoint would not resume this run.
if [ "$(cat "$WORK/drafter-work/run" 2>/dev/null)" != "$RUN" ]; then rm -rf "$WORK/drafter-work"; fi
mkdir -p "$WORK/drafter-work" && echo "$RUN" > "$WORK/drafter-work/run"
[ -f "$DATA/checkpoint/index.json" ] && python scripts/drafter/checkpoint.py restore "$DATA/checkpoint" "$WORK/drafter-work" --run "$RUN"
while true; do
    status=0
    timeout "${CHUNK_MINUTES}m" trtspec --threads "$THREADS" train-drafter --target "$TARGET" --data "$WORK/train.jsonl" \
        --block-size 16 --layers "$LAYERS" --num-features "$NUM_FEATURES" --mask-token-id "$MASK" --steps "$STEPS" --batch-size 8 \
        --anchors 32 --max-length 512 --lr "$LR" "${START[@]}" "${VOCAB[@]}" --checkpoint-every 25 --work "$WORK/drafter-work" --feature-cache "$WORK/features" -o "$WORK/smollm2-b16" \
        || status=$?
    [ "$status" -eq 0 ] || [ "$status" -eq 124 ] || exit "$status"  # 124: the chunk's time is up
    python scripts/drafter/checkpoint.py save "$WORK/drafter-work" "$DATA/checkpoint" --run "$RUN"
    python scripts/drafter/curve.py "$WORK/drafter-work" --held-out "$HELD_OUT_SHARD" \
        --target "$TARGET" --prompts "$HELD_OUT" --draft-counts "$WORK/draft_vocab" --curve "$DATA/curve.jsonl" --run "$RUN"
    [ "$status" -eq 124 ] || break
done

# 5. The drafter and its draft vocabulary's counts into the package.
python scripts/drafter/ship.py "$WORK/smollm2-b16" --counts "$WORK/draft_vocab" -o "$SHIP_TO"

# 6. BlockPilot's policy for the pair, shipped inside the drafter (blockpilot/, which `auto` reads):
#    the last POLICY_PROMPTS requests and the policy's stubs decoded at AR and at every size of
#    POLICY_SIZES through this backend, greedy and at T = 1 (sampled requests accept less), and
#    labelled with the fastest (label-blocks); then the policy trained on the four label sets, its
#    inputs (and whether AR is a candidate) chosen by cross-validation against knowing only whether
#    a request samples (--ablation): a summary that does not pay on unseen prompts is not shipped.
ship_policy() {  # ship_policy NAME MODEL-OPTIONS...: label through those models, train, ship as $SHIP_TO/NAME
    local name=$1 labels=()
    shift
    for kind in prompts stubs; do
        for T in 0 1; do
            trtspec --threads "$THREADS" label-blocks "$@" --prompts "$WORK/policy/$kind.jsonl" \
                --block-sizes "$POLICY_SIZES" --max-new-tokens "$POLICY_TOKENS" --temperature "$T" --seed 0 \
                -o "$WORK/policy/labels-$name-$kind-t$T.jsonl"
            labels+=("$WORK/policy/labels-$name-$kind-t$T.jsonl")
        done
    done
    trtspec --threads "$THREADS" train-policy "${labels[@]}" --ablation --ar auto --steps "$POLICY_STEPS" \
        -o "$WORK/policy/$name"
    # train-policy writes nothing into the installed package (its guard); the shipped drafter takes a copy
    rm -rf "${SHIP_TO:?}/$name" && mkdir "$SHIP_TO/$name" && cp "$WORK/policy/$name"/policy.* "$SHIP_TO/$name/"
}
if [ "$POLICY_PROMPTS" -gt 0 ] && [ "$SHIP_POLICY" = 1 ]; then
    mkdir -p "$WORK/policy"
    tail -n "$POLICY_PROMPTS" "$DATA/prompts.jsonl" > "$WORK/policy/prompts.jsonl"
    tail -n "$POLICY_PROMPTS" "$DATA/$POLICY_STUBS.jsonl" > "$WORK/policy/stubs.jsonl"
    ship_policy blockpilot --target "$TARGET" --drafter "$SHIP_TO"
fi

# 7. The same policy labelled through the pair's 4-bit engine (`trtspec build --weights int4`), whose
#    cycles cost otherwise (a verify of 16 is 4.5 AR steps there, 2 in float32, and a sampled request's
#    speculation does not pay): shipped beside the first as blockpilot-int4/, which a 4-bit build
#    embeds instead (trtspec.blockpilot.policy.drafter_policy). The same prompts and stubs as step 6.
if [ "$POLICY_PROMPTS" -gt 0 ] && [ "$SHIP_POLICY" = 1 ] && [ "$INT4_POLICY" = 1 ]; then
    trtspec --threads "$THREADS" build --target "$TARGET" --drafter "$SHIP_TO" --backend onnxruntime --weights int4 \
        --block-sizes "$POLICY_SIZES" -o "$WORK/engine-int4"
    ship_policy blockpilot-int4 --engine "$WORK/engine-int4"
fi
