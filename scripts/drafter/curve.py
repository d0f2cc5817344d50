"""The held-out acceptance curve: tau of a training run's current drafter on prompts it never saw.

Reads the work directory's checkpoint.pt, writes its drafter (z-lab layout) to `WORK/latest`,
decodes the held-out prompts greedily at the trained block size with the target verifying, and
appends {step, sequences seen, tau, histogram} to the curve file. The recipe holds out the first
shard of responses (its prompts are never trained on).

    python scripts/drafter/curve.py build/smollm2/drafter-work --held-out data/smollm2/responses/shard-0000.jsonl.gz \
        --curve data/smollm2/curve.jsonl
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import torch

from trtspec.api import Pipeline
from trtspec.assets import resolve_target
from trtspec.fileio import atomic_write_text
from trtspec.models import load_target, save_drafter
from trtspec.runtime.engine import EngineConfig
from trtspec.runtime.request import GenerationConfig
from trtspec.runtime.schedule import BlockChoice
from trtspec.runtime.stats import mean_tau, pooled_histogram
from trtspec.training.data import read_prompt_set
from trtspec.training.trainer import CHECKPOINT_FILE, TrainConfig, new_drafter


def export_drafter(work: Path, target_dir: Path) -> tuple[Path, dict]:
    """The checkpoint's drafter as a directory `WORK/latest`, and the checkpoint's step and config."""
    state = torch.load(work / CHECKPOINT_FILE, map_location="cpu", weights_only=False)
    config = TrainConfig(**{**state["config"], "target_layer_ids": tuple(state["config"]["target_layer_ids"])})
    drafter = new_drafter(load_target(target_dir), config)
    drafter.load_state_dict(state["drafter"])
    return save_drafter(drafter, work / "latest"), {"step": state["step"], "config": state["config"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("work", type=Path)
    parser.add_argument("--target", default="smollm2")
    parser.add_argument("--held-out", required=True, help="Records whose prompts were not trained on.")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--draft-counts", type=Path, help="Token counts of the training data (trtspec draft-vocab), "
                                                              "for a run trained with --draft-vocab.")
    parser.add_argument("--curve", type=Path, help="JSONL to append the point to.")
    parser.add_argument("--run", help="The run's name, kept with the point (steps count from each run's start).")
    args = parser.parse_args()
    target_dir = resolve_target(args.target)
    drafter_dir, trained = export_drafter(args.work, target_dir)
    block = trained["config"]["block_size"]
    vocab = trained["config"].get("draft_vocab") or None  # the K ids it was trained to propose among
    pipeline = Pipeline(target_dir, drafter_dir, dtype=args.dtype, device="cpu", max_context=512,
                        draft_vocab=vocab, draft_counts=args.draft_counts if vocab else None)
    prompts = [r["prompt_ids"] for r in read_prompt_set(args.held_out, args.prompts)]
    config = replace(GenerationConfig(max_new_tokens=args.max_new_tokens), block=BlockChoice(block))
    engine = pipeline.stepped_engine(EngineConfig(max_running=len(prompts)), load_aware=False)
    began = time.perf_counter()
    stats = [g.stats for g in engine.generate(prompts, [config] * len(prompts))]
    point = {"run": args.run, "step": trained["step"],
             "sequences_seen": trained["step"] * trained["config"]["batch_size"], "block_size": block,
             "draft_vocab": vocab, "tau": round(mean_tau(stats), 3), "histogram": pooled_histogram(stats),
             "prompts": len(prompts), "seconds": round(time.perf_counter() - began, 1)}
    print(json.dumps(point))
    if args.curve is not None:
        old = args.curve.read_text() if args.curve.exists() else ""
        atomic_write_text(args.curve, old + json.dumps(point) + "\n")


if __name__ == "__main__":
    main()
