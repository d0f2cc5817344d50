"""What one request asks for (GenerationConfig) and what it gets back (Generation), and the checks
that refuse a request an engine cannot decode. The engine (trtspec.runtime.engine) decodes it.

`REQUEST_FIELDS` declares the fields every front end takes (`trtspec serve`'s JSON, the Triton
model's inputs) once: name, kind, default, range; `request_config` turns their values into a
GenerationConfig, whose types check the ranges."""

from __future__ import annotations

import reprlib
from dataclasses import dataclass, field, replace

from trtspec.errors import FieldError, TrtspecError, field_error
from trtspec.limits import (LOGPROBS, MAX_NEW_TOKENS, MIN_P, MIN_TOKENS, PENALTY, REPETITION_PENALTY, SEED,
                            TEMPERATURE, TOP_K, TOP_P, Limit, check_block_size)
from trtspec.runtime.grammar import Grammar
from trtspec.runtime.processing import Processing
from trtspec.runtime.sampling import SamplingConfig
from trtspec.runtime.schedule import BlockChoice
from trtspec.runtime.stats import DecodeStats
from trtspec.tokenizer import check_stop_strings

DEFAULT_MAX_TOKENS = 256  # a request that sets no limit: this many new tokens, fewer when the context is shorter


@dataclass(frozen=True)
class GenerationConfig:
    """One request's ask: its block schedule (`block`: B, B:G, AR or auto, see
    trtspec.runtime.schedule), token limit, stop ids, stop strings and sampling. `ignore_eos`: the engine's own
    stop ids (the tokenizer's EOS) do not end it, so it runs to its limit unless its own stop ids
    or stop strings end it (vLLM's field, which load tools send to fix output lengths); except
    with a grammar, whose end is the output's end (trtspec.runtime.processing)."""

    block: BlockChoice = BlockChoice(16)
    max_new_tokens: int = DEFAULT_MAX_TOKENS
    stop_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # stop strings: the output ends before the first (trtspec.runtime.output)
    keep_stop: bool = False     # the text ends with the stop string instead (vLLM's include_stop_str_in_output)
    skip_special: bool = True   # special tokens (EOS, ...) decode to nothing, else to their text
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    ignore_eos: bool = False
    min_tokens: int = 0
    processing: Processing = Processing()
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.block, BlockChoice):
            raise TrtspecError(f"GenerationConfig.block must be a BlockChoice, got {self.block!r}")
        object.__setattr__(self, "stop", tuple(check_stop_strings(self.stop, "stop")))
        for size in self.block.sizes:
            if size > 1:  # ranges: trtspec.limits
                check_block_size(size)
        MAX_NEW_TOKENS.check_field(self.max_new_tokens, "max_tokens")
        if MIN_TOKENS.check_field(self.min_tokens, "min_tokens") > self.max_new_tokens:
            raise FieldError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_new_tokens})",
                             "min_tokens")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                LOGPROBS.check_field(getattr(self, name), name)

    def with_stop_ids(self, extra: tuple[int, ...]) -> "GenerationConfig":
        """This config with the tokenizer's EOS ids `extra` added (none with `ignore_eos`, unless a
        grammar ends the output: it allows EOS once it is complete)."""
        merged = tuple(dict.fromkeys(self.stop_ids + tuple(extra)))
        ignored = self.ignore_eos and self.processing.grammar is None
        if ignored or merged == self.stop_ids:  # unchanged: no copy (and no second validation)
            return self
        return replace(self, stop_ids=merged)


@dataclass(frozen=True)
class RequestField:
    """One request field as every front end takes it: its name on the wire, its kind (int, float
    or bool), its default and its range. `part` is the config that holds it ("generation",
    "sampling" or "processing") under `attribute` (default: the same name); that config checks the
    range, once."""

    name: str
    kind: type
    default: object = None
    limit: Limit | None = None
    part: str = "generation"
    attribute: str = ""

    def read(self, value):
        """A decoded value for its config (None: the default). Only the kind is checked here: an
        integer too long to show, or a non-boolean for a flag; an int for a float field is a float."""
        if value is None:
            return self.default
        if self.kind is bool:
            if not isinstance(value, bool) and type(value).__name__ != "bool_":  # numpy's, from Triton
                raise FieldError(f"{self.name} must be true or false, got {reprlib.repr(value)}", self.name)
            return bool(value)
        if isinstance(value, int) and not isinstance(value, bool):
            if abs(value) > 2**64:
                raise FieldError(f"{self.name} must be {self.limit.describe()}, got a number of "
                                 f"{len(str(abs(value)))} digits", self.name)
            return float(value) if self.kind is float else value
        return value


