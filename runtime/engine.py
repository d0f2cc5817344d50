"""The engine: every request is decoded here, alone or many together, each with its own block size.

`LocalEngine.step()` is one iteration of the loop: schedule -> run -> step -> emit. The
*scheduler* admits queued requests between cycles into free cache slots (up to `max_running`),
prefills at most one chunk of prompt tokens per iteration (so a long prompt never stalls the
others for more than one chunk; several short prompts share it), and groups the decoding requests
by their current block size. The *runner* (`trtspec.runtime.runner`) makes one batched draft call
and one batched verify call per group, of one request or many alike. Each request's own
*controller* (`trtspec.runtime.controller`) accepts and commits its tokens, and the engine *emits*
them to the request's callback. Requests leave on a stop id or their limit, or when cancelled, and
their slots are reused at once.

`LocalEngine.generate()` submits requests and steps on the caller's thread (`trtspec run`, bench,
labels, data generation, the build's self-check); `Engine` runs the same `step()` on a background
thread for servers (`trtspec serve`, the Triton model, `bench --concurrency`). Either way
`submit()` returns a `Request` handle; `on_commit` receives each cycle's newly committed token ids
on the stepping thread (the prefill's token as soon as the prefill ends), and, in an engine with a
tokenizer, `on_text` their text (`trtspec.runtime.output`: a stop string ends the request there);
`Request.result()` waits for the end.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from trtspec.errors import Cancelled, TrtspecError
from trtspec.export.bindings import PREFILL_LOGITS
from trtspec.limits import CONCURRENCY, DRAFT_WIDTH, PROMPT_LOOKUP, PROPOSAL_TEMPERATURE
from trtspec.runtime.controller import Controller, ControllerFactory, Stepper, native_controller
from trtspec.runtime.lookup import MIN_MATCH, PromptLookup
from trtspec.runtime.output import OutputProcessor
from trtspec.runtime.processing import RowProcessor
from trtspec.runtime.request import Generation, GenerationConfig, TokenLogprob, check_built_sizes, check_request
from trtspec.runtime.runner import BatchRunner
from trtspec.runtime.sampling import DEFAULT_PROPOSAL_TEMPERATURE, Sampler, draw_proposals, greedy_tokens, \
    point_masses, sample_requests
from trtspec.runtime.schedule import BlockChoice, BlockChooser, BlockPolicy, Load
from trtspec.runtime.stats import DecodeStats
from trtspec.runtime.widths import (VerifyCosts, confident_width, cycle_width, default_draft_width,
                                    top_probabilities, widening_pays)

RECENT_S = 1.0  # time constant of Load.recent, the engine's recent running count

OnCommit = Callable[[list[int]], None]
OnText = Callable[[str], None]


@contextlib.contextmanager
def _torch_threads(count: int | None):
    """torch's intra-op threads set to `count` for the block (None: as they are)."""
    before = torch.get_num_threads()
    if count is None or count == before:
        yield
        return
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class Busy(TrtspecError):
    """The engine's queue is full; the caller should retry later (HTTP 429/503)."""


@dataclass(frozen=True)
class EngineConfig:
    max_running: int = 8        # requests decoding together (cache slots)
    max_queued: int = 64        # waiting requests beyond which submit() raises Busy
    prefill_chunk: int = 256    # prompt tokens prefilled per loop iteration (over all new requests; 0: whole prompts)
    # sampled requests draw their drafts from the drafter at this fraction of their temperature; 0: they
    # propose its argmax, as greedy ones do (DFlash's rule). None: the pipeline's, by default
    # sampling.DEFAULT_PROPOSAL_TEMPERATURE.
    proposal_temperature: float | None = None
    # drafts copied from the request's own text where its last `prompt_lookup` (or more) tokens occurred
    # before, the drafter's elsewhere (runtime.lookup); 0: the drafter's only. None: the pipeline's, by
    # default lookup.MIN_MATCH.
    prompt_lookup: int | None = None
    # with prompt lookup, a cycle whose copy is shorter verifies this many positions, the drafter's
    # proposals filling them, and a longer copy widens it up to the block (runtime.widths.cycle_width);
    # 0: every cycle verifies its whole block. None: the pipeline's, by default 4 on a CPU and 0 elsewhere.
    draft_width: int | None = None
    # a greedy request decoding alone verifies, of what it drafted, the width its drafter's confidence
    # and the engine's timing say pays (runtime.widths.confident_width); False: the width above.
    # None: the pipeline's, by default on.
    confident_width: bool | None = None

    def __post_init__(self) -> None:
        CONCURRENCY.check(self.max_running, "concurrency (max-running)")  # their caches are also checked against memory (runtime.memory)
        if self.max_queued < 1:
            raise TrtspecError(f"max-queued must be >= 1, got {self.max_queued}")
        if self.prefill_chunk < 0:
            raise TrtspecError(f"prefill-chunk must be >= 0 (0: whole prompts), got {self.prefill_chunk}")
        if self.proposal_temperature is not None:
            object.__setattr__(self, "proposal_temperature", PROPOSAL_TEMPERATURE.check(self.proposal_temperature))
        if self.prompt_lookup is not None:
            object.__setattr__(self, "prompt_lookup", PROMPT_LOOKUP.check(self.prompt_lookup))
        if self.draft_width is not None:
            object.__setattr__(self, "draft_width", DRAFT_WIDTH.check(self.draft_width))


