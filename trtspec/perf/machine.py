"""The machine description that every measurement records beside its figures."""

from __future__ import annotations

import os
import platform

import torch

from trtspec import __version__


def machine_info(pipeline) -> dict:
    """`describe_machine` of the device, dtype and backend a Pipeline runs on."""
    return describe_machine(pipeline.runner.device, pipeline.dtype, pipeline.backend)


def describe_machine(device: torch.device, dtype: torch.dtype, backend: str) -> dict:
    """What a measurement ran on: recorded beside every timing so figures from two runs can be compared."""
    info = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
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
