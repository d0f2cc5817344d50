"""BlockPilot: the policy itself, label -> train -> evaluate on the tiny pair, and `auto` at run time."""

import json

import pytest
import torch
from helpers import TRAINED_PROMPTS, assert_one_line_error, code_prompts, generate, single, trtspec_in_process

from trtspec.errors import TrtspecError
from trtspec.blockpilot.policy import load_policy, summarize_prefill
from trtspec.blockpilot.training import expected_regret, simplest_within_one_error, train_policy
from trtspec.runtime.request import GenerationConfig
from trtspec.runtime.schedule import AR, AUTO, BlockChoice

PROMPTS = ["def add(a, b):\n", "for i in range(10):\n", "class Point:\n", "import os\nimport sys\n",
           "Speculative decoding drafts", "def f(x):\n    return"]


def test_prefill_summary():
    features = torch.arange(12.0).reshape(4, 3)
    # tail logits: one certain position (entropy 0, top-1 1) and one uniform over 4 tokens
    logits = torch.tensor([[0.0, -1e4, -1e4, -1e4], [0.0, 0.0, 0.0, 0.0]])
    assert summarize_prefill(features, logits, ("last",)).tolist() == [9, 10, 11]
    assert summarize_prefill(features, logits, ("mean",)).tolist() == [4.5, 5.5, 6.5]
    length = summarize_prefill(features, logits, ("length",)).item()
    assert length == pytest.approx(torch.log(torch.tensor(4.0)).item())
    entropy, top1 = summarize_prefill(features, logits, ("confidence",)).tolist()
    assert entropy == pytest.approx(torch.log(torch.tensor(4.0)).item() / 2) and top1 == pytest.approx(0.625)
    assert summarize_prefill(features, logits).shape == (9,)
    wide = torch.randn(64, 1000, generator=torch.Generator().manual_seed(0)) * 4  # against the textbook form
    log_probs = wide.log_softmax(dim=-1)
    textbook = [float(-(log_probs.exp() * log_probs).sum(-1).mean()), float(log_probs.exp().max(-1).values.mean())]
    assert summarize_prefill(features[:1], wide, ("confidence",)).tolist() == pytest.approx(textbook, rel=1e-5)
    with pytest.raises(TrtspecError, match="unknown BlockPilot feature"):
        summarize_prefill(features, logits, ("median",))


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    """Prompts whose first feature is positive run fastest at B=16, the others at B=8; a policy
    trained on them, saved, and new prompts to ask it about."""
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(400, 5, generator=generator)
    positive = inputs[:, 0] > 0
    speeds = torch.stack([torch.where(positive, 1.0, 2.0), torch.where(positive, 2.0, 1.0)], dim=1)
    policy = train_policy(inputs, speeds, (8, 16), ("last",), hidden=16, steps=300)
    saved = policy.save(tmp_path_factory.mktemp("toy") / "policy")
    return inputs, speeds, policy, saved, torch.randn(200, 5, generator=generator)


def test_policy_learns_a_feature_dependent_choice(toy):
    """It must tell the two kinds apart on new prompts, not only on those it was trained on."""
    inputs, speeds, policy, _, fresh = toy
    picks = policy.net(fresh).argmax(dim=1)
    assert (picks == (fresh[:, 0] > 0).long()).float().mean() > 0.95
    assert expected_regret(policy.net(inputs), speeds) < 0.05


def test_the_ablation_keeps_the_baseline_unless_a_summary_beats_it_by_more_than_its_error():
    def row(speedup: float, error: float) -> dict:
        return {"modelled_speedup": speedup, "standard_error": error, "mean_regret": 0.0}

    close = {("sampled", False): row(1.425, 0.018), ("last", False): row(1.406, 0.02),
             ("length", False): row(1.430, 0.018), ("length", True): row(1.431, 0.01)}
    assert simplest_within_one_error(close) == ("sampled", False)  # 1.425 >= 1.431 - 0.01
    clear = {**close, ("last", True): row(1.50, 0.02)}
    assert simplest_within_one_error(clear) == ("last", True)  # nothing else within 1.50 - 0.02
    tied = {("sampled", False): row(1.30, 0.0), ("length", False): row(1.35, 0.06), ("mean", False): row(1.36, 0.05)}
    assert simplest_within_one_error(tied) == ("length", False)  # the first within the best's error, not the best


