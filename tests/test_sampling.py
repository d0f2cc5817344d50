"""At T > 0, speculative decoding samples exactly from the target's distribution.

The decode loop runs for real (prefill, draft, verify, accept, commit) many times with different
seeds: tens of thousands of requests, so they are decoded 64 at a time by the continuous-batching
engine (each request with its own seed, controller and sampler, exactly as served), and a one-slot
engine (what `trtspec run` decodes with) is checked the same way with fewer requests. The first
tokens they produce are compared with the exact distribution computed from the target's logits
(chi-square, plus a Bonferroni-corrected binomial test per cell, which is what catches a shift
concentrated on one token). The same test run with a subtly broken acceptance rule,
moving 1% of probability mass onto the drafter's proposal, must fail: that shows it has the power to
catch a shift of that size (broken in the Python oracle of the controller, which the same loop runs
in place of the native controller; the native controller agrees with that oracle cycle by cycle,
test_controller.py).
"""

import numpy as np
import pytest
import torch

from trtspec.runtime import processing as processing_module
from helpers import ALPHA, SAMPLED_PROMPT as PROMPT, SAMPLED_VOCAB as VOCAB, break_acceptance_rule, exact_distribution, \
    exact_three_token_distribution, fit_pvalue, generate, predictable_pair, processed_logits, pvalues, sample_three_tokens, \
    single
from trtspec.runtime.request import GenerationConfig
from trtspec.runtime.reference import PythonController, accepted_length
from trtspec.runtime.processing import Processing
from trtspec.runtime import sampling as sampling_module
from trtspec.runtime.sampling import Sampler, SamplingConfig, draw_proposals, sample_requests
from trtspec.runtime.schedule import BlockChoice

SAMPLES = 30_000


@pytest.fixture(scope="module")
def pair():
    # the drafter mostly proposes token 7, which the target samples with probability ~0.14
    return predictable_pair(vocab_size=VOCAB, beta=0.5, hidden=16, layers=1, heads=2, kv_heads=1)


def processed(logits: torch.Tensor, prompt: list[int], output: list[int], processing: Processing,
              min_p: float = 0.0) -> torch.Tensor:
    """One position's distribution at T = 1 under vLLM's processing (helpers.processed_logits), then min_p."""
    probs = torch.softmax(processed_logits(logits, prompt, output, processing).double(), dim=-1)
    probs[probs < min_p * probs.max()] = 0.0
    return probs / probs.sum()


def exact_processed_distribution(target, processing: Processing, min_p: float) -> np.ndarray:
    """p(t1, t2, t3 | prompt) [VOCAB] * 3 with every position processed given the tokens before it."""
    grid = torch.cartesian_prod(*[torch.arange(VOCAB)] * 2)
    sequences = torch.cat([torch.tensor(PROMPT).expand(len(grid), -1), grid], dim=1)
    with torch.no_grad():
        logits = target(sequences, 0, None)[0].double()
    start = len(PROMPT) - 1
    joint = np.zeros((VOCAB,) * 3)
    for row, (t1, t2) in enumerate(grid.tolist()):
        p1 = processed(logits[row, start], PROMPT, [], processing, min_p)[t1]
        p2 = processed(logits[row, start + 1], PROMPT, [t1], processing, min_p)[t2]
        p3 = processed(logits[row, start + 2], PROMPT, [t1, t2], processing, min_p)
        joint[t1, t2] = (p1 * p2 * p3).numpy()
    return joint


PROCESSING = Processing(logit_bias=((3, 1.5),), repetition_penalty=1.5, frequency_penalty=0.7, presence_penalty=0.4)


