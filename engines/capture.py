"""CUDA-graph capture and replay of an executor's runs, keyed by their bindings.

A run whose graph, profile, tensor shapes and tensor addresses all equal an earlier run's launches
the same kernels on the same memory, so it is captured once and replayed from then on. The protocol
is fixed: warm up on a side stream (which also settles lazy initialisation and TensorRT's deferred
shape updates), synchronise, capture, replay. BatchRunner's static mode (trtspec.runtime.runner)
keeps every binding of a decode cycle at a fixed address, so each block size's draft and verify are
captured once and replayed every cycle. Needs a CUDA device; nothing here runs on the CPU.
"""

from __future__ import annotations

from typing import Callable, Mapping

import torch

from trtspec.engines.executor import ProfileKey

BindingKey = tuple
WARMUP_RUNS = 2
MAX_GRAPHS = 512  # beyond this, runs stay eager (each graph pins its own memory pool)


def binding_key(graph: str, profile: ProfileKey, inputs: Mapping[str, torch.Tensor],
                outputs: Mapping[str, torch.Tensor]) -> BindingKey:
    """What a captured graph depends on: the graph, its profile, and every tensor's shape and address."""
    tensors = sorted({**inputs, **outputs}.items())
    return (graph, profile, tuple((name, tuple(t.shape), t.data_ptr()) for name, t in tensors))


class CudaGraphs:
    """Captured runs of one executor on one device."""

    def __init__(self, device: torch.device):
        self.device = device
        self.graphs: dict[BindingKey, torch.cuda.CUDAGraph] = {}

    def run(self, key: BindingKey, launch: Callable[[], None]) -> None:
        """Replay the graph captured for `key`, capturing `launch` first if there is none yet.
        `launch` enqueues the work on the current stream and must not synchronise."""
        graph = self.graphs.get(key)
        if graph is None:
            if len(self.graphs) >= MAX_GRAPHS:
                launch()
                return
            graph = self.graphs[key] = self._capture(launch)
        graph.replay()

    def _capture(self, launch: Callable[[], None]) -> torch.cuda.CUDAGraph:
        caller = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(caller)
        with torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):
                launch()
        caller.wait_stream(side)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            launch()
        return graph
