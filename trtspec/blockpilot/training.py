"""BlockPilot's training: fit the policy's MLP on modelled speeds (expected regret), and compare
feature sets (and AR as a candidate) by cross-validation on label sets."""

from __future__ import annotations

import torch

from trtspec.blockpilot.evaluation import mean_speedup, strategy_metrics
from trtspec.blockpilot.labels import LabelSet
from trtspec.blockpilot.policy import BlockPilot, PolicyNet
from trtspec.errors import TrtspecError
from trtspec.runtime.schedule import BlockChoice

# "sampled" alone: no prefill summary (a policy that knows only whether the request samples)
FEATURE_SETS = ("sampled", "last", "mean", "length", "confidence", "confidence,length", "mean,confidence",
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


def with_regime(kinds: tuple[str, ...], sets: list[LabelSet]) -> tuple[str, ...]:
    """`kinds`, and "sampled" where the sets hold greedy and sampled runs: a prompt's best block size
    differs between them, so the policy must tell them apart."""
    mixed = len({s.header["temperature"] > 0 for s in sets}) > 1
    return kinds + ("sampled",) if mixed and "sampled" not in kinds else kinds


def fold_rows(count: int, folds: int) -> list[list[int]]:
    """Rows 0..count-1 dealt into `folds` held-out folds, the same for every set of `count` rows: a
    prompt labelled greedy and sampled (two sets, one prompt file) is held out of both at once."""
    order = torch.randperm(count, generator=torch.Generator().manual_seed(0)).tolist()
    return [sorted(order[fold::folds]) for fold in range(folds)]


def feature_ablation(sets: list[LabelSet], hidden: int, steps: int, folds: int = 5,
                     ar_options: tuple[bool, ...] = (False,)) -> dict[tuple[str, bool], dict]:
    """Cross-validated modelled speed-up (the mean over the sets: each is a kind of request), its
    standard error over the folds, and mean regret (over every labelled run) of a policy per
    (feature set, AR a candidate or not). "sampled" alone reads no prefill summary: it is the best
    fixed size per regime, the baseline a summary must beat on prompts it was not trained on."""
    folds = min(folds, *(len(s.records) for s in sets))  # a small set: one prompt a fold
    if folds < 2:
        raise TrtspecError("cross-validation needs at least 2 labelled prompts in every label set")
    table = {}
    held_out = [fold_rows(len(s.records), folds) for s in sets]
    for ar in ar_options:
        candidates = sets[0].candidates(ar)
        for name in FEATURE_SETS:
            kinds = with_regime(tuple(name.split(",")), sets)
            choices = [[candidates[0]] * len(s.records) for s in sets]
            fold_speedups = []
            for fold in range(folds):
                train = [s.subset(sorted(set(range(len(s.records))) - set(held[fold]))) for s, held in zip(sets, held_out)]
                policy = train_policy(torch.cat([t.inputs(kinds) for t in train]),
                                      torch.cat([t.speeds(candidates) for t in train]),
                                      candidates, kinds, hidden=hidden, steps=steps)
                unseen = [s.subset(held[fold]) for s, held in zip(sets, held_out)]
                with torch.inference_mode():
                    picks = [[candidates[i] for i in policy.net(u.inputs(kinds)).argmax(dim=1).tolist()] for u in unseen]
                for held, chosen, picked in zip(held_out, choices, picks):
                    for row, pick in zip(held[fold], picked):
                        chosen[row] = pick
                fold_speedups.append(mean_speedup(unseen, picks))
            regrets = [strategy_metrics(s, chosen)["mean_regret"] * len(s.records) for s, chosen in zip(sets, choices)]
            table[(name, ar)] = {
                "modelled_speedup": mean_speedup(sets, choices),
                "standard_error": float(torch.tensor(fold_speedups).std() / folds ** 0.5),
                "mean_regret": sum(regrets) / sum(len(s.records) for s in sets)}
    return table


def simplest_within_one_error(table: dict[tuple[str, bool], dict]) -> tuple[str, bool]:
    """The ablation's pick by the one-standard-error rule: the first entry (FEATURE_SETS' order,
    the baseline first; without AR before with it) whose speed-up is within one standard error of
    the best's. Near-ties on a few hundred labelled runs are noise, and a policy that reads more of
    the prompt than it must fits its label prompts, not the requests it will meet."""
    best = max(table.values(), key=lambda row: row["modelled_speedup"])
    floor = best["modelled_speedup"] - best["standard_error"]
    return next(key for key, row in table.items() if row["modelled_speedup"] >= floor)
