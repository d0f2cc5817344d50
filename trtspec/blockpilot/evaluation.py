"""BlockPilot's evaluation on a (held-out) label set: every fixed block size, AR, the policy and the
per-prompt oracles, by modelled and measured speed-up and regret."""

from __future__ import annotations

import statistics

import torch

from trtspec.blockpilot.labels import LabelSet
from trtspec.blockpilot.policy import BlockPilot, time_choice
from trtspec.errors import TrtspecError
from trtspec.export.bindings import PREFILL_LOGITS
from trtspec.runtime.schedule import BlockChoice
from trtspec.runtime.stats import decode_tokens


def best_fixed_block_size(sets: list[LabelSet]) -> int:
    """The single fixed block size with the highest modelled speed-up over the sets."""
    return max(sets[0].fixed, key=lambda c: mean_speedup(sets, [[c] * len(s.records) for s in sets])).size


def mean_speedup(sets: list[LabelSet], choices: list[list[BlockChoice]]) -> float:
    """The modelled speed-up when set i's prompts run choices[i], averaged over the sets (each a kind
    of request: greedy, sampled, ...), so no kind counts more for having more prompts."""
    return sum(strategy_metrics(s, c)["modelled_speedup"] for s, c in zip(sets, choices)) / len(sets)


def strategy_metrics(labels: LabelSet, choices: list[BlockChoice]) -> dict:
    """Modelled and measured figures when prompt i runs with choices[i]; regret is against the
    per-prompt best fixed block size."""
    records = labels.records
    runs = [labels.run(r, c) for r, c in zip(records, choices)]
    oracle = labels.speeds(labels.fixed).max(dim=1).values
    chosen = torch.tensor([labels.speed(r, c) for r, c in zip(records, choices)])
    modelled_tokens = sum(run["tau"] * run["cycles"] for run in runs)
    modelled_s = sum(labels.modelled_seconds(run, c) for run, c in zip(runs, choices))
    measured_tokens = sum(decode_tokens(run["new_tokens"]) for run in runs)
    measured_s = sum(run["decode_s"] for run in runs)
    ar = [r["runs"]["1"] for r in records]
    ar_measured = sum(decode_tokens(run["new_tokens"]) for run in ar) / sum(run["decode_s"] for run in ar)
    return {
        "mean_tau": statistics.fmean(run["tau"] for run in runs),
        "modelled_tokens_per_s": modelled_tokens / modelled_s,
        "modelled_speedup": modelled_tokens / modelled_s * labels.header["ar_token_s"],
        "measured_tokens_per_s": measured_tokens / measured_s,
        "measured_speedup": measured_tokens / measured_s / ar_measured,
        "mean_regret": float((1 - chosen / oracle).mean()),
        "chosen": {c.name: choices.count(c) for c in labels.candidates(ar=True) if c in choices},
    }


def evaluate_policy(policy: BlockPilot, labels: LabelSet, fixed_block_size: int) -> dict:
    """Each column, AR, BlockPilot and the per-prompt oracles on one (held-out) label set. The oracle
    is the best fixed block size per prompt in hindsight; "oracle (all)" may also pick a growing
    block or AR."""
    missing = set(policy.choices) - set(labels.candidates(ar=True))
    if missing:
        raise TrtspecError(f"the labels lack {', '.join(sorted(c.name for c in missing))}, which the policy "
                           "can choose (label-blocks --block-sizes must include every policy candidate)")
    inputs = labels.inputs(policy.kinds)
    with torch.inference_mode():
        picks = policy.net(inputs).argmax(dim=1).tolist()
    pilot = [policy.choices[i] for i in picks]
    strategies = {"AR" if c.size == 1 else f"B={c.name}": strategy_metrics(labels, [c] * len(labels.records))
                  for c in labels.candidates(ar=True)}
    strategies["blockpilot"] = strategy_metrics(labels, pilot)
    strategies["oracle"] = strategy_metrics(labels, labels.labels(labels.fixed))
    strategies["oracle (all)"] = strategy_metrics(labels, labels.labels(labels.candidates(ar=True)))
    fixed, best, oracle = (strategies[f"B={fixed_block_size}"]["modelled_speedup"],
                           strategies["blockpilot"]["modelled_speedup"], strategies["oracle"]["modelled_speedup"])
    decode_s = statistics.fmean(labels.run(r, c)["decode_s"] for r, c in zip(labels.records, pilot))
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
        "gap_closed": (best - fixed) / (oracle - fixed) if oracle > fixed else None,  # None: no gap
        "policy_overhead_s": overhead_s, "mean_decode_s": decode_s,
        "policy_overhead_fraction": overhead_s / decode_s,
    }


def format_evaluation(report: dict) -> str:
    lines = [f"{report['prompts']}: {report['n_prompts']} prompts, T={report['temperature']:g}, {report['backend']}; "
             f"fixed baseline B={report['fixed_block_size']} (best on the training labels); "
             "regret against the per-prompt best fixed B",
             f"{'strategy':>12}  {'tau':>5}  {'speed-up (modelled)':>19}  {'speed-up (measured)':>19}  {'regret':>6}"]
    for name, m in report["strategies"].items():
        lines.append(f"{name:>12}  {m['mean_tau']:>5.2f}  {m['modelled_speedup']:>18.3f}x  "
                     f"{m['measured_speedup']:>18.3f}x  {m['mean_regret']:>6.1%}")
    chosen = report["strategies"]["blockpilot"]["chosen"]
    fixed, closed = report["fixed_block_size"], report["gap_closed"]
    gap = (f"closes {closed:.0%} of the gap from B={fixed} to the oracle" if closed is not None
           else f"the oracle is no faster than B={fixed}")
    picks = ", ".join(f"{'' if name == 'AR' else 'B='}{name}: {n}" for name, n in chosen.items())
    lines.append(f"BlockPilot chose {picks}; "
                 f"{gap}; overhead {report['policy_overhead_s'] * 1e6:.0f} us per request "
                 f"({report['policy_overhead_fraction']:.3%} of decode)")
    return "\n".join(lines)
