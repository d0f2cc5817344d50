"""DBloom: the acceptance-histogram preflight and expand-block post-training, on the tiny pair."""

import json

import pytest
import torch
from helpers import TRAINED_PROMPTS, assert_one_line_error, code_prompts, trtspec_in_process

from trtspec.dbloom.histogram import Preflight, per_position_acceptance
from trtspec.training.blocks import position_weights
from trtspec.dbloom.expand import ExpandConfig, stage_plan
from trtspec.runtime.schedule import AR, BlockChoice


# 100 cycles at B=4: 10 accept 0 drafts, 20 accept 1, 30 accept 2, 40 accept all 3
HISTOGRAM = [10, 20, 30, 40]


def test_per_position_acceptance_is_conditional_on_the_position_before():
    """P(accept k | k-1): None where no cycle reached position k-1."""
    assert per_position_acceptance(HISTOGRAM) == pytest.approx([90 / 100, 70 / 90, 40 / 70])
    assert per_position_acceptance([5, 0, 0, 0]) == [0.0, None, None]


def test_preflight_estimates_the_stranded_tau():
    report = Preflight(4, HISTOGRAM, tau=3.0)
    assert report.ceiling_fraction == 0.4
    r = report.tail_rate
    assert r == pytest.approx((0.9 + 70 / 90 + 40 / 70) / 3)
    assert report.stranded_tau_estimate == pytest.approx(3.0 + 0.4 * r / (1 - r))


def test_preflight_recommends_expanding_only_a_stranded_block():
    """Many cycles at the ceiling with a high tail rate: expand, to a multiple of B; few: keep B."""
    advice = Preflight(4, HISTOGRAM, tau=3.0).recommendation()
    assert advice["expand"] and advice["to"] % 4 == 0 and advice["to"] > 4
    low = Preflight(16, [50] + [10] * 14 + [2], tau=2.0).recommendation()
    assert not low["expand"] and low["to"] is None



# BlockPilot, DBloom and the metrics share these histogram formulas (trtspec.runtime.stats).


def test_tau_is_the_mean_committed_tokens_per_cycle():
    from trtspec.runtime.stats import committed_tokens, histogram_tau

    assert committed_tokens(HISTOGRAM) == 10 * 1 + 20 * 2 + 30 * 3 + 40 * 4
    assert histogram_tau(HISTOGRAM) == pytest.approx(3.0) and histogram_tau([0, 0]) == 0.0


def test_accepted_at_least_counts_the_cycles_reaching_each_position():
    from trtspec.runtime.stats import accepted_at_least

    assert accepted_at_least(HISTOGRAM) == [100, 90, 70, 40] and accepted_at_least([]) == []


def test_a_cut_histogram_is_the_one_a_smaller_block_would_have_given():
    from trtspec.runtime.stats import cut_histogram, histogram_tau

    # as if the block had been 3: the cycles that accepted 2 or 3 drafts accepted 2 (min(a, B - 1))
    assert cut_histogram(HISTOGRAM, 3) == [10, 20, 70]
    assert histogram_tau(cut_histogram(HISTOGRAM, 3)) == pytest.approx(sum(min(a, 2) + 1 for a, n in
                                                                        enumerate(HISTOGRAM) for _ in range(n)) / 100)
    assert cut_histogram(HISTOGRAM, 4) == HISTOGRAM and cut_histogram(HISTOGRAM, 8) == HISTOGRAM


def test_pooled_histograms_add_up_position_by_position():
    from trtspec.runtime.stats import pool_histograms

    assert pool_histograms([HISTOGRAM, [1, 2], []]) == [11, 22, 30, 40] and pool_histograms([]) == []


def test_expand_block_weights_restart_the_decay_at_the_new_positions():
    plain, shifted = position_weights(24, 10.0), position_weights(24, 10.0, emphasis_from=16)
    assert plain[0] == shifted[0] == 0 and torch.equal(plain[:16], shifted[:16])
    assert shifted[16] == pytest.approx(1.0) and shifted[16] > 4 * plain[16]  # new positions restart the decay


def test_expand_block_plans_its_stages_up_to_the_new_size():
    assert stage_plan(16, ExpandConfig(to_block_size=24, steps=301, stages=2, continue_steps=50)) == [
        (16, 50, 0), (20, 151, 16), (24, 150, 16)]
    assert stage_plan(16, ExpandConfig(to_block_size=24, steps=300, settle_steps=40))[-1] == (24, 40, 0)  # plain decay
    with pytest.raises(Exception, match="larger than"):
        stage_plan(16, ExpandConfig(to_block_size=16))