def test_a_saved_policy_loads_as_it_was(toy):
    _, _, policy, saved, fresh = toy
    loaded = load_policy(saved, available_block_sizes=(8, 12, 16))
    assert torch.equal(loaded.net(fresh), policy.net(fresh)) and loaded.block_sizes == (8, 16)


def test_a_policy_over_a_block_size_the_engine_lacks_is_refused(toy):
    with pytest.raises(TrtspecError, match="16 is not in the engine"):
        load_policy(toy[3], available_block_sizes=(8, 12))


def test_a_policy_with_a_growing_block_needs_both_its_sizes(toy, tmp_path):
    inputs, speeds, _, _, _ = toy
    growing = train_policy(inputs, speeds, (BlockChoice(8), BlockChoice(4, 12)), ("last",), hidden=16, steps=5)
    loaded = load_policy(growing.save(tmp_path / "growing"), available_block_sizes=(4, 8, 12))
    assert loaded.choices == (BlockChoice(8), BlockChoice(4, 12)) and loaded.block_sizes == (4, 8, 12)
    with pytest.raises(TrtspecError, match="among 8, 4:12, but block size 12 is not in the engine"):
        load_policy(tmp_path / "growing", available_block_sizes=(4, 8, 16))


def test_a_directory_without_a_policy_is_refused(tmp_path):
    with pytest.raises(TrtspecError, match="not a BlockPilot policy"):
        load_policy(tmp_path)


def test_auto_without_a_policy_is_refused(target_dir, drafter_dir):
    from trtspec.models import load_drafter, load_target

    target = load_target(target_dir)
    engine = single(target, load_drafter(drafter_dir, target))
    with pytest.raises(TrtspecError, match="needs a BlockPilot policy"):
        generate(engine, [3, 4], GenerationConfig(block=AUTO))


@pytest.fixture(scope="module")
def trained(target_dir, drafter_dir, tmp_path_factory):
    """label-blocks -> train-policy through the real CLI on the tiny pair."""
    work = tmp_path_factory.mktemp("blockpilot")
    prompts = work / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    labels = work / "not-yet" / "labels.jsonl"  # the output's directory is created
    result = trtspec_in_process("--threads", 1, "label-blocks", "--target", target_dir, "--drafter", drafter_dir,
                                "--prompts", prompts, "--block-sizes", "4,8,4:8", "--max-new-tokens", 16, "-o", labels)
    assert result.returncode == 0, result.stderr.decode()
    result = trtspec_in_process("train-policy", labels, "-o", work / "policy", "--steps", 50, "--ablation")
    assert result.returncode == 0, result.stderr.decode()
    assert "cross-validated modelled speed-up" in result.stderr.decode()
    return work, prompts, labels


def test_label_blocks_writes_a_complete_labels_file(trained):
    """Every block size's run per prompt, the label its speeds imply, the features and the cost table."""
    from trtspec.blockpilot.labels import read_labels

    _, _, path = trained
    labels = read_labels(path)
    assert labels.choices == (BlockChoice(4), BlockChoice(8), BlockChoice(4, 8)) and len(labels.records) == len(PROMPTS)
    assert set(labels.header["cycle_cost_s"]) == {"1", "4", "8"} and labels.header["ar_token_s"] > 0
    cost = labels.cycle_cost
    for record, label in zip(labels.records, labels.labels()):
        runs = record["runs"]
        assert set(runs) == {"1", "4", "8", "4:8"} and record["label"] == label.name
        grown = runs["4:8"]
        speeds = {"4": runs["4"]["tau"] / cost(4), "8": runs["8"]["tau"] / cost(8),
                  "4:8": grown["tau"] * grown["cycles"] / ((grown["cycles"] - grown["grown_cycles"]) * cost(4)
                                                          + grown["grown_cycles"] * cost(8))}
        assert speeds[label.name] == pytest.approx(max(speeds.values()))  # 4 and 4:8 tie when it never grew
        assert runs["1"]["tau"] == 1.0 and 1.0 <= runs["8"]["tau"] <= 8.0
        assert runs["4"]["grown_cycles"] == 0 and 0 <= grown["grown_cycles"] < grown["cycles"]
    assert labels.features["last"].shape[0] == len(PROMPTS) and labels.features["length"].shape[1] == 1
    assert labels.features["confidence"].shape == (len(PROMPTS), 2) and labels.header["vocab_size"] > 0


