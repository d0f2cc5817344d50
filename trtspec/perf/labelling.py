"""`trtspec label-blocks`: BlockPilot's labels, measured. Every prompt runs autoregressively and at
every candidate block size through the sweep, and its prefill is summarised into the policy's
inputs; what that makes (the label set: its files, schema and modelled speeds) is
trtspec.blockpilot.labels."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from trtspec.blockpilot.labels import LABELS_VERSION, LabelSet, run_key
from trtspec.blockpilot.policy import PREFILL_KINDS, summarize_prefill
from trtspec.errors import TrtspecError
from trtspec.perf.sweep import Sweep, pipeline_requests, run_sweep
from trtspec.runtime.sampling import SamplingConfig
from trtspec.runtime.schedule import BlockChoice


@dataclass(frozen=True)
class LabelConfig:
    choices: tuple[BlockChoice, ...] = tuple(BlockChoice(b) for b in (12, 16, 20, 24))
    max_new_tokens: int = 128
    sampling: SamplingConfig = field(default_factory=SamplingConfig)

    def __post_init__(self) -> None:
        fixed = {c.size for c in self.choices if not c.grow_to}
        for choice in self.choices:
            if not set(choice.sizes) <= fixed:
                raise TrtspecError(f"the growing block {choice.name} is modelled from the cycle costs of B="
                                   f"{choice.size} and B={choice.grow_to}; add both as fixed block sizes")


def label_blocks(pipeline, prompts: list[str], config: LabelConfig, *, prompts_name: str = "prompts",
                 progress: bool = True) -> LabelSet:
    """Run every prompt autoregressively and at every block size; summarise each prompt's prefill."""
    if not pipeline.has_drafter:
        raise TrtspecError("labelling block sizes needs a drafter")
    seed = config.sampling.seed if config.sampling.seed is not None else 0
    summaries, lengths = {k: [] for k in PREFILL_KINDS}, []
    for prompt in prompts:  # the policy's inputs: a summary of each prompt's prefill
        ids = pipeline.codec.encode(prompt)
        lengths.append(len(ids))
        prompt_logits, prefill_features = pipeline.prefill(ids)
        for kind in PREFILL_KINDS:
            summaries[kind].append(summarize_prefill(prefill_features, prompt_logits, (kind,)).cpu())
    sweep = Sweep(config.choices, config.max_new_tokens, config.sampling)
    done = run_sweep([pipeline_requests(pipeline)], prompts, sweep, desc="label-blocks", progress=progress)
    records = [{"index": index, "prompt_tokens": length, "runs": {}} for index, length in enumerate(lengths)]
    for c, choice in enumerate(done.schedule):
        for record, generation in zip(records, done.of(c)[0]):
            stats = generation.stats
            record["runs"][run_key(choice)] = {
                "tau": stats.tau, "cycles": stats.cycles, "grown_cycles": stats.grown_cycles,
                "new_tokens": stats.new_tokens, "decode_s": stats.decode_s}
    costs = {}
    for block_size in [c.size for c in done.schedule if not c.grow_to]:
        seconds = sum(r["runs"][str(block_size)]["decode_s"] for r in records)
        cycles = sum(r["runs"][str(block_size)]["cycles"] for r in records)
        if cycles == 0:
            raise TrtspecError("no decode cycles were run (every prompt stopped at its first token); "
                               "use other prompts or a larger --max-new-tokens")
        costs[str(block_size)] = seconds / cycles
    header = {"labels_version": LABELS_VERSION, "prompts": prompts_name, "n_prompts": len(prompts),
              "block_sizes": [c.name if c.grow_to else c.size for c in config.choices],
              "max_new_tokens": config.max_new_tokens,
              "temperature": config.sampling.temperature, "seed": seed, "backend": pipeline.backend,
              "cycle_cost_s": costs, "ar_token_s": costs["1"],
              "vocab_size": int(prompt_logits.shape[-1])}
    label_set = LabelSet(header, records, {k: torch.stack(v) for k, v in summaries.items()})
    for record, label in zip(records, label_set.labels()):
        record["label"] = label.name
    return label_set
