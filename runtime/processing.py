"""What a request asks for beyond sampling that reshapes the target's distribution position by
position, applied so that speculation stays lossless.

vLLM's request fields `min_tokens`, `logit_bias`, `repetition_penalty`, `frequency_penalty`,
`presence_penalty` and a grammar (`response_format`) change each position's distribution by what
came before it. A verify call returns B rows of logits per request, and row j predicts output token
`committed + j` as if the block's first j drafts were committed. So each row is processed as AR
decoding would process that position had those drafts been committed: the acceptance rule (draft
== the posterior token drawn from the processed row) then commits exactly what AR decoding with
the same processing commits: token for token when greedy, in distribution when sampled. The rows
are processed in place, before the controller's step (greedy: its argmax) or the sampler
(temperature, min_p, top-k, top-p: trtspec.runtime.sampling).

The order is vLLM's: logit_bias, then the repetition penalty (tokens of the prompt or the output
so far: positive logits divided by it, negative ones multiplied), the frequency penalty (times each
token's count in the output) and the presence penalty (tokens in the output), then the grammar's
mask and min_tokens (the stop ids held back until the output has min_tokens tokens).

A grammar decides where its output ends, as in vLLM: min_tokens holds the stop ids back only where
the grammar allows another token, so a complete grammar ends the request (finish reason "stop")
however few tokens it has; with ignore_eos, EOS still ends a request with a grammar
(`GenerationConfig.with_stop_ids`). A grammar that allows no token at all, or that fails, ends the
request with its error in one line.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from trtspec.errors import TrtspecError, field_error
from trtspec.limits import LOGIT_BIAS, PENALTY, REPETITION_PENALTY
from trtspec.runtime.grammar import Grammar, first_line


@dataclass(frozen=True)
class Processing:
    """A request's processing (all off by default; ranges: trtspec.limits, OpenAI's and vLLM's)."""

    logit_bias: tuple[tuple[int, float], ...] = ()
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    grammar: Grammar | None = None

    def __post_init__(self) -> None:
        for name in ("frequency_penalty", "presence_penalty"):
            PENALTY.check_field(getattr(self, name), name)
        REPETITION_PENALTY.check_field(self.repetition_penalty, "repetition_penalty")
        for token, bias in self.logit_bias:
            with field_error("logit_bias"):
                LOGIT_BIAS.check(bias, f"logit_bias of token {token}")

    @property
    def penalised(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    @property
    def active(self) -> bool:
        return bool(self.logit_bias) or self.penalised or self.grammar is not None


class RowProcessor:
    """One request's processing over its decode, fed the committed tokens as they grow.

    `__call__(logits, committed, drafts)`: rows [R, V] of logits, in place, where row j predicts
    output token `len(committed) + j` after the drafts `drafts[:j]` (the prefill's row: no drafts).
    """

    def __init__(self, processing: Processing, prompt: list[int], min_tokens: int, stop_ids: tuple[int, ...],
                 vocab_size: int, device: torch.device):
        self.processing, self.vocab, self.device = processing, vocab_size, device
        self.min_tokens, self.stop_ids = min_tokens, list(stop_ids)
        self.seen = 0  # committed tokens already counted (and consumed by the grammar)
        self.counts = torch.zeros(vocab_size, device=device) if processing.penalised else None
        self.in_prompt = None
        if processing.repetition_penalty != 1.0:
            self.in_prompt = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            self.in_prompt[torch.tensor(sorted(set(prompt)), device=device)] = True
        self.bias = None
        if processing.logit_bias:
            ids, values = zip(*processing.logit_bias)
            self.bias = (torch.tensor(ids, device=device), torch.tensor(values, device=device))
        self.matcher = processing.grammar.matcher() if processing.grammar is not None else None

    def __call__(self, logits: torch.Tensor, committed: np.ndarray, drafts: np.ndarray | None = None) -> None:
        self._catch_up(committed)
        rows = logits.shape[0]
        work = logits if logits.dtype == torch.float32 else logits.float()
        if self.bias is not None:
            work[:, self.bias[0]] += self.bias[1]
        if self.counts is not None:
            self._penalise(work, self._row_counts(drafts, rows))
        if self.matcher is not None:
            self._mask(work, drafts, rows)
        left = self.min_tokens - len(committed)
        if left > 0 and self.stop_ids:
            self._hold_stops(work[:left])
        if work is not logits:
            logits.copy_(work)

    def _catch_up(self, committed: np.ndarray) -> None:
        fresh = committed[self.seen:]
        if not len(fresh):
            return
        self.seen = len(committed)
        if self.counts is not None:
            self.counts += torch.bincount(torch.as_tensor(fresh, device=self.device), minlength=self.vocab)[:self.vocab]
        if self.matcher is not None and not self.matcher.consume_tokens([int(t) for t in fresh]):
            raise TrtspecError(f"response_format: the grammar refused a committed token ({first_line(self.matcher)})")

    def _hold_stops(self, work: torch.Tensor) -> None:
        """min_tokens: the stop ids are held back from these rows, except where the grammar allows
        nothing else (its end wins)."""
        if self.matcher is None:
            work[:, self.stop_ids] = float("-inf")
            return
        held = work[:, self.stop_ids].clone()
        work[:, self.stop_ids] = float("-inf")
        ended = ~torch.isfinite(work).any(dim=-1, keepdim=True)
        work[:, self.stop_ids] = torch.where(ended, held, float("-inf"))

    def _row_counts(self, drafts: np.ndarray | None, rows: int) -> torch.Tensor:
        """Output token counts before each row: the committed ones, plus the drafts ahead of it."""
        if rows == 1:
            return self.counts[None]
        extra = torch.zeros(rows, self.vocab, device=self.device)
        extra[torch.arange(1, rows, device=self.device), torch.as_tensor(drafts[:rows - 1], device=self.device)] = 1.0
        return self.counts[None] + extra.cumsum(dim=0)

    def _penalise(self, work: torch.Tensor, counts: torch.Tensor) -> None:
        p = self.processing
        present = counts > 0
        if p.repetition_penalty != 1.0:
            seen = present | self.in_prompt[None]
            penalised = torch.where(work > 0, work / p.repetition_penalty, work * p.repetition_penalty)
            work.copy_(torch.where(seen, penalised, work))
        if p.frequency_penalty:
            work -= p.frequency_penalty * counts
        if p.presence_penalty:
            work -= p.presence_penalty * present.to(work.dtype)

    def _mask(self, work: torch.Tensor, drafts: np.ndarray | None, rows: int) -> None:
        """Row j: the tokens the grammar allows after the drafts ahead of it. Rows past the first draft
        the grammar refuses are left as they are: that draft is rejected there, so they are never read."""
        matcher = self.matcher
        ahead = [int(t) for t in drafts[:rows - 1]] if rows > 1 else []
        valid = matcher.validate_tokens(ahead) if ahead else 0
        bitmask = np.zeros((valid + 1, (self.vocab + 31) // 32), dtype=np.int32)
        for j in range(valid + 1):
            matcher.unsafe_compute_mask_ptr(bitmask[j].ctypes.data, bitmask[j].nbytes)
            if j < valid:
                matcher.consume_token(ahead[j])
        if valid:
            matcher.rollback(valid)
        allowed = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, :self.vocab]
        if matcher.is_error() or not allowed[0].any():  # a failed grammar lets EOS through: never a silent end
            raise TrtspecError(f"response_format: the grammar cannot go on ({first_line(matcher)})")
        work[:valid + 1].masked_fill_(torch.from_numpy(allowed == 0).to(work.device), float("-inf"))
