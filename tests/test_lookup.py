"""Prompt lookup: drafts copied from the request's own text (trtspec.runtime.lookup).

The index against a plain scan of the text (the rule written out), then the engine: greedy output
with lookup equals AR's token for token while lookup supplies drafts (and narrows or widens cycles),
and at T = 1 copied drafts (point masses among drawn ones) still sample the target's distribution,
with a test that fails when the copies are verified against the drafter's distribution instead.
"""

import random

import numpy as np
import pytest
import torch

from helpers import ALPHA, exact_distribution, predictable_pair, pvalues, sample_three_tokens
from trtspec.api import Pipeline
from trtspec.errors import TrtspecError
from trtspec.runtime import engine as engine_module
from trtspec.runtime.engine import EngineConfig, LocalEngine
from trtspec.runtime.lookup import MAX_MATCH, PromptLookup
from trtspec.runtime.widths import CPU_DRAFT_WIDTH, WIDTH_SAMPLES, VerifyCosts
from trtspec.runtime.request import GenerationConfig
from trtspec.runtime.schedule import AR, BlockChoice


def scanned(text: list[int], width: int, min_match: int) -> list[int]:
    """The rule, by scanning: the longest suffix (at most MAX_MATCH, at least min_match tokens) that
    occurred earlier, and what followed its latest earlier occurrence."""
    for n in range(min(MAX_MATCH, len(text) - 1), min_match - 1, -1):
        suffix = text[len(text) - n:]
        for begin in range(len(text) - n - 1, -1, -1):
            if text[begin:begin + n] == suffix:
                return text[begin + n:begin + n + width]
    return []


def test_the_longest_suffix_seen_before_gives_what_followed_its_latest_occurrence():
    assert PromptLookup([1, 2, 3, 9, 1, 2, 3, 8, 5, 1, 2, 3]).propose(3) == [8, 5, 1]
    # a 3-token match earlier wins over a later 2-token one
    assert PromptLookup([7, 1, 2, 3, 4, 0, 9, 2, 3, 5, 1, 2, 3]).propose(3) == [4, 0, 9]
    assert PromptLookup([1, 2, 3, 4, 5, 3]).propose(4) == []               # (5, 3) never occurred before
    assert PromptLookup([1, 2, 3, 4, 5, 3], min_match=1).propose(4) == [4, 5, 3]
    assert PromptLookup([1, 2]).propose(4) == []                            # a suffix never matches itself
    assert PromptLookup([5, 5, 5], min_match=1).propose(4) == [5]           # what followed, up to the text's end


def test_the_index_follows_a_text_as_tokens_are_committed():
    rng = random.Random(0)
    for case in range(300):
        min_match, vocab = rng.randint(1, MAX_MATCH), rng.randint(2, 6)
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 12))]
        committed: list[int] = []
        lookup = PromptLookup(prompt, min_match)
        for _ in range(rng.randint(1, 6)):
            committed += [rng.randrange(vocab) for _ in range(rng.randint(1, 4))]
            lookup.catch_up(np.array(committed))
            width = rng.randint(1, 8)
            assert lookup.propose(width) == scanned(prompt + committed, width, min_match), (case, prompt, committed)


def test_a_shortest_match_outside_its_range_is_refused():
    with pytest.raises(TrtspecError, match=r"prompt lookup must be an integer in \[0, 4\], got 5"):
        EngineConfig(prompt_lookup=5)


# Prompts that restate themselves, so lookup has drafts to copy on the tiny random pair.
REPEATING = ["the cat sat on the mat; the cat sat on the", "def f(x): return x + 1\ndef f(x): return",
             "a b c d a b c d a b c d a b"]


@pytest.fixture(scope="module")
def tiny(target_dir, drafter_dir):
    return Pipeline(target_dir, drafter_dir, dtype="float32")


