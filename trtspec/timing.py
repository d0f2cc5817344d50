"""The timing primitive that BlockPilot's start-up cost table (trtspec.blockpilot.costs) and the
measurement layer (trtspec.perf) both use: one call, timed the way its device needs."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class Timer:
    """Median milliseconds of a call after warm-ups: CUDA events on a GPU (launches are
    asynchronous, so the host clock would time the launch), the host clock on the CPU."""

    device: torch.device
    repeats: int = 30
    warmup: int = 3

    def __call__(self, fn: Callable[[], object]) -> float:
        for _ in range(self.warmup):
            fn()
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
        times = []
        for _ in range(self.repeats):
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                began = time.perf_counter()
                fn()
                times.append((time.perf_counter() - began) * 1e3)
        return statistics.median(times)