def test_eval_policy_reports_every_strategy_against_the_oracle(trained):
    work, _, labels = trained
    out = work / "eval.json"
    result = trtspec_in_process("eval-policy", "--policy", work / "policy", "--labels", labels, "--json", out)
    assert result.returncode == 0, result.stderr.decode()
    report = json.loads(out.read_text())
    strategies = report["strategies"]
    assert set(strategies) == {"B=4", "B=8", "B=4:8", "AR", "blockpilot", "oracle", "oracle (all)"}
    oracle = strategies["oracle"]  # the per-prompt best fixed block size
    assert oracle["mean_regret"] == 0.0
    for name in ("B=4", "B=8"):  # no fixed size beats it (modelled)
        assert strategies[name]["modelled_speedup"] <= oracle["modelled_speedup"] + 1e-9
    assert strategies["oracle (all)"]["modelled_speedup"] >= oracle["modelled_speedup"] - 1e-9
    assert sum(report["strategies"]["blockpilot"]["chosen"].values()) == len(PROMPTS)
    # measured, not a speed claim: positive, and far below a decode (a policy that ran a model would not be)
    assert 0 < report["policy_overhead_s"] < 0.5
    assert "BlockPilot chose" in result.stdout.decode()


def test_a_policy_trained_on_greedy_and_sampled_labels_chooses_by_the_requests_temperature(
        trained, target_dir, drafter_dir, tmp_path):
    """The same prompts labelled greedy (B=8 fastest) and at T=1 (B=4 fastest): train-policy on both
    adds the "sampled" input, and `auto` at run time gives a sampled request the smaller block."""
    from trtspec.api import Pipeline
    from trtspec.runtime.sampling import SamplingConfig

    work, _, labels = trained
    lines = labels.read_text().splitlines()
    for temperature, fast, slow in ((0.0, "8", "4"), (1.0, "4", "8")):
        header, records = json.loads(lines[0]), [json.loads(line) for line in lines[1:]]
        header["temperature"] = temperature
        for record in records:
            runs = record["runs"]
            runs[fast]["tau"], runs[slow]["tau"], runs["4:8"]["tau"] = 3.0, 1.0, 1.0
        path = tmp_path / f"labels-t{temperature:g}.jsonl"
        path.write_text("\n".join(json.dumps(x) for x in [header, *records]) + "\n")
        (tmp_path / f"labels-t{temperature:g}.features.safetensors").write_bytes(
            labels.with_name("labels.features.safetensors").read_bytes())
    result = trtspec_in_process("train-policy", tmp_path / "labels-t0.jsonl", tmp_path / "labels-t1.jsonl",
                                "--features", "length", "--steps", 300, "-o", tmp_path / "policy")
    assert result.returncode == 0, result.stderr.decode()
    assert f"features length,sampled, trained on {2 * len(PROMPTS)} labelled runs" in result.stdout.decode()
    pipeline = Pipeline(target_dir, drafter_dir, policy=tmp_path / "policy")
    greedy = pipeline.generate(PROMPTS[0], GenerationConfig(block=AUTO, max_new_tokens=8))
    sampled = pipeline.generate(PROMPTS[0], GenerationConfig(block=AUTO, max_new_tokens=8,
                                                             sampling=SamplingConfig(temperature=1.0, seed=0)))
    assert (greedy.generation.stats.schedule, sampled.generation.stats.schedule) == ("8", "4")
    # cross-validated over both sets, no prefill summary beats knowing the temperature: the baseline wins
    ablation = trtspec_in_process("train-policy", tmp_path / "labels-t0.jsonl", tmp_path / "labels-t1.jsonl",
                                  "--ablation", "--steps", 200, "-o", tmp_path / "ablated")
    assert ablation.returncode == 0, ablation.stderr.decode()
    assert "features sampled, trained on" in ablation.stdout.decode()
    assert "features                           sampled: cross-validated modelled speed-up" in ablation.stderr.decode()
    ablated = Pipeline(target_dir, drafter_dir, policy=tmp_path / "ablated")
    assert [ablated.generate(PROMPTS[1], GenerationConfig(block=AUTO, max_new_tokens=8, sampling=sampling))
            .generation.stats.schedule for sampling in (SamplingConfig(), SamplingConfig(temperature=1.0, seed=1))] \
        == ["8", "4"]


