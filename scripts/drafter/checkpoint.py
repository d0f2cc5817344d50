"""Keep a training run's checkpoint in git: split into parts of at most 15 MiB, and back.

A session can end at any moment, and only what is committed survives it, so the recipe saves the
work directory's checkpoint.pt (drafter, optimizer, schedule, data order) as parts after every
training chunk, and restores it before the next one when the work directory lacks it or holds an
older step. Parts carry the recipe's name for their run (`--run`: its data, starting point and
options), and a new run does not restore another's (train-drafter would refuse to resume it). The
optimizer's moments are kept in bfloat16 (the weights stay float32), which makes the parts a third
smaller; a resumed run continues from moments rounded to 8 bits of mantissa, not from the exact
ones.

    python scripts/drafter/checkpoint.py save build/smollm2/drafter-work data/smollm2/checkpoint
    python scripts/drafter/checkpoint.py restore data/smollm2/checkpoint build/smollm2/drafter-work
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
from pathlib import Path

import torch

from trtspec.fileio import staged_directory, staged_file

CHECKPOINT = "checkpoint.pt"
PART_BYTES = 15 * 2**20


def step_of(path: Path) -> int:
    return int(torch.load(path, map_location="cpu", weights_only=False)["step"]) if path.is_file() else -1


def _moments(state: dict, dtype: torch.dtype) -> dict:
    """The checkpoint with its optimizer moments (AdamW's exp_avg, exp_avg_sq) in `dtype`."""
    for param_state in state["optimizer"]["state"].values():
        for name in ("exp_avg", "exp_avg_sq"):
            param_state[name] = param_state[name].to(dtype)
    return state


def save(work: Path, parts: Path, run: str | None = None) -> None:
    state = _moments(torch.load(work / CHECKPOINT, map_location="cpu", weights_only=False), torch.bfloat16)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    data = buffer.getvalue()
    index = {"step": state["step"], "run": run, "sha256": hashlib.sha256(data).hexdigest(), "parts": []}
    with staged_directory(parts, "checkpoint parts") as staging:
        for number, offset in enumerate(range(0, len(data), PART_BYTES)):
            name = f"part-{number:02d}"
            (staging / name).write_bytes(data[offset:offset + PART_BYTES])
            index["parts"].append(name)
        (staging / "index.json").write_text(json.dumps(index, indent=1) + "\n")
    print(f"{parts}: step {index['step']} in {len(index['parts'])} parts")


def restore(parts: Path, work: Path, run: str | None = None) -> None:
    index = json.loads((parts / "index.json").read_text())
    if run is not None and index.get("run") != run:
        print(f"{parts} holds another run's checkpoint ({index.get('run')}); this run ({run}) starts afresh")
        return
    current = step_of(work / CHECKPOINT)
    if current >= index["step"]:
        print(f"{work / CHECKPOINT} is already at step {current} (parts: {index['step']})")
        return
    data = b"".join((parts / name).read_bytes() for name in index["parts"])
    if hashlib.sha256(data).hexdigest() != index["sha256"]:
        raise SystemExit(f"{parts}: the parts do not join into the checkpoint they were cut from")
    state = _moments(torch.load(io.BytesIO(data), map_location="cpu", weights_only=False), torch.float32)
    work.mkdir(parents=True, exist_ok=True)
    with staged_file(work / CHECKPOINT) as temporary:
        torch.save(state, temporary)
    print(f"{work / CHECKPOINT}: restored step {index['step']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=("save", "restore"))
    parser.add_argument("source", type=Path)
    parser.add_argument("destination", type=Path)
    parser.add_argument("--run", help="The run's name: parts of another run are not restored.")
    args = parser.parse_args()
    (save if args.action == "save" else restore)(args.source, args.destination, args.run)


if __name__ == "__main__":
    main()
