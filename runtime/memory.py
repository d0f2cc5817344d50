"""Memory for the KV caches: how much a device has, and refusing caches that cannot fit before
they are allocated (one line with the figures, instead of an allocation traceback or a machine
pushed into swap). The runner allocates every cache once at its full size (max context x slots),
so what a concurrency costs is known before any request arrives."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Iterable, Sequence

import torch

from trtspec.errors import TrtspecError

MEMINFO = Path("/proc/meminfo")
DEFAULT_GPU_MEMORY_FRACTION = 0.9  # of a CUDA device's memory trtspec may hold (weights, caches, graphs), as vLLM's default


def limit_gpu_memory(fraction: float, device: torch.device) -> None:
    """Hold this process to `fraction` of `device`'s memory: torch's allocator refuses beyond it,
    and the caches are sized within it (available_bytes)."""
    # "cuda" names no index, which torch refuses here: it means the current device.
    index = device.index if device.index is not None else torch.cuda.current_device()
    torch.cuda.set_per_process_memory_fraction(fraction, index)


def available_bytes(device: torch.device) -> int:
    """Bytes a new allocation can take on `device`: on a CUDA device its free memory, within this
    process's share of it (limit_gpu_memory) less what torch holds already; on the CPU the kernel's
    MemAvailable estimate (free + reclaimable), else the physical memory."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        share = torch.cuda.get_per_process_memory_fraction(device) * total - torch.cuda.memory_reserved(device)
        return max(0, min(free, int(share)))
    try:
        for line in MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def format_bytes(count: float) -> str:
    """1536 -> '1.5 KiB' (binary units, as `free -h` and nvidia-smi count)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if count < 1024 or unit == "TiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    raise AssertionError("unreachable")


def cache_bytes(shapes: Iterable[Sequence[int]], dtype: torch.dtype) -> int:
    """Bytes of the key and value buffers of these cache shapes (one of each per shape)."""
    return 2 * dtype.itemsize * sum(math.prod(shape) for shape in shapes)


def check_cache_fits(slots: int, bytes_per_slot: int, max_context: int, device: torch.device) -> None:
    """Refuse `slots` requests' caches of `bytes_per_slot` each when `device` has not that much
    memory available: names the concurrency, the sizes and how many slots would fit."""
    needed, available = slots * bytes_per_slot, available_bytes(device)
    if needed <= available:
        return
    where = "this machine has" if device.type == "cpu" else f"{device} has (within --gpu-memory-fraction)"
    fits = available // bytes_per_slot
    room = f"room for at most ~{fits} concurrent requests" if fits else "not enough for one request"
    raise TrtspecError(f"concurrency {slots} needs {format_bytes(needed)} of KV cache ({format_bytes(bytes_per_slot)} "
                       f"per request at max context {max_context}); {where} {format_bytes(available)} available "
                       f"({room}): lower the concurrency or the max context")