@pytest.fixture(scope="module")
def auto_runs(trained, target_dir, drafter_dir):
    """Each prompt decoded under `auto` by a pipeline with the trained policy, and by AR."""
    from trtspec.api import Pipeline

    work, _, _ = trained
    pipeline = Pipeline(target_dir, drafter_dir, policy=work / "policy")
    baseline = pipeline.autoregressive()
    return pipeline, [(pipeline.generate(prompt, GenerationConfig(block=AUTO, max_new_tokens=20)),
                       baseline.generate(prompt, GenerationConfig(block=AR, max_new_tokens=20)))
                      for prompt in PROMPTS]


def test_auto_picks_one_of_the_policys_candidates(auto_runs):
    pipeline, runs = auto_runs
    assert pipeline.default_block == AUTO
    for auto, _ in runs:
        assert auto.generation.stats.auto and auto.generation.stats.schedule in ("4", "8", "4:8")


def test_auto_decodes_what_ar_decodes(auto_runs):
    for auto, ar in auto_runs[1]:
        assert auto.tokens == ar.tokens


def test_auto_under_load_reports_the_costs_it_judged_by(trained, target_dir, drafter_dir):
    """`bench --concurrency` with auto: the engine measured every (block size, batch) cell it may
    choose between (AR included) and the row says so; the output stays lossless."""
    from trtspec.api import Pipeline
    from trtspec.perf.concurrency import run_load
    from trtspec.runtime.sampling import SamplingConfig

    work, _, _ = trained
    pipeline = Pipeline(target_dir, drafter_dir, policy=work / "policy")
    rows = run_load(pipeline, PROMPTS, (AUTO,), (3,), max_new_tokens=32, sampling=SamplingConfig())
    auto = rows[-1]
    assert auto["block_size"] == "auto" and auto["identical_to_serial"] == auto["greedy_requests"] == len(PROMPTS)
    costs = auto["cycle_costs_ms"]
    assert costs["batches"] == [1, 2]  # the batches up to the engine's 3 slots
    assert set(costs["cycle_ms"]) == {"1", *map(str, pipeline.policy.block_sizes)}
    assert all(len(ms) == 2 and min(ms) > 0 for ms in costs["cycle_ms"].values())
    assert set(auto["learnt_tau"]) == set(costs["cycle_ms"]) - {"1"} and min(auto["learnt_tau"].values()) >= 1
    measured = auto["measured_cycle_ms"]  # the engine's own cycles, by block size and batch
    assert measured and set(measured) <= set(costs["cycle_ms"])
    assert all(int(batch) <= 3 and ms > 0 for by_batch in measured.values() for batch, ms in by_batch.items())
    assert sum(auto["decisions"].values()) == len(PROMPTS) + 3  # one verdict per auto request (and 3 warm-up)
    assert "cycle_costs_ms" not in rows[0]  # AR judged nothing