class Request:
    """A handle on one submitted request. Thread-safe."""

    def __init__(self, request_id: int, prompt: list[int], config: GenerationConfig,
                 on_commit: OnCommit | None, on_finish: Callable[["Request"], None] | None,
                 output: OutputProcessor | None = None, on_text: OnText | None = None):
        self.id, self.prompt, self.config = request_id, prompt, config
        self.on_commit, self.on_finish = on_commit, on_finish
        self.output, self.on_text = output, on_text  # its text (an engine with a tokenizer)
        # the engine's clock (time.perf_counter) at submission, and at each emission of tokens with their count
        self.submitted = time.perf_counter()
        self.emissions: list[tuple[float, int]] = []
        self.tokens: list[int] = []
        self.logprobs: list[TokenLogprob] = []  # one per token in `tokens`, when the config asks
        self.prompt_logprobs: list[TokenLogprob | None] = []
        self.stats: DecodeStats | None = None
        self.error: BaseException | None = None
        self._cancelled = False  # set by any thread, read by the stepping one (a flag: no waiting on it)
        self._done = threading.Event()

    @property
    def first_token_at(self) -> float | None:
        """When its first tokens were emitted (the engine's clock; None: none yet)."""
        return self.emissions[0][0] if self.emissions else None

    def token_intervals(self) -> list[tuple[int, float]]:
        """Each emission after the first: its token count and the seconds since the one before (the
        inter-token latency of those tokens together), from the engine's clock."""
        return [(count, at - before) for (before, _), (at, count) in zip(self.emissions, self.emissions[1:])]

    def cancel(self) -> None:
        """Withdraw the request; its slot is freed before the next cycle."""
        self._cancelled = True

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def result(self, timeout: float | None = None) -> Generation:
        """The finished generation; raises the request's error, or `Cancelled`."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.id} did not finish within {timeout} s")
        if self.error is not None:
            raise self.error
        return Generation(self.tokens, self.stats, self.logprobs if self.config.logprobs is not None else None,
                          self.prompt_logprobs if self.config.prompt_logprobs is not None else None,
                          self.output.text if self.output is not None else None)

    def _finish(self, error: BaseException | None = None) -> None:
        self.error = error
        self._done.set()
        if self.on_finish is not None:
            self.on_finish(self)


@dataclass
class _Active:
    """A request in a slot: prefilling, then decoding."""

    request: Request
    slot: int
    sampler: Sampler
    limit: int
    prefilled: int = 0
    features: list[torch.Tensor] = field(default_factory=list)  # prefill features, chunk by chunk
    tail_logits: torch.Tensor | None = None  # the prompt's last PREFILL_LOGITS logits so far
    controller: Controller | None = None  # from its first token on
    stepper: Stepper | None = None  # greedy requests' steps from verify's logits
    processor: RowProcessor | None = None  # min_tokens, penalties, biases, a grammar (None: none asked)
    context: torch.Tensor | None = None  # features the drafter cache lacks, [n, F]
    proposals: torch.Tensor | None = None  # a sampled request's: the distributions its drafts came from, [B-1, K]
    lookup: PromptLookup | None = None  # its text indexed for prompt lookup (None: off, or it does not draft)
    stats: DecodeStats | None = None
    began: float = field(default_factory=time.perf_counter)  # admission
    prefill_s: float = 0.0
    decoding_since: float = 0.0
    calls: int = 0          # verify calls this request took part in
    shared: int = 0         # requests in those calls, summed
    emitted: int = 0        # committed tokens already handed to on_commit
    failed: bool = False    # its own error ended it (`LocalEngine._alone`): the rest of the iteration skips it


# Measured on the AMD host (float32 ONNX Runtime, 300 cached positions; docs/serving.md): one padded
# call beat a call per size for every mix of B = 4 and AR rows (1+7, 2+6, 3+5: 0.78-0.88 of the two
# calls' time, held up to 2.9x the positions computed) and lost at one B = 16 beside 4 AR rows (4x).
PADDED_PER_COMPUTED = 3


def verify_calls(groups: dict[int, list["_Active"]],
                 ragged: bool = False) -> list[tuple[int, dict[int, list["_Active"]]]]:
    """An iteration's verify calls, as (width, its requests by block size), from all requests by
    block size: one call over all of them at the widest size, shorter blocks padded, so a batch of
    several sizes reads the weights once (on a CPU or a small batch the call's cost is mostly that
    read; scripts/batch_mix.py measures it, docs/serving.md has the figures). On a `ragged` target
    graph the padding costs nothing (ONNX Runtime's in-place graph attends on each row's real
    queries alone). Elsewhere it costs its attention (the stack runs on the real positions), as a
    zero query still reads every cached key: a call per size instead when the call would hold more
    than PADDED_PER_COMPUTED times the positions computed (e.g. many AR requests beside one B = 16)."""
    if len(groups) <= 1:
        return [(size, groups) for size in groups]
    if ragged:
        return [(max(groups), dict(sorted(groups.items())))]
    requests = sum(len(members) for members in groups.values())
    computed = sum(size * len(members) for size, members in groups.items())
    if max(groups) * requests > PADDED_PER_COMPUTED * computed:
        return [(size, {size: members}) for size, members in sorted(groups.items())]
    return [(max(groups), dict(sorted(groups.items())))]


class LocalEngine:
    """Continuous batching over one `BatchRunner`, stepped by its caller: submit from any thread,
    step on one. `generate()` decodes a list of requests to the end on the caller's thread. With a
    `codec` (the tokenizer) every request's text is decoded as it is committed, and its stop strings
    end it."""

    def __init__(self, runner: BatchRunner, policy: BlockPolicy | None = None, config: EngineConfig = EngineConfig(),
                 stop_ids: tuple[int, ...] = (), chooser: BlockChooser | None = None,
                 controller: ControllerFactory = native_controller, codec=None):
        if config.max_running > runner.slots:
            raise TrtspecError(f"max-running {config.max_running} exceeds the runner's {runner.slots} cache slots")
        self.runner, self.policy, self.config, self.stop_ids = runner, policy, config, tuple(stop_ids)
        self.chooser = chooser  # load-aware BlockPilot (trtspec.blockpilot.load); None: the policy's choice stands
        self.proposal_temperature = (DEFAULT_PROPOSAL_TEMPERATURE if config.proposal_temperature is None
                                     else config.proposal_temperature)
        self.prompt_lookup = MIN_MATCH if config.prompt_lookup is None else config.prompt_lookup
        self.draft_width = (default_draft_width(runner.device, runner.block_sizes) if config.draft_width is None
                            else config.draft_width)
        if self.draft_width > 1 and runner.block_sizes is not None and self.draft_width not in runner.block_sizes:
            raise TrtspecError(f"the engine was built for block sizes {', '.join(map(str, runner.block_sizes))}; "
                               f"draft width {self.draft_width} is not among them (0: whole blocks)")
        # a full-vocabulary id's column in the draft vocabulary's proposal distributions (None: the same)
        self._draft_column = None if runner.draft_ids is None else \
            {token: column for column, token in enumerate(runner.draft_ids.tolist())}
        self.new_controller = controller  # one per request (trtspec.runtime.reference has the Python one)
        self.codec = codec
        self._queue: deque[Request] = deque()
        self._active: list[_Active] = []
        self._free = list(range(config.max_running - 1, -1, -1))
        self._ids = itertools.count()
        self.lock = threading.Condition(threading.RLock())  # the stepping thread re-enters it in _retire
        self.closed = False
        self._recent, self._recent_at = 0.0, time.perf_counter()
        self._chosen: BlockChoice | None = None  # the latest `auto` admission's block, for the chooser's switches
        self.confident_width = config.confident_width is not False
        self._costs = VerifyCosts()  # one request's verify calls by width: what widening or narrowing costs

    # ---- front-end side ------------------------------------------------------------------------

    def submit(self, prompt: list[int], config: GenerationConfig, on_commit: OnCommit | None = None,
               on_finish: Callable[[Request], None] | None = None, queue_limit: bool = True,
               on_text: OnText | None = None) -> Request:
        """Queue a request; a bad one is refused here (TrtspecError), a full queue raises Busy
        (unless `queue_limit` is off: a caller that steps itself queues what it will decode)."""
        config = config.with_stop_ids(self.stop_ids)
        check_request(self.runner, list(prompt), config, self.policy)
        if config.stop and self.codec is None:
            raise TrtspecError("stop strings are matched in the text: this engine has no tokenizer")
        output = None if self.codec is None else OutputProcessor(self.codec, config.stop, config.keep_stop,
                                                                 config.skip_special, streamed=on_text is not None)
        request = Request(next(self._ids), list(prompt), config, on_commit, on_finish, output, on_text)
        with self.lock:
            if self.closed:
                raise TrtspecError("the engine is shut down")
            # free slots take their requests at the next cycle boundary, so they count as room too:
            # the engine holds max_running + max_queued however fast requests arrive
            if queue_limit and len(self._queue) >= self.config.max_queued + len(self._free):
                raise Busy(f"the engine is busy: {len(self._active)} requests are running and "
                           f"{len(self._queue)} waiting (max-queued {self.config.max_queued}); retry later")
            self._queue.append(request)
            self.lock.notify()
        return request

    def generate(self, prompts: list[list[int]], configs: list[GenerationConfig],
                 on_commit: Callable[[int, list[int]], None] | None = None,
                 on_finish: Callable[[Request], None] | None = None,
                 on_text: Callable[[int, str], None] | None = None) -> list[Generation]:
        """Decode every prompt on this thread (continuous batching over the engine's slots); results
        in the prompts' order. `on_commit(i, tokens)` streams request i's committed tokens and
        `on_text(i, piece)` their text; `on_finish` sees each request end (a progress bar)."""
        if len(prompts) != len(configs):
            raise TrtspecError(f"{len(prompts)} prompts but {len(configs)} configs")
        for prompt, config in zip(prompts, configs):  # a bad request is refused before any work
            check_request(self.runner, prompt, config, self.policy)
        requests: list[Request] = []
        left = [len(prompts)]

        def finished(request: Request) -> None:
            left[0] -= 1
            if on_finish is not None:
                on_finish(request)
        try:
            with torch.inference_mode():
                while left[0]:
                    # keep the queue just full enough for the free slots: the scheduler scans it every step
                    while len(requests) < len(prompts) and len(self._queue) < self.config.max_running:
                        index = len(requests)
                        stream = None if on_commit is None else functools.partial(on_commit, index)
                        text = None if on_text is None else functools.partial(on_text, index)
                        requests.append(self.submit(prompts[index], configs[index], stream, finished, queue_limit=False,
                                                    on_text=text))
                    self.step()
        except BaseException:  # KeyboardInterrupt included: leave the engine empty for its next caller
            for request in requests:
                request.cancel()
            self.step()
            raise
        return [r.result() for r in requests]

    def load(self) -> Load:
        with self.lock:
            decoding = [a for a in self._active if a.controller is not None]
            return Load(len(self._queue), len(self._active), tuple(a.controller.block_size for a in decoding),
                        tuple(not a.request.config.sampling.greedy for a in decoding), self._recent,
                        self.config.max_running)

    @property
    def busy(self) -> bool:
        """Requests are queued or running."""
        return bool(self._queue or self._active)

    # ---- the stepping thread -------------------------------------------------------------------

    def step(self) -> bool:
        """One iteration: schedule -> run -> step -> emit; True when a request ended in it. A fault
        of the runtime (not of one request) fails the requests it touched, and the engine goes on."""
        with self.lock:
            self._schedule()
            self._average_load()
        if not self._active:
            return False
        running = len(self._active)
        try:
            with _torch_threads(self.runner.host_threads):  # the loop's torch work (sampling, processing)
                if torch.is_inference_mode_enabled():  # generate() enters it once for all its steps
                    self._iteration()
                else:
                    with torch.inference_mode():
                        self._iteration()
        except Exception as error:
            for active in list(self._active):
                self._retire(active, error)
        return len(self._active) < running

    def _schedule(self) -> None:
        """Drop cancelled requests; admit queued ones into free slots (under the lock)."""
        for active in [a for a in self._active if a.request.cancelled]:
            self._retire(active, Cancelled("the request was cancelled"))
        for request in [r for r in self._queue if r.cancelled]:
            self._queue.remove(request)
            request._finish(Cancelled("the request was cancelled"))
        while self._queue and self._free:
            request = self._queue.popleft()
            limit = min(request.config.max_new_tokens, self.runner.max_context - len(request.prompt))
            self._active.append(_Active(request, self._free.pop(), Sampler(request.config.sampling, self.runner.device),
                                        limit))

    def _average_load(self) -> None:
        """The running count, averaged with a time constant of RECENT_S: clients of a closed loop or a
        server resubmit a moment after their requests finish, so the instant count undercounts the
        batch a new request will live in."""
        now = time.perf_counter()
        keep = math.exp(-(now - self._recent_at) / RECENT_S)
        self._recent = keep * self._recent + (1.0 - keep) * len(self._active)
        self._recent_at = now

    def _iteration(self) -> None:
        if any(a.controller is None for a in self._active):
            self._prefill()
        if self._chosen is not None:
            self._switch_to_ar(self._chosen)
        groups: dict[int, list[_Active]] = {}
        for active in self._active:
            if active.controller is not None and active.controller.running:
                groups.setdefault(active.controller.block_size, []).append(active)
        timed = self.chooser is not None
        calls = verify_calls(groups, self.runner.ragged)
        # Every call drafts before any verifies: a request's drafter context is a view of the verify
        # output it came from (no copy), which the next verify of that shape overwrites.
        drafted = []
        for _, by_size in calls:
            began = time.perf_counter()
            for size, drafting in by_size.items():  # a draft call per block size: each drafts its own block
                if size > 1:
                    self._draft(size, drafting)
            drafted.append(time.perf_counter() - began)
        for (width, by_size), draft_s in zip(calls, drafted):
            began = time.perf_counter()
            members = [active for drafting in by_size.values() for active in drafting]
            alone = members[0].controller.next_width if len(members) == 1 else 0
            self._verify(members, own_features=len(calls) > 1)
            if alone:  # one request's call: its width's cost, for widening and narrowing (runtime.widths)
                self._costs.observe(alone, (time.perf_counter() - began) * 1e3,
                                    draft_s * 1e3 if max(by_size) > 1 else None)
            for active in members:
                if not active.failed:
                    self._emit(active)
            if timed:  # what a cycle of this shape costs here, host work included: load-aware BlockPilot's costs
                self.chooser.observe_cycle(width, len(members), (time.perf_counter() - began + draft_s) * 1e3)
        for active in [a for a in self._active if a.controller is not None and not a.controller.running]:
            self._emit(active)  # any that finished without a cycle

    def _switch_to_ar(self, chosen: BlockChoice) -> None:
        """The chooser's switches after an `auto` admission got `chosen`: the requests it names turn
        AR from their next cycle (a batch of two block sizes pays the wider block for every row).
        Lossless: every token after the turn is the target's own, greedy or sampled. Their
        statistics keep the speculative cycles only."""
        self._chosen = None
        decoding = [a for a in self._active if a.controller is not None and a.controller.running]
        running = [(a.request.config.block, a.controller.block_size) for a in decoding]
        for index in self.chooser.requests_to_switch(chosen, running):
            active = decoding[index]
            self._record_cycles(active)
            active.stats.turned_ar_at = active.controller.count
            active.controller.set_block_size(1)
            active.context = None  # the drafter is not asked again

    def _prefill(self) -> None:
        """The next chunk of each new request's prompt, `prefill_chunk` tokens in all (so a long prompt
        never stalls the others for more than that; 0: whole prompts); chunks of equal length share
        one call. A request whose prompt is done gets its first token and its block size."""
        budget, chunks = self.config.prefill_chunk or self.runner.max_context, {}
        for active in [a for a in self._active if a.controller is None]:
            if budget <= 0:
                break
            # prompt logprobs: chunks whose every position's logits the prefill returns
            size = budget if active.request.config.prompt_logprobs is None else min(budget, PREFILL_LOGITS)
            chunk = active.request.prompt[active.prefilled:active.prefilled + size]
            chunks.setdefault(len(chunk), []).append((active, chunk))
            budget -= len(chunk)
        starting = []
        for rows in chunks.values():
            began = time.perf_counter()
            logits, features = self.runner.prefill([a.slot for a, _ in rows], [c for _, c in rows],
                                                   [a.prefilled for a, _ in rows],
                                                   max(self._prompt_tail(a.request.config) for a, _ in rows))
            took = (time.perf_counter() - began) / len(rows)
            for row, (active, chunk) in enumerate(rows):
                if active.request.config.prompt_logprobs is not None:
                    self._prompt_logprobs(active, logits[row])
                active.prefilled += len(chunk)
                active.prefill_s += took
                if self.runner.mask_token_id is not None and not active.request.config.block.ar:
                    active.features.append(features[row].clone())  # the drafter's context (AR drafts none)
                tail = logits[row] if active.tail_logits is None else torch.cat((active.tail_logits, logits[row]))
                active.tail_logits = tail[-PREFILL_LOGITS:].clone()
                if active.prefilled == len(active.request.prompt):
                    starting.append(active)
        for active, first in self._first_tokens(starting) if starting else ():
            self._alone(active, self._start_decoding, active, first)
            if not active.failed:
                self._emit(active)  # the first token leaves now, not after the first cycle

    def _prompt_tail(self, config: GenerationConfig) -> int:
        """How many of the prompt's last positions a request needs logits of: every one for prompt
        logprobs, PREFILL_LOGITS for a BlockPilot that reads them, else the last (its first token)."""
        if config.prompt_logprobs is not None or (config.block.auto and self.policy.reads_logits):
            return PREFILL_LOGITS
        return 1

    def _alone(self, active: _Active, work: Callable, *args):
        """`work(*args)` for one request: an error of its own (its grammar, its processing, its block
        choice) ends that request alone, with its own message, and the batch goes on (None then)."""
        try:
            return work(*args)
        except Exception as error:
            active.failed = True
            self._retire(active, error)
            return None

    def _prompt_logprobs(self, active: _Active, logits: torch.Tensor) -> None:
        """The prompt tokens this chunk's logits [T, V] predict (the first prompt token has none)."""
        request = active.request
        if not request.prompt_logprobs:
            request.prompt_logprobs.append(None)
        start = active.prefilled + 1  # row t predicts prompt token start + t
        targets = request.prompt[start:start + logits.shape[0]]
        if targets:
            request.prompt_logprobs.extend(
                token_logprobs(logits[:len(targets)], targets, request.config.prompt_logprobs))

    def _first_tokens(self, starting: list[_Active]) -> list[tuple[_Active, int]]:
        """The first token of each request whose prompt is done, from its prompt's last logits (after
        its processing; one whose processing fails ends there); the sampled ones are drawn together,
        each from its own generator, as in a verify (so a burst of sampled admissions costs one draw
        per distribution, not one per request)."""
        rows = [self._alone(active, self._first_row, active) for active in starting]
        starting = [active for active in starting if not active.failed]
        if not starting:
            return []
        rows = torch.cat([row for row in rows if row is not None])
        first = greedy_tokens(rows)
        sampled = [row for row, active in enumerate(starting) if not active.request.config.sampling.greedy]
        if sampled:
            chosen = rows if len(sampled) == len(starting) else rows[sampled]
            first[sampled] = sample_requests([starting[row].sampler for row in sampled], chosen[:, None])[:, 0]
        return list(zip(starting, first.tolist()))

    @staticmethod
    def _first_row(active: _Active) -> torch.Tensor:
        """The logits [1, V] the request's first token is drawn from: its prompt's last, processed."""
        config, last = active.request.config, active.tail_logits[-1:]
        if config.processing.active or config.min_tokens:
            active.processor = RowProcessor(config.processing, active.request.prompt, config.min_tokens,
                                            config.stop_ids, last.shape[-1], last.device)
            last = last.clone()  # a copy: BlockPilot reads the prompt's tail as the target gave it
            active.processor(last, np.empty(0, dtype=np.int64))
        return last

    def _start_decoding(self, active: _Active, bonus: int) -> None:
        request, config, began = active.request, active.request.config, time.perf_counter()
        tail = active.tail_logits
        if config.logprobs is not None:
            request.logprobs.extend(token_logprobs(tail[-1:], [bonus], config.logprobs))
        context = torch.cat(active.features) if len(active.features) > 1 else (active.features or [None])[0]
        choice = config.block
        if choice.auto:
            ask_policy = functools.partial(self.policy.choose, context, tail,  # the chooser may not need it
                                           not config.sampling.greedy)
            choice = ask_policy() if self.chooser is None else \
                self.chooser.choose(ask_policy, self.load(), not config.sampling.greedy)
            check_built_sizes(self.runner, choice)
            self._chosen = choice if self.chooser is not None else None
        active.stats = DecodeStats(block_size=choice.size, grow_to=choice.grow_to, prompt_tokens=len(request.prompt),
                                   prefill_s=active.prefill_s, auto=config.block.auto,
                                   policy_s=time.perf_counter() - began if config.block.auto else 0.0,
                                   queue_s=active.began - request.submitted)
        active.controller = self.new_controller(choice.size, active.limit, config.stop_ids,
                                                self.runner.mask_token_id or 0, choice.grow_to)
        active.controller.begin(bonus, len(request.prompt))
        active.stepper = Stepper(active.controller) if config.sampling.greedy else None
        active.context = context if choice.size > 1 else None
        if self.prompt_lookup and choice.size > 1:  # a request that drafts (none turns from AR to drafting)
            active.lookup = PromptLookup(request.prompt, self.prompt_lookup)
        active.features, active.tail_logits = [], None
        active.decoding_since = began

    def _draft(self, size: int, members: list[_Active]) -> None:
        """The group's proposals, into each controller's verify block (positions 1..W-1 of the cycle's
        width W): a greedy request's are the drafter's argmax, a sampled request's are drawn from the
        drafter's distribution under its sampling settings (kept for the verify's speculative
        sampling). Prompt lookup's copy, where it has one, replaces the leading ones and sets the
        cycle's width (`widths.cycle_width`: narrowed below the block unless the copy is long; a greedy
        request alone may verify fewer of the drafter's proposals: `widths.confident_width`). A
        request whose copy fills its width and whose drafts are point masses (greedy, or proposal
        temperature 0) skips the drafter: its context waits in `context` for the next draft."""
        drawn = self.proposal_temperature > 0
        copies = [self._copy(active, size - 1) if active.lookup is not None else [] for active in members]
        widths = [self._narrow(active, size, len(copied)) for active, copied in zip(members, copies)]
        copies = [copied[:width - 1] for copied, width in zip(copies, widths)]  # cut where widening did not pay
        drafts = [copied + [0] * (width - 1 - len(copied)) for copied, width in zip(copies, widths)]
        asking = [row for row, active in enumerate(members)
                  if len(copies[row]) < widths[row] - 1 or (drawn and active.stepper is None and widths[row] > 1)]
        skipped = set(range(len(members))).difference(asking)
        for width in sorted({widths[row] for row in asking}):  # a draft call per width: rows draft alike
            rows = [row for row in asking if widths[row] == width]
            asked = [members[row] for row in rows]
            proposed, logits = self.runner.draft([a.slot for a in asked], [a.context for a in asked],
                                                 [a.controller.draft_block[:width] for a in asked],
                                                 [a.controller.start for a in asked])
            proposed = proposed.tolist()
            sampled = [i for i, active in enumerate(asked) if active.stepper is None]
            if sampled and drawn:
                chosen = logits if len(sampled) == len(asked) else logits[sampled]
                tokens, q = draw_proposals([asked[i].sampler for i in sampled], chosen, self.runner.draft_ids,
                                           self.proposal_temperature)
                for i, proposal, distribution in zip(sampled, tokens.tolist(), q):
                    proposed[i], asked[i].proposals = proposal, distribution
            for i, row in enumerate(rows):
                copied = copies[row]
                drafts[row][len(copied):] = proposed[i][len(copied):]
                if copied and asked[i].proposals is not None and asked[i].stepper is None:
                    point_masses(asked[i].proposals, self._columns(copied))
                asked[i].context = None  # the drafter cache holds it now
                if not copied and self._narrows_by_confidence(asked[i]):
                    widths[row] = self._confident(asked[i], width, logits[i])
        for row, active in enumerate(members):
            active.controller.verify_block[1:widths[row]] = drafts[row][:widths[row] - 1]
            active.stats.copied_cycles += bool(copies[row])
            if row in skipped:  # its context may be a view of the verify output this iteration overwrites
                active.context = active.context.clone()

    def _narrow(self, active: _Active, size: int, copied: int) -> int:
        """The width of the request's next cycle after a copy of `copied` tokens, narrowed in its
        controller when below its block (only fixed blocks with prompt lookup: a growing block
        grows on acceptance, which a narrowed cycle never reaches)."""
        if active.lookup is None or active.stats.grow_to:
            return size
        width = cycle_width(size, copied, self.draft_width, self.runner.block_sizes)
        narrow = cycle_width(size, 0, self.draft_width, self.runner.block_sizes)
        if narrow < width and not self._widening_pays(active, narrow, width):
            width = narrow  # the copy is cut to it
        if width < size:
            active.controller.narrow(width)
        return width

    def _narrows_by_confidence(self, active: _Active) -> bool:
        """Whether the request's cycle may verify fewer of its drafts than it drew: a greedy request
        (whose output is the target's whatever its widths) decoding alone (a batch's call is as wide
        as its widest row), with a fixed block (a growing one grows on full acceptance)."""
        return (self.confident_width and active.stepper is not None and len(self._active) == 1
                and not active.stats.grow_to)

    def _confident(self, active: _Active, width: int, logits: torch.Tensor) -> int:
        """The width the request's cycle verifies of the `width` it drafted (runtime.widths): by the
        drafter's probabilities of its proposals (`logits` [>= width-1, K]) and this engine's timing of
        each width, once it has timed `width` and a narrower one (until then the cycle runs one of
        those, so it does). The controller verifies that many positions."""
        allowed = self.runner.verify_widths(width)
        chosen = self._costs.untimed(width, allowed)
        if chosen is None:
            chosen = confident_width(top_probabilities(logits[:width - 1]), self._costs.curve(width),
                                     self._costs.overhead_ms(), allowed)
        if chosen < width:
            active.controller.narrow(chosen)
        return chosen

    def _widening_pays(self, active: _Active, narrow: int, wide: int) -> bool:
        """Whether a greedy request decoding alone widens a cycle for its copy: by this engine's own
        verify calls of both widths (widths.widening_pays), once it has made WIDTH_SAMPLES of each
        (until then it widens, and so measures). Sampled requests and batches widen as the copy asks:
        a sampled request's cycles stay a function of its text and seed, whatever the machine's timing
        (a greedy one's output is the target's whatever its widths)."""
        if active.stepper is None or len(self._active) > 1:
            return True
        costs = [self._costs.verify_ms(width) for width in (narrow, wide)]
        return None in costs or widening_pays(narrow, wide, *costs)

    def _copy(self, active: _Active, width: int) -> list[int]:
        """Prompt lookup's proposal for the request's next `width` drafts (maybe fewer, maybe none). A
        sampled request whose drafts are drawn verifies copies as point masses in its proposal
        distributions, which hold only the draft vocabulary: its copy stops at the first token outside."""
        controller = active.controller
        active.lookup.catch_up(controller.tokens[:controller.count])
        copied = active.lookup.propose(width)
        if copied and active.stepper is None and self.proposal_temperature > 0 and self._draft_column is not None:
            columns = self._columns(copied)
            if None in columns:
                copied = copied[:columns.index(None)]
        return copied

    def _columns(self, tokens: list[int]) -> list[int | None]:
        """Full-vocabulary ids as columns of the proposal distributions (None: not in the draft vocabulary)."""
        return tokens if self._draft_column is None else [self._draft_column.get(t) for t in tokens]

    def _verify(self, members: list[_Active], own_features: bool = False) -> None:
        """The verify call of these requests, each cycle's block padded to the widest (logits of a
        row's own positions are what they would be alone), then each request's step over its own
        positions (processing, sampling, accept, commit). `own_features`: the iteration makes other
        verify calls, which may have this one's shape and so its output buffers (narrowed cycles of
        different block sizes): the drafter's next context is copied out of them."""
        sizes = [active.controller.next_width for active in members]  # the cycles' widths, before the step
        logits, features = self.runner.verify([a.slot for a in members],
                                              [a.controller.verify_block[:size] for a, size in zip(members, sizes)],
                                              [a.controller.start for a in members])
        asked = [self._alone(active, self._process, active, logits[row, :size], size)
                 for row, (active, size) in enumerate(zip(members, sizes))]
        live = [row for row, active in enumerate(members) if not active.failed]
        # the sampled rows of a block size are drawn together (per row, a small model's batch is mostly
        # dispatch cost), each over its own positions: a request draws the same uniforms in any batch
        drawn = {}
        for size in sorted(set(sizes)) if any(members[row].stepper is None for row in live) else ():
            sampled = [row for row in live if sizes[row] == size and members[row].stepper is None]
            if not sampled:
                continue
            rows = logits if len(sampled) == len(members) and size == logits.shape[1] else logits[sampled, :size]
            drafts = torch.from_numpy(np.stack([members[row].controller.verify_block[1:size] for row in sampled]))
            proposals = None
            if size > 1 and self.proposal_temperature > 0:
                proposals = torch.stack([members[row].proposals for row in sampled]), self.runner.draft_ids
            drawn.update(zip(sampled, sample_requests([members[row].sampler for row in sampled], rows,
                                                      drafts.to(rows.device), proposals).cpu()))
        for row in live:
            active = members[row]
            if row in drawn:
                active.controller.step(drawn[row])
            else:
                active.stepper(logits, row)
            if asked[row] is not None:
                self._record_logprobs(active, *asked[row])
            active.calls += 1
            active.shared += len(members)
            if active.controller.block_size > 1 and self.runner.mask_token_id is not None:  # the next drafts read it
                verified = features[row, :active.controller.accepted + 1]
                if own_features:
                    verified = verified.clone()
                # a view of the output buffer, or after a cycle that skipped the drafter, joined to what waits
                active.context = verified if active.context is None else torch.cat([active.context, verified])

    @staticmethod
    def _process(active: _Active, rows: torch.Tensor, size: int) -> tuple[torch.Tensor, int] | None:
        """Before the step: the request's processing of its verify rows [B, V] (in place), and, when it
        asks for logprobs, the rows' log-probabilities as the target gave them and the committed count
        (for _record_logprobs after the step)."""
        asked, controller = None, active.controller
        if active.request.config.logprobs is not None:
            asked = torch.log_softmax(rows.float(), dim=-1), controller.count
        if active.processor is not None:
            active.processor(rows, controller.tokens[:controller.count], controller.verify_block[1:size])
        return asked

    @staticmethod
    def _record_logprobs(active: _Active, rows: torch.Tensor, before: int) -> None:
        """The step's committed tokens with their log-probabilities: row j gave token before + j."""
        controller = active.controller
        fresh = controller.tokens[before:controller.count].tolist()
        if fresh:
            active.request.logprobs.extend(token_logprobs(rows[:len(fresh)], fresh, active.request.config.logprobs,
                                                          normalised=True))

    def _emit(self, active: _Active) -> None:
        """Hand newly committed tokens (and their text) to the request; retire it when it has
        finished, or its text reached a stop string."""
        controller, request, output = active.controller, active.request, active.request.output
        count = controller.count
        if count > active.emitted:
            fresh = controller.tokens[active.emitted:count].tolist()
            active.emitted = count
            piece = ""
            if output is not None:
                piece, fresh = output.push(fresh)
            request.tokens.extend(fresh)
            request.emissions.append((time.perf_counter(), len(fresh)))
            try:
                if request.on_commit is not None:
                    request.on_commit(fresh)
                if piece and request.on_text is not None:
                    request.on_text(piece)
            except Exception as error:  # Cancelled, or the front end's callback failed: this request ends
                self._retire(active, error)
                return
        if not controller.running or (output is not None and output.stopped):
            self._retire(active)

    @staticmethod
    def _record_cycles(active: _Active) -> None:
        """The request's cycles so far (acceptance histogram, grown cycles, ceilings) in its statistics."""
        stats, controller = active.stats, active.controller
        stats.histogram = controller.histogram[:max(stats.block_size, stats.grow_to)].tolist()
        stats.grown_cycles, stats.ceilings, stats.draft_tokens = controller.grown_cycles, controller.ceilings, \
            controller.drafts

    def _retire(self, active: _Active, error: BaseException | None = None) -> None:
        """Free the slot at once and finish the request (with its statistics, or its error)."""
        with self.lock:
            if active not in self._active:
                return
            self._active.remove(active)
            self._free.append(active.slot)
        stats, controller, request = active.stats, active.controller, active.request
        if error is None and request.output is not None and controller is not None:
            error = self._last_text(request)
        if stats is not None and controller is not None:
            if not stats.turned_ar_at:  # one that turned AR under load keeps its speculative cycles
                self._record_cycles(active)
            stopped = error is None and request.output is not None and request.output.stopped
            stats.new_tokens = len(request.tokens) if stopped else controller.count  # a stop string: what it returns
            stats.finish_reason = "cancelled" if error is not None else "stop" if stopped else controller.finish_reason
            stats.decode_s = time.perf_counter() - active.decoding_since
            stats.batch_mean = active.shared / active.calls if active.calls else 0.0
            if error is None and self.chooser is not None:  # every request's acceptance, auto or not
                self.chooser.observe_request(BlockChoice(stats.block_size, stats.grow_to), stats.histogram,
                                             not active.request.config.sampling.greedy)
            if active.request.first_token_at is not None:
                stats.ttft_s = active.request.first_token_at - active.request.submitted
        active.request.stats = stats
        active.request._finish(error)

    @staticmethod
    def _last_text(request: Request) -> BaseException | None:
        """The text the request's output held back until its end, to its `on_text` (the error that
        callback raised, if any)."""
        rest = request.output.finish(request.tokens)
        if rest and request.on_text is not None:
            try:
                request.on_text(rest)
            except Exception as error:
                return error
        return None


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: int, normalised: bool = False) -> list[TokenLogprob]:
    """Each row's token's log-probability and the row's `top` likeliest tokens (`normalised`: the
    rows are log-probabilities already)."""
    rows = logits if normalised else torch.log_softmax(logits.float(), dim=-1)
    rows = rows.cpu()
    chosen = rows.gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist()
    if not top:
        return [TokenLogprob(t, lp) for t, lp in zip(tokens, chosen)]
    values, ids = rows.topk(top, dim=-1)
    return [TokenLogprob(t, lp, tuple(zip(i, v))) for t, lp, i, v in zip(tokens, chosen, ids.tolist(), values.tolist())]


