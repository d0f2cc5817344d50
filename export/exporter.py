"""torch.export of the step graphs, and their ONNX form.

Each graph is exported once with dynamic axes (token count, cached positions, context count,
block size) rather than once per block size: the weights are stored once, ONNX Runtime runs any
shape from the one graph, and TensorRT gets the per-block-size specialisation from its
optimization profiles (min = opt = max on the token axis for each block size, see
`trtspec.engines.tensorrt.profile_table`) inside a single engine that also holds one copy of
the weights.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import torch

from trtspec.export.bindings import DRAFT, MAX_BATCH, MAX_BLOCK_SIZE, TARGET, GraphSpec
from trtspec.export.fusion import fuse_file
from trtspec.export.steps import DraftStep, TargetStep
from trtspec.models import DFlashDrafter, Qwen3Target

# Example sizes for tracing: any values inside the ranges that are not 0 or 1 (which torch.export
# would treat as special) and differ from each other, so no two axes get unified by accident.
EXAMPLE_SIZES = {"tokens": 5, "past": 7, "context": 3, "block": 4, "batch": 2, "slots": 6, "positions": 9,
                 "scored": 8}


# torch.export specialises axes of size 1, and a block of 2 makes the proposals axis (B - 1) one;
# a two-token block (one proposal) is no use for a block drafter anyway.
MIN_COMPILED_BLOCK_SIZE = 3

# Unoptimized ONNX graphs still get constants up to this many elements folded (export_onnx).
SMALL_CONSTANT = 1024


def dim_ranges(max_context: int) -> dict[str, tuple[int, int]]:
    """(min, max) of every dynamic axis for an engine holding `max_context` positions."""
    return {
        "tokens": (1, max_context),            # prefill: the prompt; verify(B): B; AR: 1
        "past": (0, max_context + MAX_BLOCK_SIZE),
        "context": (1, max_context),           # first draft: the prompt's features; then 1..B
        "block": (MIN_COMPILED_BLOCK_SIZE, MAX_BLOCK_SIZE),
        "batch": (1, MAX_BATCH),               # requests in one call
        "slots": (1, MAX_BATCH),               # cache slots (concurrent requests) of the runtime's buffers
        "positions": (1, MAX_BATCH * max_context),  # a target call's real (unpadded) positions
        "scored": (1, MAX_BATCH * max_context),     # ... and those of them whose logits it returns
    }


def step_modules(target: Qwen3Target, drafter: DFlashDrafter) -> dict[str, torch.nn.Module]:
    return {TARGET: TargetStep(target, tuple(drafter.config.target_layer_ids)).eval(),
            DRAFT: DraftStep(drafter).eval()}


def _example(spec: GraphSpec, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, ...]:
    tensors = []
    for t in spec.inputs:
        shape = t.shape(EXAMPLE_SIZES)
        if t.name == "starts":
            tensors.append(torch.full(shape, EXAMPLE_SIZES["past"] + EXAMPLE_SIZES["context"], device=device))
        elif t.name == "counts":
            tensors.append(torch.full(shape, EXAMPLE_SIZES["context"], device=device))
        elif t.name in ("computed", "scored"):  # real positions among batch x tokens (all but the last),
            tensors.append(torch.arange(shape[0], device=device))  # scored ones among them (all but the last)
        elif t.name == "slots":
            tensors.append(torch.arange(shape[0], device=device) % EXAMPLE_SIZES["slots"])
        elif t.dtype == "int64":
            tensors.append(torch.ones(shape, dtype=torch.long, device=device))
        else:
            tensors.append(torch.randn(shape, dtype=dtype, device=device))
    return tuple(tensors)


def _dynamic_shapes(spec: GraphSpec, max_context: int) -> tuple:
    ranges = dim_ranges(max_context)
    dims = {name: torch.export.Dim(name, min=low, max=high) for name, (low, high) in ranges.items()}
    return tuple({axis: dims[d] for axis, d in enumerate(t.dims) if isinstance(d, str)} or None
                 for t in spec.inputs)


def export_program(module: torch.nn.Module, spec: GraphSpec, max_context: int,
                   dtype: torch.dtype, device: torch.device) -> torch.export.ExportedProgram:
    with torch.no_grad():
        return torch.export.export(module, _example(spec, dtype, device),
                                   dynamic_shapes=_dynamic_shapes(spec, max_context))


def export_onnx(module: torch.nn.Module, spec: GraphSpec, max_context: int, dtype: torch.dtype,
                device: torch.device, path: Path, optimize: bool = True) -> None:
    """Write `path` (ONNX, weights inline) and check it with onnx.checker. `optimize`: the exporter's
    own graph optimizer, which takes about as long as the export itself and which ONNX Runtime's
    optimizer, run when a session opens, makes nearly redundant; TensorRT's parser and the 4-bit
    quantizer get fully optimized graphs. Unoptimized graphs still get their small constants folded
    (a small part of the export's time): ONNX Runtime cannot fold the exporter's `CastLike` nodes
    itself, and on a small model each node left costs a dispatch per step (docs/benchmarks.md)."""
    import onnx
    import onnxscript.optimizer

    # The exporter reports every step and optional-package gaps (torchvision) on the console;
    # a build shows its own progress bar instead.
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            module, _example(spec, dtype, device), dynamic_shapes=_dynamic_shapes(spec, max_context),
            input_names=[t.name for t in spec.inputs], output_names=[t.name for t in spec.outputs],
            dynamo=True, optimize=optimize, verbose=False)
        if not optimize:
            onnxscript.optimizer.fold_constants(program.model, onnx_shape_inference=False,
                                                input_size_limit=SMALL_CONSTANT, output_size_limit=SMALL_CONSTANT)
    program.save(str(path))
    fuse_file(path)  # q/k/v, gate/up: one product each (export/fusion.py)
    onnx.checker.check_model(str(path), full_check=True)

