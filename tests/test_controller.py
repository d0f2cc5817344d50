"""The native decode controller agrees with the Python oracle cycle by cycle.

Requests with any block size (some growing), limit and stop ids are driven through both with the
same drafts and posterior tokens (or logits, for the greedy step); after every cycle the accept
length, committed tokens, stop or limit, statistics and next start position must be identical.
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
PROPERTIES = ("running", "block_size", "next_width", "grown_cycles", "ceilings", "drafts", "count", "start",
              "accepted", "committed", "finish_reason", "cycles", "tau", "ceiling_fraction")


@st.composite
def requests(draw):
    block_size = draw(st.integers(1, 24))
    grow_to = draw(st.sampled_from([0, *range(block_size + 1, 25)])) if block_size >= 2 else 0
    return (block_size, draw(st.integers(1, 60)), draw(st.lists(st.integers(0, VOCAB - 1), max_size=2)),
            draw(st.integers(1, 500)), grow_to, draw(st.integers(0, 2**32 - 1)), draw(st.booleans()),
            draw(st.integers(1, 6)), draw(st.booleans()))


def _propose(rng, posterior):
    """Drafts that agree with the posterior for a random prefix, then mostly not."""
    drafts = rng.integers(0, VOCAB, len(posterior) - 1)
    agree = rng.integers(0, len(posterior))
    drafts[:agree] = posterior[:agree]
    return drafts


def _assert_same(native, oracle):
    for name in PROPERTIES:
        assert getattr(native, name) == getattr(oracle, name), name
    assert native.tokens[:native.count].tolist() == oracle.tokens[:oracle.count].tolist()
    assert native.histogram.tolist() == oracle.histogram.tolist()
    assert native.verify_block[0] == oracle.verify_block[0]
    assert native.draft_block.tolist() == oracle.draft_block.tolist()


@settings(max_examples=300, deadline=None)
@given(requests())
def test_native_controller_matches_the_python_oracle(request):
    block_size, limit, stop_ids, start, grow_to, seed, greedy, turn_ar_at, narrowing = request
    rng = np.random.default_rng(seed)
    width = max(block_size, grow_to)
    controllers = [make(block_size, limit, stop_ids, MASK, grow_to) for make in (native_controller, PythonController)]
    first = int(rng.integers(0, VOCAB))
    for controller in controllers:
        controller.begin(first, start)
    _assert_same(*controllers)
    cycle = 0
    while controllers[1].running:
        cycle += 1
        if cycle == turn_ar_at:  # the request turns autoregressive mid-way (auto under load)
            for controller in controllers:
                controller.set_block_size(1)
        if greedy:  # small integers: ties are common, and both must take the first maximum
            logits = rng.integers(0, 3, (width, LOGITS_VOCAB)).astype(np.float32)
            posterior = logits.argmax(axis=-1)
        else:
            posterior = rng.integers(0, VOCAB, width)
        drafts = _propose(rng, posterior)
        if narrowing and rng.random() < 0.5:  # this cycle verifies only its first positions
            narrowed = int(rng.integers(1, controllers[1].block_size + 1))
            for controller in controllers:
                controller.narrow(narrowed)
            _assert_same(*controllers)
        running = []
        for controller in controllers:
            controller.verify_block[1:] = drafts
            running.append(controller.step_greedy(logits) if greedy else controller.step(torch.from_numpy(posterior)))
        assert running[0] == running[1] == controllers[1].running
        _assert_same(*controllers)


def test_a_stop_id_mid_block_ends_the_request_at_the_stop():
    """The drafts after the stop are accepted by the target but never committed."""
    controller = native_controller(5, 100, [7], MASK)
    controller.begin(1, 10)
    controller.verify_block[1:] = [2, 7, 3, 4]
    assert not controller.step(np.array([2, 7, 3, 9, 9]))
    assert (controller.accepted, controller.committed, controller.finish_reason) == (3, 2, "stop")
    assert controller.tokens[:controller.count].tolist() == [1, 2, 7]
    assert controller.start == 14 and controller.histogram.tolist() == [0, 0, 0, 1, 0]


def test_a_growing_block_follows_whether_the_base_block_was_full():
    """The rule over three cycles: a full base block grows it, a full base block keeps it grown,
    a short one shrinks it back."""
    controller = native_controller(3, 100, [], MASK, 6)
    controller.begin(1, 0)
    assert controller.block_size == 3 and controller.verify_block.shape == (6,)
    controller.verify_block[1:3] = [2, 3]
    controller.step(np.array([2, 3, 4]))  # both drafts accepted: a full block of 3
    assert controller.block_size == 6 and controller.ceilings == 1
    controller.verify_block[1:6] = [5, 6, 0, 0, 0]
    controller.step(np.array([5, 6, 7, 8, 9, 1]))  # 2 of 5 accepted at 6: not a ceiling, but a full base block
    assert controller.block_size == 6 and (controller.grown_cycles, controller.ceilings) == (1, 1)
    controller.verify_block[1:6] = [9, 9, 9, 9, 9]
    controller.step(np.array([1, 2, 3, 4, 5, 6]))  # none accepted: back to the base size
    assert controller.block_size == 3 and controller.grown_cycles == 2 and controller.cycles == 3
    assert controller.tokens[:controller.count].tolist() == [1, 2, 3, 4, 5, 6, 7, 1]
    assert controller.histogram.tolist() == [1, 0, 2, 0, 0, 0] and controller.ceiling_fraction == pytest.approx(1 / 3)


def test_a_narrowed_cycle_verifies_only_its_width():
    """Drafts past the width are never accepted (the target's tokens there are not read), the cycle
    counts its own drafts and no ceiling, and the next cycle runs the whole block again."""
    controller = native_controller(8, 100, [], MASK)
    controller.begin(1, 0)
    controller.narrow(4)
    assert (controller.next_width, controller.block_size) == (4, 8)
    controller.verify_block[1:8] = [2, 3, 4, 5, 6, 7, 8]
    controller.step_greedy(np.eye(9, dtype=np.float32)[[2, 3, 4, 5]])  # 4 rows suffice: all 3 drafts, bonus 5
    assert (controller.accepted, controller.drafts, controller.ceilings) == (3, 3, 0)
    assert controller.tokens[:controller.count].tolist() == [1, 2, 3, 4, 5] and controller.next_width == 8
    controller.verify_block[1:8] = [6, 7, 8, 9, 9, 9, 9]
    controller.step(np.array([6, 7, 8, 9, 9, 9, 9, 3]))  # a whole block, all accepted: a ceiling
    assert (controller.drafts, controller.ceilings, controller.histogram.tolist()) == (10, 1, [0, 0, 0, 1, 0, 0, 0, 1])


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError):
        native_controller(0, 5, [], MASK)
    with pytest.raises(ValueError):  # a block wider than the controller's buffers
        native_controller(4, 5, [], MASK).set_block_size(5)
    for base, grown in ((4, 4), (4, 2), (1, 4)):  # a block grows from B >= 2 to a larger size
        with pytest.raises(ValueError):
            native_controller(base, 5, [], MASK, grown)
    controller = native_controller(4, 5, [], MASK)
    controller.begin(1, 0)
    with pytest.raises(ValueError):
        controller.step(np.zeros((1, 4), dtype=np.int64))  # a batch's rows, not one request's
    with pytest.raises(ValueError):
        controller.step(np.zeros(3, dtype=np.int64))  # fewer positions than the block
    with pytest.raises(ValueError):
        controller.step_greedy(np.zeros((3, 8), dtype=np.float32))
    for width in (0, 5):  # a cycle narrows within its block
        with pytest.raises(ValueError):
            controller.narrow(width)
    controller.narrow(2)
    with pytest.raises(ValueError):
        controller.step(np.zeros(1, dtype=np.int64))  # fewer positions than the narrowed cycle
