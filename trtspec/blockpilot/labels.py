"""BlockPilot's label sets: every prompt run at every candidate block size, as `trtspec label-blocks`
measured it (trtspec.perf.labelling).

A label set is `OUT.jsonl` (a header line with the settings and the per-cycle cost table, then
one line per prompt with tau, cycles, tokens and raw decode time at AR and at every block size)
and `OUT.features.safetensors` (prefill summaries of every prompt, one tensor per feature kind,
so feature sets can be compared without rerunning anything).

A request's speed at B is *modelled* as tau_B / cycle_cost_B, with cycle_cost_B the backend's
mean decode time per cycle at B over the whole set: single-request wall times are noisy on a
shared machine, the cost per cycle is not. The raw times are kept for checking. A growing block
`B:G` (a column beside the fixed sizes) is modelled from its cycles at B and at G, with the costs
measured at the fixed sizes B and G, which must therefore be columns too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from trtspec.errors import TrtspecError
from trtspec.fileio import check_output_file, staged_file
from trtspec.blockpilot.policy import PREFILL_KINDS
from trtspec.runtime.schedule import BlockChoice
from trtspec.validate import (NON_NEGATIVE, POSITIVE, POSITIVE_INT, Fields, InputError, jsonl_records,
                              load_tensors)

LABELS_VERSION = 2  # 2: confidence features, vocab_size


def run_key(choice: BlockChoice) -> str:
    """Where a prompt's run of `choice` is stored in its record: its name, AR under "1"."""
    return "1" if choice.size == 1 else choice.name


def features_path(path: Path) -> Path:
    return path.with_name(path.name.removesuffix(".jsonl") + ".features.safetensors")


def check_labels_output(path: str | Path, inputs=()) -> None:
    """Refuse, before any labelling, an output that is not *.jsonl or where either file of the
    label set cannot or must not be written (`trtspec.fileio.check_output_file`)."""
    check_output_file(path, inputs, suffix=".jsonl", what="labels")
    check_output_file(features_path(Path(path)), inputs)


@dataclass
class LabelSet:
    header: dict
    records: list[dict]
    features: dict[str, torch.Tensor]  # kind -> [N, D_kind]

    @property
    def choices(self) -> tuple[BlockChoice, ...]:
        """The columns: fixed block sizes and growing blocks."""
        return tuple(BlockChoice.parse(b, allow_auto=False) for b in self.header["block_sizes"])

    @property
    def fixed(self) -> tuple[BlockChoice, ...]:
        return tuple(c for c in self.choices if not c.grow_to)

    def candidates(self, ar: bool = False) -> tuple[BlockChoice, ...]:
        """The columns a policy can choose from; with `ar`, also autoregressive decoding (always labelled)."""
        return self.choices + ((BlockChoice(1),) if ar else ())

    @staticmethod
    def run(record: dict, choice: BlockChoice) -> dict:
        return record["runs"][run_key(choice)]

    def cycle_cost(self, block_size: int) -> float:
        return self.header["cycle_cost_s"][str(block_size)]

    def modelled_seconds(self, run: dict, choice: BlockChoice) -> float:
        """A run's decode time from its cycle counts and the per-cycle costs."""
        grown = run.get("grown_cycles", 0)
        grown_s = grown * self.cycle_cost(choice.grow_to) if grown else 0.0
        return (run["cycles"] - grown) * self.cycle_cost(choice.size) + grown_s

    def speed(self, record: dict, choice: BlockChoice) -> float:
        """A prompt's modelled decode tokens/s with `choice` (0 if it ran no cycle: it stopped at prefill's token)."""
        run = self.run(record, choice)
        seconds = self.modelled_seconds(run, choice)
        return run["tau"] * run["cycles"] / seconds if seconds > 0 else 0.0

    def speeds(self, choices: tuple[BlockChoice, ...] | None = None) -> torch.Tensor:
        """Modelled decode tokens/s [N, K] of each of `choices` (default: every column)."""
        choices = self.choices if choices is None else choices
        return torch.tensor([[self.speed(r, c) for c in choices] for r in self.records], dtype=torch.float32)

    def labels(self, choices: tuple[BlockChoice, ...] | None = None) -> list[BlockChoice]:
        """Per prompt, the fastest of `choices` (default: every column) by modelled speed."""
        choices = self.choices if choices is None else choices
        return [choices[i] for i in self.speeds(choices).argmax(dim=1).tolist()]

    def subset(self, rows: list[int]) -> "LabelSet":
        """These prompts only (cross-validation's folds)."""
        return LabelSet(self.header, [self.records[r] for r in rows], {k: v[rows] for k, v in self.features.items()})

    def inputs(self, kinds: tuple[str, ...]) -> torch.Tensor:
        return torch.cat([self.features[k] for k in kinds], dim=1)

    def write(self, path: str | Path) -> Path:
        """The features file first, then the JSONL that names the set: each one atomically."""
        path = Path(path)
        check_labels_output(path)
        lines = [json.dumps(self.header)] + [json.dumps(r) for r in self.records]
        with staged_file(features_path(path)) as temporary:
            save_file({k: v.contiguous() for k, v in self.features.items()}, str(temporary))
        with staged_file(path, suffix=".jsonl", what="labels") as temporary:
            temporary.write_text("\n".join(lines) + "\n", encoding="utf-8")
        return path


