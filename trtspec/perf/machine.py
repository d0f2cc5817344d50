"""The machine description that every measurement records beside its figures."""

from __future__ import annotations

import os
import platform

import torch

from trtspec import __version__
from trtspec.device import cpu_flags, cpu_model

KERNEL_FLAGS = {"avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8"}


def machine_info(pipeline) -> dict:
    """`describe_machine` of the device, dtype and backend a Pipeline runs on."""
    return describe_machine(pipeline.runner.device, pipeline.dtype, pipeline.backend)


def describe_machine(device: torch.device, dtype: torch.dtype, backend: str) -> dict:
    """What a measurement ran on: recorded beside every timing so figures from two runs can be compared."""
    info = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu": cpu_model(),  # hosts differ (AMX or not): a figure is only comparable on the same CPU
        "cpu_features": sorted(cpu_flags() & KERNEL_FLAGS),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
        "backend": backend,
        "python": platform.python_version(),
        "trtspec": __version__,
    }
    if device.type == "cuda":
        info["gpu"], info["cuda"] = torch.cuda.get_device_name(device), torch.version.cuda
    return info
