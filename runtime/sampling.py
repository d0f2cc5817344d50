"""Turning logits into tokens (the acceptance rule that keeps speculation lossless is applied by
the decode controller, `trtspec.runtime.controller`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from trtspec.limits import MIN_P, SAMPLING_RESOLUTION, SEED, SEED_MAX, TEMPERATURE, TOP_K, TOP_P

TOP_P_CANDIDATES = 256  # tokens sorted for top-p before falling back to the whole vocabulary


@dataclass(frozen=True)
class SamplingConfig:
    """Ranges: trtspec.limits (T >= 0 and finite, top-k >= -1 (-1: off, stored as 0), top-p in (0, 1],
    min-p in [0, 1], seed in [0, 2**63-1]).

    A temperature or top-p below float32's resolution (limits.SAMPLING_RESOLUTION) is stored as
    greedy (temperature 0), its limit: float32 would round it to 0 and sample garbage. Normalised
    here, so eager decoding, the engines and both servers decode it the same way."""

    temperature: float = 0.0   # 0 = greedy
    top_k: int = 0             # 0 = off
    top_p: float = 1.0         # 1 = off
    seed: int | None = None
    min_p: float = 0.0         # 0 = off: tokens below min_p x the likeliest one's probability are dropped

    def __post_init__(self) -> None:
        object.__setattr__(self, "temperature", TEMPERATURE.check_field(self.temperature, "temperature"))
        object.__setattr__(self, "top_k", max(TOP_K.check_field(self.top_k, "top_k"), 0))
        object.__setattr__(self, "top_p", TOP_P.check_field(self.top_p, "top_p"))
        object.__setattr__(self, "min_p", MIN_P.check_field(self.min_p, "min_p"))
        if self.seed is not None:
            object.__setattr__(self, "seed", SEED.check_field(self.seed, "seed"))
        if self.temperature < SAMPLING_RESOLUTION or self.top_p < SAMPLING_RESOLUTION:
            object.__setattr__(self, "temperature", 0.0)  # T -> 0 and top-p -> 0: the likeliest token

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def distribution(self) -> tuple[float, int, float, float]:
        """What shapes the sampled distribution (not the seed): rows with equal ones are processed together."""
        return self.temperature, self.top_k, self.top_p, self.min_p


class Sampler:
    """Draws posterior tokens from the target's logits, one independent draw per row."""

    def __init__(self, config: SamplingConfig, device: torch.device | str = "cpu"):
        self.config, self.device = config, device
        self._generator: torch.Generator | None = None  # made at the first draw: a greedy request never draws

    @property
    def generator(self) -> torch.Generator:
        if self._generator is None:
            self._generator = torch.Generator(device=self.device)
            if self.config.seed is None:
                self._generator.seed()
            else:
                self._generator.manual_seed(self.config.seed)
        return self._generator

    def probabilities(self, logits: torch.Tensor) -> torch.Tensor:
        """The distribution sampled from at T > 0 (temperature, then min-p, top-k and top-p: vLLM's
        order), [N, V]."""
        c = self.config
        # Shift by the maximum before dividing: every entry is <= 0, so a tiny T sends the others to
        # -inf (probability 0) instead of overflowing to inf/inf = NaN.
        logits = logits.float()
        scaled = (logits - logits.max(dim=-1, keepdim=True).values) / c.temperature
        if c.min_p > 0:  # p < min_p * p_max, as logits: the likeliest token's scaled logit is 0
            scaled = scaled.masked_fill(scaled < math.log(c.min_p), float("-inf"))
        if c.top_k and c.top_k < scaled.shape[-1]:
            kth = torch.topk(scaled, c.top_k, dim=-1).values[..., -1:]
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        probs = torch.softmax(scaled, dim=-1)
        if c.top_p < 1:
            # The nucleus almost always lies among a few hundred tokens: sort only those (a full sort
            # of a 150k vocabulary per drafted position costs more than a small model's step). Exact
            # whenever they hold top_p of the mass (every token beyond has at least that much above it).
            top, order = probs.topk(min(TOP_P_CANDIDATES, probs.shape[-1]), dim=-1)
            if bool((top.sum(dim=-1) < c.top_p).any()):
                top, order = probs.sort(dim=-1, descending=True)
            before = top.cumsum(dim=-1) - top  # mass strictly above each token
            top = top.masked_fill(before >= c.top_p, 0.0)
            probs = torch.zeros_like(probs).scatter(-1, order, top)
            probs = probs / probs.sum(dim=-1, keepdim=True)
        return probs

    def uniforms(self, rows: int, like: torch.Tensor) -> torch.Tensor:
        """This request's next `rows` uniforms [rows, 1], from its own generator."""
        return torch.rand(rows, 1, generator=self.generator, device=like.device, dtype=like.dtype)

    def sample(self, logits: torch.Tensor) -> torch.Tensor:
        """One token per row of `logits` [N, V] -> [N]: inverse-CDF draws, one uniform per row (several
        times faster than torch.multinomial over a large vocabulary)."""
        if self.config.greedy:
            return greedy_tokens(logits)
        probs = self.probabilities(logits)
        return _inverse_cdf(probs, self.uniforms(probs.shape[0], probs))


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """The argmax over the last dimension, the first maximum on ties (as `argmax`): torch's CPU
    argmax over bfloat16 logits takes ~5x as long as `max` (2.6 against 0.55 ms for 16 rows of
    49,152), a tenth of a small model's decode step."""
    return logits.max(dim=-1).indices


