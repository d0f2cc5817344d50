"""BlockPilot's choice: a request's block size, once, right after prefill, from what prefill computed.

The candidates are block sizes and growing blocks (`6:16`: cycles at 6, at 16 after one that
fills a block of 6; see trtspec.runtime.schedule), so the one choice after prefill also decides
whether the request may widen its block inside repetitive stretches; and, optionally, AR: no
speculation for a request where no block size would pay for its cycles.

The prefill already produced the target's tapped-layer features of every prompt position (the
drafter's context) and its next-token logits over the prompt's last positions; BlockPilot reads a
summary of them (the last position's features, their mean over the prompt, the prompt length, and
the target's confidence over the prompt's tail: how predictable the text is to the target, which
is what acceptance measures), and whether the request samples (a sampled request accepts less than
a greedy one on the same prompt, so its best block size is smaller); a small MLP scores each
candidate block size. It runs once per request, in the runtime, on tensors that are already there.

Labels come from running every prompt at every candidate block size (`trtspec label-blocks`): a
request's speed at B is modelled as tau_B / cycle_cost_B, with the per-cycle cost of each block
size measured on the backend (wall times of single requests are too noisy to label with). The
policy is trained to minimise expected regret against the best block size of each prompt, so
a choice that is nearly as fast costs nearly nothing.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from trtspec.errors import TrtspecError
from trtspec.fileio import POLICY, staged_directory
from trtspec.runtime.schedule import BlockChoice
from trtspec.timing import Timer
from trtspec.validate import POSITIVE_INT, Fields, load_tensors, read_json_object

PREFILL_KINDS = ("last", "mean", "length", "confidence")  # summaries of what prefill computed
FEATURE_KINDS = PREFILL_KINDS + ("sampled",)  # ... and the request's own: 1 when it samples (T > 0)
POLICY_CONFIG, POLICY_WEIGHTS = "policy.json", "policy.safetensors"
DRAFTER_POLICY_DIR = "blockpilot"  # a drafter directory may ship its policy here
# ... and one labelled through an engine of other weights, whose cycles cost otherwise: on a 4-bit engine a
# verify of 16 costs 4.5 AR steps (2 in float32) and a sampled request's speculation does not pay
WEIGHTS_POLICY_DIRS = {"int4": "blockpilot-int4"}


def drafter_policy(drafter_dir: str | Path | None, weights: str = "float") -> Path | None:
    """The policy shipped inside a drafter directory for an engine of `weights` (`trtspec build
    --weights`): the one labelled on such an engine where the drafter ships one, else its general one;
    None if it ships none."""
    if drafter_dir is None:
        return None
    for name in (WEIGHTS_POLICY_DIRS.get(weights), DRAFTER_POLICY_DIR):
        if name is not None and (Path(drafter_dir) / name / POLICY_CONFIG).is_file():
            return Path(drafter_dir) / name
    return None


def summarize_prefill(features: torch.Tensor, logits: torch.Tensor, kinds: tuple[str, ...] = PREFILL_KINDS,
                      sampled: bool = False) -> torch.Tensor:
    """The policy's input from prefill's features [P, F] and tail logits [T, V] of a request that
    samples or not: the chosen summaries, concatenated (float32)."""
    features = features.float()
    parts = []
    for kind in kinds:
        if kind == "last":
            parts.append(features[-1])
        elif kind == "mean":
            parts.append(features.mean(dim=0))
        elif kind == "length":
            parts.append(torch.tensor([math.log(features.shape[0])], device=features.device))
        elif kind == "confidence":
            parts.append(prompt_confidence(logits).to(features.device))
        elif kind == "sampled":
            parts.append(torch.tensor([float(sampled)], device=features.device))
        else:
            raise TrtspecError(f"unknown BlockPilot feature {kind!r} (known: {', '.join(FEATURE_KINDS)})")
    return torch.cat(parts)


def prompt_confidence(logits: torch.Tensor) -> torch.Tensor:
    """The target's mean next-token entropy and mean top-1 probability over the prompt's tail [2].

    One pass of exp over the [T, V] logits: with w = exp(l - max) and Z = sum(w), the entropy is
    max + log Z - (w . l) / Z and the top-1 probability 1 / Z. `auto` runs this on the engine
    thread for every request, where nothing else decodes, so it takes one pass rather than
    log_softmax, exp and max in turn (timings: docs/benchmarks.md)."""
    logits = logits.float()
    top = logits.max(dim=-1, keepdim=True).values
    weights = (logits - top).exp_()
    total = weights.sum(dim=-1)
    entropy = top.squeeze(-1) + total.log() - torch.linalg.vecdot(weights, logits) / total
    return torch.stack([entropy.mean(), total.reciprocal().mean()])


class PolicyNet(nn.Module):
    """Standardised input -> one hidden layer -> a score per candidate block size."""

    def __init__(self, inputs: int, hidden: int, choices: int):
        super().__init__()
        self.register_buffer("mean", torch.zeros(inputs))
        self.register_buffer("std", torch.ones(inputs))
        self.layers = nn.Sequential(nn.Linear(inputs, hidden), nn.GELU(), nn.Linear(hidden, choices))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers((x - self.mean) / self.std)


@dataclass
class BlockPilot:
    choices: tuple[BlockChoice, ...]
    kinds: tuple[str, ...]
    net: PolicyNet
    info: dict

    @property
    def block_sizes(self) -> tuple[int, ...]:
        """Every block size the policy's choices run (what the engine must have; AR needs none)."""
        return tuple(sorted({size for choice in self.choices for size in choice.sizes if size > 1}))

    @property
    def reads_logits(self) -> bool:
        return "confidence" in self.kinds

    def choose(self, features: torch.Tensor, logits: torch.Tensor, sampled: bool = False) -> BlockChoice:
        """The schedule for a request whose prefill produced `features` [P, F] and tail `logits` [T, V]."""
        x = summarize_prefill(features, logits, self.kinds, sampled).to(self.net.mean.device)
        with torch.inference_mode():
            return self.choices[int(self.net(x).argmax())]

    def to(self, device: torch.device) -> "BlockPilot":
        self.net.to(device)
        return self

    def save(self, directory: str | Path) -> Path:
        config = {"kind": "blockpilot", "choices": [c.name for c in self.choices], "features": list(self.kinds),
                  "inputs": self.net.mean.numel(), "hidden": self.net.layers[0].out_features, **self.info}
        with staged_directory(directory, POLICY) as staging:
            (staging / POLICY_CONFIG).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
            save_file({k: v.contiguous() for k, v in self.net.state_dict().items()}, str(staging / POLICY_WEIGHTS))
        return Path(directory)


