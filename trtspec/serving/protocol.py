"""The OpenAI wire format, read: a completions or chat completions body checked field by field
(`parse_request`) and turned into prompt ids and a `GenerationConfig` (a `ParsedRequest`), and the
bodies of vLLM's /tokenize and /detokenize. Pure functions of a decoded body and the tokenizer: no
server, no event loop. Every refusal is an `ApiError` in OpenAI's shape that names the field.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace

from trtspec import limits
from trtspec.errors import FieldError, TrtspecError
from trtspec.runtime.request import REQUEST_FIELDS, GenerationConfig, RequestField, check_room, request_config
from trtspec.runtime.sampling import derive_seed
from trtspec.runtime.schedule import BlockChoice
from trtspec.serving.frontend import logit_bias, response_format, short_repr, stops


class ApiError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code

    def payload(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def headers(self) -> dict | None:
        """What a client should do next: retry later (429, 503) or authenticate (401)."""
        if self.status == 401:
            return {"WWW-Authenticate": "Bearer"}
        return {"Retry-After": "1"} if self.status in (429, 503) else None


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


@contextmanager
def refused_as(param: str | None, wire: Mapping[str, str] | None = None) -> Iterator[None]:
    """Inside it, a check's TrtspecError is answered 400 with its message: a FieldError names its own
    field (as `wire` spells it on this route), any other names `param`."""
    try:
        yield
    except FieldError as exc:
        raise bad_request(str(exc), (wire or {}).get(exc.field, exc.field)) from None
    except TrtspecError as exc:
        raise bad_request(str(exc), param) from None


@dataclass
class ParsedRequest:
    """A request body after the door: what to submit and how to answer."""

    prompt_ids: list[int]
    config: GenerationConfig
    stream: bool = False
    include_usage: bool = False
    chat: bool = False
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage in every chunk
    n: int = 1                      # independent choices, each its own engine request
    echo: str | None = None         # completions' echo: the prompt's text, put before the completion

    def choice_config(self, index: int) -> GenerationConfig:
        """Choice `index`'s config: with a seed, choice i samples with the seed of the run's i-th
        request (derive_seed), so every choice differs and the whole answer reproduces."""
        sampling = self.config.sampling
        if index == 0 or sampling.seed is None:
            return self.config
        return replace(self.config, sampling=replace(sampling, seed=derive_seed(sampling.seed, index)))


# The fields a request may have: every front end's (REQUEST_FIELDS), OpenAI's others that trtspec
# implements, trtspec's block_size, vLLM's stop_token_ids and those without effect on the result
# (user, metadata, ...). The rest of OpenAI's and vLLM's are refused unless given their default value
# (`_UNSUPPORTED`), and any other field is refused by name: no field is ever silently ignored.
_COMMON = {spec.name for spec in REQUEST_FIELDS} | {
    "model", "stop", "stop_token_ids", "stream", "stream_options", "n", "user", "block_size",
    "logprobs", "logit_bias", "response_format"}
_FIELDS = {False: _COMMON | {"prompt", "echo"},
           True: _COMMON | {"messages", "max_completion_tokens", "metadata", "store", "service_tier",
                            "chat_template_kwargs", "add_generation_prompt", "continue_final_message", "top_logprobs"}}
_UNSUPPORTED = {"top_logprobs": (None, 0), "echo": (None, False), "best_of": (None, 1),
                "suffix": (None, ""), "tools": (None, []), "functions": (None, []), "tool_choice": (None, "none"),
                "function_call": (None, "none"), "parallel_tool_calls": (None, True, False),
                "modalities": (None, ["text"]), "reasoning_effort": (None,), "prediction": (None,), "audio": (None,),
                # vLLM's extras (the rest are refused as unknown)
                "spaces_between_special_tokens": (None, True), "add_special_tokens": (None,), "echo_prompt": (None,)}


_CHOICES = RequestField("n", int, 1, limits.CHOICES)


def _check_fields(body: dict, chat: bool) -> None:
    route = "chat completions" if chat else "completions"
    for name, value in body.items():
        if name in _FIELDS[chat]:
            continue
        if name not in _UNSUPPORTED:
            raise bad_request(f"unknown field {short_repr(name)} (a {route} request takes "
                              f"{', '.join(sorted(_FIELDS[chat]))})", name)
        defaults = [d for d in _UNSUPPORTED[name] if d is not None]
        if value is not None and not any(value == d and isinstance(value, bool) == isinstance(d, bool)
                                         for d in defaults):
            shown = " or ".join(json.dumps(d) for d in defaults)
            raise bad_request(f"{name} is not supported by trtspec serve"
                              + (f" (only its default, {shown})" if shown else ""), name)


def _choices(body: dict) -> int:
    """`n`: how many choices, each its own engine request (OpenAI's own field: Triton has no choices)."""
    with refused_as("n"):
        return limits.CHOICES.check_field(_CHOICES.read(body.get("n")), "n")


def _check_characters(characters: int, codec, max_context: int, param: str) -> None:
    """Refuse, before tokenizing it, a text longer than the model's context could hold."""
    if characters > codec.text_bytes_cap(max_context):  # a text's characters: at most its UTF-8 bytes
        raise bad_request(f"the {param} ({characters} characters) is longer than the model's context of {max_context} "
                          "tokens can hold", param)


def _prompt_ids(body: dict, codec, max_context: int) -> list[int]:
    """`prompt`: a string, or token ids, or a list holding exactly one of them."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        _check_characters(len(prompt), codec, max_context, "prompt")
        ids = codec.encode_unlocked(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        vocab = codec.tokenizer.get_vocab_size(with_added_tokens=True)
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise bad_request(f"prompt: token id {short_repr(bad[0])} is outside the vocabulary (0..{vocab - 1})",
                              "prompt")
        ids = list(prompt)
    elif isinstance(prompt, list) and any(isinstance(t, float) for t in prompt):
        raise bad_request(f"prompt: {short_repr(next(t for t in prompt if isinstance(t, float)))} is not a token id "
                          "(floats are not token ids)", "prompt")
    elif isinstance(prompt, list) and len(prompt) > 1:
        raise bad_request("prompt: one prompt per request (a list of several prompts is not supported)", "prompt")
    else:
        raise bad_request("prompt must be a string or a list of token ids", "prompt")
    return ids


def _flag(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"{name} must be true or false, got {short_repr(value)}", name)
    return value


def _template_options(body: dict) -> dict:
    """vLLM's chat template fields: `chat_template_kwargs` (an object passed to the template, such as
    Qwen3's {"enable_thinking": false}), `add_generation_prompt`, `continue_final_message`."""
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and (not isinstance(kwargs, dict) or len(kwargs) > 64):
        raise bad_request("chat_template_kwargs must be an object of at most 64 template variables, "
                          f"got {short_repr(kwargs)}", "chat_template_kwargs")
    add, extend = _flag(body, "add_generation_prompt", True), _flag(body, "continue_final_message", False)
    if add and extend:  # as vLLM: add_generation_prompt is true unless it is set to false
        raise bad_request("continue_final_message needs add_generation_prompt: false (both cannot be true)",
                          "continue_final_message")
    if extend and body["messages"][-1].get("role") != "assistant":
        raise bad_request("continue_final_message continues the last message, which must be the assistant's",
                          "continue_final_message")
    return {"template_kwargs": kwargs, "add_generation_prompt": add, "continue_final_message": extend}


def _chat_ids(body: dict, codec, max_context: int) -> list[int]:
    """`messages`: [{role, content}], content a string or a list of {"type": "text", "text"} parts."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list of {role, content} objects", "messages")
    plain, size = [], 0
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise bad_request(f"messages[{i}] must be an object with a string role", "messages")
        content = message.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise bad_request(f"messages[{i}].content: only text parts are supported", "messages")
            content = "".join(p["text"] for p in content)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise bad_request(f"messages[{i}].content must be a string or a list of text parts", "messages")
        plain.append({"role": message["role"], "content": content})
        size += len(content) + len(message["role"])
    _check_characters(size, codec, max_context, "messages")
    options = _template_options(body)
    with refused_as("messages"):
        text = codec.apply_chat_template(plain, label="chat", **options)
    _check_characters(len(text), codec, max_context, "messages")
    with refused_as("messages"):
        return codec.encode_unlocked(text, add_special_tokens=False)  # encode_chat's ids, the GIL released


def _stops(body: dict, codec) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """`stop`: a string or a list of strings, which end the text (one that is exactly one token is
    also a stop id); `stop_token_ids`: token ids (vLLM's field). Counted and measured before any
    of them is tokenized."""
    stop, ids = body.get("stop"), body.get("stop_token_ids")
    texts = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(texts, list):
        raise bad_request(f"stop must be a string or a list of strings, got {short_repr(stop)}", "stop")
    if ids is not None and (not isinstance(ids, list)
                            or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids)):
        raise bad_request(f"stop_token_ids must be a list of token ids, got {short_repr(ids)}", "stop_token_ids")
    with refused_as(None):
        return stops(texts, ids or [], codec)


def _logprobs(body: dict, chat: bool) -> tuple[int | None, int | None]:
    """How many alternatives to list per output token and per prompt token (None: no logprobs).
    Chat: `logprobs` true/false and `top_logprobs`; completions: `logprobs` a count, and `echo`
    (which also lists the prompt's). Their range is GenerationConfig's to check."""
    if chat:
        wanted, top = _flag(body, "logprobs", False), body.get("top_logprobs")
        if top and not wanted:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        return (0 if top is None else top) if wanted else None, None
    count = body.get("logprobs")
    return count, count if _flag(body, "echo", False) else None


def _block_choice(body: dict, default: BlockChoice) -> BlockChoice:
    value = body.get("block_size")
    if value is None:
        return default
    if isinstance(value, int) and not isinstance(value, bool) and not 0 <= value <= limits.MAX_BLOCK_SIZE:
        raise bad_request(f"block_size must be in [2, {limits.MAX_BLOCK_SIZE}], \"B:G\", \"auto\" or \"AR\", "
                          f"got {short_repr(value)}", "block_size")
    if isinstance(value, str) and len(value) > 16:
        raise bad_request(f"block_size must be B, \"B:G\", \"auto\" or \"AR\", got {short_repr(value)}", "block_size")
    with refused_as("block_size"):
        return BlockChoice.parse(value, allow_ar=True, label="block_size")


def parse_request(body, codec, default_block: BlockChoice, chat: bool, max_context: int = limits.INT32_MAX,
                  vocab_size: int | None = None) -> ParsedRequest:
    """Check a completions / chat completions body field by field; ApiError(400) names the field.
    The cheap checks come first: the prompt is tokenized last (with the GIL released)."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    _check_fields(body, chat)
    n = _choices(body)
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise bad_request("user must be a string", "user")
    # as vLLM: max_completion_tokens (OpenAI's name now) over max_tokens when a chat request gives both
    limit_field = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    block = _block_choice(body, default_block)
    stream = body.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise bad_request("stream must be true or false", "stream")
    options = body.get("stream_options")
    usage_keys = ("include_usage", "continuous_usage_stats")
    if options is not None and (not isinstance(options, dict) or not stream or set(options) - set(usage_keys)
                                or not all(isinstance(options.get(k, False), bool) for k in usage_keys)):
        raise bad_request("stream_options is an object {\"include_usage\": true or false, \"continuous_usage_stats\": "
                          "true or false}, and only with stream: true", "stream_options")
    logprobs, prompt_logprobs = _logprobs(body, chat)
    texts, stop_ids = _stops(body, codec)
    vocab_size = vocab_size or codec.tokenizer.get_vocab_size(with_added_tokens=True)
    values = {**{spec.name: body.get(spec.name) for spec in REQUEST_FIELDS}, "max_tokens": body.get(limit_field),
              "logprobs": logprobs}  # OpenAI's two forms of it, as one count
    wire = {"max_tokens": limit_field, "logprobs": "top_logprobs" if chat else "logprobs", "prompt_logprobs": "logprobs"}
    with refused_as("block_size", wire):  # what a FieldError leaves to refuse is the block's
        config = request_config(values, block, stop_ids, texts,
                                logit_bias=logit_bias(body.get("logit_bias"), vocab_size),
                                grammar=response_format(body.get("response_format"), codec, vocab_size),
                                prompt_logprobs=prompt_logprobs)
    ids = _chat_ids(body, codec, max_context) if chat else _prompt_ids(body, codec, max_context)
    if body.get(limit_field) is not None:  # asked for: refused when it does not fit (else capped), as vLLM
        with refused_as(limit_field):
            check_room(len(ids), config.max_new_tokens, max_context, limit_field)
    options = options or {}
    echo = None
    if not chat and _flag(body, "echo", False):
        echo = body["prompt"] if isinstance(body["prompt"], str) else \
            codec.decode(ids, skip_special_tokens=config.skip_special)
        echo = echo[0] if isinstance(echo, list) else echo
    return ParsedRequest(ids, config, bool(stream), bool(options.get("include_usage")), chat,
                         bool(options.get("continuous_usage_stats")), n, echo)


def parse_tokenize(body: dict, codec, max_context: int) -> list[int]:
    """vLLM's /tokenize: {"prompt": text} or {"messages": [...]} (with the chat fields) -> ids. A
    text longer than the context can hold is refused before it is tokenized, as a prompt is, so
    the route's work is bounded like a completion's."""
    fields = {"model", "prompt", "add_special_tokens"} if "messages" not in body else \
        {"model", "messages", "chat_template_kwargs", "add_generation_prompt", "continue_final_message"}
    for name in body:
        if name not in fields:
            raise bad_request(f"unknown field {short_repr(name)} (/tokenize takes {', '.join(sorted(fields))})", name)
    if "messages" in body:
        return _chat_ids(body, codec, max_context)
    if isinstance(body.get("prompt"), str):
        _check_characters(len(body["prompt"]), codec, max_context, "prompt")
        return codec.encode_unlocked(body["prompt"], _flag(body, "add_special_tokens", True))
    raise bad_request("give prompt (a string) or messages", "prompt")


def parse_detokenize(body: dict, vocab_size: int) -> list[int]:
    """vLLM's /detokenize: {"tokens": [ids]}."""
    for name in body:
        if name not in ("model", "tokens"):
            raise bad_request(f"unknown field {short_repr(name)} (/detokenize takes model, tokens)", name)
    ids = body.get("tokens")
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size
                                             for t in ids):
        raise bad_request(f"tokens must be a list of token ids in 0..{vocab_size - 1}", "tokens")
    return ids
