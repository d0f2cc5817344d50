"""Continuous batching (trtspec.runtime.engine): lossless, isolated, bounded.

Requests join and leave a running batch, with every kind of block size side by side (AR, fixed,
growing, BlockPilot's auto), prompts prefilled in chunks, and stops and limits landing mid-block.
Every greedy request must produce exactly the tokens it produces decoded alone; at T = 1 the
tokens must follow the target's own distribution inside a batch of others (and a broken
acceptance rule must be caught there too). A bad request, a failing callback, a full queue and a
cancellation each affect only their own request.
"""

import threading

import numpy as np
import pytest
import torch
from helpers import SAMPLED_PROMPT as PROMPT, break_acceptance_rule, code_prompts, exact_three_token_distribution, predictable_pair, pvalues

from trtspec.api import Pipeline
from trtspec.errors import Cancelled, TrtspecError
from trtspec.runtime import engine as engine_module
from trtspec.runtime.processing import Processing
from trtspec.runtime.request import GenerationConfig
from trtspec.runtime.engine import Busy, Engine, EngineConfig, LocalEngine
from trtspec.runtime.reference import PythonController
from trtspec.runtime.runner import BatchRunner
from trtspec.runtime.sampling import SamplingConfig
from trtspec.runtime.schedule import AR, AUTO, BlockChoice

# (block size, grow_to): AR, fixed, growing and BlockPilot's choice, cycled over the prompts.
SCHEDULES = [(1, 0), (4, 0), (8, 0), (16, 0), (6, 16), (None, 0)]  # None: auto
LIMITS = [24, 37, 50, 61]  # token limits that land mid-block for most block sizes


@pytest.fixture(scope="module")
def pair_eager(target_dir, trained_drafter_dir):
    """The tiny target with a drafter trained for it, whose BlockPilot policy decides `auto`. Cycles
    keep their widths whatever the machine's timing (no confidence narrowing), so a request's
    acceptance is the same alone and batched."""
    return Pipeline(target_dir, trained_drafter_dir, confident_width=False)


@pytest.fixture(scope="module")
def pair_ort(target_dir, trained_drafter_dir, tmp_path_factory):
    pytest.importorskip("onnxruntime", reason="the onnxruntime backend needs the [onnx] extra")
    from trtspec.build import BuildConfig, build_engine

    output = tmp_path_factory.mktemp("engines") / "pair-ort"
    build_engine(target_dir, trained_drafter_dir, output,
                 BuildConfig(block_sizes=(4, 6, 8, 12, 16, 20, 24), backend="onnxruntime", max_batch=8),
                 progress=False)
    return Pipeline(engine=output, confident_width=False)


def _alone(pipeline, ids, config):
    """The request decoded by itself: the pipeline's one-slot local engine (what `trtspec run` uses)."""
    return pipeline.local_engine.generate([ids], [config])[0]


