"""Cycle costs (trtspec.perf.cycle_costs, scripts/gpu/cycle_costs.py) at the tiny shape on the CPU: the
random pair is what it claims, the runtime engine it times decodes exactly like eager PyTorch
(run by run and over the static bindings that CUDA-graph replay uses), and a measurement fills
every row of its report."""

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from helpers import ar_of, local_engine_of, generate, single
from trtspec.perf.cycle_costs import (QWEN3_4B, TINY, CycleCostConfig, drafter_config, measure, random_pair,
                                 runtime_engine, tiny)
from trtspec.errors import TrtspecError
from trtspec.models import Qwen3Target, load_drafter, load_target
from trtspec.runtime.request import GenerationConfig
from trtspec.runtime.schedule import AR, BlockChoice

ROOT = Path(__file__).resolve().parents[1]


def test_the_drafter_config_is_dflash_for_qwen3_4b():
    config = drafter_config(QWEN3_4B)
    assert config.num_hidden_layers == 5 and config.hidden_size == 2560 and config.vocab_size == 151_936
    assert config.target_layer_ids == (1, 9, 17, 25, 33) and config.num_target_layers == 36


@pytest.fixture(scope="module")
def pair():
    return random_pair(TINY, drafter_config(TINY), torch.device("cpu"), torch.bfloat16)


def test_random_pair_is_allocated_on_the_device_in_the_dtype(pair):
    target, drafter = pair
    tensors = [*target.parameters(), *drafter.parameters()]
    assert all(t.dtype == torch.bfloat16 and t.device.type == "cpu" for t in tensors)


def test_random_pair_shares_one_head(pair):
    """As a real Qwen3-4B pair does: tied embeddings, and the drafter bound to the target's head."""
    target, drafter = pair
    assert target.lm_head.weight is target.model.embed_tokens.weight
    assert drafter.lm_head is target.lm_head  # bound: shares the target's head


def test_random_pair_weights_are_finite_at_the_initializer_scale(pair):
    weights = pair[0].model.layers[0].mlp.up_proj.weight.float()
    assert 0.015 < weights.std().item() < 0.025 and torch.isfinite(weights).all()


def test_random_pair_is_seeded(pair):
    target, _ = pair
    again, _ = random_pair(TINY, drafter_config(TINY), torch.device("cpu"), torch.bfloat16)
    assert torch.equal(again.lm_head.weight, target.lm_head.weight)  # seeded


@pytest.mark.parametrize("static", [False, True])
def test_the_timed_runtime_engine_decodes_like_eager_pytorch(target_dir, drafter_dir, static):
    target = load_target(target_dir)
    drafter = load_drafter(drafter_dir, target)
    runner = runtime_engine(target, drafter, (4, 8), max_context=96, cuda_graphs=False)
    runner.static = static  # the fixed bindings replay needs, here without the capture (a CPU has none)
    engine = local_engine_of(runner)
    eager = single(target, drafter)
    prompt = torch.randint(2, target.config.vocab_size, (12,), generator=torch.Generator().manual_seed(0)).tolist()
    for block_size in (4, 8):
        config = GenerationConfig(block=BlockChoice(block_size), max_new_tokens=40)
        assert generate(engine, prompt, config).tokens == generate(eager, prompt, config).tokens
    ar = GenerationConfig(block=AR, max_new_tokens=40)
    assert generate(ar_of(engine), prompt, ar).tokens == generate(single(target), prompt, ar).tokens


def test_a_tiny_measurement_fills_every_row():
    config = replace(tiny(CycleCostConfig(block_sizes=(4, 8))), repeats=2, requests=1)
    reports = []
    costs = measure(config, torch.device("cpu"), torch.float32, on_progress=lambda c: reports.append(len(c.steps)))
    assert not costs.errors()
    assert [(s.step, s.block_size) for s in costs.steps] == [("verify", 1), ("verify", 4), ("draft", 4),
                                                             ("verify", 8), ("draft", 8)]
    assert all(s.eager_ms > 0 and s.graph_ms is None for s in costs.steps)  # no CUDA graphs on a CPU
    assert [(x.loop, x.block_size) for x in costs.loops] == [("eager", 1), ("eager", 4), ("eager", 8)]
    assert all(0 < x.model_ms < x.cycle_ms and x.cycles > 0 for x in costs.loops)
    assert reports[0] == 1 and len(reports) == 3 + 1 + 3  # after every block size's steps, the profiles, each loop
    table = costs.format_table().splitlines()
    assert [line.split()[0] for line in table[3:6]] == ["AR", "4", "8"]
    weights = sum(p.numel() * p.element_size() for p in Qwen3Target(TINY).parameters())
    assert costs.floor["weight_bytes"] == weights and costs.floor["floor_ms"] > 0
    assert "weight-read floor" in table[6] and "x the floor (eager)" in table[6]
    assert set(costs.kernels) == {"AR step", "verify B=8", "draft B=8"}
    for kernels in costs.kernels.values():  # the costliest first, shares of the call's time
        assert kernels and [k["ms"] for k in kernels] == sorted((k["ms"] for k in kernels), reverse=True)
        assert 0 < sum(k["share"] for k in kernels) <= 1.0001 and any("mm" in k["name"] for k in kernels)
    data = json.loads(json.dumps(costs.to_dict()))
    assert data["target"]["hidden_size"] == TINY.hidden_size and data["loops"][0]["host_share"] is not None


def test_config_refuses_a_request_longer_than_the_cache():
    with pytest.raises(TrtspecError, match="does not fit"):
        CycleCostConfig(past=64, prompt_tokens=64, new_tokens=8)


def test_script_refuses_the_4b_shape_on_the_cpu_in_one_line(tmp_path):
    result = subprocess.run([sys.executable, ROOT / "scripts" / "gpu" / "cycle_costs.py", "--device", "cpu",
                             "--shape", "qwen3-4b", "--out", tmp_path], capture_output=True, text=True)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == ["Error: a Qwen3-4B-shaped model on the CPU takes tens of GB "
                                                  "and minutes per cycle; use --shape tiny"]
    assert not list(tmp_path.iterdir())