def _groups(samplers: list[Sampler]) -> list[list[int]]:
    """Requests whose distributions are configured alike: processed in one computation (the per-row
    work of a small model's batch is mostly launch and dispatch cost)."""
    groups: dict[tuple, list[int]] = {}
    for index, sampler in enumerate(samplers):
        groups.setdefault(sampler.config.distribution, []).append(index)
    return list(groups.values())


# A sampled request's drafts are drawn at this fraction of its temperature by default (EngineConfig's
# proposal_temperature; 0: the drafter's argmax). A block drafter gives each position's marginal, drawn
# independently of the draws before it, so a draw off the mode leaves the next positions' drafts less
# likely to fit: a sharper q trades a little first-position acceptance for coherence. Measured
# (HumanEval, T = 1, B = 4, the default pair; docs/benchmarks.md): tau 1.44 with greedy drafts, 1.49 at
# 1.0, 1.56-1.57 at 0.6-0.8, 1.50 at 0.4. Any q is lossless.
DEFAULT_PROPOSAL_TEMPERATURE = 0.7


def draw_proposals(samplers: list[Sampler], logits: torch.Tensor, ids: torch.Tensor | None,
                   temperature: float = DEFAULT_PROPOSAL_TEMPERATURE) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sampled request's proposals drawn from the drafter's own distribution: its proposal
    logits [R, n, K] (over `ids`, the draft vocabulary; None: the whole one) under the request's
    sampling settings at `temperature` x its temperature (> 0) -> (proposals [R, n] as
    full-vocabulary ids, their distributions q [R, n, K]).

    At T > 0 the target's token at a position is often not its likeliest, so a greedy proposal is
    accepted with probability p(argmax q) at best, however good the drafter: a proposal drawn from
    q and verified by speculative sampling (sample_requests' `proposals`) is accepted with
    probability sum min(p, q), which tends to 1 as the drafter approaches the target."""
    tokens = torch.empty(logits.shape[:2], dtype=torch.long, device=logits.device)
    q = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    rows, width = logits.shape[1], logits.shape[2]
    like = torch.empty(0, device=logits.device)
    for members in _groups(samplers):
        chosen = logits[members] if len(members) < len(samplers) else logits
        flat = chosen.reshape(-1, width).float()
        # shifted first, as the sampler does: a tiny fraction sends the rest to -inf, never inf - inf
        probs = samplers[members[0]].probabilities((flat - flat.max(dim=-1, keepdim=True).values) / temperature)
        uniform = torch.cat([samplers[i].uniforms(rows, like) for i in members])
        tokens[members] = _inverse_cdf(probs, uniform).view(len(members), rows)
        q[members] = probs.view(len(members), rows, width)
    return (tokens if ids is None else ids[tokens]), q


def point_masses(q: torch.Tensor, columns: list[int]) -> None:
    """Make q's leading rows [len(columns), K] point masses at `columns`, in place: drafts that were
    copied, not drawn (prompt lookup), are verified as the certainties they were proposed with."""
    q[:len(columns)] = 0.0
    q[torch.arange(len(columns)), torch.tensor(columns, dtype=torch.long)] = 1.0


def sample_requests(samplers: list[Sampler], logits: torch.Tensor, drafts: torch.Tensor | None = None,
                    proposals: tuple[torch.Tensor, torch.Tensor | None] | None = None) -> torch.Tensor:
    """Each request's rows of `logits` [R, N, V] sampled by its sampler (none greedy) -> [R, N].

    Requests whose distributions are configured alike are processed in one computation; each
    request still draws its uniforms from its own generator, in the same order, so a seeded request
    draws the same tokens as it would alone.

    With `drafts` [R, N-1] (the proposals the rows verify), column c is drawn only for the requests
    whose columns before it matched their drafts: the controller accepts up to the first mismatch and
    never reads a later token, which is left -1. Without `proposals` the drafts are greedy (a point
    mass): column c is the target's own draw, which accepts the draft when it equals it. With
    `proposals` (q [R, N-1, K] over ids [K] or the whole vocabulary, what draw_proposals drew the
    drafts from) it is speculative sampling: the draft is kept with probability min(1, p/q), else
    the token is drawn from the residual max(0, p - q), normalised; either way distributed as p.
    The uniforms are drawn as without drafts, so every token that is read is the same (at T > 0
    most blocks part at the first column or two, and each row's distribution costs as much as a
    small model's whole sampling step)."""
    tokens = torch.empty(logits.shape[:2], dtype=torch.long, device=logits.device)
    rows, vocab = logits.shape[1], logits.shape[2]
    like = torch.empty(0, device=logits.device)  # float32, as the probabilities
    draws = 2 if proposals is not None else 1  # speculative sampling: a uniform to accept, one to resample
    for members in _groups(samplers):
        chosen = logits[members] if len(members) < len(samplers) else logits
        sampler = samplers[members[0]]
        uniform = torch.cat([samplers[i].uniforms(rows * draws, like) for i in members])
        if drafts is None or rows == 1:
            probs = sampler.probabilities(chosen.reshape(-1, vocab))
            tokens[members] = _inverse_cdf(probs, uniform[::draws]).view(len(members), rows)
            continue
        tokens[members] = -1
        uniform = uniform.view(len(members), rows, draws)
        live = list(range(len(members)))  # positions in `members` still matching their drafts
        for column in range(rows):
            at = [members[i] for i in live]
            probs = sampler.probabilities(chosen[live, column])
            if proposals is None or column == rows - 1:
                drawn = _inverse_cdf(probs, uniform[live, column, :1])
            else:
                q, ids = proposals
                drawn = _speculative_draw(probs, drafts[at, column], q[at, column], ids, uniform[live, column])
            tokens[at, column] = drawn
            if column == rows - 1:
                break
            matched = (drawn == drafts[at, column]).tolist()
            live = [i for i, same in zip(live, matched) if same]
            if not live:
                break
    return tokens


def _speculative_draw(probs: torch.Tensor, drafts: torch.Tensor, q: torch.Tensor, ids: torch.Tensor | None,
                      uniform: torch.Tensor) -> torch.Tensor:
    """Speculative sampling of one column: target probabilities [L, V], drafts [L] drawn from q
    [L, K] (over ids), uniforms [L, 2] -> tokens [L] distributed as `probs`."""
    q_full = q if ids is None else probs.new_zeros(probs.shape).index_copy_(1, ids, q)
    rows = torch.arange(len(drafts), device=probs.device)
    kept = uniform[:, 0] * q_full[rows, drafts] < probs[rows, drafts]  # with probability min(1, p/q)
    if bool(kept.all()):
        return drafts
    left = _residual(probs, q_full)
    empty = left.sum(dim=-1, keepdim=True) <= 0  # p == q but for rounding: a rejection there draws from p
    resampled = _inverse_cdf(torch.where(empty, probs, left), uniform[:, 1:])
    return torch.where(kept, drafts, resampled)


def _residual(probs: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """What a rejected proposal is redrawn from: max(0, p - q) (unnormalised)."""
    return (probs - q).clamp_(min=0)


def _inverse_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """The token whose cumulative probability first exceeds each row's uniform [N, 1] -> [N]."""
    cdf = probs.cumsum(dim=-1)
    tokens = torch.searchsorted(cdf, uniform * cdf[:, -1:], right=True)[:, 0]
    return tokens.clamp_(max=probs.shape[-1] - 1)


def derive_seed(base: int | None, offset: int) -> int:
    """The seed of the `offset`-th request of a run seeded with `base` (default 0), kept in [0, 2**63-1]."""
    return ((base or 0) + offset) % (SEED_MAX + 1)
