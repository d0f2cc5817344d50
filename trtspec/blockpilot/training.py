"""BlockPilot's training: fit the policy's MLP on modelled speeds (expected regret), and compare
feature sets (and AR as a candidate) by cross-validation on a label set."""

from __future__ import annotations

import torch

from trtspec.blockpilot.evaluation import strategy_metrics
from trtspec.blockpilot.labels import LabelSet
from trtspec.blockpilot.policy import BlockPilot, PolicyNet
from trtspec.runtime.schedule import BlockChoice

FEATURE_SETS = ("last", "mean", "length", "confidence", "confidence,length", "mean,confidence",
                "last,mean,length", "last,mean,length,confidence")


def expected_regret(scores: torch.Tensor, speeds: torch.Tensor) -> torch.Tensor:
    """Mean over prompts of sum_B softmax(scores)_B * (1 - speed_B / best speed): cost-sensitive."""
    regret = 1.0 - speeds / speeds.max(dim=1, keepdim=True).values
    return (scores.softmax(dim=1) * regret).sum(dim=1).mean()


def train_policy(inputs: torch.Tensor, speeds: torch.Tensor, choices: tuple[BlockChoice | int, ...],
                 kinds: tuple[str, ...], *, hidden: int = 64, steps: int = 600, lr: float = 3e-3,
                 weight_decay: float = 1e-2, seed: int = 0) -> BlockPilot:
    """Fit the MLP on `inputs` [N, D] (summaries) against modelled `speeds` [N, len(choices)];
    plain integers among `choices` are fixed block sizes."""
    choices = tuple(c if isinstance(c, BlockChoice) else BlockChoice(c) for c in choices)
    torch.manual_seed(seed)
    net = PolicyNet(inputs.shape[1], hidden, len(choices))
    net.mean.copy_(inputs.mean(dim=0))
    net.std.copy_(inputs.std(dim=0).clamp_min(1e-6))
    optimizer = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=weight_decay)
    for _ in range(steps):
        optimizer.zero_grad()
        loss = expected_regret(net(inputs), speeds)
        loss.backward()
        optimizer.step()
    return BlockPilot(choices, tuple(kinds), net.eval(), {"train_prompts": inputs.shape[0],
                                                           "train_regret": float(loss.detach())})


def feature_ablation(labels: LabelSet, hidden: int, steps: int, folds: int = 5,
                     ar_options: tuple[bool, ...] = (False,)) -> dict[tuple[str, bool], dict]:
    """Cross-validated modelled speed-up and regret of a policy per (feature set, AR a candidate or not)."""
    n = len(labels.records)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(0)).tolist()
    table = {}
    for ar in ar_options:
        candidates = labels.candidates(ar)
        speeds = labels.speeds(candidates)
        for name in FEATURE_SETS:
            kinds = tuple(name.split(","))
            choices = [candidates[0]] * n
            for fold in range(folds):
                held = sorted(order[fold::folds])
                train = sorted(set(range(n)) - set(held))
                policy = train_policy(labels.inputs(kinds)[train], speeds[train], candidates, kinds, hidden=hidden, steps=steps)
                with torch.inference_mode():
                    picks = policy.net(labels.inputs(kinds)[held]).argmax(dim=1).tolist()
                for i, pick in zip(held, picks):
                    choices[i] = candidates[pick]
            metrics = strategy_metrics(labels, choices)
            table[(name, ar)] = {"mean_regret": metrics["mean_regret"], "modelled_speedup": metrics["modelled_speedup"]}
    return table
