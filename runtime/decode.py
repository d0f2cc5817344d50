"""The decode loop: prefill, then cycles of draft -> verify -> accept -> commit.

Autoregressive decoding is the same loop with a block of one token and no drafter, so both
modes share every line of bookkeeping (stops, limits, statistics) and are compared like for like.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Callable, Protocol

import numpy as np
import torch

from trtspec.errors import TrtspecError
from trtspec.limits import MAX_NEW_TOKENS, check_block_size
from trtspec.runtime.controller import Controller, Stepper, native_controller
from trtspec.runtime.sampling import Sampler, SamplingConfig
from trtspec.runtime.schedule import AUTO, BlockChoice, BlockPolicy
from trtspec.runtime.stats import DecodeStats


@dataclass(frozen=True)
class GenerationConfig:
    """What one request asks for. block_size 1 means autoregressive (target only); AUTO (0) lets
    the BlockPilot policy choose once after prefill; grow_to G > block_size grows the block after a
    cycle that fills it (see trtspec.runtime.schedule)."""

    block_size: int = 16
    max_new_tokens: int = 256
    stop_ids: tuple[int, ...] = ()
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    grow_to: int = 0

    def __post_init__(self) -> None:
        if self.block_size not in (AUTO, 1):  # 1: autoregressive, AUTO: the policy's; ranges: trtspec.limits
            check_block_size(self.block_size)
        if self.grow_to:
            check_block_size(self.grow_to, "grow_to")
        if self.grow_to and self.block_size == AUTO:
            raise TrtspecError("with block size auto the BlockPilot policy chooses the growth too; drop grow_to")
        BlockChoice(self.block_size, self.grow_to)  # validates the growth
        MAX_NEW_TOKENS.check(self.max_new_tokens)

    def with_stop_ids(self, extra: tuple[int, ...]) -> "GenerationConfig":
        """This config with `extra` stop ids added (e.g. the tokenizer's EOS ids)."""
        return replace(self, stop_ids=tuple(dict.fromkeys(self.stop_ids + tuple(extra))))


Block = list[int] | torch.Tensor
ControllerFactory = Callable[[list[int], list[int], list[tuple[int, ...]], int, list[int]], Controller]


@dataclass
class Generation:
    tokens: list[int]
    stats: DecodeStats


class Runner(Protocol):
    """What the loop needs from a decode backend, a runner of the step functions that owns the KV
    caches: eager PyTorch modules or an engine's compiled graphs (trtspec.runtime.runners)."""

    device: torch.device
    max_context: int
    mask_token_id: int | None           # None: no drafter, autoregressive only
    block_sizes: tuple[int, ...] | None  # None: any block size

    def reset(self, positions: int) -> None: ...
    def prefill(self, prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]: ...  # tail logits, features
    # A block is a list or an int64 tensor (the controller's buffers, read in place).
    def verify(self, block: Block, start: int) -> tuple[torch.Tensor, torch.Tensor | None]: ...
    def draft(self, context_features: torch.Tensor, block: Block, start: int,
              out: torch.Tensor | None = None) -> torch.Tensor: ...  # proposals, written into `out` if given
    def rollback(self, length: int) -> None: ...


def generate(runner: Runner, prompt: list[int], config: GenerationConfig,
             on_commit: Callable[[list[int]], None] | None = None, policy: BlockPolicy | None = None,
             controller: ControllerFactory = native_controller) -> Generation:
    """Decode one request. `on_commit` receives each batch of newly committed tokens (streaming);
    `policy` chooses the block size after prefill when the config asks for AUTO; `controller`
    makes the per-cycle core (the native one; trtspec.runtime.reference is the Python one)."""
    block_size, grow_to = config.block_size, config.grow_to
    limit = check_request(runner, prompt, config, policy)
    sampler = Sampler(config.sampling, runner.device)
    runner.reset(len(prompt) + limit)

    with torch.inference_mode():
        began = time.perf_counter()
        prompt_logits, context = runner.prefill(prompt)
        bonus = int(sampler.sample(prompt_logits[-1:])[0])
        prefill_s = time.perf_counter() - began

        began = time.perf_counter()  # the policy's choice counts as decode time
        chosen = block_size == AUTO
        if chosen:
            choice = policy.choose(context, prompt_logits)
            block_size, grow_to = choice.size, choice.grow_to
            for size in choice.sizes:
                check_built_size(runner, size)
        stats = DecodeStats(block_size=block_size, grow_to=grow_to, prompt_tokens=len(prompt), prefill_s=prefill_s,
                            auto=chosen, policy_s=time.perf_counter() - began if chosen else 0.0)
        core = controller([block_size], [limit], [config.stop_ids], runner.mask_token_id or 0, [grow_to])
        core.begin(0, bonus, len(prompt))  # the bonus token sits at the first position after the prompt
        _cycles(runner, core, context, None if config.sampling.greedy else sampler.sample, on_commit)
        stats.decode_s = time.perf_counter() - began

    record_outcome(stats, core)
    return Generation(core.tokens[0, :stats.new_tokens].tolist(), stats)


def record_outcome(stats: DecodeStats, core: Controller, row: int = 0) -> None:
    """Copy what a finished request's controller counted (histogram, grown and ceiling cycles,
    tokens, finish reason) into its statistics: the single loop and the engine both end here."""
    stats.histogram = core.histograms[row, :max(stats.block_size, stats.grow_to)].tolist()
    stats.grown_cycles, stats.ceilings = core.grown_cycles(row), core.ceilings(row)
    stats.new_tokens = core.count(row)
    stats.finish_reason = core.finish_reason(row)


def check_request(runner: Runner, prompt: list[int], config: GenerationConfig, policy: BlockPolicy | None) -> int:
    """Refuse a request this runner cannot decode (one line saying why); else its token limit."""
    if not prompt:
        raise TrtspecError("the prompt is empty")
    if len(prompt) >= runner.max_context:
        raise TrtspecError(f"the prompt is {len(prompt)} tokens; the context holds {runner.max_context}")
    if config.block_size != 1 and runner.mask_token_id is None:
        raise TrtspecError("speculative decoding needs a drafter (or use block size 1 / --ar)")
    if config.block_size == AUTO and policy is None:
        raise TrtspecError("block size auto needs a BlockPilot policy (trtspec train-policy; then --policy DIR "
                           "or trtspec build --policy DIR)")
    for size in (config.block_size, config.grow_to):
        check_built_size(runner, size)
    return min(config.max_new_tokens, runner.max_context - len(prompt))


def _cycles(runner: Runner, core: Controller, context: torch.Tensor | None,
            posterior_of: Callable[[torch.Tensor], torch.Tensor] | None,
            on_commit: Callable[[list[int]], None] | None) -> None:
    """Cycles of draft(B) -> verify(B) -> one controller step until the request finishes.

    The blocks are the controller's own buffers: it writes each cycle's bonus into them and the
    drafter writes its proposals behind it, so verify reads [bonus, drafts] in place. The
    controller also says each cycle's block size (a growing block changes it); the views of the
    buffers at each size are made once.
    """
    verify_row, draft_row = torch.from_numpy(core.verify_blocks[0]), torch.from_numpy(core.draft_blocks[0])
    views: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
    step = Stepper(core, posterior_of)
    tokens = core.tokens[0]  # a view of the committed-token buffer, fixed for the request
    _emit(core, tokens, on_commit)
    start = core.start(0)
    while core.running:
        size = core.block_size(0)
        view = views.get(size)
        if view is None:
            view = views[size] = verify_row[:size], draft_row[:size], verify_row[1:size]
        block, draft_block, proposals = view
        if size > 1:
            runner.draft(context, draft_block, start, out=proposals)
        logits, features = runner.verify(block, start)
        step(logits)
        _emit(core, tokens, on_commit)
        start = core.start(0)
        runner.rollback(start)
        context = features[:core.accepted(0) + 1] if features is not None else None


def _emit(core: Controller, tokens: np.ndarray, on_commit: Callable[[list[int]], None] | None) -> None:
    if on_commit is not None:
        count = core.count(0)
        on_commit(tokens[count - core.committed(0):count].tolist())


def check_built_size(runner: Runner, block_size: int) -> None:
    if block_size > 1 and runner.block_sizes is not None and block_size not in runner.block_sizes:
        raise TrtspecError(f"the engine was built for block sizes {', '.join(map(str, runner.block_sizes))}; "
                           f"block size {block_size} is not among them (rebuild with --block-sizes)")