@pytest.fixture(scope="module")
def preflight_run(target_dir, drafter_dir, tmp_path_factory):
    """One `trtspec preflight` with --json and --plot, read by the tests of each of its outputs."""
    tmp_path = tmp_path_factory.mktemp("preflight")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["def add(a, b):\n", "import os\n",
                                                                            "a b c d a b c d a b c d a b"]))
    out, png = tmp_path / "pre.json", tmp_path / "pre.png"
    result = trtspec_in_process("preflight", "--target", target_dir, "--drafter", drafter_dir, "--prompts", prompts,
                                "--block-size", 8, "--max-new-tokens", 24, "--json", out, "--plot", png)
    assert result.returncode == 0, result.stderr.decode()
    return result, out, png


def test_preflight_command_writes_the_documented_json(preflight_run):
    _, out, _ = preflight_run
    data = json.loads(out.read_text())
    assert set(data) == {"block_size", "histogram", "ceiling_fraction", "per_position_acceptance", "tau",
                         "stranded_tau_estimate", "recommendation", "requests"}
    assert data["block_size"] == 8 and len(data["histogram"]) == 8 and len(data["per_position_acceptance"]) == 7
    assert data["stranded_tau_estimate"] >= data["tau"] >= 1.0
    assert len(data["requests"]) == 3 and all(r["cycles"] >= 1 for r in data["requests"])
    assert [sum(r["histogram"][a] for r in data["requests"]) for a in range(8)] == data["histogram"]
    # the drafter's own blocks, whole: prompt lookup (which would copy in the repeating prompt) and its
    # narrowed cycles are off
    assert all(r["draft_tokens"] == 7 * r["cycles"] for r in data["requests"])


def test_preflight_command_writes_the_plot(preflight_run):
    _, _, png = preflight_run
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_preflight_command_prints_the_per_position_acceptance(preflight_run):
    result, _, _ = preflight_run
    assert "P(accept k | k-1)" in result.stdout.decode()


def test_expand_block_trains_a_longer_drafter_that_stays_lossless(target_dir, drafter_dir, tmp_path):
    from trtspec.api import Pipeline
    from trtspec.runtime.request import GenerationConfig

    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"def f{i}(x):", "response": "    return x + 1\n" * 4}) + "\n"
                            for i in range(6)))
    output = tmp_path / "b20"
    args = ("expand-block", "--target", target_dir, "--drafter", drafter_dir, "--to", 20, "--data", data,
            "-o", output, "--steps", 4, "--stages", 2, "--continue-steps", 2, "--batch-size", 2, "--anchors", 2,
            "--distill", 0.5, "--settle-steps", 2)
    result = trtspec_in_process("--threads", 1, *args)
    assert result.returncode == 0, result.stderr.decode()
    config = json.loads((output / "config.json").read_text())
    assert config["block_size"] == 20
    assert config["trtspec_lineage"]["source_block_size"] == 16
    assert config["trtspec_lineage"]["stages"] == [[16, 2, 0], [18, 2, 16], [20, 2, 16], [20, 2, 0]]
    assert config["trtspec_lineage"]["distill_weight"] == 0.5  # early positions kept close to the source
    stage = output.parent / "b20.work" / "stage1-b18" / "config.json"
    before = stage.stat().st_mtime_ns
    assert trtspec_in_process("--threads", 1, *args).returncode == 0  # finished stages are reused, not retrained
    assert stage.stat().st_mtime_ns == before
    pipeline = Pipeline(target_dir, output)
    assert pipeline.drafter_block_size == 20
    for prompt in ("def add(a, b):\n", "class Point:\n"):
        spec = pipeline.generate(prompt, GenerationConfig(block=BlockChoice(20), max_new_tokens=24)).tokens
        ar = pipeline.autoregressive().generate(prompt, GenerationConfig(block=AR, max_new_tokens=24)).tokens
        assert spec == ar
    assert_one_line_error(trtspec_in_process(*args[:5], "--to", 8, *args[7:]),
                          "larger than the drafter's block size 16")


