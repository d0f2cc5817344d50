"""The native decode controller agrees with the Python oracle cycle by cycle.

Batches of requests with different block sizes (some growing), limits and stop ids are driven through both with
the same drafts and posterior tokens (or logits, for the greedy step); after every cycle each
request's accept length, committed tokens, stop or limit, statistics and next start position
must be identical.
"""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trtspec.runtime.reference import PythonController
from trtspec.runtime.controller import native_controller

VOCAB = 6  # few token ids, so drafts often match and stop ids often occur
LOGITS_VOCAB = 37  # the greedy step's argmax runs eight lanes over 32 logits, then a tail of 5
MASK = 99


@st.composite
def batches(draw):
    requests = draw(st.integers(1, 4))
    block_sizes = draw(st.lists(st.integers(1, 24), min_size=requests, max_size=requests))
    limits = draw(st.lists(st.integers(1, 60), min_size=requests, max_size=requests))
    stop_ids = draw(st.lists(st.lists(st.integers(0, VOCAB - 1), max_size=2), min_size=requests, max_size=requests))
    starts = draw(st.lists(st.integers(1, 500), min_size=requests, max_size=requests))
    grow_to = [draw(st.sampled_from([0, *range(b + 1, 25)])) if b >= 2 else 0 for b in block_sizes]
    return block_sizes, limits, stop_ids, starts, grow_to, draw(st.integers(0, 2**32 - 1)), draw(st.booleans())


def _propose(rng, posterior, width):
    """Drafts that agree with the posterior for a random prefix, then mostly not."""
    drafts = rng.integers(0, VOCAB, posterior.shape[:-1] + (width - 1,))
    for r in range(posterior.shape[0]):
        agree = rng.integers(0, width)
        drafts[r, :agree] = posterior[r, :agree]
    return drafts


def _assert_same(native, oracle, requests):
    assert native.running == oracle.running
    for r in range(requests):
        count = oracle.count(r)
        assert native.count(r) == count
        assert native.tokens[r, :count].tolist() == oracle.tokens[r, :count].tolist()
        for name in ("start", "accepted", "committed", "finish_reason", "cycles", "tau", "ceiling_fraction",
                     "block_size", "grown_cycles", "ceilings"):
            assert getattr(native, name)(r) == getattr(oracle, name)(r), (name, r)
        assert native.histograms[r].tolist() == oracle.histograms[r].tolist()
        assert native.verify_blocks[r, 0] == oracle.verify_blocks[r, 0]
        assert native.draft_blocks[r].tolist() == oracle.draft_blocks[r].tolist()


@settings(max_examples=150, deadline=None)
@given(batches())
def test_native_controller_matches_the_python_oracle(batch):
    block_sizes, limits, stop_ids, starts, grow_to, seed, greedy = batch
    rng = np.random.default_rng(seed)
    requests, width = len(block_sizes), max(block_sizes + grow_to)
    cores = [make(block_sizes, limits, stop_ids, MASK, grow_to) for make in (native_controller, PythonController)]
    for core in cores:
        for r, start in enumerate(starts):
            core.begin(r, int(rng.integers(0, VOCAB)) if core is cores[0] else int(cores[0].tokens[r, 0]), start)
    _assert_same(*cores, requests)
    cycle = 0
    while cores[1].running:
        cycle += 1
        if cycle == 3:  # the first request turns autoregressive mid-way (auto under load)
            for core in cores:
                core.set_block_size(0, 1)
        if greedy:  # small integers: ties are common, and both must take the first maximum
            logits = rng.integers(0, 3, (requests, width, LOGITS_VOCAB)).astype(np.float32)
            posterior = logits.argmax(axis=-1)
        else:
            posterior = rng.integers(0, VOCAB, (requests, width))
        drafts = _propose(rng, posterior, width)
        for core in cores:
            core.verify_blocks[:, 1:] = drafts
            if greedy:
                core.step_greedy(logits if requests > 1 else logits[0])
            else:
                core.step(torch.from_numpy(posterior) if requests > 1 else torch.from_numpy(posterior[0]))
        _assert_same(*cores, requests)


def test_a_stop_id_mid_block_truncates_and_ends_the_request():
    core = native_controller([5], [100], [[7]], MASK)
    core.begin(0, 1, 10)
    core.verify_blocks[0, 1:] = [2, 7, 3, 4]
    assert core.step(np.array([2, 7, 3, 9, 9])) == 0
    assert (core.accepted(0), core.committed(0), core.finish_reason(0)) == (3, 2, "stop")
    assert core.tokens[0, :core.count(0)].tolist() == [1, 2, 7]
    assert core.start(0) == 14 and core.histograms[0].tolist() == [0, 0, 0, 1, 0]


def test_a_growing_block_grows_after_a_full_base_block_and_shrinks_after_a_short_one():
    core = native_controller([3], [100], [[]], MASK, [6])
    core.begin(0, 1, 0)
    assert core.block_size(0) == 3 and core.verify_blocks.shape == (1, 6)
    core.verify_blocks[0, 1:3] = [2, 3]
    core.step(np.array([2, 3, 4]))  # both drafts accepted: a full block of 3
    assert core.block_size(0) == 6 and core.ceilings(0) == 1
    core.verify_blocks[0, 1:6] = [5, 6, 0, 0, 0]
    core.step(np.array([5, 6, 7, 8, 9, 1]))  # 2 of 5 accepted at 6: not a ceiling, but a full base block
    assert core.block_size(0) == 6 and (core.grown_cycles(0), core.ceilings(0)) == (1, 1)
    core.verify_blocks[0, 1:6] = [9, 9, 9, 9, 9]
    core.step(np.array([1, 2, 3, 4, 5, 6]))  # none accepted: back to the base size
    assert core.block_size(0) == 3 and core.grown_cycles(0) == 2 and core.cycles(0) == 3
    assert core.tokens[0, :core.count(0)].tolist() == [1, 2, 3, 4, 5, 6, 7, 1]
    assert core.histograms[0].tolist() == [1, 0, 2, 0, 0, 0] and core.ceiling_fraction(0) == pytest.approx(1 / 3)


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError):
        native_controller([0], [5], [[]], MASK)
    with pytest.raises(ValueError):  # a block wider than the controller's buffers
        native_controller([4], [5], [[]], MASK).set_block_size(0, 5)
    for base, grown in ((4, 4), (4, 2), (1, 4)):  # a block grows from B >= 2 to a larger size
        with pytest.raises(ValueError):
            native_controller([base], [5], [[]], MASK, [grown])
    core = native_controller([4, 4], [5, 5], [[], []], MASK)
    for r in range(2):
        core.begin(r, 1, 0)
    with pytest.raises(ValueError):
        core.step(np.zeros((1, 4), dtype=np.int64))  # one row for two requests
    with pytest.raises(ValueError):
        core.step_greedy(np.zeros((2, 3, 8), dtype=np.float32))  # fewer positions than the block
    with pytest.raises(IndexError):
        core.start(2)