def test_sampling_under_vllms_processing_follows_the_processed_target(pair):
    """At T = 1 with vLLM's processing (a bias, all three penalties, min_p), the first three tokens
    follow the target's distribution processed position by position, each given the tokens before it
    (and not the same distribution without min_p: the check sees it)."""
    joint = exact_processed_distribution(pair[0], PROCESSING, min_p=0.2)
    samples = sample_three_tokens(pair, 3_000, processing=PROCESSING, min_p=0.2)
    assert np.mean(samples[:, 1] == 7) > 0.05  # drafts are still accepted
    results = pvalues(samples, joint)
    assert min(results.values()) > ALPHA, results
    assert min(pvalues(samples, exact_processed_distribution(pair[0], PROCESSING, min_p=0.0)).values()) < ALPHA


def test_penalties_that_ignore_the_drafts_ahead_of_a_row_are_detected(pair, monkeypatch):
    """The same check has the power to see rows penalised for the committed tokens only (the drafts
    ahead of them ignored): what AR would not do at a position after an accepted draft."""
    monkeypatch.setattr(processing_module.RowProcessor, "_row_counts",
                        lambda self, drafts, rows: self.counts[None].expand(rows, -1))
    joint = exact_processed_distribution(pair[0], PROCESSING, min_p=0.2)
    results = pvalues(sample_three_tokens(pair, 3_000, processing=PROCESSING, min_p=0.2), joint)
    assert min(results.values()) < ALPHA, results


@pytest.mark.slow
def test_speculative_sampling_matches_the_target(pair):
    joint = exact_three_token_distribution(pair[0])
    samples = sample_three_tokens(pair, SAMPLES)
    accepted_first = np.mean(samples[:, 1] == 7)
    assert 0.1 < accepted_first < 0.5  # the drafter's proposal is sometimes, not always, right
    results = pvalues(samples, joint)
    assert min(results.values()) > ALPHA, results


def test_a_residual_that_ignores_the_proposals_is_detected(pair, monkeypatch):
    """Sampled requests verify drafts drawn from the drafter's distribution q: a rejected draft is
    redrawn from max(0, p - q). Redrawn from p instead, the draft's token is drawn twice over (kept
    with probability min(1, p/q), then again from p): the test must see it."""
    monkeypatch.setattr(sampling_module, "_residual", lambda probs, q: probs.clone())
    results = pvalues(sample_three_tokens(pair, 1_000), exact_three_token_distribution(pair[0]))
    assert min(results.values()) < ALPHA, results


def test_proposals_are_drawn_from_the_drafters_distribution_and_verified_exactly():
    """draw_proposals draws each row's drafts from softmax(drafter logits) at DEFAULT_PROPOSAL_TEMPERATURE x the
    request's temperature (ids mapped through the draft vocabulary), and one column of speculative
    sampling over them gives tokens distributed as the target's p, whatever q is."""
    from scipy.stats import chisquare

    count, ids = 40_000, torch.tensor([3, 0, 2])  # a draft vocabulary of three of the four ids
    drafter_logits = torch.log(torch.tensor([0.6, 0.3, 0.1])).expand(count, 1, 3)
    samplers = [Sampler(SamplingConfig(temperature=1.0, seed=seed)) for seed in range(count)]
    drafts, q = draw_proposals(samplers, drafter_logits, ids)
    wanted = torch.softmax(drafter_logits[0, 0] / sampling_module.DEFAULT_PROPOSAL_TEMPERATURE, dim=-1)
    assert torch.allclose(q[0, 0], wanted)
    seen = np.bincount(drafts[:, 0].numpy(), minlength=4)
    expected = wanted.double().numpy()
    assert seen[1] == 0 and chisquare(seen[[3, 0, 2]], count * expected / expected.sum()).pvalue > ALPHA
    target = torch.log(torch.tensor([0.1, 0.5, 0.15, 0.25]))  # p(3) < q(3): some drafts are redrawn
    logits = target.expand(count, 2, 4)  # a draft, then the bonus column
    tokens = sample_requests(samplers, logits, drafts, (q, ids))
    first = np.bincount(tokens[:, 0].numpy(), minlength=4)
    assert chisquare(first, count * np.array([0.1, 0.5, 0.15, 0.25])).pvalue > ALPHA
    kept = (tokens[:, 0] == drafts[:, 0]).float().mean().item()
    p = torch.tensor([0.25, 0.1, 0.15])  # the target's probabilities of ids 3, 0, 2
    assert abs(kept - torch.minimum(p, wanted).sum().item()) < 0.015  # sum min(p, q)