def test_teacher_forced_acceptance_equals_drafting_each_context_through_the_inference_path(target_dir,
                                                                                          trained_drafter_dir):
    """Every anchor of the target's continuation, drafted one at a time with the runtime's cached
    drafter forward, gives the histogram that the packed teacher-forced pass reports."""
    from trtspec.api import Pipeline
    from trtspec.dbloom.preflight import run_teacher_forced
    from trtspec.training.data import continue_prompts
    from trtspec.runtime.request import GenerationConfig

    pair = Pipeline(target_dir, trained_drafter_dir)  # a trained pair: acceptance varies
    prompt, block_size, horizon = code_prompts(TRAINED_PROMPTS + 3)[-1], 8, 40  # held out
    report = run_teacher_forced(pair, [prompt], block_size, horizon, progress=False)

    target, drafter = pair.target, pair.drafter
    ids = pair.codec.encode(prompt)
    config = GenerationConfig(block=AR, max_new_tokens=horizon + block_size - 1).with_stop_ids(pair.codec.stop_ids)
    sequence = ids + continue_prompts(pair, [ids], config, progress=False)[0]
    expected = [0] * block_size
    with torch.inference_mode():
        _, features = target(torch.tensor([sequence]), 0, None, drafter.config.target_layer_ids)
        for start in range(len(ids), len(ids) + horizon):
            block = torch.tensor([[sequence[start]] + [drafter.config.mask_token_id] * (block_size - 1)])
            drafts = drafter(features[:, :start], block, start, drafter.new_cache(1, start)).argmax(-1)[0].tolist()
            truth = sequence[start + 1:start + block_size]
            expected[next((k for k, (d, t) in enumerate(zip(drafts, truth)) if d != t), block_size - 1)] += 1
    assert sum(expected) == horizon and sum(n > 0 for n in expected) >= 6  # every depth of acceptance occurs
    assert report.histogram == expected
    assert report.requests[0]["cycles"] == horizon
    assert report.tau == pytest.approx(1 + sum(a * n for a, n in enumerate(expected)) / horizon)


def test_teacher_forced_preflight_refuses_sampling():
    result = trtspec_in_process("preflight", "--teacher-forced", "--temperature", 1, "--limit", 1)
    assert_one_line_error(result, "--teacher-forced", "greedy")


def test_teacher_forced_preflight_refuses_an_engine(tmp_path):
    result = trtspec_in_process("preflight", "--teacher-forced", "--engine", tmp_path, "--limit", 1)
    assert_one_line_error(result, "--teacher-forced", "--engine")


def _expand_data(path, word: str):
    path.write_text("".join(json.dumps({"prompt": f"def f{i}(x):", "response": f"    return x + {word}\n" * 3}) + "\n"
                            for i in range(4)))
    return path


def test_expand_block_reuses_only_its_own_finished_stages(target_dir, drafter_dir, tmp_path):
    """A killed (or finished) run's stages were adopted whatever the data and options of the next
    run, and so was any drafter placed in the work directory under a stage's name: now a stage is
    resumed under train-drafter's check (other data or options: one line) and only the drafter its
    own finished checkpoint holds is reused."""
    from helpers import random_drafter, save_random_drafter
    from helpers import trtspec_in_process as cli

    from trtspec.fileio import MARKER
    from trtspec.models import load_drafter, load_target, save_drafter

    target = load_target(target_dir)
    data, other = _expand_data(tmp_path / "a.jsonl", "1"), _expand_data(tmp_path / "b.jsonl", "y")
    output, work = tmp_path / "b20", tmp_path / "b20.work"
    args = ("--threads", 1, "expand-block", "--target", target_dir, "--drafter", drafter_dir, "--to", 20, "-o", output,
            "--steps", 2, "--stages", 1, "--batch-size", 2, "--anchors", 2)
    # a trtspec drafter placed where stage 0 goes is trained over, not adopted as the finished stage
    placed = save_drafter(random_drafter(target, block_size=20, seed=9), work / "stage0-b20")
    foreign = {name: t.clone() for name, t in load_drafter(placed, target).state_dict().items()}
    assert cli(*args, "--data", data).returncode == 0
    result = load_drafter(output, target).state_dict()
    assert any(not torch.equal(result[name], foreign[name]) for name in foreign)
    stage = work / "stage0-b20" / "model.safetensors"
    before = stage.stat().st_mtime_ns
    assert cli(*args, "--data", data).returncode == 0 and stage.stat().st_mtime_ns == before  # its own: reused
    # the same work directory with other data or options: refused, naming what differs
    checkpoint = work / "stage0.work" / "checkpoint.pt"
    assert_one_line_error(cli(*args, "--data", other), str(checkpoint), "the training data (--data) differ")
    assert_one_line_error(cli(*args, "--data", data, "--lr", 0.01), "lr (checkpoint 0.0003, now 0.01)")
    # a drafter swapped in for the finished stage (unmarked, as copied by hand) is neither adopted nor removed
    (work / "stage0-b20").rename(tmp_path / "own-stage")
    save_random_drafter(work / "stage0-b20", target, block_size=20, seed=9)
    (work / "stage0-b20" / MARKER).unlink()
    assert_one_line_error(cli(*args, "--data", data), "stage0-b20", "not a previous trtspec checkpoint")
