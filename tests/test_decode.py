"""Greedy speculative decoding is token-for-token the target's own greedy decoding."""

import pytest
import torch

from helpers import ar_of, local_engine_of, generate, predictable_pair, random_drafter, single, tiny_config
from trtspec.errors import TrtspecError
from trtspec.models import Qwen3Target
from trtspec.runtime.engine import EngineConfig, LocalEngine
from trtspec.runtime.request import GenerationConfig
from trtspec.runtime.sampling import SamplingConfig
from trtspec.runtime.schedule import AR, BlockChoice

BLOCK_SIZES = (2, 4, 8, 12, 16, 20, 24)
GROWING = ((2, 8), (4, 12), (8, 24))  # B growing to G after a full block of B


def _prompts(count, vocab, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (int(torch.randint(1, 30, (1,), generator=gen)),), generator=gen).tolist()
            for _ in range(count)]


@pytest.fixture(scope="module")
def predictable():
    return single(*predictable_pair())


@pytest.fixture(scope="module")
def unhelpful():
    torch.manual_seed(0)
    target = Qwen3Target(tiny_config(layers=3)).eval()
    return single(target, random_drafter(target, layer_ids=(0, 2), seed=5))


def _mid_block_cut(stats) -> bool:
    """True when the last cycle accepted more tokens than the output kept."""
    counted = 1 + sum((a + 1) * n for a, n in enumerate(stats.histogram))
    return counted > stats.new_tokens


@pytest.mark.parametrize("engine_name", ["predictable", "unhelpful"])
def test_greedy_speculative_equals_autoregressive(engine_name, request):
    """AR one request at a time (the engine's batch-1 path); every speculative schedule of every
    prompt decoded together, one slot each (its batched path: test_engine.py checks that each request
    decodes there exactly as alone). One batch for all the prompts: a batch of one prompt's schedules
    per prompt cost the unhelpful pair 20 s, nearly all of it per-iteration overhead. The unhelpful pair
    runs without prompt lookup, whose copies would accept what its drafter does not: its cycles reject."""
    engine = request.getfixturevalue(engine_name)
    schedules = [(b, 0) for b in BLOCK_SIZES] + list(GROWING)
    prompts = _prompts(8, 64)
    jobs = [(prompt, b, g) for prompt in prompts for b, g in schedules]
    together = LocalEngine(engine.runner.with_slots(len(jobs)), config=EngineConfig(
        max_running=len(jobs), prompt_lookup=0 if engine_name == "unhelpful" else None))
    configs = [GenerationConfig(block=BlockChoice(b, g), max_new_tokens=70) for _, b, g in jobs]
    expected = {tuple(prompt): generate(engine, prompt, GenerationConfig(block=AR, max_new_tokens=70)).tokens
                for prompt in prompts}
    totals, grown = {b: [0] * b for b in BLOCK_SIZES}, 0
    for (prompt, block_size, grow_to), result in zip(jobs, together.generate([p for p, _, _ in jobs], configs)):
        assert result.tokens == expected[tuple(prompt)], f"B={block_size}:{grow_to} prompt={prompt}"
        if grow_to:
            grown += result.stats.grown_cycles
        else:
            totals[block_size] = [x + y for x, y in zip(totals[block_size], result.stats.histogram)]
    if engine_name == "predictable":
        # the drafter exercises every kind of cycle: none, part of the block, the whole block
        for block_size in (4, 8, 12):
            hist = totals[block_size]
            assert hist[0] > 0 and sum(hist[1:-1]) > 0 and hist[-1] > 0, (block_size, hist)
        assert grown > 0  # the growing blocks did grow
    else:
        assert all(sum(h[1:]) < 0.2 * sum(h) for h in totals.values())


def test_stop_ids_and_token_limits_that_land_mid_block(predictable):
    cuts = 0
    for prompt in _prompts(12, 64, seed=1):
        reference = generate(predictable, prompt, GenerationConfig(block=AR, max_new_tokens=60)).tokens
        for stop in set(reference[3:40:6]):
            expected = reference[:reference.index(stop) + 1]
            for block_size in (4, 8, 16):
                result = generate(predictable, prompt, GenerationConfig(block=BlockChoice(block_size), max_new_tokens=60,
                                                                        stop_ids=(stop,)))
                assert result.tokens == expected
                assert result.stats.finish_reason == "stop"
                cuts += _mid_block_cut(result.stats)
        for limit in (1, 2, 7, 13, 29):
            for block_size in (4, 8, 16):
                result = generate(predictable, prompt, GenerationConfig(block=BlockChoice(block_size), max_new_tokens=limit))
                assert result.tokens == reference[:limit]
                assert result.stats.new_tokens == limit and result.stats.finish_reason == "length"
                cuts += _mid_block_cut(result.stats)
    assert cuts > 20  # the truncation path really was exercised inside accepted blocks


def test_context_limit_stops_generation(predictable):
    context = predictable.runner.max_context
    predictable.runner.max_context = 40
    try:
        prompt = _prompts(1, 64)[0]
        ar = generate(predictable, prompt, GenerationConfig(block=AR, max_new_tokens=500))
        spec = generate(predictable, prompt, GenerationConfig(block=BlockChoice(16), max_new_tokens=500))
        assert len(prompt) + len(ar.tokens) == 40 and spec.tokens == ar.tokens
        with pytest.raises(TrtspecError, match="the context holds 40"):
            generate(predictable, list(range(2, 42)), GenerationConfig(block=BlockChoice(4)))
    finally:
        predictable.runner.max_context = context


