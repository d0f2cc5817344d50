"""What every front end does between a request and the engine, once: `trtspec serve`
(`trtspec.serving.app`) and the Triton model (`trtspec.serving.triton_model`) differ
only in how a request arrives and how its answer leaves.

* `generation_config`: a request's fields as a `GenerationConfig`, the one place a front end
  builds one (each front end reads its own wire format and applies its own defaults first).
* `Bridge`: the engine thread's callbacks (`on_commit`, `on_finish`) become events handed to the
  front end's own thread or event loop (`LoopBridge`), which does the work: the engine thread
  only queues, so no client's text or response delays the next cycle.
* `Reply`: a request's committed tokens as text pieces (`trtspec.tokenizer.TextStream`), cut
  before the first stop string, which withdraws the request; at the end, its generation as the
  client sees it (finish reason "stop" when a stop string ended it).
* `observe_finished`: a finished request in the serving metrics (`trtspec.serving.metrics`),
  with its latency, time to first token and queue time from the engine's handle.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from typing import Callable

from trtspec.runtime.processing import Processing
from trtspec.runtime.request import Generation, GenerationConfig
from trtspec.runtime.sampling import SamplingConfig
from trtspec.runtime.schedule import BlockChoice
from trtspec.runtime.stats import DecodeStats
from trtspec.tokenizer import TextStream

COMMIT, FINISH = "commit", "finish"  # a Bridge's events: (COMMIT, new token ids), (FINISH, the engine's Request)


def generation_config(block: BlockChoice, max_new_tokens: int, stop_ids: tuple[int, ...], *,
                      temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                      seed: int | None = None, ignore_eos: bool = False, min_tokens: int = 0, min_p: float = 0.0,
                      processing: Processing = Processing(), logprobs: int | None = None,
                      prompt_logprobs: int | None = None) -> GenerationConfig:
    """A request's fields as a GenerationConfig, whose checks (trtspec.limits, shared with the CLI)
    refuse out-of-range values in a TrtspecError naming the field: temperature >= 0 and finite,
    top_p in (0, 1], top_k >= 0, seed in [0, 2**63-1], max_new_tokens in [1, 2**31-1] (the block
    schedule was checked when its BlockChoice was made)."""
    sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, min_p=min_p)
    return GenerationConfig(block=block, max_new_tokens=max_new_tokens, stop_ids=stop_ids, sampling=sampling,
                            ignore_eos=ignore_eos, min_tokens=min_tokens, processing=processing, logprobs=logprobs,
                            prompt_logprobs=prompt_logprobs)


class Bridge:
    """One request's engine callbacks, carried to the thread or event loop that answers it: on the
    engine thread, `on_commit` and `on_finish` only hand `(COMMIT, tokens)` and `(FINISH, request)`
    to `deliver`, which must only queue them."""

    def __init__(self, deliver: Callable[[str, object], None]):
        self.deliver = deliver

    def on_commit(self, tokens: list[int]) -> None:
        self.deliver(COMMIT, list(tokens))

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
    """One request's answer as it forms, on the front end's side of the Bridge: committed tokens in,
    text pieces out (which join to exactly the decoded text), cut before the first stop string;
    reaching one withdraws the request (`request`, the engine's handle once submitted), which frees
    its slot before the next cycle."""

    def __init__(self, codec, stops: tuple[str, ...] = (), metrics=None, keep_stop: bool = False,
                 skip_special: bool = True):
        self.stream = TextStream(codec, stops, keep_stop, skip_special)
        self.request = None
        self.reported = True  # after `end`: whether the statistics are the engine's (see there)
        self.metrics, self._last = metrics, None  # token counts and inter-token latency, as tokens come
        self.counted = 0  # tokens already counted in the metrics

    @property
    def stopped(self) -> bool:
        """Whether the text reached a stop string (the rest of the request is not wanted)."""
        return self.stream.stopped

    @property
    def text(self) -> str:
        """The text so far (after `end`: all of it)."""
        return self.stream.text

    def push(self, tokens: list[int]) -> str:
        """The text that can be sent after these committed tokens ('' when none)."""
        if self.metrics is not None and tokens:
            now = time.perf_counter()
            self.metrics.observe_tokens(len(tokens), None if self._last is None else now - self._last)
            self._last, self.counted = now, self.counted + len(tokens)
        piece = self.stream.push(tokens)
        if self.stopped and self.request is not None:
            self.request.cancel()  # a stop string: the engine frees the slot and finishes the request
        return piece

    def end(self) -> tuple[str, Generation]:
        """Once the engine has finished the request, or a stop string has ended it: the rest of its
        text (bytes held back until the end) and its generation as the client sees it. A request
        ended by a stop string has the tokens through the one that completed it and finish reason
        "stop"; its statistics count what was decoded until it was withdrawn, or, when the engine
        has not reported yet (`reported` false), the request and no cycles. Otherwise raises the
        request's error (`Cancelled`, a TrtspecError, ...)."""
        if self.stopped:
            stats, tokens = self.request.stats, list(self.stream.tokens)
            self.reported = stats is not None
            if stats is None:
                stats = DecodeStats(block_size=1, prompt_tokens=len(self.request.prompt), new_tokens=len(tokens))
            return "", Generation(tokens, replace(stats, finish_reason="stop"))
        generation = self.request.result(timeout=0)
        rest = self.stream.finish(generation.tokens)
        if self.stopped:  # the stop string ends in the bytes the decoder held back
            generation = Generation(list(self.stream.tokens), replace(generation.stats, finish_reason="stop"))
        return rest, generation


def observe_finished(metrics, request, stats: DecodeStats, counted: int = 0) -> None:
    """A finished request (a stop or its limit) in the serving metrics (None: none kept): its
    statistics and its times since submission: to the end, to its first token (TTFT) and to
    its admission into a slot; its generated tokens beyond the `counted` ones (`Reply.counted`:
    those already counted as they were committed)."""
    if metrics is None:
        return
    first = request.first_token_at
    if stats.new_tokens > counted:
        metrics.observe_tokens(stats.new_tokens - counted, None)
    metrics.observe_finished(stats, latency_s=time.perf_counter() - request.submitted,
                             ttft_s=None if first is None else first - request.submitted, queue_s=stats.queue_s)
