"""Devices and dtypes as the user names them ("auto", "cuda:1", "bfloat16"), resolved in one place."""

from __future__ import annotations

import os
import platform
from pathlib import Path

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


DTYPE_ENV = "TRTSPEC_DTYPE"  # what `auto` means, where set (the test suite pins float32: exactness is checked there)


def resolve_dtype(dtype: str, device: torch.device, compiled: bool = False) -> torch.dtype:
    """auto: bfloat16 where its matrix products are fast (CUDA; a CPU with AMX or AVX512-BF16, for
    eager PyTorch), float32 elsewhere and for engines `compiled` for a CPU (ONNX Runtime's CPU
    kernels are float32). Whether `--backend auto` runs eager or a float32 engine: `engine_first`."""
    if dtype == "auto":
        dtype = os.environ.get(DTYPE_ENV) or "auto"
    if dtype == "auto":
        fast = fast_bfloat16(device) and (device.type == "cuda" or not compiled)
        return torch.bfloat16 if fast else torch.float32
    if dtype not in MODEL_DTYPES:
        raise TrtspecError(f"dtype must be one of auto, {', '.join(MODEL_DTYPES)}; got {dtype!r}"
                           + (f" (from {DTYPE_ENV})" if os.environ.get(DTYPE_ENV) == dtype else ""))
    return MODEL_DTYPES[dtype]


def engine_first(device: torch.device) -> bool:
    """Whether `--dtype auto` decodes faster through a float32 engine compiled for this CPU than
    eagerly in bfloat16: everywhere but on AMX, where verifying a block in eager bfloat16 costs
    little more than one step. With AVX512-BF16 alone, eager bfloat16 beats eager float32 but not
    the float32 ONNX Runtime engine (an AMD EPYC Zen 4, one thread, 8 chat prompts: AR 27.4 tok/s
    and B = 16 52.4 through the engine, 17.5 and 40.4 eager in bfloat16; docs/benchmarks.md)."""
    return device.type == "cpu" and "amx_bf16" not in cpu_flags()


def fast_bfloat16(device: torch.device) -> bool:
    """Whether bfloat16 matrix products are fast here: a CUDA device that supports them, or a CPU
    with AMX-BF16 or AVX512-BF16 (torch's oneDNN kernels use them; elsewhere bfloat16 on a CPU is
    emulated and slower than float32)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    flags = cpu_flags()
    return "amx_bf16" in flags or "avx512_bf16" in flags


def _cpuinfo_field(name: str) -> str:
    """The first `name : value` line of /proc/cpuinfo ('' where there is none, as off Linux)."""
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.is_file():
        return ""
    return next((line.split(":", 1)[1].strip() for line in cpuinfo.read_text(errors="replace").splitlines()
                 if line.split(":", 1)[0].strip() == name), "")


def cpu_flags() -> set[str]:
    """The CPU's feature flags (avx2, avx512f, amx_bf16, ...): they decide which kernels run."""
    return set(_cpuinfo_field("flags").split())


def cpu_model() -> str:
    """The CPU's model name, or the machine's architecture where the system does not say."""
    return _cpuinfo_field("model name") or platform.machine()


def describe_device(device: torch.device) -> str:
    """The hardware behind a timing, for keys of what is measured once per machine: the GPU's name
    and compute capability with the CUDA version, or the CPU's model, architecture and core count."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"{torch.cuda.get_device_name(device)} sm_{major}{minor} cuda {torch.version.cuda}"
    model = platform.processor()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        model = next((line.split(":", 1)[1].strip() for line in cpuinfo.read_text(errors="replace").splitlines()
                      if line.startswith("model name")), model)
    return f"{model} {platform.machine()} x{os.cpu_count()}"
