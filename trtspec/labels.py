"""BlockPilot's data: per-prompt labels (every prompt at every block size) and the evaluation.

A label set is `OUT.jsonl` (a header line with the settings and the per-cycle cost table, then
one line per prompt with tau, cycles, tokens and raw decode time at AR and at every block size)
and `OUT.features.safetensors` (prefill summaries of every prompt, one tensor per feature kind,
so feature sets can be compared without rerunning anything).

A request's speed at B is *modelled* as tau_B / cycle_cost_B, with cycle_cost_B the backend's
mean decode time per cycle at B over the whole set: single-request wall times are noisy on a
shared machine, the cost per cycle is not. The raw times are kept for checking.
"""

from __future__ import annotations

import json
import statistics
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from trtspec.errors import TrtspecError
from trtspec.export.bindings import PREFILL_LOGITS
from trtspec.fileio import atomic_write_text
from trtspec.policy import FEATURE_KINDS, BlockPilot, summarize_prefill, time_choice
from trtspec.runtime.decode import GenerationConfig
from trtspec.runtime.sampling import SamplingConfig
from trtspec.training.data import read_jsonl

LABELS_VERSION = 2  # 2: confidence features, vocab_size


@dataclass(frozen=True)
class LabelConfig:
    block_sizes: tuple[int, ...] = (12, 16, 20, 24)
    max_new_tokens: int = 128
    sampling: SamplingConfig = field(default_factory=SamplingConfig)


def features_path(path: Path) -> Path:
    return path.with_name(path.name.removesuffix(".jsonl") + ".features.safetensors")


@dataclass
class LabelSet:
    header: dict
    records: list[dict]
    features: dict[str, torch.Tensor]  # kind -> [N, D_kind]

    @property
    def block_sizes(self) -> tuple[int, ...]:
        return tuple(self.header["block_sizes"])

    def cycle_cost(self, block_size: int) -> float:
        return self.header["cycle_cost_s"][str(block_size)]

    def speeds(self) -> torch.Tensor:
        """Modelled decode tokens/s [N, K]: tau at B over the cost of one cycle at B."""
        return torch.tensor([[r["runs"][str(b)]["tau"] / self.cycle_cost(b) for b in self.block_sizes]
                             for r in self.records], dtype=torch.float32)

    def labels(self) -> list[int]:
        return [self.block_sizes[i] for i in self.speeds().argmax(dim=1).tolist()]

    def inputs(self, kinds: tuple[str, ...]) -> torch.Tensor:
        return torch.cat([self.features[k] for k in kinds], dim=1)

    def write(self, path: str | Path) -> Path:
        path = Path(path)
        if path.suffix != ".jsonl":
            raise TrtspecError(f"labels are written as JSONL; name the output *.jsonl, not {path.name}")
        lines = [json.dumps(self.header)] + [json.dumps(r) for r in self.records]
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = features_path(path).with_name("." + features_path(path).name + ".tmp")
        save_file({k: v.contiguous() for k, v in self.features.items()}, str(temporary))
        temporary.replace(features_path(path))
        return atomic_write_text(path, "\n".join(lines) + "\n")


def read_labels(path: str | Path) -> LabelSet:
    path = Path(path)
    rows = read_jsonl(path, ())
    if not rows or rows[0].get("labels_version") != LABELS_VERSION:
        raise TrtspecError(f"{path} is not a label set from `trtspec label-blocks` (version {LABELS_VERSION})")
    if not features_path(path).is_file():
        raise TrtspecError(f"{path}: its features file {features_path(path).name} is missing")
    features = load_file(str(features_path(path)))
    if any(t.shape[0] != len(rows) - 1 for t in features.values()):
        raise TrtspecError(f"{features_path(path).name} does not match {path.name} (different prompt counts)")
    return LabelSet(rows[0], rows[1:], features)