@pytest.mark.parametrize("block, width", [(4, 0), (8, 0), (8, 3), (16, 4)])
def test_greedy_output_with_copied_drafts_is_ars(tiny, block, width, monkeypatch):
    """With lookup, some cycles copy, and those whose copy fills the cycle skip the drafter (its
    context then waits for the next draft); with a draft width below the block, cycles without a long
    copy are narrowed. The output is AR's either way."""
    configs = [GenerationConfig(max_new_tokens=40, block=BlockChoice(block))] * len(REPEATING)
    reference = tiny.autoregressive().generate_batch(REPEATING, [GenerationConfig(max_new_tokens=40, block=AR)] * 3)
    for lookup, copies in ((1, True), (0, False)):
        engine = tiny.stepped_engine(EngineConfig(max_running=3, prompt_lookup=lookup, draft_width=width,
                                                  confident_width=False), load_aware=False)
        drafted, draft = [], engine.runner.draft
        monkeypatch.setattr(engine.runner, "draft", lambda slots, *rest: drafted.append(len(slots)) or draft(slots, *rest))
        ids = [tiny.codec.encode(prompt) for prompt in REPEATING]
        generations = engine.generate(ids, configs)
        assert [g.tokens for g in generations] == [r.tokens for r in reference]
        copied = sum(g.stats.copied_cycles for g in generations)
        cycles = sum(g.stats.cycles for g in generations)
        assert (copied > 0) == copies, copied
        assert (sum(drafted) < cycles) == copies, (sum(drafted), cycles)  # full copies skipped the drafter
        drafts = sum(g.stats.draft_tokens for g in generations)
        assert (drafts < cycles * (block - 1)) == (copies and width > 0), drafts  # narrowed cycles (lookup only)
        if copies and width:
            assert drafts > cycles * (width - 1)  # ... and long copies widened some
        assert all(g.stats.to_dict()["copied_cycles"] == g.stats.copied_cycles for g in generations)


def test_the_pipeline_sets_its_engines_prompt_lookup(target_dir, drafter_dir, tiny):
    assert tiny.stepped_engine(EngineConfig(max_running=1), load_aware=False).prompt_lookup == 2
    off = Pipeline(target_dir, drafter_dir, prompt_lookup=0, draft_width=0)
    assert (off.local_engine.prompt_lookup, off.local_engine.draft_width) == (0, 0)
    engine = off.stepped_engine(EngineConfig(max_running=1, prompt_lookup=3, draft_width=6), load_aware=False)
    assert (engine.prompt_lookup, engine.draft_width) == (3, 6)
    assert tiny.local_engine.draft_width == CPU_DRAFT_WIDTH  # eager on a CPU: any width


def test_a_greedy_request_alone_widens_only_where_this_engines_calls_say_it_pays(tiny):
    """Alone, a greedy request's copies widen its cycles until the engine has timed both widths; where
    the wide calls cost too much for their positions the copies are cut to the narrow width instead.
    The output is AR's either way."""
    configs = [GenerationConfig(max_new_tokens=40, block=BlockChoice(16))] * len(REPEATING)
    reference = tiny.autoregressive().generate_batch(REPEATING, [GenerationConfig(max_new_tokens=40, block=AR)] * 3)
    ids = [tiny.codec.encode(prompt) for prompt in REPEATING]
    for dear in (False, True):
        engine = tiny.stepped_engine(EngineConfig(max_running=1, prompt_lookup=1, draft_width=4, confident_width=False),
                                     load_aware=False)
        if dear:  # as if timed: each position beyond 4 costs a third of a 4-wide call
            engine._costs = VerifyCosts()
            for width in range(4, 17):
                for _ in range(WIDTH_SAMPLES):
                    engine._costs.observe(width, 30.0 + 10.0 * (width - 4))
        generations = engine.generate(ids, configs)
        assert [g.tokens for g in generations] == [r.tokens for r in reference]
        cycles, drafts = (sum(getattr(g.stats, name) for g in generations) for name in ("cycles", "draft_tokens"))
        assert sum(g.stats.copied_cycles for g in generations) > 0
        assert (drafts == 3 * cycles) == dear, (drafts, cycles)  # every cycle 4 wide, or some widened


def test_a_draft_width_the_engine_was_not_built_for_is_refused(tiny):
    runner = tiny.runner.with_slots(1, 64)
    runner.block_sizes = (4, 8, 16)  # as a built engine records them
    with pytest.raises(TrtspecError, match="draft width 5 is not among them"):
        LocalEngine(runner, config=EngineConfig(max_running=1, draft_width=5))


