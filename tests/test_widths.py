"""How many positions a cycle verifies: prompt lookup's width, and the drafter's confidence."""

import numpy as np
import pytest
import torch

from trtspec.api import Pipeline
from trtspec.runtime.engine import EngineConfig
from trtspec.runtime.request import GenerationConfig
from trtspec.runtime.sampling import SamplingConfig
from trtspec.runtime.schedule import AR, BlockChoice
from trtspec.runtime.widths import (CPU_DRAFT_WIDTH, WIDTH_SAMPLES, VerifyCosts, confident_width, cycle_width,
                                    default_draft_width, expected_tokens, top_probabilities, widening_pays)

PROMPTS = ["the cat sat on the mat; the cat sat on the", "def f(x): return x + 1\ndef f(x): return",
           "one two three four five six seven eight nine ten"]


def test_a_cycle_is_as_wide_as_its_copy_within_the_block():
    assert [cycle_width(16, copied, 4, None) for copied in (0, 2, 3, 5, 15)] == [4, 4, 4, 6, 16]
    assert [cycle_width(16, copied, 4, (4, 8, 16)) for copied in (3, 4, 9)] == [4, 8, 16]  # built widths
    assert (cycle_width(16, 5, 0, None), cycle_width(3, 0, 4, None), cycle_width(8, 0, 1, None)) == (16, 3, 1)
    assert default_draft_width(torch.device("cpu"), None) == CPU_DRAFT_WIDTH
    assert default_draft_width(torch.device("cpu"), (8, 16)) == 8  # rounded up to a built width
    assert default_draft_width(torch.device("cpu"), (3,)) == 0
    assert default_draft_width(torch.device("cuda"), None) == 0  # a GPU verifies 16 positions for about one's cost


def test_a_cycle_widens_where_its_extra_positions_cost_little():
    # verify ms over 300 cached positions, 1 thread (docs/engines.md): float32 4 -> 16 positions 47.8
    # -> 86.8, the 4-bit target 31.3 -> 89.4 (and 51.0 at 8)
    assert widening_pays(4, 16, 47.8, 86.8) and widening_pays(4, 8, 47.8, 65.4)
    assert not widening_pays(4, 16, 31.3, 89.4) and not widening_pays(4, 8, 31.3, 51.0)


def test_expected_tokens_count_each_proposal_with_the_chance_that_it_and_those_before_are_accepted():
    np.testing.assert_allclose(expected_tokens(np.array([0.5, 0.5, 1.0])), [1.0, 1.5, 1.75, 2.0])
    np.testing.assert_allclose(expected_tokens(np.array([0.0, 1.0])), [1.0, 1.0, 1.0])


def test_top_probabilities_are_the_softmax_maxima():
    logits = torch.randn(3, 500) * 4
    np.testing.assert_allclose(top_probabilities(logits), torch.softmax(logits, -1).amax(-1).numpy(), rtol=1e-5)
    assert top_probabilities(torch.tensor([[1e4, 0.0, 0.0]]))[0] == 1.0  # no overflow


# verify ms by width over ~250 cached positions, 1 thread (docs/architecture.md, "Narrowed cycles"):
# the 4-bit engine, where each row costs ~2.5 ms, and the float32 one, where the first rows cost ~1
INT4_MS = np.array([13.4, 15.3, 18.6, 20.8])
FLOAT32_MS = np.array([32.8, 35.1, 36.9, 38.0])


@pytest.mark.parametrize("confidence, int4, float32", [
    ([0.95, 0.9, 0.9], 4, 4),   # a confident drafter: every proposal is worth its row
    ([0.9, 0.3, 0.2], 2, 3),    # the second proposal is a coin toss: dear rows stop there, cheap ones go on
    ([0.05, 0.9, 0.9], 1, 1),   # the first is unlikely: the cycle verifies the bonus alone
])
def test_the_width_with_the_most_expected_tokens_per_millisecond(confidence, int4, float32):
    widths = [1, 2, 3, 4]
    assert confident_width(np.array(confidence), INT4_MS, 2.5, widths) == int4
    assert confident_width(np.array(confidence), FLOAT32_MS, 4.0, widths) == float32
    assert confident_width(np.array([0.9, 0.3, 0.2]), INT4_MS, 2.5, [1, 4]) == 4  # only the widths allowed