def label_blocks(pipeline, prompts: list[str], config: LabelConfig, *, prompts_name: str = "prompts",
                 progress: bool = True) -> LabelSet:
    """Run every prompt autoregressively and at every block size; summarise each prompt's prefill."""
    if not pipeline.has_drafter:
        raise TrtspecError("labelling block sizes needs a drafter")
    baseline = pipeline.autoregressive()
    seed = config.sampling.seed if config.sampling.seed is not None else 0
    records, summaries = [], {k: [] for k in FEATURE_KINDS}
    sizes = (1, *config.block_sizes)
    with tqdm(total=len(prompts) * len(sizes), desc="label-blocks", unit="req", file=sys.stderr,
              disable=not progress, dynamic_ncols=True) as bar:
        for index, prompt in enumerate(prompts):
            ids = pipeline.codec.encode(prompt)
            pipeline.engine.reset(len(ids))
            with torch.inference_mode():
                prompt_logits, prefill_features = pipeline.engine.prefill(ids)
            for kind in FEATURE_KINDS:
                summaries[kind].append(summarize_prefill(prefill_features, prompt_logits, (kind,)).cpu())
            runs = {}
            for block_size in sizes:
                generation_config = GenerationConfig(block_size=block_size, max_new_tokens=config.max_new_tokens,
                                                     sampling=replace(config.sampling, seed=seed + index))
                stats = (baseline if block_size == 1 else pipeline).generate(prompt, generation_config).generation.stats
                runs[str(block_size)] = {"tau": stats.tau, "cycles": stats.cycles, "new_tokens": stats.new_tokens,
                                         "decode_s": stats.decode_s}
                bar.update()
            records.append({"index": index, "prompt_tokens": len(ids), "runs": runs})
    costs = {}
    for block_size in sizes:
        seconds = sum(r["runs"][str(block_size)]["decode_s"] for r in records)
        cycles = sum(r["runs"][str(block_size)]["cycles"] for r in records)
        if cycles == 0:
            raise TrtspecError("no decode cycles were run (every prompt stopped at its first token); "
                               "use other prompts or a larger --max-new-tokens")
        costs[str(block_size)] = seconds / cycles
    header = {"labels_version": LABELS_VERSION, "prompts": prompts_name, "n_prompts": len(prompts),
              "block_sizes": list(config.block_sizes), "max_new_tokens": config.max_new_tokens,
              "temperature": config.sampling.temperature, "seed": seed, "backend": pipeline.backend,
              "cycle_cost_s": costs, "ar_token_s": costs["1"],
              "vocab_size": int(prompt_logits.shape[-1])}
    label_set = LabelSet(header, records, {k: torch.stack(v) for k, v in summaries.items()})
    for record, label in zip(records, label_set.labels()):
        record["label"] = label
    return label_set


def best_fixed_block_size(labels: LabelSet) -> int:
    """The single block size with the highest modelled decode speed over the whole set."""
    tokens = {b: sum(r["runs"][str(b)]["tau"] * r["runs"][str(b)]["cycles"] for r in labels.records)
              for b in labels.block_sizes}
    seconds = {b: sum(r["runs"][str(b)]["cycles"] for r in labels.records) * labels.cycle_cost(b)
               for b in labels.block_sizes}
    return max(labels.block_sizes, key=lambda b: tokens[b] / seconds[b])


def strategy_metrics(labels: LabelSet, choices: list[int]) -> dict:
    """Modelled and measured figures when prompt i runs at block size choices[i]."""
    records = labels.records
    runs = [r["runs"][str(b)] for r, b in zip(records, choices)]
    speeds = labels.speeds()
    oracle = speeds.max(dim=1).values
    chosen = torch.tensor([speeds[i, labels.block_sizes.index(b)] for i, b in enumerate(choices)])
    modelled_tokens = sum(run["tau"] * run["cycles"] for run in runs)
    modelled_s = sum(run["cycles"] * labels.cycle_cost(b) for run, b in zip(runs, choices))
    measured_tokens = sum(max(run["new_tokens"] - 1, 0) for run in runs)
    measured_s = sum(run["decode_s"] for run in runs)
    ar = [r["runs"]["1"] for r in records]
    ar_measured = sum(max(run["new_tokens"] - 1, 0) for run in ar) / sum(run["decode_s"] for run in ar)
    return {
        "mean_tau": statistics.fmean(run["tau"] for run in runs),
        "modelled_tokens_per_s": modelled_tokens / modelled_s,
        "modelled_speedup": modelled_tokens / modelled_s * labels.header["ar_token_s"],
        "measured_tokens_per_s": measured_tokens / measured_s,
        "measured_speedup": measured_tokens / measured_s / ar_measured,
        "mean_regret": float((1 - chosen / oracle).mean()),
        "chosen": {str(b): choices.count(b) for b in labels.block_sizes},
    }


