"""What every front end does between a request and the engine, once: `trtspec serve`
(`trtspec.serving.app`) and the Triton model (`trtspec.serving.triton_model`) differ
only in how a request arrives and how its answer leaves.

* `Bridge`: the engine thread's callbacks (`on_commit`, `on_text`, `on_finish`) become events
  handed to the front end's own thread or event loop (`LoopBridge`), which does the work: the
  engine thread only queues, so no client's response delays the next cycle. The text is the
  engine's (`trtspec.runtime.output`: detokenized once, ended at the request's stop strings).
* `Reply`: a request on the front end's side: its engine handle, its tokens counted in the
  serving metrics (`trtspec.serving.metrics`) as they are committed, and at the end its generation,
  observed there with its latency, time to first token, inter-token latencies and queue time,
  all from the engine's clock.
* `stops`, `logit_bias`, `response_format`: the structured request fields, read the same way by
  both (the scalar ones are `trtspec.runtime.request.REQUEST_FIELDS`); `check_json_text`: JSON
  whose strings are all text.
"""

from __future__ import annotations

import asyncio
import reprlib
import time
from typing import Callable

from trtspec.errors import FieldError, field_error
from trtspec.runtime.grammar import Grammar, grammar_tokenizer, response_format_grammar
from trtspec.runtime.request import Generation
from trtspec.tokenizer import check_text

# a Bridge's events: (COMMIT, new token ids), (TEXT, their text), (FINISH, the engine's Request)
COMMIT, TEXT, FINISH = "commit", "text", "finish"
MAX_LOGIT_BIAS = 1024  # tokens one request may bias


def _short_reprs() -> reprlib.Repr:
    """A value in a one-line message: its repr, cut short (bounded work, whatever its size or depth)."""
    reprs = reprlib.Repr()
    reprs.maxstring = reprs.maxother = reprs.maxlong = 40
    reprs.maxlist = reprs.maxdict = 4
    reprs.maxlevel = 2
    return reprs


short_repr = _short_reprs().repr


def stops(texts, ids, codec) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """`stop` (strings: the text ends before the first; one that is exactly one token is also a stop
    id) and `stop_token_ids` (the output ends after the token) as a config's stop strings and stop
    ids; refused in a FieldError naming the field."""
    with field_error("stop"):
        texts, single_token_ids = codec.stop_strings(texts, "stop")
    with field_error("stop_token_ids"):
        token_ids = codec.stop_token_ids(ids, "stop_token_ids")
    return texts, tuple(dict.fromkeys(single_token_ids + token_ids))


def logit_bias(value, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """`logit_bias`: {"token id": bias} as (token, bias) pairs; the biases' range is Processing's
    to check."""
    bias = value or {}
    if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS:
        raise FieldError(f"logit_bias must be an object of at most {MAX_LOGIT_BIAS} \"token id\": bias pairs",
                         "logit_bias")
    pairs = []
    for key, bias_value in bias.items():
        token = int(key) if key.isascii() and key.isdigit() and len(key) < 12 else -1
        if not 0 <= token < vocab_size:
            raise FieldError(f"logit_bias: {short_repr(key)} is not a token id in 0..{vocab_size - 1}", "logit_bias")
        if isinstance(bias_value, bool) or not isinstance(bias_value, (int, float)):
            raise FieldError(f"logit_bias[{short_repr(key)}] must be a number, got {short_repr(bias_value)}",
                             "logit_bias")
        pairs.append((token, float(bias_value)))
    return tuple(pairs)


def check_json_text(value, field: str | None = None) -> None:
    """Every string of a decoded JSON value, keys included, must be text: a "\\ud800" escape is
    not. Refused in a FieldError naming the top-level key it is under (or `field`)."""
    pending = [(value, field)]
    while pending:
        item, under = pending.pop()
        if isinstance(item, dict):
            for key, inner in item.items():
                pending.append((key, under or key))
                pending.append((inner, under or key))
        elif isinstance(item, list):
            pending.extend((inner, under) for inner in item)
        elif isinstance(item, str) and not item.isascii():
            named = under if isinstance(under, str) and under.isascii() else None
            with field_error(named):
                check_text(item, named or "a string")


def response_format(value, codec, vocab_size: int) -> Grammar | None:
    """`response_format` (OpenAI's: json_object, json_schema; vLLM's structured outputs) as the
    grammar the output follows (None: free text)."""
    if value is None:
        return None
    with field_error("response_format"):
        return response_format_grammar(value, grammar_tokenizer(codec, vocab_size))


class Bridge:
    """One request's engine callbacks, carried to the thread or event loop that answers it: on the
    engine thread, `on_commit`, `on_text` and `on_finish` only hand `(COMMIT, tokens)`,
    `(TEXT, piece)` and `(FINISH, request)` to `deliver`, which must only queue them. A cycle's
    COMMIT comes before its TEXT, and the text the engine held back to the end before FINISH."""

    def __init__(self, deliver: Callable[[str, object], None]):
        self.deliver = deliver

    def on_commit(self, tokens: list[int]) -> None:
        self.deliver(COMMIT, list(tokens))

    def on_text(self, piece: str) -> None:
        self.deliver(TEXT, piece)

    def on_finish(self, request) -> None:
        self.deliver(FINISH, request)


class LoopBridge(Bridge):
    """A Bridge into an asyncio event loop: the events arrive in `queue`."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        super().__init__(self._put)
        self.loop, self.queue = loop, asyncio.Queue()

    def _put(self, kind: str, payload) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (kind, payload))
        except RuntimeError:  # the loop is closed: the server is gone
            pass


class Reply:
    """One request's answer on the front end's side of its Bridge: `request` is the engine's handle
    once submitted; its committed tokens are counted in the serving metrics (None: none kept) as
    they come (`commit`), and `end` observes the rest once the engine has finished it."""

    def __init__(self, metrics=None):
        self.request = None
        self.metrics = metrics
        self.counted = 0  # tokens already counted in the metrics

    def commit(self, tokens: list[int]) -> None:
        """Committed tokens, counted in the metrics (the generation counter) as they come."""
        if self.metrics is not None and tokens:
            self.metrics.observe_tokens(len(tokens))
            self.counted += len(tokens)

    def end(self) -> Generation:
        """Once the engine has finished the request: its generation (its text ended at a stop string,
        its finish reason, its statistics), observed in the metrics. Otherwise raises the request's
        error (`Cancelled`, a TrtspecError, ...)."""
        generation = self.request.result(timeout=0)
        if self.metrics is not None:
            stats, request = generation.stats, self.request
            if stats.new_tokens > self.counted:  # tokens it was not told as they were committed
                self.metrics.observe_tokens(stats.new_tokens - self.counted)
            self.metrics.observe_finished(stats, latency_s=time.perf_counter() - request.submitted,
                                          ttft_s=stats.ttft_s, queue_s=stats.queue_s,
                                          intervals=request.token_intervals())
        return generation