def read_policy_config(path: Path) -> dict:
    """policy.json of a BlockPilot policy: "choices" (block sizes, B:G or AR), "features" (known
    kinds), "inputs" and "hidden" (positive sizes); returns the parsed values and the rest as info."""
    data = read_json_object(path, "BlockPilot policy")
    fields = Fields(data, path)
    key = "choices" if "choices" in data else "block_sizes"  # "block_sizes": before growing blocks
    raw = fields.items(key, (str, int), "block sizes (B, \"B:G\" or \"AR\")", nonempty=True)
    try:
        choices = tuple(BlockChoice.parse(c, allow_auto=False, allow_ar=True) for c in raw)
    except TrtspecError as exc:
        fields.fail(key, f"holds a bad block size ({exc})")
    kinds = tuple(fields.strings("features", nonempty=True))
    unknown = [k for k in kinds if k not in FEATURE_KINDS]
    if unknown:
        fields.fail("features", f"holds unknown kinds {unknown} (known: {', '.join(FEATURE_KINDS)})")
    parsed = {"choices": choices, "features": kinds, "inputs": fields.integer("inputs", POSITIVE_INT),
              "hidden": fields.integer("hidden", POSITIVE_INT)}
    parsed["info"] = {k: v for k, v in data.items() if k not in ("choices", "block_sizes", "features", "inputs",
                                                                   "hidden")}
    return parsed


def load_policy(directory: str | Path, available_block_sizes: tuple[int, ...] | None = None) -> BlockPilot:
    """Load a policy directory; refuse one that may choose a block size the engine lacks."""
    directory = Path(directory)
    config_path, weights_path = directory / POLICY_CONFIG, directory / POLICY_WEIGHTS
    if not config_path.is_file() or not weights_path.is_file():
        raise TrtspecError(f"{directory} is not a BlockPilot policy (needs {POLICY_CONFIG} and {POLICY_WEIGHTS}; "
                           "make one with `trtspec train-policy`)")
    config = read_policy_config(config_path)
    choices, kinds = config["choices"], config["features"]
    net = PolicyNet(config["inputs"], config["hidden"], len(choices))
    try:
        net.load_state_dict(load_tensors(weights_path, "BlockPilot policy"))
    except RuntimeError as exc:  # missing, unexpected or misshaped tensors
        reason = " ".join(str(exc).split())[:200]
        raise TrtspecError(f"{weights_path} does not fit {config_path.name} ({reason})") from None
    if not all(bool(torch.isfinite(t).all()) for t in net.state_dict().values()):
        raise TrtspecError(f"{weights_path} holds NaN or infinite values")
    policy = BlockPilot(choices, kinds, net.eval(), config["info"])
    if available_block_sizes is not None:
        missing = sorted(set(policy.block_sizes) - set(available_block_sizes))
        if missing:
            raise TrtspecError(f"the policy in {directory} chooses among {', '.join(c.name for c in choices)}, "
                               f"but block size{'' if len(missing) == 1 else 's'} {', '.join(map(str, missing))} "
                               f"{'is' if len(missing) == 1 else 'are'} not in the engine "
                               f"(built for {', '.join(map(str, available_block_sizes))})")
    return policy


def time_choice(policy: BlockPilot, features: torch.Tensor, logits: torch.Tensor, repeats: int = 200) -> float:
    """Median seconds for one `choose` call (the policy's whole per-request cost)."""
    timer = Timer(policy.net.mean.device, repeats=repeats, warmup=1)
    return timer(lambda: policy.choose(features, logits)) / 1e3