def evaluate_policy(policy: BlockPilot, labels: LabelSet, fixed_block_size: int) -> dict:
    """Each fixed block size, BlockPilot and the per-prompt oracle on one (held-out) label set."""
    missing = set(policy.block_sizes) - set(labels.block_sizes)
    if missing:
        raise TrtspecError(f"the labels lack block sizes {sorted(missing)} that the policy can choose")
    inputs = labels.inputs(policy.kinds)
    with torch.inference_mode():
        picks = policy.net(inputs).argmax(dim=1).tolist()
    pilot = [policy.block_sizes[i] for i in picks]
    strategies = {f"B={b}": strategy_metrics(labels, [b] * len(labels.records)) for b in labels.block_sizes}
    strategies["blockpilot"] = strategy_metrics(labels, pilot)
    strategies["oracle"] = strategy_metrics(labels, labels.labels())
    fixed, best, oracle = (strategies[f"B={fixed_block_size}"]["modelled_speedup"],
                           strategies["blockpilot"]["modelled_speedup"], strategies["oracle"]["modelled_speedup"])
    decode_s = statistics.fmean(r["runs"][str(b)]["decode_s"] for r, b in zip(labels.records, pilot))
    # The policy's cost per request: summarising prefill's outputs plus the MLP, timed on
    # realistic prompt-sized features and tail logits.
    width, vocabulary = labels.features["last"].shape[1], labels.header["vocab_size"]
    prompt_tokens = int(statistics.median(r["prompt_tokens"] for r in labels.records))
    overhead_s = time_choice(policy, torch.randn(prompt_tokens, width),
                             torch.randn(min(prompt_tokens, PREFILL_LOGITS), vocabulary))
    return {
        "prompts": labels.header["prompts"], "n_prompts": len(labels.records), "backend": labels.header["backend"],
        "temperature": labels.header["temperature"], "fixed_block_size": fixed_block_size,
        "strategies": strategies,
        "gap_closed": (best - fixed) / (oracle - fixed) if oracle > fixed else float("nan"),
        "policy_overhead_s": overhead_s, "mean_decode_s": decode_s,
        "policy_overhead_fraction": overhead_s / decode_s,
    }


def format_evaluation(report: dict) -> str:
    lines = [f"{report['prompts']}: {report['n_prompts']} prompts, T={report['temperature']:g}, {report['backend']}; "
             f"fixed baseline B={report['fixed_block_size']} (best on the training labels)",
             f"{'strategy':>11}  {'tau':>5}  {'speed-up (modelled)':>19}  {'speed-up (measured)':>19}  {'regret':>6}"]
    for name, m in report["strategies"].items():
        lines.append(f"{name:>11}  {m['mean_tau']:>5.2f}  {m['modelled_speedup']:>18.3f}x  "
                     f"{m['measured_speedup']:>18.3f}x  {m['mean_regret']:>6.1%}")
    chosen = report["strategies"]["blockpilot"]["chosen"]
    lines.append(f"BlockPilot chose {', '.join(f'B={b}: {n}' for b, n in chosen.items())}; closes "
                 f"{report['gap_closed']:.0%} of the gap from B={report['fixed_block_size']} to the oracle; "
                 f"overhead {report['policy_overhead_s'] * 1e6:.0f} us per request "
                 f"({report['policy_overhead_fraction']:.3%} of decode)")
    return "\n".join(lines)
