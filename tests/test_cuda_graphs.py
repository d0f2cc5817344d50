"""CUDA-graph replay of the chosen block size's draft and verify graphs equals eager execution.

The static binding mode that replay needs (whole fixed-size caches as `past`, fixed input and
output buffers, staged cache writes) runs on the CPU too, so its outputs are checked here against
the ordinary mode; capture and replay themselves need a GPU.
"""

import pytest
import torch

from helpers import ar_of, core_of, generate, opened
from trtspec.engines.capture import CudaGraphs, binding_key
from trtspec.runtime.request import GenerationConfig
from trtspec.runtime.schedule import BlockChoice

PROMPTS = [[5, 9, 13, 2, 7], [40, 41, 42, 43, 44, 45, 46, 47], [3] * 12]
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA-graph capture needs a CUDA device")


def _greedy(engine, block_size):
    config = GenerationConfig(block=BlockChoice(block_size), max_new_tokens=20)
    return [generate(engine, prompt, config).tokens for prompt in PROMPTS]


@pytest.mark.parametrize("block_size", [1, 4, 8])
def test_static_bindings_decode_like_the_ordinary_engine(ort_engine_dir, block_size):
    ordinary = opened(ort_engine_dir, torch.device("cpu"))
    if block_size == 1:
        ordinary = ar_of(ordinary)
    static = core_of(ordinary.runner.with_slots(1, drafter=block_size > 1))
    static.runner.static = True
    assert _greedy(static, block_size) == _greedy(ordinary, block_size)


@pytest.mark.gpu
@needs_gpu
def test_a_captured_run_replays_like_eager():
    device = torch.device("cuda")
    x, weight, out = (torch.randn(64, 64, device=device) for _ in range(3))

    def launch():
        torch.matmul(x, weight, out=out)

    graphs = CudaGraphs(device)
    key = binding_key("g", 4, {"x": x, "weight": weight}, {"out": out})
    for _ in range(3):
        x.normal_()
        graphs.run(key, launch)
        assert torch.allclose(out, x @ weight)
    assert len(graphs.graphs) == 1


@pytest.mark.gpu
@needs_gpu
def test_torch_engine_replayed_as_cuda_graphs_equals_eager(target_dir, drafter_dir, tmp_path):
    from trtspec.build import BuildConfig, build_engine

    output = tmp_path / "torch-engine"
    build_engine(target_dir, drafter_dir, output, BuildConfig(block_sizes=(4, 8), backend="torch", device="cuda"),
                 progress=False)
    device = torch.device("cuda")
    eager, replayed = opened(output, device), opened(output, device, cuda_graphs=True)
    for block_size in (4, 8):
        assert _greedy(replayed, block_size) == _greedy(eager, block_size)
    assert replayed.executor.cuda_graphs.graphs  # the cycles really were captured