def test_verify_costs_need_the_full_width_and_a_narrower_one_before_they_give_a_curve():
    costs = VerifyCosts()
    assert costs.untimed(4, [1, 2, 3, 4]) == 4 and costs.curve(4) is None
    for _ in range(WIDTH_SAMPLES):
        costs.observe(4, 20.0, overhead_ms=2.0)
    assert costs.untimed(4, [1, 2, 3, 4]) == 2 and costs.curve(4) is None  # then one narrower, near 2
    assert costs.untimed(4, [1, 4]) == 1  # a runner built for fewer widths times the one it has
    for _ in range(WIDTH_SAMPLES - 1):
        costs.observe(2, 15.0)
    assert costs.curve(4) is None  # a width counts once it has WIDTH_SAMPLES calls
    costs.observe(2, 15.0)
    assert costs.untimed(4, [1, 2, 3, 4]) is None
    # measured where timed, interpolated between, extrapolated below along the same line
    np.testing.assert_allclose(costs.curve(4), [12.5, 15.0, 17.5, 20.0])
    assert costs.overhead_ms() == 2.0
    assert costs.verify_ms(3) is None


@pytest.fixture(scope="module")
def tiny(target_dir, drafter_dir):
    return Pipeline(target_dir, drafter_dir, dtype="float32")


def _timed(engine, ms_per_row: float, monkeypatch) -> None:
    """The engine's timing as if measured, and kept: a call of width w costs 10 + ms_per_row x (w - 1)."""
    for width in range(1, 9):
        for _ in range(WIDTH_SAMPLES):
            engine._costs.observe(width, 10.0 + ms_per_row * (width - 1), overhead_ms=1.0)
    monkeypatch.setattr(engine._costs, "observe", lambda *args: None)


@pytest.mark.parametrize("ms_per_row, narrowed", [(5.0, True), (0.0, False)])
def test_a_greedy_request_alone_verifies_what_its_drafters_confidence_says_pays(tiny, ms_per_row, narrowed,
                                                                                  monkeypatch):
    """Where rows are dear, a greedy request decoding alone verifies fewer drafts than it drew (the
    tiny pair's drafter is unsure); where they are free, all of them. Its output is AR's either way."""
    block = 8
    reference = tiny.autoregressive().generate_batch(PROMPTS, [GenerationConfig(max_new_tokens=40, block=AR)] * 3)
    engine = tiny.stepped_engine(EngineConfig(max_running=1, prompt_lookup=0, draft_width=0), load_aware=False)
    _timed(engine, ms_per_row, monkeypatch)
    generations = engine.generate([tiny.codec.encode(p) for p in PROMPTS],
                                  [GenerationConfig(max_new_tokens=40, block=BlockChoice(block))] * 3)
    assert [g.tokens for g in generations] == [r.tokens for r in reference]
    cycles, drafts = (sum(getattr(g.stats, name) for g in generations) for name in ("cycles", "draft_tokens"))
    assert (drafts < cycles * (block - 1)) == narrowed, (drafts, cycles)


def test_sampled_requests_batches_and_the_switch_keep_their_widths(tiny, monkeypatch):
    """Sampled requests (whose output must not depend on the machine's timing), requests decoding
    together (a call is as wide as its widest row) and an engine with the choice off verify every
    draft they drew, however dear the rows: the choice is asked only of a greedy request alone."""
    cases = [(EngineConfig(max_running=1, prompt_lookup=0, draft_width=0), 1.0, 1),
             (EngineConfig(max_running=3, prompt_lookup=0, draft_width=0), 0.0, 3),
             (EngineConfig(max_running=1, prompt_lookup=0, draft_width=0, confident_width=False), 0.0, 1)]
    for config, temperature, together in cases:
        engine = tiny.stepped_engine(config, load_aware=False)
        _timed(engine, 5.0, monkeypatch)
        running, choose = [], engine._confident
        monkeypatch.setattr(engine, "_confident", lambda *args: running.append(len(engine._active)) or choose(*args))
        sampling = SamplingConfig(temperature=temperature, seed=3)
        engine.generate([tiny.codec.encode(p) for p in PROMPTS[:together]],
                        [GenerationConfig(max_new_tokens=40, block=BlockChoice(8), sampling=sampling)] * together)
        assert set(running) <= ({1} if together > 1 else set()), (config, running)  # a batch's last one may be alone


def test_a_runner_verifies_any_width_unless_built_for_some(tiny):
    runner = tiny.runner.with_slots(1, 64)
    assert runner.verify_widths(5) == [1, 2, 3, 4, 5]  # eager modules: any
    runner.block_sizes = (4, 8, 16)  # as a built engine of a fixed-shape backend records them
    assert runner.verify_widths(8) == [1, 4, 8]
