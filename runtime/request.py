"""What one request asks for (GenerationConfig) and what it gets back (Generation), and the checks
that refuse a request an engine cannot decode. The engine (trtspec.runtime.engine) decodes it."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from trtspec.errors import TrtspecError
from trtspec.limits import LOGPROBS, MAX_NEW_TOKENS, check_block_size
from trtspec.runtime.processing import Processing
from trtspec.runtime.sampling import SamplingConfig
from trtspec.runtime.schedule import BlockChoice
from trtspec.runtime.stats import DecodeStats


@dataclass(frozen=True)
class GenerationConfig:
    """One request's ask: its block schedule (`block`: B, B:G, AR or auto, see
    trtspec.runtime.schedule), token limit, stop ids and sampling. `ignore_eos`: the engine's own
    stop ids (the tokenizer's EOS) do not end it, so it runs to its limit unless its own stop ids
    or stop strings end it (vLLM's field, which load tools send to fix output lengths); except
    with a grammar, whose end is the output's end (trtspec.runtime.processing)."""

    block: BlockChoice = BlockChoice(16)
    max_new_tokens: int = 256
    stop_ids: tuple[int, ...] = ()
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    ignore_eos: bool = False
    min_tokens: int = 0
    processing: Processing = Processing()
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.block, BlockChoice):
            raise TrtspecError(f"GenerationConfig.block must be a BlockChoice, got {self.block!r}")
        for size in self.block.sizes:
            if size > 1:  # ranges: trtspec.limits
                check_block_size(size)
        MAX_NEW_TOKENS.check(self.max_new_tokens)
        if not 0 <= self.min_tokens <= self.max_new_tokens:
            raise TrtspecError(f"min_tokens must be in [0, max_new_tokens ({self.max_new_tokens})], "
                               f"got {self.min_tokens}")
        for count in (self.logprobs, self.prompt_logprobs):
            if count is not None:
                LOGPROBS.check(count)

    def with_stop_ids(self, extra: tuple[int, ...]) -> "GenerationConfig":
        """This config with the tokenizer's EOS ids `extra` added (none with `ignore_eos`, unless a
        grammar ends the output: it allows EOS once it is complete)."""
        merged = tuple(dict.fromkeys(self.stop_ids + tuple(extra)))
        ignored = self.ignore_eos and self.processing.grammar is None
        if ignored or merged == self.stop_ids:  # unchanged: no copy (and no second validation)
            return self
        return replace(self, stop_ids=merged)


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability under the target, and the likeliest tokens there with theirs."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class Generation:
    tokens: list[int]
    stats: DecodeStats
    logprobs: list[TokenLogprob] | None = None         # one per token, when asked for
    prompt_logprobs: list[TokenLogprob | None] | None = None  # one per prompt token (the first: None)


def check_request(runner, prompt: list[int], config: GenerationConfig, policy) -> int:
    """Refuse a request this runner cannot decode (one line saying why); else its token limit."""
    if not prompt:
        raise TrtspecError("the prompt is empty")
    if len(prompt) >= runner.max_context:
        raise TrtspecError(f"the prompt is {len(prompt)} tokens; the context holds {runner.max_context}")
    if not config.block.ar and runner.mask_token_id is None:
        raise TrtspecError("speculative decoding needs a drafter (or use block size 1 / --ar)")
    if config.block.auto and policy is None:
        raise TrtspecError("block size auto needs a BlockPilot policy (trtspec train-policy; then --policy DIR "
                           "or trtspec build --policy DIR)")
    check_built_sizes(runner, config.block)
    limit = min(config.max_new_tokens, runner.max_context - len(prompt))
    grammar = config.processing.grammar
    if grammar is not None and grammar.forced > limit:  # its output could never be complete
        raise TrtspecError(f"response_format: every output of the schema is at least {grammar.forced} tokens long; "
                           f"this request has room for {limit}")
    return limit


def check_room(prompt_tokens: int, max_new_tokens: int, max_context: int, field: str) -> None:
    """vLLM's rule, in every front end: a request that asks for more new tokens than its prompt
    leaves room for in the context is refused (one that does not ask is capped at the context). A
    prompt the context cannot hold at all is check_request's to refuse."""
    if prompt_tokens < max_context < prompt_tokens + max_new_tokens:
        raise TrtspecError(f"this model's maximum context length is {max_context} tokens; this request asks for "
                           f"{prompt_tokens + max_new_tokens} ({prompt_tokens} in the prompt, {max_new_tokens} new): "
                           f"lower {field} or shorten the prompt")


def check_built_sizes(runner, block: BlockChoice) -> None:
    """Refuse a schedule whose block sizes the runner's engine was not built for."""
    for size in block.sizes:
        if size > 1 and runner.block_sizes is not None and size not in runner.block_sizes:
            raise TrtspecError(f"the engine was built for block sizes {', '.join(map(str, runner.block_sizes))}; "
                               f"block size {size} is not among them (rebuild with --block-sizes)")
