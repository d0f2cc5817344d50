"""`trtspec serve`: an OpenAI-compatible HTTP front end over the batched engine.

A front end only translates and streams: a request body is checked field by field at the door
(`parse_request`), becomes prompt ids and a `GenerationConfig`, and is submitted to the engine;
the engine's thread hands each cycle's committed tokens to the event loop (`frontend.LoopBridge`),
where they are detokenized and cut at stop strings (`frontend.Reply`) and sent as one response or as
server-sent events in OpenAI's chunk format. Every response carries a `trtspec` object (block size and
whether BlockPilot chose it, tau, histogram, ceiling fraction). `/metrics` is
`trtspec.serving.metrics` in Prometheus' text format.

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health, GET /metrics,
and vLLM's POST /tokenize, POST /detokenize, GET /version.
Errors use OpenAI's JSON shape: 400 bad request, 404 unknown model or route, 429 queue full,
503 shutting down. A client that disconnects cancels its request, which frees its slot.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ipaddress
import json
import json.scanner
import reprlib
import secrets
import signal
import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace

import uvicorn
from fastapi import FastAPI, Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from uvicorn.protocols.http.h11_impl import H11Protocol

from trtspec import __version__, limits
from trtspec.errors import Cancelled, TrtspecError
from trtspec.runtime.engine import Busy
from trtspec.runtime.grammar import grammar_tokenizer, response_format_grammar
from trtspec.runtime.processing import Processing
from trtspec.runtime.request import GenerationConfig, check_room
from trtspec.runtime.sampling import derive_seed
from trtspec.tokenizer import check_text
from trtspec.runtime.schedule import BlockChoice
from trtspec.runtime.stats import DecodeStats
from trtspec.serving.door import MAX_BODY_BYTES, READ_TIMEOUT_S
from trtspec.serving import logprobs as logprob_objects
from trtspec.serving.frontend import FINISH, LoopBridge, Reply, generation_config, observe_finished
from trtspec.serving.metrics import CONTENT_TYPE, VLLM_PREFIX, ServingMetrics

DOOR_THREADS = 2            # requests decoded, checked and tokenized at once, off the event loop
_C_DECODER_BYTES = 256 * 2**10  # larger bodies: json's pure-Python scanner, which lets the loop run
JSON_VALUES_BESIDES_PROMPT = 10_000  # a large body holds at most max_context + this many JSON values


def _shower() -> reprlib.Repr:
    """A value in a one-line message: its repr, cut short (bounded work, whatever its size or depth)."""
    shower = reprlib.Repr()
    shower.maxstring = shower.maxother = shower.maxlong = 40
    shower.maxlist = shower.maxdict = 4
    shower.maxlevel = 2
    return shower


_show = _shower().repr


class ApiError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code

    def response(self) -> JSONResponse:
        headers = {"Retry-After": "1"} if self.status in (429, 503) else None
        if self.status == 401:
            headers = {"WWW-Authenticate": "Bearer"}
        return JSONResponse({"error": {"message": self.message, "type": self.kind, "param": self.param,
                                       "code": self.code}}, status_code=self.status, headers=headers)


def _bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


@dataclass
class ParsedRequest:
    """A request body after the door: what to submit and how to answer."""

    prompt_ids: list[int]
    config: GenerationConfig
    stops: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    chat: bool = False
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage in every chunk
    keep_stop: bool = False         # include_stop_str_in_output
    skip_special: bool = True       # skip_special_tokens
    n: int = 1                      # independent choices, each its own engine request
    echo: str | None = None         # completions' echo: the prompt's text, put before the completion

    def choice_config(self, index: int) -> GenerationConfig:
        """Choice `index`'s config: with a seed, choice i samples with the seed of the run's i-th
        request (derive_seed), so every choice differs and the whole answer reproduces."""
        sampling = self.config.sampling
        if index == 0 or sampling.seed is None:
            return self.config
        return replace(self.config, sampling=replace(sampling, seed=derive_seed(sampling.seed, index)))


# The fields a request may have: OpenAI's that trtspec implements, trtspec's block_size, vLLM's
# top_k and stop_token_ids, and those without effect on the result (user, metadata, ...). The rest
# of OpenAI's and vLLM's are refused unless given their default value (`_UNSUPPORTED`), and any other
# field is refused by name: no field is ever silently ignored.
_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "stream",
           "stream_options", "n", "user", "block_size", "ignore_eos", "include_stop_str_in_output",
           "skip_special_tokens", "min_tokens", "logprobs", "presence_penalty", "frequency_penalty",
           "repetition_penalty", "min_p", "logit_bias", "response_format"}
_FIELDS = {False: _COMMON | {"prompt", "echo"},
           True: _COMMON | {"messages", "max_completion_tokens", "metadata", "store", "service_tier",
                            "chat_template_kwargs", "add_generation_prompt", "continue_final_message", "top_logprobs"}}
_UNSUPPORTED = {"top_logprobs": (None, 0), "echo": (None, False), "best_of": (None, 1),
                "suffix": (None, ""), "tools": (None, []), "functions": (None, []), "tool_choice": (None, "none"),
                "function_call": (None, "none"), "parallel_tool_calls": (None, True, False),
                "modalities": (None, ["text"]), "reasoning_effort": (None,), "prediction": (None,), "audio": (None,),
                # vLLM's extras (the rest are refused as unknown)
                "spaces_between_special_tokens": (None, True), "add_special_tokens": (None,), "echo_prompt": (None,)}
MAX_LOGIT_BIAS = 1024  # tokens one request may bias


def _check_fields(body: dict, chat: bool) -> None:
    route = "chat completions" if chat else "completions"
    for name, value in body.items():
        if name in _FIELDS[chat]:
            continue
        if name not in _UNSUPPORTED:
            raise _bad(f"unknown field {_show(name)} (a {route} request takes {', '.join(sorted(_FIELDS[chat]))})",
                       name)
        defaults = [d for d in _UNSUPPORTED[name] if d is not None]
        if value is not None and not any(value == d and isinstance(value, bool) == isinstance(d, bool)
                                         for d in defaults):
            shown = " or ".join(json.dumps(d) for d in defaults)
            raise _bad(f"{name} is not supported by trtspec serve" + (f" (only its default, {shown})" if shown else ""),
                       name)


def _number(body: dict, name: str, limit: limits.Limit, default):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > 2**64:
        raise _bad(f"{name} must be {limit.describe()}, got a number of {len(str(abs(value)))} digits", name)
    if not limit.integer and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    try:
        return limit.check(value, name)
    except TrtspecError as exc:
        raise _bad(str(exc), name) from None


def _fits(characters: int, codec, max_context: int, param: str) -> None:
    """Refuse, before tokenizing it, a text longer than the model's context could hold."""
    if characters > codec.text_bytes_cap(max_context):  # a text's characters: at most its UTF-8 bytes
        raise _bad(f"the {param} ({characters} characters) is longer than the model's context of {max_context} "
                   "tokens can hold", param)