REQUEST_FIELDS = (
    RequestField("max_tokens", int, DEFAULT_MAX_TOKENS, MAX_NEW_TOKENS, attribute="max_new_tokens"),
    RequestField("min_tokens", int, 0, MIN_TOKENS),
    RequestField("ignore_eos", bool, False),
    RequestField("logprobs", int, None, LOGPROBS),  # alternatives listed per output token (None: no logprobs)
    RequestField("temperature", float, 0.0, TEMPERATURE, "sampling"),
    RequestField("top_p", float, 1.0, TOP_P, "sampling"),
    RequestField("top_k", int, 0, TOP_K, "sampling"),
    RequestField("min_p", float, 0.0, MIN_P, "sampling"),
    RequestField("seed", int, None, SEED, "sampling"),
    RequestField("presence_penalty", float, 0.0, PENALTY, "processing"),
    RequestField("frequency_penalty", float, 0.0, PENALTY, "processing"),
    RequestField("repetition_penalty", float, 1.0, REPETITION_PENALTY, "processing"),
    RequestField("include_stop_str_in_output", bool, False, attribute="keep_stop"),
    RequestField("skip_special_tokens", bool, True, attribute="skip_special"),
)


def read_fields(values: dict) -> dict[str, dict]:
    """The REQUEST_FIELDS values (by wire name; absent or None: the field's default), read and
    grouped by part, under their attribute names."""
    parts: dict[str, dict] = {"generation": {}, "sampling": {}, "processing": {}}
    for spec in REQUEST_FIELDS:
        parts[spec.part][spec.attribute or spec.name] = spec.read(values.get(spec.name))
    return parts


def request_config(values: dict, block: BlockChoice, stop_ids: tuple[int, ...] = (), stop: tuple[str, ...] = (), *,
                   logit_bias: tuple[tuple[int, float], ...] = (), grammar: Grammar | None = None,
                   prompt_logprobs: int | None = None) -> GenerationConfig:
    """A request's GenerationConfig from its REQUEST_FIELDS values (`read_fields`) and what each
    front end reads in its own way. A value out of range is a FieldError naming its field."""
    parts = read_fields(values)
    sampling = SamplingConfig(**parts["sampling"])
    processing = Processing(logit_bias=logit_bias, grammar=grammar, **parts["processing"])
    return GenerationConfig(block=block, stop_ids=tuple(stop_ids), stop=tuple(stop), sampling=sampling,
                            processing=processing, prompt_logprobs=prompt_logprobs, **parts["generation"])


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
    text: str | None = None  # the tokens' text, cut before the first stop string (an engine with a tokenizer)


def check_request(runner, prompt: list[int], config: GenerationConfig, policy) -> int:
    """Refuse a request this runner cannot decode (one line saying why, a FieldError naming the
    field at fault); else its token limit."""
    if not prompt:
        raise FieldError("the prompt is empty", "prompt")
    if len(prompt) >= runner.max_context:
        raise FieldError(f"the prompt is {len(prompt)} tokens; the context holds {runner.max_context}", "prompt")
    with field_error("block_size"):
        check_block(runner, config.block, policy)
    limit = min(config.max_new_tokens, runner.max_context - len(prompt))
    grammar = config.processing.grammar
    if grammar is not None and grammar.forced > limit:  # its output could never be complete
        raise FieldError(f"response_format: every output of the schema is at least {grammar.forced} tokens long; "
                         f"this request has room for {limit}", "response_format")
    return limit


def check_block(runner, block: BlockChoice, policy) -> None:
    """Refuse a block schedule this runner cannot run: any block needs a drafter, auto a policy,
    and every size an engine built for it."""
    if not block.ar and runner.mask_token_id is None:
        raise TrtspecError("speculative decoding needs a drafter (or use block size 1 / --ar)")
    if block.auto and policy is None:
        raise TrtspecError("block size auto needs a BlockPilot policy (trtspec train-policy; then --policy DIR "
                           "or trtspec build --policy DIR)")
    check_built_sizes(runner, block)


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