def test_the_cost_table_is_timed_once_per_machine(trained, target_dir, drafter_dir, tmp_path, monkeypatch, capsys):
    """An engine with a policy times its cost table the first time, saying so on stderr; the next
    engine of the same kind reads it from the cache ($TRTSPEC_CACHE/costs) instead of timing it
    again, silently; other slots (another key) are timed afresh; a damaged entry is timed again and
    rewritten; an unwritable cache only costs the timing."""
    import trtspec.blockpilot.costs as costs
    from trtspec.api import Pipeline
    from trtspec.runtime.engine import EngineConfig

    timed = []
    real = costs.measure_costs
    monkeypatch.setattr(costs, "measure_costs", lambda runner, sizes: timed.append(runner.slots) or real(runner, sizes))
    monkeypatch.setenv("TRTSPEC_CACHE", str(tmp_path / "cache"))
    pipeline = Pipeline(target_dir, drafter_dir, policy=trained[0] / "policy")
    first = pipeline.stepped_engine(EngineConfig(max_running=2)).chooser.costs
    entries = list((tmp_path / "cache" / costs.COSTS_DIR).glob("*.json"))
    assert timed == [2] and len(entries) == 1
    sizes = ", ".join(map(str, sorted({1, *pipeline.policy.block_sizes})))
    assert capsys.readouterr().err == (f"timing a decode cycle at block sizes {sizes} and batches up to 2 for "
                                       "BlockPilot's load-aware choice (once: later starts reuse it)\n")
    assert sorted(first.cycle_ms) == [1, *pipeline.policy.block_sizes] and first.batches == (1, 2)
    again = Pipeline(target_dir, drafter_dir, policy=trained[0] / "policy").stepped_engine(EngineConfig(max_running=2))
    assert timed == [2] and again.chooser.costs == first  # read back, not timed
    assert "timing" not in capsys.readouterr().err
    pipeline.stepped_engine(EngineConfig(max_running=3))
    assert timed == [2, 3] and len(list(entries[0].parent.glob("*.json"))) == 2
    entries[0].write_text(entries[0].read_text()[:-40])
    assert pipeline.stepped_engine(EngineConfig(max_running=2)).chooser.costs.batches == (1, 2) and timed == [2, 3, 2]
    assert json.loads(entries[0].read_text())["table"]["batches"] == [1, 2]  # rewritten whole
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("TRTSPEC_CACHE", str(tmp_path / "a-file"))
    assert pipeline.stepped_engine(EngineConfig(max_running=2)).chooser is not None and timed == [2, 3, 2, 2]


def test_a_policy_may_choose_not_to_speculate(target_dir, drafter_dir, tmp_path):
    """AR as a candidate: a policy that always prefers it decodes those requests with the target
    alone (the same tokens as AR), and an engine needs no block size for it."""
    from trtspec.api import Pipeline

    inputs = torch.randn(50, 1)
    speeds = torch.tensor([[2.0, 1.0]]).expand(50, -1)  # AR twice as fast as B=4 for every prompt
    policy = train_policy(inputs, speeds, (BlockChoice(1), BlockChoice(4)), ("length",), hidden=8, steps=50)
    directory = policy.save(tmp_path / "ar-policy")
    assert load_policy(directory, available_block_sizes=(4,)).block_sizes == (4,)
    pipeline = Pipeline(target_dir, drafter_dir, policy=directory)
    result = pipeline.generate(PROMPTS[0], GenerationConfig(block=AUTO, max_new_tokens=12))
    assert result.generation.stats.auto and result.generation.stats.block_size == 1
    assert result.tokens == pipeline.autoregressive().generate(PROMPTS[0], GenerationConfig(block=AR,
                                                                                            max_new_tokens=12)).tokens


def test_train_policy_ar_auto_needs_the_ablation(trained):
    work, _, labels = trained
    assert_one_line_error(trtspec_in_process("train-policy", labels, "-o", work / "x", "--ar", "auto"), "add --ablation")
    assert not (work / "x").exists()


