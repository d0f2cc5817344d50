"""DBloom's expand-block: post-train a drafter made for block B0 on a longer block B1.

Widening the block only at inference does not work: attention is bidirectional, so even early
positions see a different block than in training. A short curriculum does: optionally first
continue training at B0, then grow the block in stages up to B1 (e.g. 16 -> 20 -> 24), with the
loss weights of the newly exposed positions (>= B0) restarted at full weight so they are
learned rather than drowned by the decay that favours early positions. Optionally, while the
block grows, positions below B0 are also kept close to the drafter we started from (a KL term
against a frozen copy seeing the same longer blocks, in every stage longer than B0), so the new
positions cost the early ones, which carry most of the acceptance, less. Optionally a last
"settle" stage trains at B1 with the source's plain decay, so the early positions have the last
word once the new ones are learned.

Each stage is a `train_drafter` run with its own checkpoints in the work directory, so a restart
resumes it under the same check as train-drafter's (same data, target, starting drafter and
options, or a one-line refusal), and a finished stage is reused only where its drafter is the one
its own finished checkpoint holds: never a stage of another run, nor a drafter placed there.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch

from trtspec.errors import TrtspecError
from trtspec.fileio import CHECKPOINT, check_output_dir
from trtspec.limits import check_block_size
from trtspec.models import DFlashDrafter, Qwen3Target, load_drafter, save_drafter
from trtspec.runtime.sampling import derive_seed
from trtspec.training.blocks import default_gamma
from trtspec.training.trainer import TrainConfig, finished_checkpoint, train_drafter, work_directory


@dataclass(frozen=True)
class ExpandConfig:
    to_block_size: int = 24
    steps: int = 300                 # spread over the growth stages
    stages: int = 2                  # B0 -> ... -> B1 in this many equal steps
    continue_steps: int = 0          # continuation fine-tuning at B0 first
    lr: float = 3e-4
    batch_size: int = 8
    anchors_per_sequence: int = 16
    seed: int = 0
    checkpoint_every: int = 50
    distill_weight: float = 0.0      # KL to the source drafter at positions < B0 past B0; 0 = off
    settle_steps: int = 0            # a last stage at B1 with the source's plain position decay


def stage_plan(from_block: int, config: ExpandConfig) -> list[tuple[int, int, int]]:
    """(block size, steps, emphasised-from position) per stage."""
    if config.to_block_size <= from_block:
        raise TrtspecError(f"--to must be larger than the drafter's block size {from_block}, got {config.to_block_size}")
    check_block_size(config.to_block_size, "--to")
    stages = max(1, min(config.stages, config.to_block_size - from_block))
    sizes = [from_block + (config.to_block_size - from_block) * (i + 1) // stages for i in range(stages)]
    per_stage = [config.steps // stages + (1 if i < config.steps % stages else 0) for i in range(stages)]
    plan = [(from_block, config.continue_steps, 0)] if config.continue_steps else []
    plan += [(size, steps, from_block) for size, steps in zip(sizes, per_stage) if steps > 0]
    return plan + ([(config.to_block_size, config.settle_steps, 0)] if config.settle_steps else [])


def frozen_copy(drafter: DFlashDrafter, target: Qwen3Target) -> DFlashDrafter:
    """An independent, gradient-free copy of `drafter` sharing the target's embedding and head."""
    copy = DFlashDrafter(drafter.config).to(device=target.device, dtype=target.dtype)
    copy.load_state_dict(drafter.state_dict())
    for param in copy.parameters():
        param.requires_grad_(False)
    return copy.eval().bind(target)


def _reusable(stage_dir: Path, finished: dict | None, target: Qwen3Target) -> bool:
    """Whether `stage_dir` holds exactly the drafter of its stage's `finished` checkpoint."""
    if finished is None or not (stage_dir / "config.json").is_file():
        return False
    try:
        written = load_drafter(stage_dir, target).state_dict()
    except TrtspecError:
        return False
    saved = finished["drafter"]
    return written.keys() == saved.keys() and all(
        torch.equal(written[name].cpu(), saved[name].to(written[name].dtype).cpu()) for name in saved)


def expand_block(target: Qwen3Target, drafter: DFlashDrafter, sequences: list[tuple[list[int], int]],
                 config: ExpandConfig, output: str | Path, work_dir: str | Path | None = None,
                 progress: bool = True) -> Path:
    """Run the curriculum; each stage is kept in WORK so a restart resumes it (module docstring)."""
    source = drafter.config
    work = work_directory(output, work_dir)
    plan = stage_plan(source.block_size, config)
    stages = [(work / f"stage{number}-b{size}", work / f"stage{number}.work")
              for number, (size, _, _) in enumerate(plan)]
    for stage_dir, _ in stages:  # before any training: a stage written over must be one of trtspec's
        check_output_dir(stage_dir, CHECKPOINT)
    teacher = frozen_copy(drafter, target) if config.distill_weight > 0 else None
    for number, ((block_size, steps, emphasis), (stage_dir, stage_work)) in enumerate(zip(plan, stages)):
        lineage = {"source_block_size": source.block_size, "block_size": config.to_block_size,
                   "steps": config.steps, "continue_steps": config.continue_steps,
                   "distill_weight": config.distill_weight, "settle_steps": config.settle_steps,
                   "stages": [list(stage) for stage in plan], "source_lineage": dict(source.lineage)}
        drafter.config = replace(drafter.config, block_size=block_size, lineage=lineage)
        # Positions below B0 keep the decay the drafter was trained with; new ones restart it.
        distilling = teacher is not None and block_size > source.block_size  # every stage past B0
        train_config = TrainConfig(block_size=block_size, steps=steps, batch_size=config.batch_size,
                                   gamma=default_gamma(source.block_size),
                                   anchors_per_sequence=config.anchors_per_sequence, lr=config.lr,
                                   seed=derive_seed(config.seed, number), checkpoint_every=config.checkpoint_every,
                                   position_weight_shift=emphasis, lineage=lineage,
                                   mask_token_id=source.mask_token_id,
                                   distill_below=source.block_size if distilling else 0,
                                   distill_weight=config.distill_weight)
        finished = finished_checkpoint(target, sequences, train_config, stage_dir, stage_work, drafter)
        if not _reusable(stage_dir, finished, target):  # resumes, or rewrites a finished stage from its checkpoint
            train_drafter(target, sequences, train_config, stage_dir, stage_work, drafter=drafter,
                          teacher=teacher, progress=progress)
        drafter = load_drafter(stage_dir, target)
    drafter.config = replace(drafter.config, block_size=config.to_block_size)
    return save_drafter(drafter, output)