def test_a_tiny_proposal_temperature_draws_the_drafters_argmax():
    """A fraction of T far below float32's range (EngineConfig's proposal_temperature) sharpens q to
    the argmax: finite, never inf - inf."""
    logits = torch.tensor([[[0.5, 2.0, -1.0], [3.0, 0.0, 1.0]]]).expand(8, 2, 3)
    ids = torch.tensor([7, 4, 9])
    samplers = [Sampler(SamplingConfig(temperature=1.0, seed=seed)) for seed in range(8)]
    drafts, q = draw_proposals(samplers, logits, ids, temperature=1e-30)
    assert drafts.tolist() == [[4, 7]] * 8
    assert torch.equal(q, torch.tensor([[[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]]).expand(8, 2, 3))


def test_drafts_drawn_at_another_fraction_of_t_still_sample_from_the_target(pair, monkeypatch):
    """Any proposal distribution is lossless: drafts drawn at 2 x T (flatter than the default) too;
    at 0 the engine never draws (its drafts are the drafter's argmax)."""
    from trtspec.runtime import engine

    fractions = []
    monkeypatch.setattr(engine, "draw_proposals", lambda *args: fractions.append(args[3]) or draw_proposals(*args))
    results = pvalues(sample_three_tokens(pair, 2_000, proposal_temperature=2.0), exact_three_token_distribution(pair[0]))
    assert min(results.values()) > ALPHA, results
    assert set(fractions) == {2.0}
    fractions.clear()
    sample_three_tokens(pair, 64, proposal_temperature=0.0)
    assert fractions == []


def test_min_tokens_samples_from_the_target_without_its_stop_ids(pair):
    """min_tokens = 3 with the drafter's favourite token as a stop id: the first three tokens follow
    the target's distribution with that id removed at every position (never drawn, never accepted)."""
    favourite = 7
    samples = sample_three_tokens(pair, 2_000, stop_ids=(favourite,), min_tokens=3)
    assert favourite not in samples
    results = pvalues(samples, exact_distribution(pair[0], 3, banned=(favourite,)))
    assert min(results.values()) > ALPHA, results


def test_one_request_at_a_time_samples_from_the_target(pair):
    """The same check through a one-slot engine, one request at a time (what `trtspec run` decodes with:
    the same acceptance rule, whose power the batched checks show; what is particular to one slot is
    how its buffers are passed, where a mistake shifts far more than 1%)."""
    joint = exact_three_token_distribution(pair[0])
    results = pvalues(sample_three_tokens(pair, 1_000, batched=False), joint)
    assert min(results.values()) > ALPHA, results


@pytest.mark.slow
def test_a_growing_block_samples_from_the_target(pair):
    """B=2 growing to 4: after prefill's t1, a cycle at 2 that accepts its draft commits t2, t3 and
    makes the next cycle, which commits t4 onwards, run at 4. The first four tokens must follow the
    target's own distribution (each marginal beyond t1, and jointly)."""
    joint = exact_distribution(pair[0], 4)
    samples = sample_three_tokens(pair, 20_000, block_size=2, grow_to=4, tokens=4)
    assert 0.1 < np.mean(samples[:, 1] == 7) < 0.5  # so about that share of requests grew
    results = four_token_pvalues(samples, joint)
    assert min(results.values()) > ALPHA, results


def four_token_pvalues(samples: np.ndarray, joint: np.ndarray) -> dict[str, float]:
    return {"t4": fit_pvalue(samples[:, 3:4], joint.sum(axis=(0, 1, 2))),
            "(t3, t4)": fit_pvalue(samples[:, 2:4], joint.sum(axis=(0, 1))),
            "(t1, t2, t3, t4)": fit_pvalue(samples, joint)}


@pytest.mark.slow
def test_a_one_percent_break_of_the_acceptance_rule_is_detected(pair, monkeypatch):
    joint = exact_three_token_distribution(pair[0])
    # The drafter proposes token 7 almost everywhere, so first drafts are rejected with probability
    # about 1 - p(7); wrongly accepting this share of them moves about 1% of the next token's mass.
    break_rate = 0.01 / (1 - joint.sum(axis=(0, 2))[7])
    coin = torch.Generator().manual_seed(0)

    def sloppy_accepted_length(drafts, posterior):
        accepted = accepted_length(drafts, posterior)
        if accepted == 0 and torch.rand((), generator=coin) < break_rate:
            return accepted + 1
        return accepted

    break_acceptance_rule(monkeypatch, sloppy_accepted_length)
    results = pvalues(sample_three_tokens(pair, SAMPLES, controller=PythonController), joint)
    assert min(results.values()) < ALPHA, results


def test_an_off_by_one_acceptance_rule_is_detected(pair, monkeypatch):
    break_acceptance_rule(monkeypatch, lambda drafts, posterior: (drafts == posterior[1:]).long().cumprod(-1).sum(-1))
    joint = exact_three_token_distribution(pair[0])
    # decoded 64 at a time (it ran one request at a time before issue 39: the rule is the same code)
    results = pvalues(sample_three_tokens(pair, 3_000, controller=PythonController), joint)
    assert min(results.values()) < ALPHA, results


@pytest.mark.slow
def test_an_off_by_one_rule_in_grown_cycles_only_is_detected(pair, monkeypatch):
    """The four-token check of growing blocks has the power to see a rule broken only in the
    cycles that run at the grown size (three drafts at 2:4; about one request in seven grows)."""
    def grown_off_by_one(drafts, posterior):
        if drafts.shape[-1] == 3:
            return (drafts == posterior[1:]).long().cumprod(-1).sum(-1)
        return accepted_length(drafts, posterior)

    break_acceptance_rule(monkeypatch, grown_off_by_one)
    joint = exact_distribution(pair[0], 4)
    samples = sample_three_tokens(pair, 8_000, block_size=2, grow_to=4, tokens=4, controller=PythonController)
    results = four_token_pvalues(samples, joint)
    assert min(results.values()) < ALPHA, results


def test_accepted_length_rule():
    drafts = torch.tensor([[4, 5, 6], [4, 5, 6], [9, 5, 6], [4, 5, 6]])
    posterior = torch.tensor([[4, 5, 6, 1], [4, 0, 6, 1], [4, 5, 6, 1], [4, 5, 0, 1]])
    assert accepted_length(drafts, posterior).tolist() == [3, 1, 0, 2]


FOUR_TOKENS = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))


