"""CUDA-graph replay of the chosen block size's draft and verify graphs equals eager execution.

The static binding mode that replay needs (whole fixed-size caches as `past`, fixed input and
output buffers, staged cache writes) runs on the CPU too, so its outputs are checked here against
the ordinary mode, on the step modules that the GPU engines export (a CPU ONNX Runtime engine's
target graph updates its caches in place instead, and is never captured); capture and replay
themselves need a GPU.
"""

import pytest
import torch

from helpers import ar_of, local_engine_of, generate, single
from trtspec.engines.capture import CudaGraphs, binding_key
from trtspec.engines.executor import PREFILL
from trtspec.models import load_drafter, load_target
from trtspec.runtime.engine import EngineConfig, LocalEngine
from trtspec.runtime.request import GenerationConfig
from trtspec.runtime.runner import BATCH_BUCKETS, bucket, context_bucket
from trtspec.runtime.schedule import BlockChoice

PROMPTS = [[5, 9, 13, 2, 7], [40, 41, 42, 43, 44, 45, 46, 47], [3] * 12]
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA-graph capture needs a CUDA device")


def _greedy(engine, block_size):
    config = GenerationConfig(block=BlockChoice(block_size), max_new_tokens=20)
    return [generate(engine, prompt, config).tokens for prompt in PROMPTS]


@pytest.fixture(scope="module")
def pair(target_dir, drafter_dir):
    target = load_target(target_dir)
    return target, load_drafter(drafter_dir, target)


@pytest.mark.parametrize("block_size", [1, 4, 8])
def test_static_bindings_decode_like_the_ordinary_engine(pair, block_size):
    ordinary = single(*pair)
    if block_size == 1:
        ordinary = ar_of(ordinary)
    static = local_engine_of(ordinary.runner.with_slots(1, drafter=block_size > 1))
    static.runner.static = True
    assert _greedy(static, block_size) == _greedy(ordinary, block_size)


class KeyRecorder:
    """An executor that runs another and records the binding key of every decode call: the CUDA
    graphs a GPU would capture for the same calls."""

    def __init__(self, executor):
        self.executor, self.backend, self.device = executor, executor.backend, executor.device
        self.keys: set = set()

    def run(self, graph, profile, inputs, outputs):
        if profile != PREFILL:
            self.keys.add(binding_key(graph, profile, inputs, outputs))
        self.executor.run(graph, profile, inputs, outputs)


def test_buckets():
    assert [bucket(n) for n in (1, 2, 3, 5, 8, 9, 33, 64, 65, 129)] == [1, 2, 4, 8, 8, 16, 64, 64, 128, 192]
    assert [context_bucket(n) for n in (1, 2, 3, 4, 5, 17, 300)] == [1, 2, 4, 4, 8, 32, 512]


@pytest.fixture(scope="module")
def static_batch(pair):
    """Seven requests of mixed block sizes decoded together in six static slots, with the binding key
    of every decode call; and the ordinary engine, to decode each alone."""
    ordinary = single(*pair)
    static_runner = ordinary.runner.with_slots(6)
    static_runner.static = True
    recorder = static_runner.executor = KeyRecorder(static_runner.executor)
    engine = LocalEngine(static_runner, config=EngineConfig(max_running=6, prefill_chunk=16))
    prompts = PROMPTS + [[7, 8, 9] * 6, [11, 12], [60] * 20, [2, 4, 6, 8]]
    configs = [GenerationConfig(block=BlockChoice(size), max_new_tokens=limit)
               for size, limit in zip((4, 8, 1, 4, 8, 4, 1), (20, 31, 17, 40, 9, 26, 33))]
    together = engine.generate([list(p) for p in prompts], configs)
    return ordinary, prompts, configs, together, recorder


def test_a_static_batch_decodes_each_request_as_alone(static_batch):
    ordinary, prompts, configs, together, _ = static_batch
    for prompt, config, generation in zip(prompts, configs, together):
        alone = generate(ordinary if config.block.size > 1 else ar_of(ordinary), prompt, config)
        assert generation.tokens == alone.tokens
        assert generation.stats.histogram == alone.stats.histogram


def test_a_static_batch_runs_over_one_binding_per_bucketed_shape(static_batch):
    """Every decode call ran over the bindings of its (graph, block size, batch bucket, context
    bucket): the graphs a GPU captures once and replays."""
    recorder = static_batch[-1]
    shapes = set()
    for graph, profile, tensors in recorder.keys:
        dims = dict((name, shape) for name, shape, _ in tensors)
        batch = dims["slots"][0]
        assert batch in BATCH_BUCKETS and profile in (1, 4, 8)
        width = dims["context"][1] if graph == "draft" else 0
        assert graph != "draft" or width == context_bucket(width)
        shapes.add((graph, profile, batch, width))
    assert len(shapes) == len(recorder.keys)  # one set of addresses per shape: replayable
    assert any(batch > 1 for _, _, batch, _ in shapes)  # rows really were batched (and padded)


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