def _requests(pipeline, count):
    """Code prompts of about 100 tokens (the drafter's kind: drafts are accepted) with mixed schedules,
    limits and, for a third of them, an extra stop id: a token of the request's own greedy output
    halfway to its limit, so that it stops there or earlier."""
    requests = []
    for i, prompt in enumerate(code_prompts(count, words=40, seed=3)):
        size, grow_to = SCHEDULES[i % len(SCHEDULES)]
        ids, limit = pipeline.codec.encode(prompt), LIMITS[i % len(LIMITS)]
        stop_ids = ()
        if i % 3 == 2:
            stop_ids = (_alone(pipeline, ids, GenerationConfig(block=AR, max_new_tokens=limit)).tokens[limit // 2],)
        config = GenerationConfig(block=BlockChoice(size, grow_to), max_new_tokens=limit, stop_ids=stop_ids)
        requests.append((ids, config))
    return requests


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["eager", "onnxruntime"])
def test_batched_greedy_equals_each_request_alone(backend, request):
    pipeline = request.getfixturevalue("pair_eager" if backend == "eager" else "pair_ort")
    # 18 requests hold every (schedule, limit, stop) combination of _requests (a period of 12) and six
    # more; eight slots for them: requests join as others leave; prompts prefill in chunks of 48.
    requests = _requests(pipeline, 18)
    with pipeline.engine(EngineConfig(max_running=8, max_queued=18, prefill_chunk=48)) as engine:
        handles = [engine.submit(ids, config) for ids, config in requests]
        batched = [h.result(timeout=600) for h in handles]
    for (ids, config), generation in zip(requests, batched):
        alone = _alone(pipeline, ids, config)
        assert generation.tokens == alone.tokens
        assert generation.stats.new_tokens == len(alone.tokens)
        if (generation.stats.block_size, generation.stats.grow_to) == (alone.stats.block_size, alone.stats.grow_to):
            # Tokens are lossless whatever the drafter proposes; the acceptance shows a batched drafter
            # that reads the wrong slot, position or context.
            assert generation.stats.histogram == alone.stats.histogram
    stats = [g.stats for g in batched]
    assert max(s.batch_mean for s in stats) > 1.5  # cycles really were shared
    assert {s.finish_reason for s in stats} == {"stop", "length"}
    assert any(s.auto for s in stats) and any(s.grow_to for s in stats)
    assert any(s.new_tokens % max(s.block_size, 1) for s in stats if s.finish_reason == "length")


@pytest.fixture(scope="module")
def predictable():
    return predictable_pair(vocab_size=8, beta=0.5, hidden=16, layers=1, heads=2, kv_heads=1)


def _sample_in_batches(pair, count: int, controller=None, static: bool = False) -> np.ndarray:
    """First three tokens of `count` seeded T = 1 requests at B = 4, each decoded among greedy
    requests at other block sizes and other sampled ones (`static`: in the CUDA-graph binding mode,
    rows padded to batch buckets)."""
    options = {"controller": controller} if controller is not None else {}
    runner = BatchRunner.eager(*pair, slots=64)
    runner.static = static
    engine = Engine(LocalEngine(runner,
                               config=EngineConfig(max_running=64, max_queued=count * 2), **options))
    try:
        sampled = []
        for seed in range(count):
            sampled.append(engine.submit(PROMPT, GenerationConfig(
                block=BlockChoice(4), max_new_tokens=3, sampling=SamplingConfig(temperature=1.0, seed=seed))))
            if seed % 4 == 0:  # neighbours: greedy at other sizes, and longer
                engine.submit(PROMPT + [seed % 8], GenerationConfig(block=BlockChoice((2, 3, 1)[seed % 3]), max_new_tokens=9))
        return np.array([r.result(timeout=600).tokens for r in sampled])
    finally:
        engine.close()


def test_seeded_requests_draw_in_a_batch_what_they_draw_alone():
    """A seed reproduces a request whatever it is batched with: sampled requests (their first tokens
    drawn together at admission, their verify rows together every cycle), greedy ones, penalised
    ones and ones asking for logprobs, at AR, 4 and 8, eight at a time against one at a time."""
    pair = predictable_pair(vocab_size=64, beta=0.5)
    configs = [GenerationConfig(block=BlockChoice((4, 8, 1)[i % 3]), max_new_tokens=12,
                                sampling=SamplingConfig(temperature=(0.0, 0.8, 1.0)[i % 3], top_k=(0, 5)[i % 2], seed=i),
                                processing=Processing(repetition_penalty=1.3) if i % 4 == 1 else Processing(),
                                logprobs=2 if i % 5 == 0 else None) for i in range(12)]
    prompts = [[2, 3, 4 + i % 5] for i in range(12)]
    together = LocalEngine(BatchRunner.eager(*pair, slots=8), config=EngineConfig(max_running=8))
    alone = LocalEngine(BatchRunner.eager(*pair, slots=1), config=EngineConfig(max_running=1))
    batched = together.generate(prompts, configs)
    for prompt, config, generation in zip(prompts, configs, batched):
        expected = alone.generate([prompt], [config])[0]
        assert generation.tokens == expected.tokens
        if config.logprobs is None:
            assert generation.logprobs is None and expected.logprobs is None
        else:  # the same tokens; their values to float32 rounding (a batch's matmuls sum in another order)
            assert [lp.token for lp in generation.logprobs] == [lp.token for lp in expected.logprobs]
            assert [lp.logprob for lp in generation.logprobs] == pytest.approx([lp.logprob for lp in expected.logprobs],
                                                                                abs=1e-4)
    assert len({tuple(g.tokens) for g in batched}) > 6  # sampled requests differ: the seeds are used


def test_a_batch_of_several_block_sizes_verifies_in_one_call(monkeypatch):
    """AR, B = 4 and B = 8 requests side by side run one verify call per iteration (at 8, the
    shorter blocks padded), with each request's tokens what it decodes alone; a batch where the
    padded call would hold more than three times the positions computed (seven AR requests beside
    one B = 8: 64 for 15) runs a call per size, unless the runner's target graph is ragged (its
    padding costs nothing: ONNX Runtime's in-place graph). (Whole blocks: draft width 0.)"""
    pair = predictable_pair(vocab_size=64, beta=0.5)
    runner = BatchRunner.eager(*pair, slots=8)
    widths = []
    verify = runner.verify
    monkeypatch.setattr(runner, "verify", lambda slots, blocks, starts: (
        widths.append((len(slots), max(len(b) for b in blocks))), verify(slots, blocks, starts))[1])
    alone = LocalEngine(BatchRunner.eager(*pair, slots=1), config=EngineConfig(max_running=1))
    engine = LocalEngine(runner, config=EngineConfig(max_running=8, draft_width=0))
    for sizes, calls, ragged in (((1, 4, 8, 1, 4, 8), {(6, 8)}, False),
                                 ((4, 4) + (1,) * 6, {(8, 4)}, False),  # 32 for 14: one call
                                 ((1,) * 7 + (8,), {(7, 1), (1, 8)}, False), ((1,) * 7 + (8,), {(8, 8)}, True)):
        widths.clear()
        runner.ragged = ragged
        configs = [GenerationConfig(block=BlockChoice(size), max_new_tokens=30) for size in sizes]
        prompts = [[2, 3, 4 + i] for i in range(len(sizes))]
        batched = engine.generate(prompts, configs)
        assert set(widths[:3]) == calls  # the first iterations, while every request runs
        for prompt, config, generation in zip(prompts, configs, batched):
            assert generation.tokens == alone.generate([prompt], [config])[0].tokens


@pytest.mark.slow
def test_sampling_inside_a_batch_follows_the_target(predictable):
    joint = exact_three_token_distribution(predictable[0])
    results = pvalues(_sample_in_batches(predictable, 6_000), joint)
    assert min(results.values()) > 1e-3, results


def test_sampling_inside_a_static_padded_batch_follows_the_target(predictable):
    """The same through the static bindings a GPU replays: batches padded to buckets, contexts to
    powers of two (what runs on CUDA by default, here on the CPU)."""
    joint = exact_three_token_distribution(predictable[0])
    results = pvalues(_sample_in_batches(predictable, 3_000, static=True), joint)
    assert min(results.values()) > 1e-3, results


def test_a_broken_acceptance_rule_is_caught_inside_a_batch(predictable, monkeypatch):
    break_acceptance_rule(monkeypatch, lambda drafts, posterior: (drafts == posterior[1:]).long().cumprod(-1).sum(-1))
    joint = exact_three_token_distribution(predictable[0])
    results = pvalues(_sample_in_batches(predictable, 1_500, controller=PythonController), joint)
    assert min(results.values()) < 1e-3, results


@pytest.fixture(scope="module")
def tiny(target_dir, drafter_dir):
    return Pipeline(target_dir, drafter_dir)


def test_engines_take_the_pipelines_proposal_temperature_unless_their_config_sets_one(target_dir, drafter_dir, tiny):
    assert tiny.stepped_engine(EngineConfig(max_running=1), load_aware=False).proposal_temperature == 0.7
    greedy = Pipeline(target_dir, drafter_dir, proposal_temperature=0)
    assert greedy.local_engine.proposal_temperature == 0.0
    assert greedy.stepped_engine(EngineConfig(max_running=2), load_aware=False).proposal_temperature == 0.0
    own = greedy.stepped_engine(EngineConfig(max_running=2, proposal_temperature=0.5), load_aware=False)
    assert own.proposal_temperature == 0.5
    with pytest.raises(TrtspecError, match="proposal temperature must be a number >= 0, got -1"):
        EngineConfig(proposal_temperature=-1)


def test_run_draws_a_sampled_requests_drafts_at_its_proposal_temperature(target_dir, drafter_dir, tmp_path,
                                                                          monkeypatch):
    """The command line's --proposal-temperature reaches the engine that decodes (and 0 never draws)."""
    from helpers import trtspec_in_process
    from trtspec.runtime import engine, sampling

    fractions = []
    monkeypatch.setattr(engine, "draw_proposals", lambda *args: fractions.append(args[3]) or sampling.draw_proposals(*args))
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("def fib(n):")
    common = ("run", prompt, "--target", target_dir, "--drafter", drafter_dir, "--block-size", 4, "--max-new-tokens", 12,
              "--temperature", 1, "--seed", 0, "--json")
    for fraction in (0.3, 0):
        result = trtspec_in_process(*common, "--proposal-temperature", fraction)
        assert result.returncode == 0, result.stderr.decode()
    assert fractions and set(fractions) == {0.3}


def test_a_bad_request_fails_alone(tiny):
    """Refused submissions and a failing callback raise for their own request only: the batch's other
    requests finish as if decoded alone (one engine run shows both sides)."""
    prompts = [[5, 9, 33, 2, 7], [100, 3], [8] * 30]
    config = GenerationConfig(block=BlockChoice(4), max_new_tokens=40)
    alone = [_alone(tiny, p, config).tokens for p in prompts]
    calls = []

    def failing_callback(tokens):
        calls.append(tokens)
        raise RuntimeError("the client went away")

    with tiny.engine(EngineConfig(max_running=4)) as engine:
        good = [engine.submit(p, config) for p in prompts]
        for bad, message in (([], "empty"), ([5] * 5000, "context holds"),
                             ([5, 6], "needs a BlockPilot policy")):
            with pytest.raises(TrtspecError, match=message):
                engine.submit(bad, GenerationConfig(block=AUTO) if "policy" in message else config)
        failing = engine.submit([5, 6, 7], config, on_commit=failing_callback)
        with pytest.raises(RuntimeError, match="went away"):
            failing.result(timeout=120)
        assert [r.result(timeout=120).tokens for r in good] == alone
    assert len(calls) == 1  # the failing request stopped at its first commit


def test_a_full_queue_answers_busy(tiny):
    """The engine holds max_running + max_queued requests whether or not its loop has admitted the
    first ones yet (requests can arrive faster than cycles end); the next one is refused."""
    with tiny.engine(EngineConfig(max_running=2, max_queued=1)) as engine:
        config = GenerationConfig(block=BlockChoice(4), max_new_tokens=200)
        with engine.local.lock:  # the loop cannot admit anything meanwhile: the worst case for arrivals
            held = [engine.submit([5, 9, 33], config) for _ in range(3)]
            with pytest.raises(Busy, match="busy"):
                engine.submit([5, 9, 33], config)
        assert all(len(r.result(timeout=120).tokens) == 200 for r in held)


def test_the_prefills_token_is_emitted_when_the_prefill_ends(tiny):
    """Its time to first token is the prefill's, not the prefill's plus a draft and a verify."""
    local = tiny.stepped_engine(EngineConfig(max_running=1), load_aware=False)
    commits = []
    request = local.submit([5, 9, 33], GenerationConfig(block=BlockChoice(4), max_new_tokens=20),
                           on_commit=commits.append)
    local.step()  # the prefill, then the first cycle
    assert len(commits) == 2 and len(commits[0]) == 1
    while local.busy:
        local.step()
    assert [token for tokens in commits for token in tokens] == request.result().tokens


def test_cancelling_frees_the_slot_within_a_cycle(tiny):
    started = threading.Event()
    with tiny.engine(EngineConfig(max_running=1)) as engine:
        long = engine.submit([5, 9, 33], GenerationConfig(block=BlockChoice(4), max_new_tokens=1000),
                             on_commit=lambda tokens: started.set())
        assert started.wait(60)
        long.cancel()
        with pytest.raises(Cancelled):
            long.result(timeout=60)
        assert len(long.tokens) < 1000
        after = engine.submit([5, 9, 33], GenerationConfig(block=BlockChoice(4), max_new_tokens=5))
        assert len(after.result(timeout=60).tokens) == 5  # the one slot was free again
        assert engine.load().running == 0


def test_the_engine_needs_its_slots(tiny):
    runner = BatchRunner.eager(tiny.target, tiny.drafter, slots=2)
    with pytest.raises(TrtspecError, match="cache slots"):
        LocalEngine(runner, config=EngineConfig(max_running=3))
    with pytest.raises(TrtspecError, match="max-running"):
        EngineConfig(max_running=0)


def test_a_concurrency_whose_caches_cannot_fit_is_refused_before_allocating(tiny):
    """Before: `--max-concurrency 100000` ended in an allocation traceback. The limit is checked where
    the config is made, the caches' bytes (from the model config and max context) against the
    device's memory before anything is allocated; the figures are in the one line."""
    from helpers import tiny_config
    from trtspec.models import Qwen3Target
    from trtspec.runtime.memory import available_bytes, format_bytes

    with pytest.raises(TrtspecError, match=r"concurrency \(max-running\) must be an integer in \[1, 4096\], got 100000"):
        EngineConfig(max_running=100000)
    # 2 layers x 2 KV heads x head_dim 8, float32, K and V: 256 bytes a position, 2**31 positions a slot
    huge = Qwen3Target(tiny_config(max_positions=2**31 - 64)).eval()
    per_slot = 256 * 2**31
    available = format_bytes(available_bytes(huge.device))
    with pytest.raises(TrtspecError) as refused:
        BatchRunner.eager(huge, None, slots=3)
    assert str(refused.value).startswith(
        f"concurrency 3 needs {format_bytes(3 * per_slot)} of KV cache ({format_bytes(per_slot)} per request at max "
        f"context {2**31 - 64}); this machine has {available} available (")
    # the batched eager caches hold the pipeline's max context, not the model's maximum (2048 here)
    runner_context = tiny.runner.max_context
    try:
        tiny.runner.max_context = 100
        with tiny.engine(EngineConfig(max_running=2)) as engine:
            assert engine.runner.max_context == 100
            assert all(cache.shape[0] == 100 + 64 for caches in engine.runner._caches.values() for cache in caches)
    finally:
        tiny.runner.max_context = runner_context


def test_a_batch_has_caches_for_its_own_requests_not_the_models_whole_context(tiny, monkeypatch):
    """generate_batch zeroed caches for the model's whole context at every call (3 GiB, seconds, for
    the default pair at 8 slots): they hold its longest prompt and largest budget now, rounded up to
    a power of two from 1,024, and a request reaching past the floor decodes as it does alone."""
    from trtspec.api import batch_context

    def budget(tokens):
        return GenerationConfig(max_new_tokens=tokens)
    assert batch_context([[1] * 10, [1] * 300], [budget(16), budget(256)], 8192) == 1024
    assert batch_context([[1] * 1000], [budget(48)], 8192) == 2048
    assert batch_context([[1] * 1000], [budget(48)], 1500) == 1500  # never past the model's
    sized = []
    made = Pipeline.stepped_engine
    monkeypatch.setattr(Pipeline, "stepped_engine",
                        lambda self, *args, **kw: sized.append(kw["max_context"]) or made(self, *args, **kw))
    prompt = "def main():\n    return 1\n" * 62
    config = GenerationConfig(block=BlockChoice(4), max_new_tokens=48)
    ids = tiny.codec.encode(prompt)
    assert 1024 - 48 < len(ids) <= 1024  # the prompt and its budget pass the floor
    alone = tiny.generate(prompt, config)
    batched = tiny.generate_batch([prompt, "def f(x):"], [config, config], max_running=2)
    assert sized == [2048] and batched[0].tokens == alone.tokens and len(alone.tokens) == 48


def _cycles(size: int, accepted: dict[int, int]) -> list[int]:
    """An acceptance histogram at block size `size`: {accepted drafts: cycles}."""
    return [accepted.get(a, 0) for a in range(size)]


def test_auto_requests_still_speculating_turn_ar_when_the_load_sends_a_later_one_to_ar(pair_eager):
    """A burst of `auto` requests went to B = 8; then the load-aware chooser sends the next `auto`
    admission to AR (it judged the batch better off AR): the speculating `auto` requests turn AR
    from their next cycle (one call per iteration, not two), a request with a fixed size keeps it,
    every output is still exactly AR's, and their statistics keep their speculative cycles."""
    from trtspec.runtime.stats import committed_tokens

    from trtspec.blockpilot.load import LoadAwareChooser

    local = pair_eager.stepped_engine(EngineConfig(max_running=8))
    admissions = []

    class FirstWaveThenAR(LoadAwareChooser):  # the chooser's verdicts, in a fixed order; its switches
        def choose(self, choice, load, sampled=False):
            admissions.append(load)
            return BlockChoice(8) if len(admissions) <= 3 else AR
    local.chooser = FirstWaveThenAR(local.chooser.costs, local.chooser.choices)
    prompts = [pair_eager.codec.encode(p) for p in code_prompts(5, words=40, seed=3)]
    auto, fixed = GenerationConfig(block=AUTO, max_new_tokens=48), GenerationConfig(block=BlockChoice(8), max_new_tokens=48)
    requests = [local.submit(prompt, auto) for prompt in prompts[:3]] + [local.submit(prompts[3], fixed)]
    for _ in range(4):
        local.step()
    assert local.load().block_sizes == (8, 8, 8, 8)  # prefilled and speculating, none finished
    requests.append(local.submit(prompts[4], auto))
    local.step()
    assert local.load().block_sizes == (1, 1, 1, 8, 1)  # the burst followed the late one; the fixed one did not
    while local.busy:
        local.step()
    expected = pair_eager.local_engine.generate(prompts, [GenerationConfig(block=AR, max_new_tokens=48)] * 5)
    assert [r.result(timeout=0).tokens for r in requests] == [g.tokens for g in expected]
    for request in requests[:3]:
        stats = request.stats
        assert stats.block_size == 8 and stats.auto and stats.new_tokens == 48 and sum(stats.histogram) >= 3
        assert stats.turned_ar_at == 1 + committed_tokens(stats.histogram) < 48  # its cycles: those before it
    assert requests[3].stats.turned_ar_at == 0 and 1 + committed_tokens(requests[3].stats.histogram) >= 48
    assert requests[4].stats.block_size == 1 and requests[4].stats.turned_ar_at == 0


def test_an_ar_verdict_switches_only_the_auto_requests_still_speculating():
    from trtspec.blockpilot.costs import CostTable
    from trtspec.blockpilot.load import LoadAwareChooser

    chooser = LoadAwareChooser(CostTable((1, 2), {1: [10.0, 11.0], 8: [20.0, 25.0]}))
    running = [(AUTO, 8), (BlockChoice(8), 8), (AUTO, 1), (AUTO, 12)]  # (asked for, current size)
    assert chooser.requests_to_switch(AR, running) == [0, 3]
    assert chooser.requests_to_switch(BlockChoice(8), running) == []


def test_load_aware_blockpilot_keeps_speculation_only_while_it_pays():
    from trtspec.blockpilot.costs import CostTable
    from trtspec.blockpilot.load import LoadAwareChooser
    from trtspec.runtime.engine import Load
    from trtspec.runtime.schedule import BlockChoice

    # AR: 10 ms + 0.5 ms per request; B=12: 25 ms + 5 ms per request (compute grows with B * batch).
    batches = (1, 2, 4, 8, 16)
    costs = CostTable(batches, {1: [10 + 0.5 * n for n in batches], 12: [25 + 5 * n for n in batches]})
    chooser = LoadAwareChooser(costs)
    twelve = BlockChoice(12)
    for _ in range(20):
        chooser.observe_request(twelve, _cycles(12, {3: 32}))  # tau 4 at B=12: 4 / 30 ms beats 1 / 10.5 ms alone
    assert chooser.choose(twelve, Load(0, 1, ())) == twelve
    assert chooser.choose(twelve, Load(0, 9, (1,) * 8)) == BlockChoice(1)  # joining eight AR requests is nearly free
    assert chooser.choose(twelve, Load(0, 17, (12,) * 16)) == BlockChoice(1)  # 17 at AR beat 17 at 12 by far: drift
    assert chooser.choose(twelve, Load(0, 3, (12, 12))) == twelve
    assert chooser.choose(BlockChoice(1), Load(0, 1, ())) == BlockChoice(1)
    # Sampled requests learn their own tau: accepting little at T > 0 sends them to AR, not greedy ones.
    assert chooser.choose(twelve, Load(0, 1, ()), sampled=True) == twelve  # the prior: speculation
    for _ in range(20):
        chooser.observe_request(twelve, _cycles(12, {1: 32}), sampled=True)  # 2 / 30 ms < 1 / 10.5 ms
    assert chooser.choose(twelve, Load(0, 1, ()), sampled=True) == BlockChoice(1)
    assert chooser.choose(twelve, Load(0, 1, ())) == twelve
    # A sampled neighbour shares the greedy request's call and commits its own (smaller) tau.
    expected = (chooser.tau(12) + chooser.tau(12, sampled=True)) / costs.cost(12, 2)
    assert chooser.rate(12, [False, True]) == pytest.approx(expected)
    for _ in range(200):
        chooser.observe_request(twelve, _cycles(12, {0: 16, 1: 16}))  # it turns out to accept little: AR even alone
    assert chooser.choose(twelve, Load(0, 1, ())) == BlockChoice(1)
    assert chooser.decisions == {"kept": 4, "ar": 4}


def test_load_aware_blockpilot_asks_the_policy_only_when_speculation_has_a_chance():
    """The policy's forward costs the engine thread ~5 ms per request, in which no request decodes:
    where the load settles the size whatever it answers, the chooser decides without it."""
    from trtspec.blockpilot.costs import CostTable
    from trtspec.blockpilot.load import LoadAwareChooser
    from trtspec.runtime.engine import Load
    from trtspec.runtime.schedule import BlockChoice

    batches = (1, 2, 4, 8, 16)
    costs = CostTable(batches, {1: [10 + 0.5 * n for n in batches], 8: [20 + 3 * n for n in batches],
                                12: [25 + 5 * n for n in batches]})
    chooser, asked = LoadAwareChooser(costs), []
    chooser.observe_request(BlockChoice(12), _cycles(12, {2: 1000}))  # tau 3 at 12 and at 8

    def policy() -> BlockChoice:
        asked.append(True)
        return BlockChoice(12)

    assert chooser.choose(policy, Load(0, 16, (1,) * 15)) == BlockChoice(1) and not asked  # 16 x 3 / 68 ms < 16 / 18 ms
    assert chooser.choose(policy, Load(0, 1, ())) == BlockChoice(8) and asked == [True]  # 3 / 23 ms > 3 / 30 ms, 1 / 10.5 ms
    assert chooser.decisions == {"ar": 1, "smaller": 1}
    # told what the policy can answer: where the load settles on 8, an answer of 8 or 12 comes out as 8 ...
    told = LoadAwareChooser(costs, (BlockChoice(8), BlockChoice(12)))
    told.observe_request(BlockChoice(12), _cycles(12, {2: 1000}))
    assert told.choose(policy, Load(0, 1, ())) == BlockChoice(8) and asked == [True] and told.decisions == {"load": 1}
    # ... but a growing block from 8 would run as it is: a policy that can answer one is asked
    grows = LoadAwareChooser(costs, (BlockChoice(8, grow_to=12), BlockChoice(12)))
    grows.observe_request(BlockChoice(12), _cycles(12, {2: 1000}))
    assert grows.choose(policy, Load(0, 1, ())) == BlockChoice(8) and asked == [True, True]


def test_load_aware_blockpilot_takes_a_smaller_block_when_the_batch_pays_for_it():
    """Evidence at B = 12 also tells what B = 8 would accept (each cycle cut at 8); the batch is
    judged as if all of it ran at the candidate size, so it moves to 8 as it grows even while
    its first requests still decode at 12, and a burst is judged as the batch it becomes."""
    from trtspec.blockpilot.costs import CostTable
    from trtspec.blockpilot.load import PRIOR_CYCLES, LoadAwareChooser
    from trtspec.runtime.engine import Load
    from trtspec.runtime.schedule import BlockChoice

    batches = (1, 2, 4, 8, 16)
    costs = CostTable(batches, {1: [10 + 0.5 * n for n in batches], 8: [20 + 3 * n for n in batches],
                                12: [24 + 5 * n for n in batches]})
    chooser, twelve = LoadAwareChooser(costs), BlockChoice(12)
    cycles = 10_000 * PRIOR_CYCLES  # the prior weighs nothing beside this
    chooser.observe_request(twelve, _cycles(12, {11: cycles // 2, 3: cycles // 2}))  # tau 8 at B=12
    assert chooser.tau(12) == pytest.approx(8.0, rel=1e-3)
    assert chooser.tau(8) == pytest.approx(6.0, rel=1e-3)  # (8 + 4) / 2: the full blocks cut at 8
    assert chooser.tau(8, sampled=True) < 3.0  # no sampled request ran: the prior alone
    # alone: 8 / 29 ms (B=12) > 6 / 23 ms (B=8) > 1 / 10.5 ms (AR)
    assert chooser.choose(twelve, Load(0, 1, ())) == twelve
    # a batch of four: 4 x 6 / 32 ms at 8 > 4 x 8 / 44 ms at 12 > 4 / 12 ms at AR
    assert chooser.choose(twelve, Load(0, 4, ())) == BlockChoice(8)  # four arrived together, none decodes yet
    assert chooser.choose(twelve, Load(0, 4, (8, 8, 8))) == BlockChoice(8)
    assert chooser.choose(twelve, Load(3, 1, (), slots=4)) == BlockChoice(8)  # one admitted, three queued for free slots
    assert chooser.choose(twelve, Load(3, 1, (), slots=1)) == twelve  # ... but no slot is free: it runs alone
    # ... but 12 is within STAY_MARGIN (10%) of 8 there (3% below): with three at 12 already, joining them beats
    # opening a second call
    assert chooser.choose(twelve, Load(0, 4, (12, 12, 12))) == twelve
    assert chooser.choose(BlockChoice(8), Load(0, 1, ())) == BlockChoice(8)  # never a larger block than the policy's
    # alone for an instant, but four ran lately (clients about to come back): judged as a batch of four
    assert chooser.choose(twelve, Load(0, 1, (), recent=3.8)) == BlockChoice(8)
    assert chooser.decisions == {"kept": 4, "smaller": 4}


def test_load_aware_blockpilot_explores_before_it_judges():
    """With no finished request at the policy's size the choice is kept even where the prior would
    say AR (for one request at a time): AR requests show no acceptance, so an engine that never
    speculated would never learn.
    A request of a few cycles (its last one cut by its token limit) is no evidence."""
    from trtspec.blockpilot.costs import CostTable
    from trtspec.blockpilot.load import OBSERVED_MIN, PRIOR_CYCLES, LoadAwareChooser
    from trtspec.runtime.engine import Load
    from trtspec.runtime.schedule import BlockChoice

    batches = (1, 2, 4, 8, 16)
    costs = CostTable(batches, {1: [10 + 0.5 * n for n in batches], 8: [20 + 3 * n for n in batches]})
    chooser, eight = LoadAwareChooser(costs), BlockChoice(8)
    assert chooser.choose(eight, Load(0, 8, ())) == eight  # the prior (2.74) would lose to AR at eight requests
    # one explores at a time: while it decodes, the next admission goes by the prior
    assert chooser.choose(eight, Load(0, 8, (8,))) == BlockChoice(1)
    assert chooser.choose(eight, Load(0, 8, (1, 1))) == BlockChoice(1)  # nor beside a batch heading to AR
    chooser.observe_request(eight, _cycles(8, {1: int(PRIOR_CYCLES) - 1}))  # tau 2, one cycle short of enough
    assert chooser.choose(eight, Load(0, 8, ())) == eight
    chooser.observe_request(eight, _cycles(8, {0: OBSERVED_MIN - 1}))  # a short request: counted, it would tip it to AR
    assert chooser.tau(8) > 2 and chooser.choose(eight, Load(0, 8, ())) == eight
    chooser.observe_request(eight, _cycles(8, {1: OBSERVED_MIN}))
    assert chooser.choose(eight, Load(0, 8, ())) == BlockChoice(1)  # 8 x 2 / 44 ms < 8 / 14 ms
    assert chooser.decisions == {"kept": 3, "ar": 3}
    # 12, never run, is not explored where it could not pay: 8's cycles, ceilings extended to 12,
    # give at most tau 2 here; with every cycle a ceiling at 8 it could (tau up to 12), so it is
    twelve = BlockChoice(12)
    costs = CostTable(batches, {1: [10 + 0.5 * n for n in batches], 8: [20 + 3 * n for n in batches],
                                12: [24 + 4 * n for n in batches]})
    chooser = LoadAwareChooser(costs)
    chooser.observe_request(eight, _cycles(8, {1: int(PRIOR_CYCLES)}))
    assert chooser.choose(twelve, Load(0, 8, ())) == BlockChoice(1)
    chooser.observe_request(eight, _cycles(8, {7: 40 * int(PRIOR_CYCLES)}))
    assert chooser.choose(twelve, Load(0, 8, ())) == twelve


def test_load_aware_blockpilot_judges_by_the_cycles_the_engine_measured():
    """The start-up table times bare calls at a fixed context; the engine's own cycles (host work
    included) replace it for the shapes the engine ran, and are fitted to it for the others."""
    from trtspec.blockpilot.costs import CostTable
    from trtspec.blockpilot.load import MEASURED_MIN, WINDOW, LoadAwareChooser
    from trtspec.runtime.engine import Load
    from trtspec.runtime.schedule import BlockChoice

    chooser, eight = LoadAwareChooser(CostTable((1, 2, 4), {1: [10.0, 11.0, 12.0], 8: [20.0, 30.0, 60.0]})), BlockChoice(8)
    chooser.observe_request(eight, _cycles(8, {3: 100_000}))  # tau 4 at B = 8
    assert chooser.choose(eight, Load(0, 4, ())) == BlockChoice(1)  # the table: 4 x 4 / 60 ms < 4 / 12 ms (by > AR_MARGIN)
    for _ in range(MEASURED_MIN - 1):
        chooser.observe_cycle(8, 4, 48.0)
    assert chooser.cost(8, 4) == 60.0  # too few cycles of that shape yet
    chooser.observe_cycle(8, 4, 48.0)
    assert chooser.cost(8, 4) == 48.0
    assert chooser.cost(8, 2) == pytest.approx(30.0 * 0.8)  # one shape: the table scaled by measured / table
    assert chooser.cost(1, 4) == pytest.approx(12.0 * 0.8)
    assert chooser.choose(eight, Load(0, 4, ())) == BlockChoice(1)  # 16 / 48 ms < 4 / 9.6 ms
    for _ in range(MEASURED_MIN):  # AR's cycles carry more host work per token than the table shows
        chooser.observe_cycle(1, 4, 12.5)
    assert chooser.choose(eight, Load(0, 4, ())) == eight  # 16 / 48 ms > 4 / 12.5 ms
    # two shapes: a line through them, 12 -> 12.5 ms and 60 -> 48 ms, finds the host work every cycle carries
    assert chooser.cost(8, 2) == pytest.approx(12.5 + (30 - 12) * 35.5 / 48)
    for _ in range(WINDOW):  # the host slowed down: only the latest cycles count
        chooser.observe_cycle(8, 4, 64.0)
    assert chooser.cost(8, 4) == 64.0 and chooser.choose(eight, Load(0, 4, ())) == BlockChoice(1)


def test_load_aware_blockpilot_adds_the_host_work_the_table_lacks():
    """The table times bare calls; every real cycle adds the engine's host work. Fitted as a ratio,
    that work would be spread over the table's costs and AR, the cheapest call, would look cheaper
    than it runs (the demo pair at 4 clients: the figures below; AR put at 8.2 ms a cycle, where the
    engine then measured 12.1 ms). A line through the measured shapes keeps it per cycle."""
    from trtspec.blockpilot.costs import CostTable, fit_host_work
    from trtspec.blockpilot.load import MEASURED_MIN, LoadAwareChooser
    from trtspec.runtime.engine import Load
    from trtspec.runtime.schedule import BlockChoice

    table = CostTable((1, 2, 4), {1: [8.2, 9.1, 10.3], 8: [16.1, 22.7, 34.4]})  # timed at start-up, 4 clients
    chooser, eight = LoadAwareChooser(table), BlockChoice(8)
    chooser.observe_request(eight, _cycles(8, {1: 30_000, 2: 70_000}))  # tau 2.7
    for batch, ms in ((1, 14.6), (2, 19.5), (4, 27.1)):
        for _ in range(MEASURED_MIN):
            chooser.observe_cycle(8, batch, ms)
    slope, host = fit_host_work(np.array([16.1, 22.7, 34.4]), np.array([14.6, 19.5, 27.1]))
    assert 0.6 < slope < 0.75 and 3 < host < 4.5
    assert chooser.cost(1, 4) == pytest.approx(slope * 10.3 + host)  # ~10.7 ms, not 10.3 x 0.86 = 8.9 (the ratio)
    # 4 x 2.7 / 27.1 ms > 4 / 10.7 ms (+ AR_MARGIN), not 4 / 8.9; joining three at 8 it stays there ...
    assert chooser.choose(eight, Load(0, 4, (8, 8, 8))) == eight
    # ... but with nothing decoding yet, AR is within AR_EXPLORE of 8 on a guess: it runs AR to measure it
    assert chooser.choose(eight, Load(0, 4, ())) == BlockChoice(1)
    for _ in range(MEASURED_MIN):
        chooser.observe_cycle(1, 4, 12.1)  # what the demo pair's AR cycles took at 4 clients
    assert chooser.choose(eight, Load(0, 4, ())) == eight  # measured: 4 / 12.1 ms is 18% behind, nothing to explore
    too_alike = fit_host_work(np.array([20.0, 21.0]), np.array([10.0, 12.0]))
    assert too_alike == (pytest.approx((10 / 20 + 12 / 21) / 2), 0.0)  # the median ratio
    assert fit_host_work(np.array([10.0, 40.0]), np.array([5.0, 30.0]))[1] == 0.0  # no host work: the ratio


def test_load_aware_blockpilot_follows_the_batch_where_it_is_heading():
    """Near a tie an admission joins the latest admission's size, not the majority's: a move to a
    better size then finishes within one request's life. Joining the majority held a batch on the
    worse of two close sizes and let each admission that found the margin open a second group for
    its whole life (the demo pair at 4 clients, AR 4% ahead of B = 8: 0.94x of AR, bench run 15)."""
    from trtspec.blockpilot.costs import CostTable
    from trtspec.blockpilot.load import MEASURED_MIN, WINDOW, LoadAwareChooser
    from trtspec.runtime.engine import Load
    from trtspec.runtime.schedule import BlockChoice

    chooser, eight = LoadAwareChooser(CostTable((1, 2, 4), {1: [8.0, 9.0, 10.0], 8: [16.0, 22.0, 34.0]})), BlockChoice(8)
    chooser.observe_request(eight, _cycles(8, {1: 30_000, 2: 70_000}))  # tau 2.7
    for _ in range(MEASURED_MIN):
        chooser.observe_cycle(8, 4, 27.0)  # 4 x 2.7 / 27 ms = 0.40 tokens per ms
        chooser.observe_cycle(1, 4, 9.4)  # 4 / 9.4 ms = 0.43, 0.41 after AR_MARGIN: ahead by 3%
    assert chooser.choose(eight, Load(0, 4, ())) == BlockChoice(1)  # nothing decodes: the best
    assert chooser.choose(eight, Load(0, 4, (8, 8, 8))) == eight  # within STAY_MARGIN: no second group for 3%
    assert chooser.choose(eight, Load(0, 4, (8, 8, 1))) == BlockChoice(1)  # the batch is moving to AR: follow it
    assert chooser.choose(eight, Load(0, 4, (1, 1, 8))) == eight  # ... or back to 8, once an admission went there
    for _ in range(WINDOW):
        chooser.observe_cycle(1, 4, 8.0)  # AR 21% ahead, past the margin: the batch starts to move
    assert chooser.choose(eight, Load(0, 4, (8, 8, 8))) == BlockChoice(1)


def test_the_engine_learns_acceptance_from_every_speculative_request():
    """tau is a property of the drafter on the engine's traffic, not of `auto` requests alone: an
    engine that served fixed sizes already knows what `auto` would accept. A growing block's grown
    cycles count as full acceptance at its base size; AR requests show nothing."""
    from trtspec.blockpilot.costs import CostTable
    from trtspec.blockpilot.load import LoadAwareChooser

    chooser = LoadAwareChooser(CostTable((1, 2), {1: [1.0, 1.5], 4: [2.0, 3.0], 8: [3.0, 5.0]}))
    configs = [GenerationConfig(block=BlockChoice(8), max_new_tokens=60),
               GenerationConfig(block=BlockChoice(4, 8), max_new_tokens=60),
               GenerationConfig(block=AR, max_new_tokens=20)]
    runner = BatchRunner.eager(*predictable_pair(), slots=2)  # cycles that accept nothing, part or all
    with Engine(LocalEngine(runner, config=EngineConfig(max_running=2), chooser=chooser)) as engine:
        fixed, growing, ar = [engine.submit([5, 9, 33, 2, 7], c).result(timeout=120).stats for c in configs]
    assert growing.grown_cycles > 0  # else the growing request shows nothing here

    def cut(histogram: list[int], size: int) -> tuple[float, float]:  # (committed, cycles) as if at `size`
        return (float(sum((min(a, size - 1) + 1) * n for a, n in enumerate(histogram))), float(sum(histogram)))

    assert chooser._evidence(8, False) == cut(fixed.histogram, 8)
    expected = [x + y for x, y in zip(cut(fixed.histogram, 4), cut(growing.histogram, 4))]
    assert chooser._evidence(4, False) == pytest.approx(expected)
    assert chooser._evidence(4, True) == (0.0, 0.0)
    # ... and it timed every cycle it ran, by (block size, batch): each request ran alone here
    assert {batch for _, batch in chooser._cycles} == {1} and {size for size, _ in chooser._cycles} == {1, 4, 8}
    assert sum(map(len, chooser._cycles.values())) == fixed.cycles + growing.cycles + ar.cycles


def test_static_buffers_for_graph_replay_decode_the_same(tiny):
    """The CUDA-graph binding mode (whole cache as past, inputs in fixed buffers) on the CPU: the
    same tokens and acceptance as the plain batched runner."""
    prompts = [[5, 9, 33, 2, 7], [100, 3], [8] * 30, [7, 7]]
    configs = [GenerationConfig(block=BlockChoice(b), max_new_tokens=30) for b in (4, 8, 1, 4)]
    outputs = []
    for static in (False, True):
        runner = BatchRunner.eager(tiny.target, tiny.drafter, slots=4)
        runner.static = static
        with Engine(LocalEngine(runner, config=EngineConfig(max_running=4))) as engine:
            generations = [r.result(timeout=120) for r in [engine.submit(p, c) for p, c in zip(prompts, configs)]]
        outputs.append([(g.tokens, g.stats.histogram) for g in generations])
    assert outputs[0] == outputs[1]


def test_load_aware_blockpilot_forgets_a_shape_it_has_not_run_lately():
    """A median from minutes ago set against one from now judges the host's drift, not the sizes:
    a shape not run for STALE_S is measured afresh (and AR, close to the best again, explored)."""
    from trtspec.blockpilot.costs import CostTable
    from trtspec.blockpilot.load import MEASURED_MIN, STALE_S, LoadAwareChooser
    from trtspec.runtime.engine import Load
    from trtspec.runtime.schedule import BlockChoice

    now = [0.0]
    table = CostTable((1, 2, 4), {1: [8.2, 9.1, 10.3], 8: [16.1, 22.7, 34.4]})
    chooser, eight = LoadAwareChooser(table, clock=lambda: now[0]), BlockChoice(8)
    chooser.observe_request(eight, _cycles(8, {1: 30_000, 2: 70_000}))  # tau 2.7
    for _ in range(MEASURED_MIN):
        chooser.observe_cycle(1, 4, 12.1)  # AR measured on a slow host: 18% behind B = 8
    for ms, batch in ((14.6, 1), (27.1, 4)):
        for _ in range(MEASURED_MIN):
            chooser.observe_cycle(8, batch, ms)
    assert chooser.choose(eight, Load(0, 4, ())) == eight
    now[0] = STALE_S / 2
    for _ in range(MEASURED_MIN):
        chooser.observe_cycle(8, 4, 27.1)  # B = 8 keeps running
    now[0] = STALE_S + 1  # AR last ran STALE_S ago, B = 8 half that
    assert (1, 4) not in chooser.measured() and chooser.measured()[8, 4] == 27.1
    assert (8, 1) not in chooser.measured()  # its fit is left to the shapes measured lately
    assert chooser.choose(eight, Load(0, 4, ())) == BlockChoice(1)  # close on the table's guess: explored again
    chooser.observe_cycle(1, 4, 9.0)
    assert (1, 4) not in chooser.measured()  # the old cycles went with it: MEASURED_MIN fresh ones count
    for _ in range(MEASURED_MIN - 1):
        chooser.observe_cycle(1, 4, 9.0)
    assert chooser.cost(1, 4) == 9.0 and chooser.choose(eight, Load(0, 4, (1, 1, 1))) == BlockChoice(1)


def test_the_loop_runs_torch_on_its_own_thread_beside_an_onnxruntime_engine(ort_engine_dir, target_dir, drafter_dir,
                                                                           monkeypatch):
    """Beside an ONNX Runtime engine on a CPU, whose spinning pool owns the cores, the loop's own torch
    work (here: a sampled request's) runs with one torch thread, and the caller's count comes back
    after; eager modules keep the caller's threads for their own products."""
    before, sample, seen = torch.get_num_threads(), engine_module.sample_requests, []
    monkeypatch.setattr(engine_module, "sample_requests", lambda *args: seen.append(torch.get_num_threads()) or sample(*args))
    torch.set_num_threads(2)
    try:
        for pipeline, inside in ((Pipeline(engine=ort_engine_dir), 1), (Pipeline(target_dir, drafter_dir), 2)):
            seen.clear()
            pipeline.generate("def f(x):", GenerationConfig(block=BlockChoice(4), max_new_tokens=12,
                                                            sampling=SamplingConfig(temperature=1.0, seed=1)))
            assert seen and set(seen) == {inside}
            assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
