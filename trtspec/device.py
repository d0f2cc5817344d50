"""Devices and dtypes as the user names them ("auto", "cuda:1", "bfloat16"), resolved in one place."""

from __future__ import annotations

import torch

from trtspec.errors import TrtspecError
from trtspec.limits import check_device

MODEL_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str) -> torch.device:
    """auto, cpu, cuda or cuda:N (refused in one line when unknown or absent)."""
    device = check_device(device)
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise TrtspecError(f"device {device!r} requested but CUDA is not available")
    resolved = torch.device(device)
    if resolved.index is not None and resolved.index >= torch.cuda.device_count():
        raise TrtspecError(f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return resolved


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in MODEL_DTYPES:
        raise TrtspecError(f"dtype must be one of auto, {', '.join(MODEL_DTYPES)}; got {dtype!r}")
    return MODEL_DTYPES[dtype]