def _prompt_ids(body: dict, codec, max_context: int) -> list[int]:
    """`prompt`: a string, or token ids, or a list holding exactly one of them."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        _fits(len(prompt), codec, max_context, "prompt")
        ids = codec.encode_unlocked(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        vocab = codec.tokenizer.get_vocab_size(with_added_tokens=True)
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise _bad(f"prompt: token id {_show(bad[0])} is outside the vocabulary (0..{vocab - 1})", "prompt")
        ids = list(prompt)
    elif isinstance(prompt, list) and any(isinstance(t, float) for t in prompt):
        raise _bad(f"prompt: {_show(next(t for t in prompt if isinstance(t, float)))} is not a token id "
                   "(floats are not token ids)", "prompt")
    elif isinstance(prompt, list) and len(prompt) > 1:
        raise _bad("prompt: one prompt per request (a list of several prompts is not supported)", "prompt")
    else:
        raise _bad("prompt must be a string or a list of token ids", "prompt")
    if not ids:
        raise _bad("the prompt is empty", "prompt")
    _room(len(ids), max_context, "prompt")
    return ids


def _room(tokens: int, max_context: int, param: str) -> None:
    """Refuse in the door a prompt the context cannot hold with one new token (the engine would)."""
    if tokens >= max_context:
        raise _bad(f"the {param} is {tokens} tokens; the model's context holds {max_context} (prompt and output)",
                   param)


def _flag(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _bad(f"{name} must be true or false, got {_show(value)}", name)
    return value


def _template_options(body: dict) -> dict:
    """vLLM's chat template fields: `chat_template_kwargs` (an object passed to the template, such as
    Qwen3's {"enable_thinking": false}), `add_generation_prompt`, `continue_final_message`."""
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and (not isinstance(kwargs, dict) or len(kwargs) > 64):
        raise _bad(f"chat_template_kwargs must be an object of at most 64 template variables, got {_show(kwargs)}",
                   "chat_template_kwargs")
    add, extend = _flag(body, "add_generation_prompt", True), _flag(body, "continue_final_message", False)
    if add and extend:  # as vLLM: add_generation_prompt is true unless it is set to false
        raise _bad("continue_final_message needs add_generation_prompt: false (both cannot be true)",
                   "continue_final_message")
    if extend and body["messages"][-1].get("role") != "assistant":
        raise _bad("continue_final_message continues the last message, which must be the assistant's",
                   "continue_final_message")
    return {"template_kwargs": kwargs, "add_generation_prompt": add, "continue_final_message": extend}


