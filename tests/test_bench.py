"""`trtspec bench`: prompt sets, the speed-up aggregation, and the command end to end on the tiny pair."""

import json
import statistics

import pytest
from helpers import assert_one_line_error, trtspec_in_process

from trtspec.perf.bench import (BenchConfig, BenchReport, BenchRun, load_prompts, run_bench,
                           speedups)
from trtspec.errors import TrtspecError
from trtspec.runtime.request import Generation
from trtspec.runtime.sampling import SamplingConfig
from trtspec.runtime.schedule import AUTO, BlockChoice, parse_block_choices, parse_block_sizes
from trtspec.runtime.stats import DecodeStats, schedule_counts

PROMPTS = ["def add(a, b):\n", "for i in range(10):\n", "class Point:\n"]




@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p, "id": i}) + "\n" for i, p in enumerate(PROMPTS)))
    return path


@pytest.fixture(scope="module")
def pipeline(target_dir, drafter_dir):
    from trtspec.api import Pipeline
    return Pipeline(target_dir, drafter_dir)


def test_humaneval_prompts_are_bundled():
    name, prompts = load_prompts("humaneval")
    assert name == "humaneval" and len(prompts) == 164
    for prompt in prompts:
        assert prompt.lstrip().split()[0] in {"def", "from", "import", "FIX"}, prompt[:40]
        assert "def " in prompt
    assert load_prompts("humaneval", limit=5)[1] == prompts[:5]


def test_jsonl_prompts(prompts_file, tmp_path):
    assert load_prompts(str(prompts_file)) == (str(prompts_file), PROMPTS)
    assert load_prompts(str(prompts_file), limit=2)[1] == PROMPTS[:2]
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"prompt": "  "}) + "\n")
    with pytest.raises(TrtspecError, match="empty.jsonl:1: prompt is empty"):
        load_prompts(str(empty))
    with pytest.raises(TrtspecError, match=r"--limit must be an integer in \[1, 2\*\*31-1\], got 0"):
        load_prompts("humaneval", limit=0)


def test_block_size_lists_are_parsed_strictly():
    """Duplicates and spaces are forgiven; anything that is not a plain size in range is one line."""
    assert parse_block_sizes("8,12,8, 16") == (8, 12, 16)
    for bad, message in [("8,x", "an integer B"), ("8,,12", "an integer B"), ("²", "an integer B"),
                         ("1", r"in \[2, 64\], got 1"), ("65", "got 65"), ("6:16", "plain block sizes")]:
        with pytest.raises(TrtspecError, match=message):
            parse_block_sizes(bad)


def test_block_choice_lists_are_parsed_strictly():
    """Growing blocks (B:G) and auto where allowed; a growth that does not grow is one line."""
    assert parse_block_choices("6, 6:16,auto,6", allow_auto=True) == (BlockChoice(6), BlockChoice(6, 16),
                                                                      AUTO)
    assert [c.name for c in parse_block_choices("6,6:16")] == ["6", "6:16"]
    for bad, message in [("auto", "an integer B or B:G"), ("6:6", "to a larger size"), ("6:x", "an integer B or B:G"),
                         ("6:65", "up to 64")]:
        with pytest.raises(TrtspecError, match=message):
            parse_block_choices(bad)


def test_bench_config_refuses_too_few_repeats_or_tokens():
    with pytest.raises(TrtspecError, match="--repeats"):
        BenchConfig(repeats=0)
    with pytest.raises(TrtspecError, match="--max-new-tokens"):
        BenchConfig(max_new_tokens=1)


def _run(block_size: int, repeats: list[list[tuple[int, float, list[int]]]]) -> BenchRun:
    """A run from hand-made (new_tokens, decode_s, histogram) per request, per repeat."""
    return BenchRun(BlockChoice(block_size),
                    [[Generation([], DecodeStats(block_size, new_tokens=n, decode_s=s, histogram=h))
                      for n, s, h in repeat] for repeat in repeats])