def test_top_p_keeps_the_fewest_tokens_reaching_p():
    top_p = Sampler(SamplingConfig(temperature=1.0, top_p=0.9, seed=0)).probabilities(FOUR_TOKENS)
    assert torch.allclose(top_p, torch.tensor([[0.5, 0.3, 0.15, 0.0]]) / 0.95)


def test_top_k_keeps_the_k_likeliest_tokens():
    """In the distribution, renormalised, and in what is drawn from it."""
    logits = FOUR_TOKENS
    top_k = Sampler(SamplingConfig(temperature=1.0, top_k=2, seed=0)).probabilities(logits)
    assert torch.allclose(top_k, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    sampler = Sampler(SamplingConfig(temperature=1.0, top_k=2, seed=0))
    draws = sampler.sample(logits.expand(2000, -1))
    assert set(draws.tolist()) == {0, 1}


def test_seeded_sampling_is_reproducible(pair):
    config = GenerationConfig(block=BlockChoice(4), max_new_tokens=20, sampling=SamplingConfig(temperature=0.8, seed=7))
    one = single(*pair)
    assert generate(one, PROMPT, config).tokens == generate(one, PROMPT, config).tokens


def test_requests_sampled_together_draw_what_each_draws_alone():
    """The engine draws a batch's sampled rows together (sample_requests), grouped by distribution:
    each seeded request gets the tokens its own sampler gives, whatever its neighbours."""
    configs = [SamplingConfig(temperature=1.0, seed=1), SamplingConfig(temperature=0.7, top_k=5, seed=2),
               SamplingConfig(temperature=1.0, seed=3), SamplingConfig(temperature=0.7, top_k=5, top_p=0.9, seed=4),
               SamplingConfig(temperature=1.0, min_p=0.1, seed=5)]
    logits = torch.randn(len(configs), 6, 50, generator=torch.Generator().manual_seed(0)) * 3
    together, alone = [Sampler(c) for c in configs], [Sampler(c) for c in configs]
    for _ in range(3):  # the generators advance alike, cycle after cycle
        assert torch.equal(sample_requests(together, logits), torch.stack([s.sample(r) for s, r in zip(alone, logits)]))



def test_drawing_only_up_to_the_first_mismatch_gives_the_tokens_the_controller_reads():
    """With the drafts, a request's columns after its first mismatch are not drawn (-1); every column
    up to and including it is the token the full draw gives, and the generators stay in step."""
    configs = [SamplingConfig(temperature=1.0, seed=1), SamplingConfig(temperature=1.0, seed=2),
               SamplingConfig(temperature=0.7, top_k=5, seed=3), SamplingConfig(temperature=1.0, seed=4)]
    logits = torch.randn(len(configs), 6, 8, generator=torch.Generator().manual_seed(0)) * 2
    column, full = [Sampler(c) for c in configs], [Sampler(c) for c in configs]
    partial = 0
    for _ in range(20):
        expected = sample_requests(full, logits)
        drafts = expected[:, :-1].clone()
        drafts[0, 0] += 1       # parts at column 0
        drafts[1, 2] += 1       # at column 2
        drafts[2] = (drafts[2] + torch.randint(0, 2, (5,))) % 8  # wherever it happens to part
        got = sample_requests(column, logits, drafts)
        for row in range(len(configs)):
            parts = (drafts[row] != expected[row, :-1]).nonzero()
            read = int(parts[0]) + 1 if len(parts) else 6  # the columns the controller reads
            assert torch.equal(got[row, :read], expected[row, :read])
            assert (got[row, read:] == -1).all()
            partial += read < 6
    assert partial >= 40  # rows 0 and 1 every time: the test skipped columns

@pytest.mark.parametrize("sampling", [SamplingConfig(temperature=1e-50, seed=3),
                                      SamplingConfig(temperature=1.0, top_p=1e-300, seed=3),
                                      SamplingConfig(temperature=1e-45, top_p=1e-40, top_k=5, seed=3)],
                         ids=["T=1e-50", "top_p=1e-300", "both-subnormal"])
def test_a_temperature_or_top_p_below_float32_resolution_decodes_greedy(sampling, target_dir, drafter_dir):
    """Float32 rounds such a T or top-p to 0 (0/0 before the fix: one token repeated); their limit,
    the likeliest token, is what the eager loop and the batched engine decode."""
    from trtspec.api import Pipeline

    pipeline = Pipeline(target_dir, drafter_dir)
    prompt = "def fibonacci(n):"
    greedy = pipeline.generate(prompt, GenerationConfig(block=BlockChoice(8), max_new_tokens=24)).tokens
    tiny = GenerationConfig(block=BlockChoice(8), max_new_tokens=24, sampling=sampling)
    assert len(set(greedy)) > 3  # a real continuation, not one token repeated
    assert pipeline.generate(prompt, tiny).tokens == greedy
    assert [r.tokens for r in pipeline.generate_batch([prompt, prompt], [tiny, tiny], max_running=2)] == [greedy, greedy]
    assert sampling.greedy and sampling.temperature == 0.0  # normalised once, so the servers get it too