def read_labels(path: str | Path) -> LabelSet:
    """A label set and its features, checked field by field as they are read (below); the "sampled"
    feature is the set's own temperature (every prompt of a set is decoded at one)."""
    path = Path(path)
    header, records = check_label_set(path, jsonl_records(path))
    if not features_path(path).is_file():
        raise TrtspecError(f"{path}: its features file {features_path(path).name} is missing")
    features = check_label_features(features_path(path), len(records))
    features["sampled"] = torch.full((len(records), 1), float(header["temperature"] > 0))
    return LabelSet(header, records, features)


def check_label_set(path: Path, rows: list[tuple[str, dict]]) -> tuple[dict, list[dict]]:
    """The header and records of a label set (`trtspec label-blocks`): every field the policy
    training and evaluation read, with its type and range."""
    (where, header), records = rows[0], rows[1:]
    head = Fields(header, where)
    if header.get("labels_version") != LABELS_VERSION:
        raise InputError(f"{path} is not a label set from `trtspec label-blocks` (version {LABELS_VERSION})")
    if not records:
        raise InputError(f"{path} holds a header but no labelled prompts")
    head.text("prompts")
    head.text("backend")
    head.number("temperature")
    head.integer("vocab_size", POSITIVE_INT)
    head.number("ar_token_s", POSITIVE)
    columns = head.items("block_sizes", (str, int), "block sizes (B or \"B:G\")", nonempty=True)
    try:
        choices = [BlockChoice.parse(c, allow_auto=False) for c in columns]
    except TrtspecError as exc:
        head.fail("block_sizes", f"holds a bad block size ({exc})")
    costs = head.obj("cycle_cost_s")
    for size in sorted({s for c in choices for s in c.sizes} | {1}):
        costs.number(str(size), POSITIVE)
    keys = ["1"] + [c.name for c in choices]
    for where, record in records:
        fields = Fields(record, where)
        fields.integer("prompt_tokens", POSITIVE_INT)
        runs = fields.obj("runs")
        for key in keys:
            run = runs.obj(key)
            run.number("tau", NON_NEGATIVE)
            run.integer("cycles")
            run.integer("new_tokens")
            run.number("decode_s", NON_NEGATIVE)
            if run.integer("grown_cycles", default=0) > run.data["cycles"]:
                run.fail("grown_cycles", "exceeds cycles")
    if sum(r["runs"]["1"]["decode_s"] for _, r in records) <= 0:
        raise InputError(f"{path}: runs.1.decode_s (autoregressive) is 0 for every prompt")
    return header, [record for _, record in records]


def check_label_features(path: Path, count: int) -> dict:
    """A label set's prefill summaries: one finite float tensor [count, D] per feature kind."""
    tensors = load_tensors(path, "label features")
    for kind in PREFILL_KINDS:
        tensor = tensors.get(kind)
        if tensor is None:
            raise InputError(f"{path}: has no tensor {kind!r}")
        if tensor.dim() != 2 or not tensor.is_floating_point() or tensor.shape[0] != count:
            raise InputError(f"{path}: tensor {kind!r} must be a float [{count}, D] tensor (one row per prompt), "
                             f"got {tensor.dtype} {list(tensor.shape)}")
        if not bool(torch.isfinite(tensor).all()):
            raise InputError(f"{path}: tensor {kind!r} holds NaN or infinite values")
    return tensors