def _chat_ids(body: dict, codec, max_context: int) -> list[int]:
    """`messages`: [{role, content}], content a string or a list of {"type": "text", "text"} parts."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages must be a non-empty list of {role, content} objects", "messages")
    plain, size = [], 0
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise _bad(f"messages[{i}] must be an object with a string role", "messages")
        content = message.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise _bad(f"messages[{i}].content: only text parts are supported", "messages")
            content = "".join(p["text"] for p in content)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise _bad(f"messages[{i}].content must be a string or a list of text parts", "messages")
        plain.append({"role": message["role"], "content": content})
        size += len(content) + len(message["role"])
    _fits(size, codec, max_context, "messages")
    options = _template_options(body)
    try:
        text = codec.apply_chat_template(plain, label="chat", **options)
    except TrtspecError as exc:
        raise _bad(str(exc), "messages") from None
    _fits(len(text), codec, max_context, "messages")
    try:
        ids = codec.encode_unlocked(text, add_special_tokens=False)  # encode_chat's ids, the GIL released
    except TrtspecError as exc:
        raise _bad(str(exc), "messages") from None
    if not ids:
        raise _bad("the chat prompt is empty", "messages")
    _room(len(ids), max_context, "messages")
    return ids


def _stops(body: dict, codec) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """`stop`: a string or a list of strings, cut from the text (one that is exactly one token also
    stops the engine); `stop_token_ids`: token ids (vLLM's field). Counted and measured before any
    of them is tokenized."""
    stop, ids = body.get("stop"), body.get("stop_token_ids")
    texts = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(texts, list):
        raise _bad(f"stop must be a string or a list of strings, got {_show(stop)}", "stop")
    if ids is not None and (not isinstance(ids, list)
                            or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids)):
        raise _bad(f"stop_token_ids must be a list of token ids, got {_show(ids)}", "stop_token_ids")
    try:
        text_stops, text_ids = codec.stop_strings(texts, "stop")
    except TrtspecError as exc:
        raise _bad(str(exc), "stop") from None
    try:
        token_ids = codec.stop_token_ids(ids or [], "stop_token_ids")
    except TrtspecError as exc:
        raise _bad(str(exc), "stop_token_ids") from None
    return text_stops, tuple(dict.fromkeys(text_ids + token_ids))


def _logprobs(body: dict, chat: bool) -> tuple[int | None, int | None]:
    """How many alternatives to list per output token and per prompt token (None: no logprobs).
    Chat: `logprobs` true/false and `top_logprobs`; completions: `logprobs` a count, and `echo`
    (which also lists the prompt's)."""
    if chat:
        wanted = _flag(body, "logprobs", False)
        top = _number(body, "top_logprobs", limits.LOGPROBS, None)
        if top and not wanted:
            raise _bad("top_logprobs needs logprobs: true", "top_logprobs")
        return (top or 0) if wanted else None, None
    count = _number(body, "logprobs", limits.LOGPROBS, None)
    return count, count if _flag(body, "echo", False) else None


def _processing(body: dict, codec, vocab_size: int) -> Processing:
    """The penalties, `logit_bias` ({"token id": bias}) and `response_format` (a grammar)."""
    penalties = {name: _number(body, name, limit, default) for name, limit, default in (
        ("presence_penalty", limits.PENALTY, 0.0), ("frequency_penalty", limits.PENALTY, 0.0),
        ("repetition_penalty", limits.REPETITION_PENALTY, 1.0))}
    bias = body.get("logit_bias") or {}
    if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS:
        raise _bad(f"logit_bias must be an object of at most {MAX_LOGIT_BIAS} \"token id\": bias pairs", "logit_bias")
    biases = []
    for key, value in bias.items():
        token = int(key) if key.isascii() and key.isdigit() and len(key) < 12 else -1
        if not 0 <= token < vocab_size:
            raise _bad(f"logit_bias: {_show(key)} is not a token id in 0..{vocab_size - 1}", "logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _bad(f"logit_bias[{_show(key)}] must be a number, got {_show(value)}", "logit_bias")
        try:
            biases.append((token, limits.LOGIT_BIAS.check(float(value), f"logit_bias[{key}]")))
        except TrtspecError as exc:
            raise _bad(str(exc), "logit_bias") from None
    grammar = None
    if body.get("response_format") is not None:
        try:
            grammar = response_format_grammar(body["response_format"], grammar_tokenizer(codec, vocab_size))
        except TrtspecError as exc:
            raise _bad(str(exc), "response_format") from None
    return Processing(logit_bias=tuple(biases), grammar=grammar, **penalties)


def _block_choice(body: dict, default: BlockChoice) -> BlockChoice:
    value = body.get("block_size")
    if value is None:
        return default
    if isinstance(value, int) and not isinstance(value, bool) and not 0 <= value <= limits.MAX_BLOCK_SIZE:
        raise _bad(f"block_size must be in [2, {limits.MAX_BLOCK_SIZE}], \"B:G\", \"auto\" or \"AR\", "
                   f"got {_show(value)}", "block_size")
    if isinstance(value, str) and len(value) > 16:
        raise _bad(f"block_size must be B, \"B:G\", \"auto\" or \"AR\", got {_show(value)}", "block_size")
    try:
        return BlockChoice.parse(value, allow_ar=True, label="block_size")
    except TrtspecError as exc:
        raise _bad(str(exc), "block_size") from None


def parse_request(body, codec, default_block: BlockChoice, chat: bool, max_context: int = limits.INT32_MAX,
                  vocab_size: int | None = None) -> ParsedRequest:
    """Check a completions / chat completions body field by field; ApiError(400) names the field.
    The cheap checks come first: the prompt is tokenized last (with the GIL released)."""
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    _check_fields(body, chat)
    n = _number(body, "n", limits.CHOICES, 1)
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise _bad("user must be a string", "user")
    default_tokens = limits.MAX_NEW_TOKENS.high if chat else 16  # OpenAI's defaults: the context, and 16
    # as vLLM: max_completion_tokens (OpenAI's name now) over max_tokens when a chat request gives both
    limit_field = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _number(body, limit_field, limits.MAX_NEW_TOKENS, default_tokens)
    temperature = _number(body, "temperature", limits.TEMPERATURE, 0.0)
    top_p = _number(body, "top_p", limits.TOP_P, 1.0)
    top_k = _number(body, "top_k", limits.TOP_K, 0)
    seed = _number(body, "seed", limits.SEED, None)
    block = _block_choice(body, default_block)
    stream = body.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise _bad("stream must be true or false", "stream")
    options = body.get("stream_options")
    usage_keys = ("include_usage", "continuous_usage_stats")
    if options is not None and (not isinstance(options, dict) or not stream or set(options) - set(usage_keys)
                                or not all(isinstance(options.get(k, False), bool) for k in usage_keys)):
        raise _bad("stream_options is an object {\"include_usage\": true or false, \"continuous_usage_stats\": "
                   "true or false}, and only with stream: true", "stream_options")
    ignore_eos = _flag(body, "ignore_eos", False)
    min_tokens = _number(body, "min_tokens", limits.MIN_TOKENS, 0)
    if min_tokens > max_tokens:
        raise _bad(f"min_tokens ({min_tokens}) must not exceed {limit_field} ({max_tokens})", "min_tokens")
    keep_stop, skip_special = _flag(body, "include_stop_str_in_output", False), _flag(body, "skip_special_tokens", True)
    min_p = _number(body, "min_p", limits.MIN_P, 0.0)
    logprobs, prompt_logprobs = _logprobs(body, chat)
    texts, stop_ids = _stops(body, codec)
    processing = _processing(body, codec, vocab_size or codec.tokenizer.get_vocab_size(with_added_tokens=True))
    try:  # the sampling fields passed their checks above: what is left to refuse is the block's
        config = generation_config(block, max_tokens, stop_ids, temperature=temperature,
                                   top_p=top_p, top_k=top_k, seed=seed, ignore_eos=ignore_eos,
                                   min_tokens=min_tokens, min_p=min_p, processing=processing, logprobs=logprobs,
                                   prompt_logprobs=prompt_logprobs)
    except TrtspecError as exc:
        raise _bad(str(exc), "block_size") from None
    ids = _chat_ids(body, codec, max_context) if chat else _prompt_ids(body, codec, max_context)
    if body.get(limit_field) is not None:  # asked for: refused when it does not fit (else capped), as vLLM
        try:
            check_room(len(ids), max_tokens, max_context, limit_field)
        except TrtspecError as exc:
            raise _bad(str(exc), limit_field) from None
    options = options or {}
    echo = None
    if not chat and _flag(body, "echo", False):
        echo = body["prompt"] if isinstance(body["prompt"], str) else codec.decode(ids, skip_special_tokens=skip_special)
        echo = echo[0] if isinstance(echo, list) else echo
    return ParsedRequest(ids, config, texts, bool(stream), bool(options.get("include_usage")), chat,
                         bool(options.get("continuous_usage_stats")), keep_stop, skip_special, n, echo)


def decode_body(raw: bytes, max_values: int = limits.INT32_MAX):
    """A request body as JSON, or ApiError(400): not UTF-8, not JSON, nested too deep, an integer
    too long for Python to read, or a string with a lone surrogate (not Unicode text). A large body
    is decoded by json's pure-Python scanner, which lets other threads (the event loop) run, and
    refused past `max_values` values."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _bad(f"the request body is not UTF-8 (byte {exc.start})") from None
    decoder = json.JSONDecoder()
    if len(raw) > _C_DECODER_BYTES:
        _count_values(decoder, max_values)
        decoder.scan_once = json.scanner.py_make_scanner(decoder)
    try:
        body = decoder.decode(text)
    except RecursionError:
        raise _bad("the request body is nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, and integers past Python's 4300-digit limit
        raise _bad(f"the request body is not valid JSON ({' '.join(str(exc).split())[:200]})") from None
    _refuse_lone_surrogates(body)
    return body


def _count_values(decoder: json.JSONDecoder, limit: int) -> None:
    """Make the decoder refuse a body of more than `limit` JSON values: a million small ones
    (`[[],[],...]`, 200,000 stop strings) keep a thread busy in Python for a second, and the engine's
    thread, which gives up the GIL at every tensor operation, then waits at each for its turn."""
    count = 0

    def counted(scan):
        def scan_counted(string, index):
            nonlocal count
            count += 1
            if count > limit:
                raise _bad(f"the request body holds more than {limit} JSON values")
            return scan(string, index)
        return scan_counted

    parse_object, parse_array = decoder.parse_object, decoder.parse_array
    decoder.parse_object = lambda where, strict, scan, *rest: parse_object(where, strict, counted(scan), *rest)
    decoder.parse_array = lambda where, scan: parse_array(where, counted(scan))


def _refuse_lone_surrogates(body) -> None:
    """Every string of the body, keys included, must be text: a "\\ud800" escape is not."""
    pending = [(body, None)]
    while pending:
        value, field_name = pending.pop()
        if isinstance(value, dict):
            for key, item in value.items():
                pending.append((key, field_name or key))
                pending.append((item, field_name or key))
        elif isinstance(value, list):
            pending.extend((item, field_name) for item in value)
        elif isinstance(value, str) and not value.isascii():
            named = field_name if isinstance(field_name, str) and field_name.isascii() else None
            try:
                check_text(value, named or "a string")
            except TrtspecError as exc:
                raise _bad(str(exc), named) from None


async def read_body(http: HttpRequest, max_bytes: int, timeout_s: float) -> bytes:
    """The body, refused (413) past max_bytes, declared or sent, and (408) when it has not arrived
    within timeout_s: a client sending slowly cannot hold the door."""
    declared = http.headers.get("content-length", "")
    too_large = ApiError(413, f"the request body is larger than this server's limit of {max_bytes} "
                              "bytes (--max-body-bytes)", code="request_too_large")
    if declared.isdigit() and (len(declared) > 18 or int(declared) > max_bytes):
        raise too_large
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in http.stream():
                size += len(chunk)
                if size > max_bytes:
                    raise too_large
                chunks.append(chunk)
    except TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {timeout_s:g} s (--read-timeout)",
                       code="request_timeout") from None
    return b"".join(chunks)


@dataclass
class _Outcome:
    text_parts: list[str] = field(default_factory=list)
    finish_reason: str = "stop"
    completion_tokens: int = 0
    stats: DecodeStats | None = None
    logprob_at: int = 0    # streaming: tokens whose logprobs were sent
    text_offset: int = 0   # streaming completions: the text offset of the next token


def trtspec_extension(stats: DecodeStats | None) -> dict:
    """The `trtspec` object of a response: the block size actually run and its acceptance statistics."""
    if stats is None:
        return {}
    out = {"block_size": stats.schedule if stats.block_size > 1 else "AR", "block_size_auto": stats.auto,
           "tau": stats.tau, "histogram": list(stats.histogram),
           "ceiling_fraction": stats.ceiling_fraction if stats.block_size > 1 else None,  # AR has no block
           "cycles": stats.cycles, "grown_cycles": stats.grown_cycles, "prefill_s": stats.prefill_s,
           "decode_s": stats.decode_s, "decode_tokens_per_s": stats.decode_tokens_per_s}
    for name in ("queue_s", "ttft_s", "batch_mean"):  # the batched engine's fields
        if getattr(stats, name, None) is not None:
            out[name] = getattr(stats, name)
    if stats.turned_ar_at:  # `auto` turned AR under load after this many tokens (its cycles: before it)
        out["turned_ar_at"] = stats.turned_ar_at
    return out


OPEN_ROUTES = ("/health", "/metrics")  # what a server with an API key answers without it, as vLLM


class _ApiKey:
    """ASGI middleware: every route but OPEN_ROUTES wants `Authorization: Bearer KEY` (401 otherwise,
    in OpenAI's shape), before its body is read."""

    def __init__(self, app, key: str):
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in OPEN_ROUTES:
            given = next((value for name, value in scope["headers"] if name == b"authorization"), b"")
            if not secrets.compare_digest(given, self.expected):
                refusal = ApiError(401, "a valid API key is required: send the header Authorization: Bearer KEY",
                                   code="invalid_api_key")
                await refusal.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


class OpenAIServer:
    """The ASGI app over one pipeline and its engine. `app` is what uvicorn serves.

    The event loop only routes: a body is read with a size limit (`max_body_bytes`, else 413) and a
    deadline (`read_timeout_s`, else 408), then decoded, checked and tokenized on the door's
    threads (DOOR_THREADS), so one large or odd request never stalls the other clients' streams."""

    def __init__(self, pipeline, engine_config, *, model_name: str, block_size: BlockChoice | None = None,
                 metrics: ServingMetrics | None = None, metrics_prefix: str = VLLM_PREFIX,
                 max_body_bytes: int = MAX_BODY_BYTES,
                 read_timeout_s: float = READ_TIMEOUT_S, api_key: str | None = None, replica: dict | None = None):
        self.pipeline, self.codec, self.engine_config = pipeline, pipeline.codec, engine_config
        self.model_name = model_name
        self.default_block = block_size or pipeline.default_block
        self.metrics = metrics or ServingMetrics(model_name=model_name, vllm_prefix=metrics_prefix)
        self.max_body_bytes, self.read_timeout_s, self.api_key = max_body_bytes, read_timeout_s, api_key
        self.replica = replica  # on Ray Serve: which replica answered ({"id", "pid"}), in every trtspec object
        self.engine = None
        self.created = int(time.time())
        self.closing = False
        self._close_lock = threading.Lock()
        self._door = ThreadPoolExecutor(DOOR_THREADS, thread_name_prefix="trtspec-door")
        self.app = self._make_app()

    # -- life cycle ----------------------------------------------------------------------------
    def start(self) -> None:
        if self.engine is None:
            self.engine = self.pipeline.engine(self.engine_config)

    def close(self) -> None:
        """Stop the engine: what is still queued or running is cancelled (clients get their error)."""
        self.closing = True
        with self._close_lock:
            if self.engine is not None:
                self.engine.close(cancel=True)
                self.engine = None
        self._door.shutdown(wait=False, cancel_futures=True)

    def _make_app(self) -> FastAPI:
        @asynccontextmanager
        async def lifespan(app):
            self.start()
            try:
                yield
            finally:
                await asyncio.get_running_loop().run_in_executor(None, self.close)

        app = FastAPI(title="trtspec", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
        if self.api_key:
            app.add_middleware(_ApiKey, key=self.api_key)

        @app.exception_handler(ApiError)
        async def api_error(request, exc: ApiError):
            return exc.response()

        @app.exception_handler(HTTPException)
        async def http_error(request, exc: HTTPException):
            kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
            return ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", kind).response()

        @app.exception_handler(Exception)
        async def internal_error(request, exc: Exception):  # a bug: logged by uvicorn, answered in OpenAI's shape
            return ApiError(500, f"internal error ({type(exc).__name__})", "internal_error").response()

        @app.exception_handler(RequestValidationError)
        async def validation_error(request, exc):
            return _bad(str(exc)).response()

        @app.get("/health")
        async def health():
            if self.closing or self.engine is None:
                raise ApiError(503, "the server is shutting down", "service_unavailable")
            return {"status": "ok"}

        @app.get("/metrics")
        async def metrics():
            if self.engine is not None:
                load = self.engine.load()
                self.metrics.observe_load(load.queued, load.running, load.block_sizes, load.slots)
            return Response(self.metrics.render(), media_type=CONTENT_TYPE)

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [self._model_card()]}

        @app.get("/v1/models/{name:path}")
        async def model(name: str):
            self._check_model(name)
            return self._model_card()

        @app.get("/version")
        async def version():
            return {"version": __version__}

        @app.post("/tokenize")
        async def tokenize(request: HttpRequest):
            return await self._at_door(request, self._tokenize)

        @app.post("/detokenize")
        async def detokenize(request: HttpRequest):
            return await self._at_door(request, self._detokenize)

        @app.post("/v1/completions")
        async def completions(request: HttpRequest):
            return await self._handle(request, chat=False)

        @app.post("/v1/chat/completions")
        async def chat_completions(request: HttpRequest):
            return await self._handle(request, chat=True)

        return app

    def _model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "trtspec",
                "root": self.model_name, "parent": None, "max_model_len": self.pipeline.runner.max_context}

    def _check_model(self, name) -> None:
        if name != self.model_name:
            raise ApiError(404, f"The model {_show(name)} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")

    # -- requests ------------------------------------------------------------------------------
    async def _read_body(self, http: HttpRequest) -> bytes:
        return await read_body(http, self.max_body_bytes, self.read_timeout_s)

    async def _at_door(self, http: HttpRequest, work):
        """`work(body)` on the door's threads for one of vLLM's utility routes."""
        try:
            raw = await self._read_body(http)
        except ClientDisconnect:
            return Response(status_code=499)

        def run():
            body = decode_body(raw, self.pipeline.runner.max_context + JSON_VALUES_BESIDES_PROMPT)
            if not isinstance(body, dict):
                raise _bad("the request body must be a JSON object")
            if body.get("model") is not None:
                self._check_model(body["model"])
            return work(body)
        return await asyncio.get_running_loop().run_in_executor(self._door, run)

    def _tokenize(self, body: dict) -> dict:
        """vLLM's /tokenize: {"prompt": text} or {"messages": [...]} (with the chat fields) -> ids. A
        text longer than the context can hold is refused before it is tokenized, as a prompt is, so
        the route's work is bounded like a completion's."""
        fields = {"model", "prompt", "add_special_tokens"} if "messages" not in body else \
            {"model", "messages", "chat_template_kwargs", "add_generation_prompt", "continue_final_message"}
        for name in body:
            if name not in fields:
                raise _bad(f"unknown field {_show(name)} (/tokenize takes {', '.join(sorted(fields))})", name)
        context = self.pipeline.runner.max_context
        if "messages" in body:
            ids = _chat_ids(body, self.codec, context)
        elif isinstance(body.get("prompt"), str):
            _fits(len(body["prompt"]), self.codec, context, "prompt")
            ids = self.codec.encode_unlocked(body["prompt"], _flag(body, "add_special_tokens", True))
        else:
            raise _bad("give prompt (a string) or messages", "prompt")
        return {"count": len(ids), "max_model_len": context, "tokens": ids}

    def _detokenize(self, body: dict) -> dict:
        """vLLM's /detokenize: {"tokens": [ids]} -> {"prompt": text}."""
        for name in body:
            if name not in ("model", "tokens"):
                raise _bad(f"unknown field {_show(name)} (/detokenize takes model, tokens)", name)
        ids, vocab = body.get("tokens"), self.codec.tokenizer.get_vocab_size(with_added_tokens=True)
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab
                                                 for t in ids):
            raise _bad(f"tokens must be a list of token ids in 0..{vocab - 1}", "tokens")
        return {"prompt": self.codec.decode(ids)}

    def _parse(self, raw: bytes, chat: bool) -> ParsedRequest:
        """The door's work, on its threads: decode, check and tokenize one body."""
        body = decode_body(raw, self.pipeline.runner.max_context + JSON_VALUES_BESIDES_PROMPT)
        if not isinstance(body, dict) or not isinstance(body.get("model"), str):
            raise _bad("model must be given, as a string", "model")
        self._check_model(body["model"])
        return parse_request(body, self.codec, self.default_block, chat, self.pipeline.runner.max_context,
                             self.pipeline.vocab_size)

    async def _handle(self, http: HttpRequest, chat: bool):
        try:
            raw = await self._read_body(http)
        except ClientDisconnect:
            return Response(status_code=499)  # nobody is listening
        try:
            parsed = await asyncio.get_running_loop().run_in_executor(self._door, self._parse, raw, chat)
        except RuntimeError:  # the door is shut: the server is shutting down
            if not self.closing:
                raise
            raise ApiError(503, "the server is shutting down", "service_unavailable") from None
        if self.closing or self.engine is None:
            raise ApiError(503, "the server is shutting down", "service_unavailable")
        loop, choices = asyncio.get_running_loop(), []
        try:
            for index in range(parsed.n):
                bridge = LoopBridge(loop)
                reply = Reply(self.codec, parsed.stops, self.metrics, parsed.keep_stop, parsed.skip_special)
                reply.request = self.engine.submit(parsed.prompt_ids, parsed.choice_config(index), bridge.on_commit,
                                                   bridge.on_finish)
                choices.append((reply, bridge))
        except TrtspecError as exc:
            for reply, _ in choices:  # all the choices or none
                reply.request.cancel()
            if isinstance(exc, Busy):
                self.metrics.observe_failed("rejected")
                raise ApiError(429, str(exc), "rate_limit_exceeded", code="queue_full") from None
            raise _bad(str(exc)) from None
        ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        if parsed.stream:
            return StreamingResponse(self._stream(parsed, choices, ident),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return await self._complete(http, parsed, choices, ident)

    async def _events(self, reply: Reply, bridge: LoopBridge, outcome: _Outcome):
        """Text pieces as the engine commits tokens, each with the count of tokens committed since the
        last piece; `outcome` is filled in at the end. The request
        is cancelled when it stops at a stop string (by `reply`), or when the consumer goes away."""
        finished, pending = False, 0
        try:
            while True:
                kind, tokens = await bridge.queue.get()
                if kind == FINISH:
                    break
                piece = reply.push(tokens)
                outcome.completion_tokens += len(tokens)
                pending += len(tokens)
                if piece:
                    yield piece, pending
                    pending = 0
                if reply.stopped:
                    break
            finished = True
        finally:
            if not finished:
                reply.request.cancel()
                self.metrics.observe_failed("cancelled")
        try:
            piece, generation = reply.end()  # done: a stop string, or on_finish came last
        except Cancelled:
            self.metrics.observe_failed("cancelled")
            raise ApiError(503, "the request was cancelled (the server is shutting down)", "service_unavailable")
        except TrtspecError as exc:
            self.metrics.observe_failed("error")
            raise _bad(str(exc)) from None
        except Exception:
            self.metrics.observe_failed("error")
            raise
        if piece:
            yield piece, pending
        outcome.stats = generation.stats if reply.reported else None  # none to show: cut before a cycle reported
        outcome.finish_reason = generation.stats.finish_reason or "stop"
        outcome.completion_tokens = len(generation.tokens)
        observe_finished(self.metrics, reply.request, generation.stats, reply.counted)

    def _usage(self, parsed: ParsedRequest, outcomes: list[_Outcome]) -> dict:
        prompt, completion = len(parsed.prompt_ids), sum(o.completion_tokens for o in outcomes)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": 0}}  # no prefix cache: every prompt token is computed

    async def _complete(self, http: HttpRequest, parsed: ParsedRequest, choices: list, ident: str):
        outcomes = [_Outcome() for _ in choices]

        async def collect(reply, bridge, outcome):
            async for piece, _ in self._events(reply, bridge, outcome):
                outcome.text_parts.append(piece)

        async def disconnected():
            while (await http.receive())["type"] != "http.disconnect":
                pass

        work = asyncio.ensure_future(asyncio.gather(*(collect(r, b, o) for (r, b), o in zip(choices, outcomes)),
                                                    return_exceptions=True))  # every choice's end is collected
        watch = asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (work, watch):
                if not task.done():
                    task.cancel()
        if not work.done() or work.cancelled():
            await asyncio.gather(work, return_exceptions=True)  # its cleanup cancels the engine requests
            return Response(status_code=499)  # nobody is listening
        failed = next((e for e in work.result() if isinstance(e, BaseException)), None)
        if failed is not None:  # a choice failed: the answer is its error
            raise failed
        answers = []
        for index, outcome in enumerate(outcomes):
            text = (parsed.echo or "") + "".join(outcome.text_parts)
            request = choices[index][0].request
            listed = logprob_objects.entries(request.tokens[:outcome.completion_tokens],
                                             request.logprobs[:outcome.completion_tokens])
            choice = {"index": index, "finish_reason": outcome.finish_reason,
                      "logprobs": self._logprobs(parsed, request, listed, 0, echo=parsed.echo is not None)}
            choice.update({"message": {"role": "assistant", "content": text}} if parsed.chat else {"text": text})
            if parsed.n > 1:
                choice["trtspec"] = self._extension(outcome.stats)
            answers.append(choice)
        return {"id": ident, "object": "chat.completion" if parsed.chat else "text_completion",
                "created": int(time.time()), "model": self.model_name, "choices": answers,
                "usage": self._usage(parsed, outcomes), "trtspec": self._extension(outcomes[0].stats)}

    def _extension(self, stats: DecodeStats | None) -> dict:
        out = trtspec_extension(stats)
        if self.replica is not None:
            out["replica"] = self.replica
        return out

    def _logprobs(self, parsed: ParsedRequest, request, listed: list, offset: int, echo: bool = False) -> dict | None:
        """The choice's logprobs object for these (token, logprob) entries; `echo`: the prompt's first."""
        if parsed.config.logprobs is None:
            return None
        if parsed.chat:
            return logprob_objects.chat_logprobs(self.codec, listed)
        if echo:
            listed = logprob_objects.entries(parsed.prompt_ids, request.prompt_logprobs) + listed
        return logprob_objects.completion_logprobs(self.codec, listed, offset)

    def _streamed_logprobs(self, parsed: ParsedRequest, request, outcome: _Outcome, count: int) -> dict | None:
        """The logprobs of a stream chunk's `count` tokens, the next after those already sent."""
        if parsed.config.logprobs is None or not count:
            return None
        at = outcome.logprob_at
        listed = logprob_objects.entries(request.tokens[at:at + count], request.logprobs[at:at + count])
        outcome.logprob_at += count
        out = self._logprobs(parsed, request, listed, outcome.text_offset)
        if not parsed.chat:
            outcome.text_offset += sum(len(t) for t in out["tokens"])
        return out

    async def _stream(self, parsed: ParsedRequest, choices: list, ident: str):
        """Server-sent events: each choice's pieces as they come, tagged with its index; its finish
        chunk when it ends; then the usage (if asked) and [DONE]. Leaving early (a disconnect)
        cancels every choice's engine request."""
        created, outcomes = int(time.time()), [_Outcome() for _ in choices]
        kind = "chat.completion.chunk" if parsed.chat else "text_completion"
        events: asyncio.Queue = asyncio.Queue()

        def chunk(index: int, piece: str | None, finish: str | None = None, logprobs: dict | None = None,
                  **extra) -> str:
            if parsed.chat:
                delta = {} if piece is None else {"content": piece}
                choice = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
            else:
                choice = {"index": index, "text": piece or "", "finish_reason": finish, "logprobs": logprobs}
            body = {"id": ident, "object": kind, "created": created, "model": self.model_name, "choices": [choice],
                    **extra}
            if parsed.continuous_usage:  # vLLM's continuous_usage_stats: the counts so far, in every chunk
                body["usage"] = self._usage(parsed, outcomes)
            elif parsed.include_usage:
                body["usage"] = None
            return f"data: {json.dumps(body)}\n\n"

        async def produce(index: int, reply: Reply, bridge: LoopBridge) -> None:
            try:
                async for piece, count in self._events(reply, bridge, outcomes[index]):
                    events.put_nowait((index, piece, None, count))
                events.put_nowait((index, None, None, 0))
            except ApiError as exc:
                events.put_nowait((index, None, exc, 0))
            except Exception as exc:  # noqa: BLE001 - a bug: the stream ends with its error, never hangs
                events.put_nowait((index, None, ApiError(500, f"internal error ({type(exc).__name__})",
                                                         "internal_error"), 0))

        if parsed.chat:
            for index in range(len(choices)):
                first = json.loads(chunk(index, "")[6:])
                first["choices"][0]["delta"] = {"role": "assistant", "content": ""}
                yield f"data: {json.dumps(first)}\n\n"
        tasks = [asyncio.ensure_future(produce(i, r, b)) for i, (r, b) in enumerate(choices)]
        echoed: set[int] = set()
        try:
            running = len(tasks)
            while running:
                index, piece, error, count = await events.get()
                request = choices[index][0].request
                if parsed.echo is not None and index not in echoed and error is None:
                    echoed.add(index)  # the prompt, once it is prefilled (its logprobs are known then)
                    yield chunk(index, parsed.echo, logprobs=self._logprobs(parsed, request, [], 0, echo=True))
                    outcomes[index].text_offset = len(parsed.echo)
                if error is not None:  # the status line is sent: report the error as an event, as OpenAI does
                    for reply, _ in choices:
                        reply.request.cancel()
                    yield f"data: {json.dumps({'error': {'message': error.message, 'type': error.kind, 'code': error.code}})}\n\n"
                    yield "data: [DONE]\n\n"
                    return
                if piece is not None:
                    yield chunk(index, piece, logprobs=self._streamed_logprobs(parsed, request, outcomes[index], count))
                    continue
                running -= 1
                outcome = outcomes[index]
                yield chunk(index, None, outcome.finish_reason, trtspec=self._extension(outcome.stats))
        finally:
            for task in tasks:
                if not task.done():
                    task.cancel()  # its _events cancels its engine request
        if parsed.include_usage:
            usage = {"id": ident, "object": kind, "created": created, "model": self.model_name, "choices": [],
                     "usage": self._usage(parsed, outcomes)}
            yield f"data: {json.dumps(usage)}\n\n"
        yield "data: [DONE]\n\n"


class _Uvicorn(uvicorn.Server):
    """uvicorn's server, except that on SIGINT/SIGTERM the front end stops taking requests at once,
    and when the grace period is over the engine is closed, which cancels what is still running:
    each of those clients gets its error (a stream: an error event and [DONE]) rather than a cut
    connection. Afterwards it returns (exit status 0) instead of raising the signal again (which
    Python turns into a KeyboardInterrupt traceback for SIGINT)."""

    def __init__(self, config: uvicorn.Config, front_end: "OpenAIServer", graceful_s: float):
        super().__init__(config)
        self.front_end, self.graceful_s = front_end, graceful_s

    async def shutdown(self, sockets=None) -> None:
        self.front_end.closing = True
        loop = asyncio.get_running_loop()
        deadline = loop.call_later(self.graceful_s, lambda: loop.run_in_executor(None, self.front_end.close))
        try:
            await super().shutdown(sockets)
        finally:
            deadline.cancel()

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {number: signal.signal(number, self.handle_exit) for number in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for number, handler in original.items():
                signal.signal(number, handler)


def listen_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port (0: any free port), made before the model loads so that a
    port in use is refused at once. An empty host (which binds every interface without saying so)
    is refused: every interface is 0.0.0.0 or ::, named (`listens_everywhere`)."""
    if not host.strip():
        raise TrtspecError("--host is empty: give an address (127.0.0.1: this machine only; 0.0.0.0 or ::: "
                           "every interface)")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except (OSError, ValueError, UnicodeError) as exc:  # ValueError: a NUL; UnicodeError: not a host name
        sock.close()
        reason = getattr(exc, "strerror", None) or "not a host name or address"
        shown = host if host.isascii() and host.isprintable() else _show(host)
        raise TrtspecError(f"cannot listen on {shown}:{port}: {reason}") from None
    return sock


def listens_everywhere(sock: socket.socket) -> bool:
    """Whether the socket is bound to every interface (0.0.0.0, ::; also what "0" resolves to)."""
    return ipaddress.ip_address(sock.getsockname()[0].split("%")[0]).is_unspecified


def socket_url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://{f'[{host}]' if sock.family == socket.AF_INET6 else host}:{port}"


class _HeadDeadline(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with a deadline on each request's head: a connection that has not
    sent a whole head `head_timeout_s` after it opened (or after its previous response) is closed.
    uvicorn's own keep-alive timer restarts on every byte, so headers sent a byte at a time would
    hold a connection open for ever."""

    def __init__(self, *args, head_timeout_s: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.head_timeout_s, self._deadline = head_timeout_s, None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm()

    def connection_lost(self, exc) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        waiting = self.cycle  # a new head replaces the cycle: then the deadline has been met

        def late() -> None:
            if self.cycle is waiting and not self.transport.is_closing():
                self.transport.close()

        self._deadline = self.loop.call_later(self.head_timeout_s, late)


def serve(server: OpenAIServer, sock: socket.socket, *, graceful_s: float = 10.0) -> None:
    """Run uvicorn on a bound socket (`listen_socket`) until SIGINT/SIGTERM. In-flight requests get
    `graceful_s` seconds to finish, then are cancelled; the engine stops last. A request's head and
    its body each have `server.read_timeout_s` to arrive; idle keep-alive connections close after 5 s."""
    # uvicorn's own deadline is a backstop: by then the closed engine has ended every request.
    config = uvicorn.Config(server.app, log_level="warning", access_log=False,
                            timeout_graceful_shutdown=graceful_s + 10, lifespan="on", timeout_keep_alive=5,
                            h11_max_incomplete_event_size=64 * 2**10,  # a request's head: 64 KiB at most
                            http=functools.partial(_HeadDeadline, head_timeout_s=server.read_timeout_s))
    try:
        _Uvicorn(config, server, graceful_s).run(sockets=[sock])
    finally:
        sock.close()
        server.close()