def test_build_refuses_a_policy_the_engine_cannot_serve(trained, target_dir, drafter_dir, tmp_path):
    pytest.importorskip("onnxruntime", reason="the onnxruntime backend needs the [onnx] extra")
    assert_one_line_error(trtspec_in_process("build", "--target", target_dir, "--drafter", drafter_dir, "--block-sizes", "4,12",
                                             "--policy", trained[0] / "policy", "-o", tmp_path / "bad"),
                          "8 is not in the engine")
    assert not (tmp_path / "bad").exists()


def test_an_engine_built_with_a_policy_decodes_auto_by_default(trained, target_dir, drafter_dir, tmp_path):
    """`run` and `bench` on the engine alone choose with the policy it ships."""
    pytest.importorskip("onnxruntime", reason="the onnxruntime backend needs the [onnx] extra")
    work, prompts, _ = trained
    engine = tmp_path / "engine"
    result = trtspec_in_process("--threads", 1, "build", "--target", target_dir, "--drafter", drafter_dir,
                                "--block-sizes", "4,8", "--policy", work / "policy", "-o", engine)
    assert result.returncode == 0 and "BlockPilot policy over B=4,8" in result.stdout.decode()
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(PROMPTS[0])
    run = trtspec_in_process("run", prompt, "--engine", engine, "--max-new-tokens", 12, "--json")  # auto by default
    stats = json.loads(run.stdout)["stats"]
    assert stats["block_size_auto"] and stats["block_size"] in ("4", "8", "4:8")  # the policy's choices
    bench = trtspec_in_process("bench", "--engine", engine, "--prompts", prompts, "--block-sizes", "4,4:8,auto", "--repeats", 1,
                               "--max-new-tokens", 12, "--json", tmp_path / "bench.json")
    assert bench.returncode == 0, bench.stderr.decode()
    runs = json.loads((tmp_path / "bench.json").read_text())["runs"]
    assert [r["block_size"] for r in runs] == ["AR", "4", "4:8", "auto"]
    assert runs[1]["grown_cycle_fraction"] == 0 and runs[2]["grow_to"] == 8
    assert sum(runs[3]["chosen_block_sizes"].values()) == len(PROMPTS)
    lines = bench.stdout.decode().splitlines()
    assert [line.split()[0] for line in lines[-4:-1]] == ["4", "4:8", "auto"]
    assert lines[-1].startswith("identical to AR: B=4 ")  # greedy, every size and auto


def test_a_4_bit_engine_takes_the_policy_labelled_on_one_where_the_drafter_ships_it(tmp_path):
    from trtspec.blockpilot.policy import DRAFTER_POLICY_DIR, POLICY_CONFIG, WEIGHTS_POLICY_DIRS, drafter_policy

    drafter = tmp_path / "drafter"
    (drafter / DRAFTER_POLICY_DIR).mkdir(parents=True)
    (drafter / DRAFTER_POLICY_DIR / POLICY_CONFIG).write_text("{}")
    assert drafter_policy(drafter, "int4") == drafter / DRAFTER_POLICY_DIR  # none of its own: the general one
    (drafter / WEIGHTS_POLICY_DIRS["int4"]).mkdir()
    (drafter / WEIGHTS_POLICY_DIRS["int4"] / POLICY_CONFIG).write_text("{}")
    assert drafter_policy(drafter, "int4") == drafter / "blockpilot-int4"
    assert drafter_policy(drafter) == drafter_policy(drafter, "float") == drafter / DRAFTER_POLICY_DIR
    assert drafter_policy(None, "int4") is None


