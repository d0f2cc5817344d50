"""The one interface every compiled backend implements.

An executor runs named graphs over caller-owned tensors: the runtime passes input tensors and
preallocated output tensors (often views into its KV-cache buffers), and the executor writes
the outputs in place. It knows graph and tensor names from `trtspec.export.bindings`, nothing
about Qwen3 or drafting.
"""

from __future__ import annotations

from typing import Mapping, Protocol

import torch

from trtspec.device import MODEL_DTYPES

# Profile keys: "prefill" for the target's prompt pass, else the token count of the call
# (a block size, or 1 for an autoregressive step).
ProfileKey = int | str
PREFILL = "prefill"

TORCH_DTYPES = {**MODEL_DTYPES, "int64": torch.int64}  # of the graphs' bindings


class Executor(Protocol):
    backend: str
    device: torch.device

    def run(self, graph: str, profile: ProfileKey, inputs: Mapping[str, torch.Tensor],
            outputs: Mapping[str, torch.Tensor]) -> None:
        """Run `graph` under `profile`, writing every output into the given tensor."""
        ...