def test_aggregation_on_hand_made_numbers():
    # AR: 2 prompts x 3 repeats; decode tokens are new_tokens - 1 (the first comes from prefill).
    ar = _run(1, [[(11, 1.0, [10]), (21, 1.0, [20])],     # 30 tokens / 2 s = 15 tok/s
                  [(11, 2.0, [10]), (21, 1.0, [20])],     # 30 / 3 = 10
                  [(11, 0.5, [10]), (21, 1.0, [20])]])    # 30 / 1.5 = 20
    spec = _run(4, [[(11, 0.5, [2, 1, 0, 2]), (21, 0.5, [5, 0, 0, 5])],   # 30 / 1 = 30 -> x2
                    [(11, 0.5, [2, 1, 0, 2]), (21, 1.0, [5, 0, 0, 5])],   # 30 / 1.5 = 20 -> x2
                    [(11, 0.1, [2, 1, 0, 2]), (21, 0.1, [5, 0, 0, 5])]])  # 30 / 0.2 = 150 -> x7.5
    assert ar.tokens_per_s_repeats == pytest.approx([15, 10, 20])
    assert spec.tokens_per_s_repeats == pytest.approx([30, 20, 150])
    assert spec.tokens_per_s == pytest.approx(30)
    assert speedups(spec.tokens_per_s_repeats, ar.tokens_per_s_repeats) == pytest.approx([2, 2, 7.5])
    # tau is the mean of per-request means: (2*1+1*2+2*4)/5 = 2.4 and (5*1+5*4)/10 = 2.5 -> 2.45
    # (pooling all cycles would give 111/45 = 2.47)
    assert spec.tau == pytest.approx(2.45)
    assert spec.histogram == [21, 3, 0, 21] and spec.ceiling_fraction == pytest.approx(21 / 45)
    report = BenchReport("hand", 2, BenchConfig(block_sizes=(4,), repeats=3), ar, [spec], {})
    assert report.speedup(spec) == pytest.approx(2.0)  # the median, not the mean (3.83)
    assert report.speedup(ar) == 1.0 and ar.tau == 1.0
    with pytest.raises(TrtspecError, match="no decode tokens"):
        speedups([1.0, 2.0], [1.0, 0.0])


def test_chosen_block_sizes_are_spelled_as_flags_smallest_first():
    mixed = [DecodeStats(12, grow_to=24), DecodeStats(4), DecodeStats(1, histogram=[3]), DecodeStats(4)]
    assert list(schedule_counts(mixed).items()) == [("AR", 1), ("4", 2), ("12:24", 1)]


def test_greedy_speculation_in_the_bench_matches_ar(pipeline):
    config = BenchConfig(block_sizes=(4,), max_new_tokens=12, repeats=1)
    report = run_bench(pipeline, PROMPTS, config, progress=False)
    ar, spec = report.runs
    assert [g.tokens for g in spec.generations[0]] == [g.tokens for g in ar.generations[0]]
    assert ar.tau == 1.0 and all(len(g.tokens) >= 1 for g in ar.generations[0])


def test_a_sampled_bench_reproduces_with_a_seed_per_repeat(pipeline):
    sampled = BenchConfig(block_sizes=(4,), max_new_tokens=12, repeats=2, sampling=SamplingConfig(temperature=1.0))
    first, second = (run_bench(pipeline, PROMPTS[:2], sampled, progress=False) for _ in range(2))
    tokens = [[[g.tokens for g in repeat] for repeat in run.generations] for run in first.runs]
    assert tokens == [[[g.tokens for g in repeat] for repeat in run.generations] for run in second.runs]
    assert tokens[0][0] != tokens[0][1]  # a different seed per repeat
    assert first.to_dict()["sampling"]["proposal_temperature"] == 0.7
    assert "T=1 (drafts drawn at 0.7 x T)" in first.format_table().splitlines()[0]


