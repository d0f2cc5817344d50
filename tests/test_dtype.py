"""What `--dtype auto` means: bfloat16 where its matrix products are fast (for eager PyTorch),
float32 for CPU engines, which `--backend auto` runs everywhere but on AMX; and what TRTSPEC_DTYPE
says where set."""

import platform
from pathlib import Path

import pytest
import torch

import trtspec.device as device_module
from trtspec.device import DTYPE_ENV, resolve_dtype
from trtspec.engine_cache import wants_engine
from trtspec.errors import TrtspecError

CPU = torch.device("cpu")


@pytest.mark.parametrize("flags, onnxruntime, eager, engine", [
    ({"avx512_bf16", "amx_bf16"}, True, torch.bfloat16, False),  # AMX: eager bfloat16, no engine
    ({"avx512_bf16"}, True, torch.bfloat16, True),   # AVX512-BF16 alone: the float32 engine where there is one
    ({"avx512_bf16"}, False, torch.bfloat16, False),  # ... and eager bfloat16 where there is none
    ({"avx2"}, True, torch.float32, True), ({"avx2"}, False, torch.float32, False)])
def test_auto_follows_the_cpu(monkeypatch, flags, onnxruntime, eager, engine):
    from trtspec.engines import onnxruntime as ort_engine

    monkeypatch.delenv(DTYPE_ENV, raising=False)
    monkeypatch.setattr(device_module, "cpu_flags", lambda: flags)
    monkeypatch.setattr(ort_engine, "available", lambda: onnxruntime)
    assert resolve_dtype("auto", CPU) == eager  # what eager modules run in
    assert resolve_dtype("auto", CPU, compiled=True) == torch.float32  # an engine compiled for the CPU
    assert resolve_dtype("float32", CPU) == torch.float32  # an explicit dtype is never changed
    assert wants_engine("auto", CPU, "auto", (16,)) == engine  # what backend auto runs
    assert wants_engine("auto", CPU, "bfloat16", (16,)) is False  # an explicit bfloat16 stays eager
    assert wants_engine("auto", CPU, "float32", (16,)) == onnxruntime


def test_the_environment_sets_what_auto_means(monkeypatch):
    monkeypatch.setenv(DTYPE_ENV, "bfloat16")
    assert resolve_dtype("auto", CPU) == torch.bfloat16
    assert resolve_dtype("float32", CPU) == torch.float32
    monkeypatch.setenv(DTYPE_ENV, "int3")
    with pytest.raises(TrtspecError, match="got 'int3' \\(from TRTSPEC_DTYPE\\)"):
        resolve_dtype("auto", CPU)


def test_this_cpus_flags_are_read():
    cpuinfo = Path("/proc/cpuinfo")
    flags = cpuinfo.read_text() if cpuinfo.is_file() else ""
    assert device_module.fast_bfloat16(CPU) == ("amx_bf16" in flags or "avx512_bf16" in flags)
    lines = flags.splitlines()
    listed = next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), [])
    assert device_module.cpu_flags() == set(listed)
    named = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "")
    assert device_module.cpu_model() == (named or platform.machine())