def test_a_drafter_that_ships_a_policy_needs_no_policy_flag(target_dir, trained_drafter_dir, tmp_path):
    """As with the bundled drafter: `run` is `auto` by default and the size it picks is one of the
    policy's (greedy: the tokens of any fixed size); `--block-size auto` works in run and bench with
    no --policy; `trtspec build` with its defaults (8/12/16/20/24, best backend here) embeds the
    policy, and the engine's greedy output equals eager PyTorch's."""
    pytest.importorskip("onnxruntime", reason="the onnxruntime backend needs the [onnx] extra")
    from trtspec.api import Pipeline

    pair = ("--target", target_dir, "--drafter", trained_drafter_dir)
    prompts = code_prompts(TRAINED_PROMPTS + 4)[TRAINED_PROMPTS:]  # held out
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(prompts[0])

    def run(*options) -> dict:
        result = trtspec_in_process("--threads", 1, "run", prompt, *pair, "--json", "--max-new-tokens", 24, *options)
        assert result.returncode == 0, result.stderr.decode()
        return json.loads(result.stdout)

    plain, auto, fixed = run(), run("--block-size", "auto"), run("--block-size", 16)
    assert plain["stats"]["block_size_auto"] and auto["stats"]["block_size_auto"]
    assert plain["stats"]["block_size"] in ("8", "16")  # the policy's choices
    assert fixed["stats"]["block_size"] == "16" and not fixed["stats"]["block_size_auto"]
    assert plain["tokens"] == auto["tokens"] == fixed["tokens"]
    listed = tmp_path / "prompts.jsonl"
    listed.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    bench = trtspec_in_process("--threads", 1, "bench", *pair, "--prompts", listed, "--block-sizes", "8,16,auto",
                               "--limit", 2, "--max-new-tokens", 16, "--repeats", 1, "--json", tmp_path / "bench.json")
    assert bench.returncode == 0, bench.stderr.decode()
    assert "auto" in bench.stdout.decode() and (tmp_path / "bench.json").is_file()

    built = trtspec_in_process("--threads", 1, "build", *pair, "-o", tmp_path / "engine")
    assert built.returncode == 0, built.stderr.decode()
    assert "B=12 (target profile 3, draft profile 1)" in built.stdout.decode()
    engine = Pipeline(engine=tmp_path / "engine")
    assert engine.backend == "onnxruntime int8 (draft)" and engine.runner.block_sizes == (8, 12, 16, 20, 24)
    assert engine.policy is not None and engine.default_block == AUTO  # the drafter's policy, embedded
    eager = Pipeline(target_dir, trained_drafter_dir)
    for text in prompts[:3]:
        for block_size in (12, 24):
            config = GenerationConfig(block=BlockChoice(block_size), max_new_tokens=48)
            assert engine.generate(text, config).tokens == eager.generate(text, config).tokens


@pytest.mark.parametrize("kinds", [("confidence",), ("length",)])
def test_prefill_scores_the_prompts_tail_only_for_a_policy_that_reads_it(target_dir, drafter_dir, tmp_path,
                                                                        monkeypatch, kinds):
    """Prefill runs the LM head only on positions something reads: a policy that reads the prompt's
    confidence gets the logits of its last PREFILL_LOGITS positions (those a whole prefill gives),
    any other the last position's alone (the first token's)."""
    from trtspec.api import Pipeline
    from trtspec.export.bindings import PREFILL_LOGITS

    inputs = torch.randn(50, 2 if kinds == ("confidence",) else 1)
    policy = train_policy(inputs, torch.rand(50, 2) + 1, (BlockChoice(4), BlockChoice(8)), kinds, hidden=8, steps=20)
    pipeline = Pipeline(target_dir, drafter_dir, policy=policy.save(tmp_path / "policy"))
    seen, choose = [], pipeline.policy.choose
    monkeypatch.setattr(pipeline.policy, "choose", lambda f, logits, s=False: seen.append(logits.clone()) or choose(f, logits, s))
    prompt = "def add(a, b):\n    return a + b\n" * 12  # longer than PREFILL_LOGITS tokens
    pipeline.generate(prompt, GenerationConfig(block=AUTO, max_new_tokens=2))
    whole = pipeline.prefill(pipeline.codec.encode(prompt))[0]
    assert len(pipeline.codec.encode(prompt)) > PREFILL_LOGITS == whole.shape[0]
    want = whole if kinds == ("confidence",) else whole[-1:]
    assert seen[0].shape == want.shape and torch.allclose(seen[0].float(), want.float(), atol=1e-4)