def test_cli_end_to_end(target_dir, drafter_dir, prompts_file, tmp_path):
    out = tmp_path / "out" / "bench.json"
    result = trtspec_in_process("bench", "--target", target_dir, "--drafter", drafter_dir, "--prompts",
                                prompts_file, "--limit", 2, "--repeats", 2, "--block-sizes", "4,8",
                                "--max-new-tokens", 16, "--json", out)
    assert result.returncode == 0, result.stderr.decode()
    data = json.loads(out.read_text())
    assert {"runs", "machine", "prompts", "n_prompts"} <= set(data)
    assert data["prompts"] == str(prompts_file) and data["n_prompts"] == 2
    assert {"platform", "processor", "cpu", "cpu_features", "cpu_count", "torch", "torch_threads", "device", "dtype",
            "python", "trtspec"} <= set(data["machine"])
    runs = data["runs"]
    assert [r["block_size"] for r in runs] == ["AR", "4", "8"]  # as `run --json` spells them
    for run in runs:
        assert {"block_size", "temperature", "tau", "ceiling_fraction", "histogram", "tokens_per_s",
                "speedup_vs_ar", "tokens_per_s_repeats", "speedup_repeats"} <= set(run)
        assert len(run["histogram"]) == (1 if run["block_size"] == "AR" else int(run["block_size"]))
        assert len(run["tokens_per_s_repeats"]) == 2 and run["tokens_per_s"] > 0
        assert run["temperature"] == 0.0 and 2 * 2 <= run["new_tokens"] <= 2 * 2 * 16
    assert runs[0]["speedup_vs_ar"] == 1.0 and runs[0]["tau"] == 1.0
    table = result.stdout.decode().splitlines()
    assert [line.split()[0] for line in table[-4:-1]] == ["AR", "4", "8"]
    assert table[-1] == "identical to AR: B=4 2/2, B=8 2/2"  # greedy: each of the 2 prompts
    assert not list(out.parent.glob(".*.tmp"))


def test_chat_sends_each_prompt_through_the_chat_template(target_dir, drafter_dir, prompts_file, tmp_path):
    out = tmp_path / "chat.json"
    result = trtspec_in_process("bench", "--target", target_dir, "--drafter", drafter_dir, "--prompts", prompts_file,
                                "--limit", 1, "--repeats", 1, "--block-sizes", "4", "--max-new-tokens", 4, "--chat",
                                "--json", out)
    assert result.returncode == 0, result.stderr.decode()
    assert json.loads(out.read_text())["prompts"] == f"{prompts_file} (chat)"


@pytest.mark.parametrize("args, message", [
    (("--prompts", "nope.jsonl"), "not found: nope.jsonl"),
    (("--block-sizes", "8,x"), "--block-sizes must be an integer B or B:G (B growing to G), or auto; got 'x'"),
    (("--block-sizes", "8:4"), "a block grows from B >= 2 to a larger size up to 64; got 8:4"),
    (("--block-sizes", "1"), "--block-sizes must be in [2, 64], got 1"),
    (("--block-sizes", "65"), "--block-sizes must be in [2, 64], got 65"),
    (("--repeats", 0), "--repeats must be an integer in [1, 2**31-1], got 0"),
    (("--limit", 0), "--limit must be an integer in [1, 2**31-1], got 0"),
    (("--limit", -1), "--limit must be an integer in [1, 2**31-1], got -1"),
    (("--temperature", "inf"), "--temperature must be a number >= 0, got inf"),
    (("--seed", 2**64), "--seed must be an integer in [0, 2**63-1]"),
])
def test_bad_input_gives_one_clear_line(args, message, target_dir, drafter_dir):
    """In-process (the entry point's own subprocess tests: test_cli.py, test_inputs.py)."""
    result = trtspec_in_process("bench", "--target", target_dir, "--drafter", drafter_dir, *args)
    stderr = result.stderr.decode()
    assert result.returncode == 1 and "Traceback" not in stderr
    assert len(stderr.strip().splitlines()) == 1 and message in stderr, stderr
    assert result.stdout == b""