class Engine:
    """A `LocalEngine` stepped on a background thread, for servers: submit from any thread."""

    def __init__(self, local: LocalEngine):
        self.local = local
        self._thread = threading.Thread(target=self._loop, name="trtspec-engine", daemon=True)
        self._thread.start()

    def submit(self, prompt: list[int], config: GenerationConfig, on_commit: OnCommit | None = None,
               on_finish: Callable[[Request], None] | None = None, on_text: OnText | None = None) -> Request:
        """Queue a request (see LocalEngine.submit)."""
        return self.local.submit(prompt, config, on_commit, on_finish, on_text=on_text)

    def load(self) -> Load:
        return self.local.load()

    @property
    def alive(self) -> bool:
        """Whether the engine still takes and decodes requests (its thread runs and it is not closed)."""
        return self._thread.is_alive() and not self.local.closed

    @property
    def runner(self) -> BatchRunner:
        return self.local.runner

    @property
    def config(self) -> EngineConfig:
        return self.local.config

    @property
    def policy(self) -> BlockPolicy | None:
        return self.local.policy

    @property
    def chooser(self) -> BlockChooser | None:
        return self.local.chooser

    def close(self, cancel: bool = True, timeout: float | None = 60.0) -> None:
        """Stop taking requests; cancel what is queued and running (or let it finish), then stop."""
        local = self.local
        with local.lock:
            local.closed = True
            if cancel:
                for request in list(local._queue) + [a.request for a in local._active]:
                    request.cancel()
            local.lock.notify()
        self._thread.join(timeout)

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _loop(self) -> None:
        """Step until closed and drained; sleep on the lock while there is nothing to do."""
        local = self.local
        while True:
            with local.lock:
                if not local.busy:
                    if local.closed:
                        return
                    local.lock.wait(0.05)
                    continue
            if local.step():  # let the clients of finished requests resubmit before the next cycle (a
                time.sleep(0)  # closed loop's next request would otherwise leave its slot empty for one)