def test_statistics(predictable):
    result = generate(predictable, _prompts(1, 64, seed=3)[0], GenerationConfig(block=BlockChoice(8), max_new_tokens=64))
    s = result.stats
    assert len(s.histogram) == 8 and s.cycles == sum(s.histogram)
    assert s.tau == pytest.approx(sum((a + 1) * n for a, n in enumerate(s.histogram)) / s.cycles)
    assert 1 <= s.tau <= 8
    assert s.ceiling_fraction == pytest.approx(s.histogram[-1] / s.cycles)
    assert s.new_tokens == len(result.tokens) and s.decode_s > 0 and s.prefill_s > 0
    ar = generate(predictable, [5, 6, 7], GenerationConfig(block=AR, max_new_tokens=10)).stats
    assert ar.histogram == [9] and ar.tau == 1.0 and ar.block_size == 1


@pytest.mark.parametrize("make, message", [
    (lambda: BlockChoice(-1), r"block size must be an integer in \[2, 64\], got -1"),
    (lambda: BlockChoice(65), r"block size must be an integer in \[2, 64\], got 65"),
    (lambda: BlockChoice(4, 65), r"grows from B >= 2 to a larger size up to 64"),
    (lambda: GenerationConfig(max_new_tokens=0), r"max_tokens must be an integer in \[1, "),
    (lambda: BlockChoice(8, 8), "grows from B >= 2 to a larger size"),
    (lambda: BlockChoice(1, 8), "grows from B >= 2"),
    (lambda: BlockChoice(None, 8), "policy chooses the growth"),
    (lambda: GenerationConfig(block=16), "must be a BlockChoice"),
])
def test_bad_generation_configs(make, message):
    with pytest.raises(TrtspecError, match=message):
        make()


def test_empty_prompt_and_missing_drafter(unhelpful):
    with pytest.raises(TrtspecError, match="empty"):
        generate(unhelpful, [], GenerationConfig(block=BlockChoice(4)))
    with pytest.raises(TrtspecError, match="needs a drafter"):
        generate(local_engine_of(unhelpful.runner.with_slots(1, drafter=False)), [3, 4], GenerationConfig(block=BlockChoice(4)))


def test_a_bfloat16_pair_decodes_with_logits_in_its_own_dtype(monkeypatch):
    """The verify graph returns bfloat16 logits for a bfloat16 target (no [b, T, vocab] float32
    upcast): greedy steps take their argmax on the device and sampling upcasts the rows it reads,
    and both decode exactly what they decoded from float32-upcast logits. (Greedy speculative equals
    greedy AR in float32; in bfloat16, verify(B) and the AR step round differently.)"""
    torch.manual_seed(0)
    target = Qwen3Target(tiny_config(layers=3)).eval().to(torch.bfloat16)
    engine = single(target, random_drafter(target, layer_ids=(0, 2), seed=5))
    assert engine.runner.prefill([0], [[5, 9, 13]], [0])[0].dtype == torch.bfloat16
    configs = [GenerationConfig(block=BlockChoice(4), max_new_tokens=24),
               GenerationConfig(block=BlockChoice(4), max_new_tokens=24, sampling=SamplingConfig(temperature=1.0, seed=3))]
    prompts = _prompts(4, target.config.vocab_size)
    own = [generate(engine, prompt, config).tokens for prompt in prompts for config in configs]
    verify = engine.runner.verify
    monkeypatch.setattr(engine.runner, "verify", lambda *args: tuple(
        t.float() if i == 0 else t for i, t in enumerate(verify(*args))))
    assert [generate(engine, prompt, config).tokens for prompt in prompts for config in configs] == own


def test_min_tokens_holds_stops_back_and_speculation_still_equals_ar(predictable):
    """min_tokens removes the stop ids from the target's distribution for the first min_tokens output
    tokens, at every verified position: a stop that greedy decoding meets early is passed over, and
    speculative output equals AR output under the same rule."""
    prompt = [5, 9, 13, 2, 7]
    free = generate(ar_of(predictable), prompt, GenerationConfig(block=AR, max_new_tokens=30)).tokens
    stop = free[2]
    stopped = GenerationConfig(block=AR, max_new_tokens=30, stop_ids=(stop,))
    assert len(generate(ar_of(predictable), prompt, stopped).tokens) <= 3
    for size in (1, 4, 8):
        config = GenerationConfig(block=BlockChoice(size), max_new_tokens=30, stop_ids=(stop,), min_tokens=12)
        engine = predictable if size > 1 else ar_of(predictable)
        tokens = generate(engine, prompt, config).tokens
        assert stop not in tokens[:12] and len(tokens) >= 12
        assert tokens == generate(ar_of(predictable), prompt, GenerationConfig(
            block=AR, max_new_tokens=30, stop_ids=(stop,), min_tokens=12)).tokens
    with pytest.raises(TrtspecError, match="min_tokens"):
        GenerationConfig(max_new_tokens=4, min_tokens=5)