def test_bench_concurrency_through_the_cli(target_dir, drafter_dir, prompts_file, tmp_path):
    out = tmp_path / "load.json"
    result = trtspec_in_process("--threads", "1", "bench", "--target", target_dir, "--drafter", drafter_dir,
                                "--prompts", prompts_file, "--block-sizes", "4,8", "--concurrency", "1,3",
                                "--max-new-tokens", "12", "--repeats", "1", "--json", out)
    assert result.returncode == 0, result.stderr
    assert b"clients" in result.stdout and b"TTFT" in result.stdout
    rows = json.loads(out.read_text())["runs"]
    assert [(r["concurrency"], r["block_size"]) for r in rows] == [(c, b) for c in (1, 3)
                                                                   for b in ("AR", "AR/pair", "4", "8")]
    assert [r["engine"] for r in rows[:4]] == ["target", "pair", "pair", "pair"]  # AR/pair: AR as auto's engine runs it
    for row in rows:
        assert row["identical_to_serial"] == row["greedy_requests"] == 3  # greedy: equal to each request alone
        assert row["throughput_tokens_per_s"] > 0 and row["latency_p99_s"] >= row["latency_p50_s"] > 0
        assert row["speedup_vs_ar"] == pytest.approx(row["throughput_tokens_per_s"] / rows[0 if row["concurrency"] == 1 else 4]["throughput_tokens_per_s"])
        if row["concurrency"] == 3:  # 3 prompts for 3 clients: no steady state without a drain, the whole run counts
            assert row["job_tokens_per_s"] == row["throughput_tokens_per_s"]
    assert max(r["batch_mean"] for r in rows if r["concurrency"] == 3) > 1.0
    for clients in (1, 3):  # each row against the fastest row at its concurrency
        cell = [r for r in rows if r["concurrency"] == clients]
        best = max(cell, key=lambda r: r["throughput_tokens_per_s"])
        assert {r["best_fixed"] for r in cell} == {best["block_size"]}
        assert best["vs_best"] == best["vs_best_paired"] == 1 and best["vs_best_ci95"] == [1, 1]
        assert all(r["vs_best"] == pytest.approx(r["throughput_tokens_per_s"] / best["throughput_tokens_per_s"])
                   for r in cell)
    bad = trtspec_in_process("bench", "--target", target_dir, "--drafter", drafter_dir, "--concurrency", "0,4")
    assert_one_line_error(bad, "--concurrency takes client counts")


def test_the_interval_of_a_ratio_resamples_repeats_in_pairs():
    """A host that drifts 3x over a run, and a row always 5% behind the other in the same repeat:
    paired, the interval is exactly 0.95 (resampled apart it would span the drift). Noise widens it
    around the ratio of the medians."""
    from trtspec.perf.concurrency import paired_interval

    host = [100.0, 300.0, 150.0, 250.0, 120.0, 280.0, 200.0, 180.0]
    assert paired_interval([0.95 * x for x in host], host) == pytest.approx([0.95, 0.95])
    noisy = [x * f for x, f in zip(host, (0.9, 1.0, 0.93, 1.02, 0.96, 0.97, 1.01, 0.92))]
    low, high = paired_interval(noisy, host)
    assert 0.9 <= low < statistics.median(noisy) / statistics.median(host) < high <= 1.02


def test_the_closed_loop_counts_the_steady_state_apart_from_the_drain(pipeline):
    """Throughput at c clients counts what was committed while all c had a request in flight: up to
    the moment the first client finds the prompt set empty. The rest of the run is the drain."""
    from trtspec.perf.concurrency import LoadRun, closed_loop
    from trtspec.runtime.request import GenerationConfig
    from trtspec.runtime.engine import EngineConfig

    prompts = [pipeline.codec.encode(p) for p in PROMPTS * 2]  # 6 prompts, 2 clients: 3 each
    run = LoadRun(2, BlockChoice(4))
    with pipeline.engine(EngineConfig(max_running=2, max_queued=2), load_aware=False) as engine:
        closed_loop(engine, prompts, GenerationConfig(block=BlockChoice(4), max_new_tokens=16), 2, run)
    (tokens, seconds), total = run.steady[0], sum(g.stats.new_tokens for g in run.generations[0])
    assert total == 6 * 16 and 4 * 16 <= tokens <= total  # at least the first four requests had finished
    assert 0 < seconds < run.seconds[0]
    assert run.throughput_repeats == [tokens / seconds] and run.job_throughput_repeats == [total / run.seconds[0]]
