#!/usr/bin/env bash
# A new user's Triton: a fresh virtual environment, the latest pip (its resolver picks the releases a
# new machine gets), `pip install -e ".[EXTRA]"`, then `trtspec build` of the suite's tiny pair (the
# torch backend: nothing beyond the triton extra; transformers writes the pair), `triton-repo` and
# `triton-serve`. Passes when both models load and a greedy request over HTTP equals `trtspec run`
# on the same engine. Too slow for the suite (a venv, an install and a native build: about 2
# minutes for triton, 5 for test); run by hand.
#   scripts/fresh_install.sh [EXTRA] [TORCH_SPEC]    # triton (default) or test; torch==2.13.0 as .ci/run
set -euo pipefail
work=$(mktemp -d)
server=
trap '[ -n "$server" ] && kill "$server" 2>/dev/null; wait 2>/dev/null; rm -rf "$work"' EXIT
# a copy of the checkout's tracked files: a build of its own, none of this checkout's builds or caches
mkdir "$work/src"
(cd "$(dirname "$0")/.." && git ls-files -z | xargs -0 cp --parents -t "$work/src")
cd "$work/src"

python3 -m venv "$work/venv"
source "$work/venv/bin/activate"
pip install -q -U pip
pip install -q "${2:-torch==2.13.0}" -e ".[${1:-triton}]"
pip list 2>/dev/null | grep -iE "^(pip|nvidia-pytriton|tritonclient|numpy) "

export TRTSPEC_CACHE="$work/cache"
pip install -q transformers  # only to write the tiny pair, as tests/conftest.py does
python - "$work" <<'EOF'
import sys
from pathlib import Path

sys.path.insert(0, "tests")
from helpers import save_hf_target, save_random_drafter
from trtspec.models import load_target

work = Path(sys.argv[1])
save_random_drafter(work / "drafter", load_target(save_hf_target(work / "target", layers=2)))
EOF
trtspec --threads 1 build --target "$work/target" --drafter "$work/drafter" --backend torch --block-sizes 8 \
    -o "$work/engine"
trtspec triton-repo --engine "$work/engine" -o "$work/repo" --threads 1
ports=$(python -c 'import socket
sockets = [socket.socket() for _ in range(3)]
for s in sockets: s.bind(("127.0.0.1", 0))
print(" ".join(str(s.getsockname()[1]) for s in sockets))')
read -r http grpc metrics <<< "$ports"
trtspec triton-serve "$work/repo" --http-port "$http" --grpc-port "$grpc" --metrics-port "$metrics" \
    > "$work/server.log" 2>&1 &
server=$!

printf 'def fibonacci(n):\n' > "$work/prompt.txt"
trtspec --threads 1 run "$work/prompt.txt" --engine "$work/engine" --block-size 8 --max-new-tokens 24 --json \
    > "$work/run.json"
python - "$http" "$work" "$server" <<'EOF'
import json, sys, time
from pathlib import Path

import numpy as np
import tritonclient.http as http

port, work, server = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
client = http.InferenceServerClient(f"127.0.0.1:{port}")
deadline = time.monotonic() + 300
while True:
    try:
        if client.is_server_ready():
            break
    except Exception:
        pass
    stat = Path(f"/proc/{server}/stat")
    if time.monotonic() > deadline or not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z":
        sys.exit("tritonserver did not become ready:\n" + (work / "server.log").read_text()[-3000:])
    time.sleep(1)
for model in ("trtspec", "trtspec_stream"):
    assert client.is_model_ready(model), f"{model} did not load:\n" + (work / "server.log").read_text()[-3000:]
inputs = []
for name, value, kind in (("text_input", np.array([(work / "prompt.txt").read_bytes()], dtype=np.object_), "BYTES"),
                          ("max_tokens", np.array([24], dtype=np.int32), "INT32"),
                          ("block_size", np.array([8], dtype=np.int32), "INT32")):
    tensor = http.InferInput(name, [1], kind)
    tensor.set_data_from_numpy(value)
    inputs.append(tensor)
text = client.infer("trtspec", inputs).as_numpy("text_output")[0].decode()
expected = json.loads((work / "run.json").read_text())["text"]
assert text == expected, (text, expected)
client.close()
print(f"fresh install: both Triton models loaded; greedy over HTTP equals trtspec run ({len(text)} characters)")
EOF