# The predictable pair's target mostly continues with 7; the prompt holds a 7 followed by 3, 4, 5, so
# after a sampled 7 lookup (shortest match 1) copies 3, 4, 5, which the target rarely draws: its
# copies are rejected and resampled from the residual, or accepted, as their point masses say.
LOOKUP_PROMPT = [2, 7, 3, 4, 5]


@pytest.fixture(scope="module")
def predictable():
    return predictable_pair(vocab_size=8, beta=0.5, hidden=16, layers=1, heads=2, kv_heads=1)


def test_sampling_with_copied_drafts_follows_the_target(predictable):
    samples = sample_three_tokens(predictable, 3_000, prompt=LOOKUP_PROMPT, prompt_lookup=1)
    assert np.mean(samples[:, 0] == 7) > 0.1  # lookup copies after these (and after any token the prompt holds)
    results = pvalues(samples, exact_distribution(predictable[0], 3, prompt=LOOKUP_PROMPT))
    assert min(results.values()) > ALPHA, results


def test_sampling_in_narrowed_cycles_follows_the_target(predictable):
    """At B = 8 with draft width 2, a cycle without a copy verifies one draft and draws its next token
    from the target at the second position; a copy widens it. Both follow the target."""
    samples = sample_three_tokens(predictable, 3_000, block_size=8, prompt=LOOKUP_PROMPT, prompt_lookup=1,
                                  draft_width=2)
    results = pvalues(samples, exact_distribution(predictable[0], 3, prompt=LOOKUP_PROMPT))
    assert min(results.values()) > ALPHA, results


def test_copies_beyond_the_draft_vocabulary_stop_where_it_does(predictable):
    """With a draft vocabulary that holds 3 but not 4, the copy 3, 4, 5 is cut to 3 (q has no column
    for 4): sampling still follows the target."""
    target, drafter = predictable_pair(vocab_size=8, beta=0.5, hidden=16, layers=1, heads=2, kv_heads=1)
    drafter.use_draft_vocab(torch.tensor([7, 3, 5, 0, 1]))
    samples = sample_three_tokens((target, drafter), 2_000, prompt=LOOKUP_PROMPT, prompt_lookup=1)
    results = pvalues(samples, exact_distribution(target, 3, prompt=LOOKUP_PROMPT))
    assert min(results.values()) > ALPHA, results


def test_copies_verified_against_the_drafters_distribution_are_detected(predictable, monkeypatch):
    """Left as the drafter's q (which puts little mass on the copied 3), a copied draft is kept with
    probability min(1, p/q) >> p: the test must see it."""
    monkeypatch.setattr(engine_module, "point_masses", lambda q, columns: None)
    samples = sample_three_tokens(predictable, 1_500, prompt=LOOKUP_PROMPT, prompt_lookup=1)
    results = pvalues(samples, exact_distribution(predictable[0], 3, prompt=LOOKUP_PROMPT))
    assert min(results.values()) < ALPHA, results


def test_a_drafter_skipped_for_a_full_copy_later_sees_every_position(tiny, monkeypatch):
    """The drafter's proposals at a start depend on every position before it: where full copies
    skipped it, the next draft must bring the skipped cycles' features along. So at every start
    drafted both with skips and without (copies cut short of the block), the proposal logits are
    equal (up to rounding: the skipped positions' keys are projected together)."""
    def logits_by_start(shorten: bool) -> dict[int, torch.Tensor]:
        engine = tiny.stepped_engine(EngineConfig(max_running=1, prompt_lookup=1, confident_width=False),
                                     load_aware=False)
        if shorten:
            copy = engine._copy
            monkeypatch.setattr(engine, "_copy", lambda active, width: copy(active, width)[:width - 1])
        seen, draft = {}, engine.runner.draft

        def recording(slots, contexts, blocks, starts):
            drafts, logits = draft(slots, contexts, blocks, starts)
            seen.update(zip(starts, logits.clone()))
            return drafts, logits
        monkeypatch.setattr(engine.runner, "draft", recording)
        engine.generate([tiny.codec.encode(REPEATING[2])], [GenerationConfig(max_new_tokens=60, block=BlockChoice(4))])
        return seen

    skipping, every = logits_by_start(False), logits_by_start(True)
    common = sorted(set(skipping) & set(every))
    assert len(common) >= 10 and len(skipping) < len(every)
    for start in common:
        assert torch.allclose(skipping[start], every[start], atol=1e-4), start
