"""DBloom's preflight: decode (or teacher-force) prompts at one block size and pool the acceptance
histograms into the analysis of trtspec.dbloom.histogram; and its plot."""

from __future__ import annotations

import sys

import torch
from tqdm import tqdm

from trtspec.errors import TrtspecError
from trtspec.fileio import staged_file
from trtspec.dbloom.histogram import Preflight
from trtspec.runtime.request import GenerationConfig
from trtspec.runtime.schedule import AR
from trtspec.runtime.schedule import BlockChoice
from trtspec.runtime.stats import DecodeStats, mean_tau, pooled_histogram
from trtspec.perf.sweep import Sweep, pipeline_requests, run_sweep

PLOT_SUFFIX = ".png"


def plot(preflight: Preflight, path: str) -> None:
    """Histogram and per-position acceptance as a PNG (needs matplotlib: the [plot] extra)."""
    try:
        import matplotlib
    except ImportError:
        raise TrtspecError("--plot needs matplotlib: pip install 'trtspec[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 3.5))
    bins = range(len(preflight.histogram))
    left.bar(bins, preflight.histogram, color=["#4477aa"] * (len(preflight.histogram) - 1) + ["#cc3311"])
    left.set(xlabel="accepted drafts per cycle", ylabel="cycles",
             title=f"B={preflight.block_size}: ceiling {preflight.ceiling_fraction:.1%}")
    rates = preflight.per_position_acceptance
    right.plot(range(1, len(rates) + 1), [r if r is not None else float("nan") for r in rates], marker="o")
    right.set(xlabel="block position k", ylabel="P(accept k | accepted k-1)", ylim=(0, 1.02),
              title=f"tau {preflight.tau:.2f} -> stranded estimate {preflight.stranded_tau_estimate:.2f}")
    figure.tight_layout()
    try:
        with staged_file(path, suffix=PLOT_SUFFIX, what="--plot") as temporary:
            figure.savefig(temporary, dpi=120, format="png")
    finally:
        plt.close(figure)


def run_preflight(pipeline, prompts: list[str], block_size: int, max_new_tokens: int, sampling,
                  progress: bool = True) -> Preflight:
    """Decode every prompt at `block_size` and pool the acceptance histograms."""
    sweep = Sweep((BlockChoice(block_size),), max_new_tokens, sampling, with_ar=False)
    done = run_sweep([pipeline_requests(pipeline)], prompts, sweep, desc="preflight", progress=progress)
    stats = [generation.stats for generation in done.of(0)[0]]
    return Preflight(block_size, pooled_histogram(stats), mean_tau(stats), [_request(s) for s in stats])


def _request(stats: DecodeStats, **extra) -> dict:
    """One request's line in the report."""
    return {"tau": stats.tau, "cycles": stats.cycles, "ceiling_fraction": stats.ceiling_fraction,
            "new_tokens": stats.new_tokens, "histogram": stats.histogram, "draft_tokens": stats.draft_tokens,
            **extra}


ANCHORS_PER_PASS = 32  # blocks per packed drafter pass when teacher forcing (bounds the attention mask)


def run_teacher_forced(pipeline, prompts: list[str], block_size: int, max_new_tokens: int,
                       progress: bool = True) -> Preflight:
    """Greedy acceptance of the drafter at every position of the target's own greedy continuation.

    Decoding starts a cycle wherever the previous one stopped, so two drafters are measured on
    different contexts: one that commits more per cycle spends fewer cycles on easy text, and its
    per-position rates lean toward the hard contexts that remain. Here the "cycle" starts at each
    of the first `max_new_tokens` positions of the continuation — the same contexts for every
    drafter and block size — so a difference in per-position acceptance is the drafter's own.
    The continuation runs `block_size - 1` tokens further so that every block has its targets.
    Each request also lists its blocks' accepted counts (`accepted`, one per start position).
    """
    from trtspec.training.blocks import pack
    from trtspec.training.data import continue_prompts

    target, drafter, codec = pipeline.target, pipeline.drafter, pipeline.codec
    if target is None or drafter is None:
        raise TrtspecError("teacher-forced acceptance runs the checkpoints: give --target and --drafter, not --engine")
    config = GenerationConfig(block=AR, max_new_tokens=max_new_tokens + block_size - 1)
    prompt_ids = [codec.encode(p) for p in prompts]
    continuations = continue_prompts(pipeline, prompt_ids, config.with_stop_ids(codec.stop_ids), progress=progress)
    stats, accepted_counts = [], []
    with torch.inference_mode():
        for ids, continuation in tqdm(list(zip(prompt_ids, continuations)), desc="teacher-forced", unit="req",
                                      file=sys.stderr, disable=not progress, dynamic_ncols=True):
            sequence = ids + continuation
            last = min(len(ids) + max_new_tokens, len(sequence) - block_size + 1)
            anchors = torch.arange(len(ids), max(len(ids), last))  # none if it stopped within a block
            _, features = target(torch.tensor([sequence], device=target.device), 0, None,
                                 drafter.config.target_layer_ids)
            accepted = []
            for group in anchors.split(ANCHORS_PER_PASS):
                batch = pack([(sequence, len(ids))], block_size, len(group), drafter.config.mask_token_id,
                             1.0, None, anchor_sets=[group])
                hidden = drafter.forward_packed(features, batch.block_tokens.to(target.device),
                                                batch.block_positions.to(target.device), batch.mask.to(target.device))
                drafts = drafter.lm_head(hidden).argmax(-1).cpu().view(-1, block_size)[:, 1:]
                matches = drafts == batch.labels.view(-1, block_size)[:, 1:]
                accepted += matches.int().cumprod(dim=1).sum(dim=1).tolist()
            counts = [accepted.count(a) for a in range(block_size)]
            stats.append(DecodeStats(block_size, new_tokens=len(continuation), histogram=counts,
                                     draft_tokens=len(accepted) * (block_size - 1)))
            accepted_counts.append(accepted)
    requests = [_request(s, accepted=accepted) for s, accepted in zip(stats, accepted_counts)]
    return Preflight(block_size, pooled_histogram(stats), mean_tau(stats), requests)
