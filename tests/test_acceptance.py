"""scripts/drafter/acceptance.py: a drafter's expected acceptance along the target's own continuation.
At T = 0 it is exact: walking the continuation cycle by cycle as decoding does gives decoding's
own acceptance histogram."""

import importlib.util
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from helpers import TRAINED_PROMPTS, code_prompts
from trtspec.api import Pipeline
from trtspec.runtime.engine import EngineConfig, LocalEngine
from trtspec.runtime.request import GenerationConfig
from trtspec.runtime.sampling import SamplingConfig
from trtspec.runtime.schedule import AR, BlockChoice

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "drafter" / "acceptance.py"
spec = importlib.util.spec_from_file_location("acceptance", SCRIPT)
acceptance = importlib.util.module_from_spec(spec)
spec.loader.exec_module(acceptance)


def _continuation(engine: LocalEngine, ids: list[int], tokens: int, sampling=SamplingConfig()) -> list[int]:
    config = replace(GenerationConfig(max_new_tokens=tokens, sampling=sampling), block=AR)
    return ids + list(engine.generate([ids], [config])[0].tokens)


def test_greedy_expected_acceptance_walks_to_decodings_own_histogram(target_dir, trained_drafter_dir):
    pipeline = Pipeline(target_dir, trained_drafter_dir, dtype="float32", device="cpu")
    size, new = pipeline.drafter.config.block_size, 40
    engine = LocalEngine(pipeline.runner, None, EngineConfig(max_running=1, prefill_chunk=0, prompt_lookup=0,
                                                             draft_width=0, confident_width=False))
    walked_any = False
    for prompt in code_prompts(TRAINED_PROMPTS + 3)[TRAINED_PROMPTS:]:
        ids = pipeline.codec.encode(prompt)
        full = _continuation(engine, ids, new + 2 * size)  # whole blocks after every anchor decoding reaches
        accepted = acceptance.block_acceptance(pipeline, acceptance.teacher_forced(pipeline, full, len(ids)), 0.0,
                                               0.0).cumprod(1).sum(1).long()
        histogram, committed = [0] * size, 1  # the prefill commits the first token: the first anchor
        while committed < new:
            drafts = int(accepted[committed - 1])
            histogram[drafts] += 1
            committed += drafts + 1
        config = replace(GenerationConfig(max_new_tokens=new), block=BlockChoice(size))
        decoded = engine.generate([ids], [config])[0]
        assert decoded.tokens == full[len(ids):len(ids) + new]
        assert decoded.stats.histogram == histogram
        walked_any |= sum(histogram[1:]) > 0
    assert walked_any  # some cycle accepted a draft: the walk was not trivially all zeros


def test_sampled_acceptance_is_the_overlap_of_the_two_distributions(target_dir, trained_drafter_dir):
    """At T > 0 a draft drawn from q is accepted with probability sum min(p, q): 1 where q is p."""
    pipeline = Pipeline(target_dir, trained_drafter_dir, dtype="float32", device="cpu")
    engine = LocalEngine(pipeline.runner, None, EngineConfig(max_running=1, prefill_chunk=0))
    ids = pipeline.codec.encode(code_prompts(TRAINED_PROMPTS + 1)[TRAINED_PROMPTS])
    full = _continuation(engine, ids, 40, SamplingConfig(temperature=1.0, seed=3))
    target_logits, draft_logits = acceptance.teacher_forced(pipeline, full, len(ids))
    overlap = acceptance.block_acceptance(pipeline, (target_logits, draft_logits), 1.0, 0.7)
    p, q = target_logits.softmax(-1), (draft_logits / 0.7).softmax(-1)
    torch.testing.assert_close(overlap, torch.minimum(p, q).sum(-1))
    assert ((overlap > 0) & (overlap < 1)).float().mean() > 0.5
    same = acceptance.block_acceptance(pipeline, (target_logits, target_logits * 0.7), 1.0, 0.7)
    torch.testing.assert_close(same, torch.ones_like(same))


def test_the_marginal_ceiling_accepts_its_exact_first_position(target_dir):
    """The ceiling's first draft comes from the target's own next-token distribution: drawn from it,
    it is always accepted; as its argmax, with that token's probability. Later positions' marginals
    average over continuations the drafts do not share, so they are accepted less."""
    from trtspec.models import load_target

    target = load_target(target_dir)
    ids = torch.randint(2, 300, (24,), generator=torch.Generator().manual_seed(0)).tolist()
    chains = acceptance.marginal_ceiling(target, ids, 6, 1.0, [0.0, 1.0], paths=16, draws=64,
                                         generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        first = target(torch.tensor([ids]), 0, None)[0][0, -1].softmax(-1)
    assert chains[1.0][0] == pytest.approx(1.0)
    assert chains[0.0][0] == pytest.approx(float(first.max()), rel=1e-5)
    for chain in chains.values():
        assert chain.shape == (5,) and bool((chain[1:] <= chain[:-1] + 1e-6).all())
    assert chains[1.0][-1] < 0.999


def test_a_draft_tree_grows_by_proposal_probability_and_counts_the_targets_path():
    """Depth 2, three tokens: the target's path is token 1 then token 2. Best-first by the product of
    the proposals: (0) 0.5, (1) 0.4, (0, 2) 0.35, (1, 2) 0.28; only (1) and (1, 2) lie on the path."""
    q = torch.tensor([[[0.5, 0.4, 0.1], [0.1, 0.2, 0.7]]])
    p = torch.tensor([[[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]])
    assert acceptance.tree_taus(p, q, [1, 2, 3, 4]).tolist() == [[1.0, 2.0, 2.0, 3.0]]


def test_a_one_child_tree_is_the_chain(target_dir, trained_drafter_dir):
    """With one child a node, a tree of B - 1 nodes is the drafter's greedy chain: its expected tau at
    T = 0 is the chain's (block_acceptance, which decoding's own histogram checks above)."""
    pipeline = Pipeline(target_dir, trained_drafter_dir, dtype="float32", device="cpu")
    size = pipeline.drafter.config.block_size
    engine = LocalEngine(pipeline.runner, None, EngineConfig(max_running=1, prefill_chunk=0))
    ids = pipeline.codec.encode(code_prompts(TRAINED_PROMPTS + 1)[TRAINED_PROMPTS])
    forced = acceptance.teacher_forced(pipeline, _continuation(engine, ids, 40), len(ids))
    chain = 1 + acceptance.block_acceptance(pipeline, forced, 0.0, 0.0).cumprod(1).sum(1)
    p, q = acceptance.distributions(pipeline, forced, 0.0, 0.0)
    torch.testing.assert_close(acceptance.tree_taus(p, q, [size - 1], top=1)[:, 0], chain.double())
