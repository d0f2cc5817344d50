"""Structured output: OpenAI's `response_format` as a grammar, matched by llguidance.

llguidance (the grammar engine vLLM and SGLang use, a small Rust library with CPU wheels)
compiles a JSON schema or "any JSON object" into a grammar over the model's tokens and, at each
position, gives the tokens the grammar allows after those before it; trtspec.runtime.processing
masks each verify row with it. It is optional (`pip install 'trtspec[serve]'`), imported here only.

A schema the grammar engine cannot honour is refused when the grammar is made, never decoded
unconstrained: one that fails to compile or to start, and a `pattern` that repeats a part more
than limits.PATTERN_REPEATS times, nested counts multiplied (llguidance's lexer gives up partway
through an unanchored `a{1000}`). `Grammar.forced` counts the tokens every output begins with, so
a request without room for them (an endless recursion: llguidance's cap) is refused before it is
admitted (trtspec.runtime.request.check_request).
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, field
from typing import Any

from trtspec.errors import TrtspecError
from trtspec.limits import PATTERN_REPEATS


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise TrtspecError("response_format needs llguidance: pip install 'trtspec[serve]'") from None
    return llguidance


@functools.lru_cache(maxsize=4)
def grammar_tokenizer(codec, vocab_size: int):
    """llguidance's view of a target's tokenizer (trtspec.tokenizer.TextCodec) over the model's
    `vocab_size` logits, its EOS ids ending a finished grammar (about a second to build for a
    large vocabulary: kept per codec)."""
    return _llguidance().LLTokenizer(codec.tokenizer.to_str(), n_vocab=vocab_size,
                                     eos_token=list(codec.stop_ids) or None)


@dataclass(frozen=True)
class Grammar:
    """A compiled grammar (llguidance's form), the tokenizer it matches tokens of, and a matcher at
    its start, made and checked once: each request matches with a copy of it, so no request
    compiles a grammar on the engine's thread."""

    source: str                                        # what it was made from, for messages
    grammar: str
    tokenizer: Any = field(compare=False, repr=False)
    start: Any = field(default=None, compare=False, repr=False)
    forced: int = 0                                    # tokens every output begins with

    def __post_init__(self) -> None:
        if self.start is None:
            llguidance = _llguidance()
            start = llguidance.LLMatcher(self.tokenizer, self.grammar, log_level=0,
                                         limits=llguidance.LLParserLimits(verbose_errors=False))
            forced = len(start.compute_ff_tokens()) if not start.is_error() else 0
            allowed = start.compute_bitmask() if not start.is_error() else b""  # the first token's
            if start.is_error() or not any(allowed):
                raise TrtspecError(f"response_format: the schema cannot be matched: {first_line(start)}")
            object.__setattr__(self, "start", start)
            object.__setattr__(self, "forced", forced)

    def matcher(self):
        """A fresh matcher at the grammar's start: one per request."""
        return self.start.deep_copy()


def first_line(matcher) -> str:
    """A matcher's error in one line (llguidance's messages may add its parser state below it)."""
    return (matcher.get_error().strip().splitlines() or ["no token allowed"])[0]


def response_format_grammar(response_format: dict, tokenizer) -> Grammar | None:
    """OpenAI's response_format: {"type": "text"} (None: no grammar), {"type": "json_object"} (any
    JSON object) or {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}. A bad one
    raises TrtspecError naming what is wrong."""
    llguidance = _llguidance()
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        schema: dict = {"type": "object"}
    elif kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise TrtspecError("response_format json_schema needs {\"json_schema\": {\"name\": ..., \"schema\": {...}}}")
    else:
        raise TrtspecError(f"response_format type must be text, json_object or json_schema, got {json.dumps(kind)}")
    _check_patterns(schema)
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
    except (ValueError, TypeError) as error:
        raise TrtspecError(f"response_format: {error}") from None
    return Grammar(kind, grammar, tokenizer)


def _check_patterns(schema) -> None:
    """Refuse a schema whose `pattern` (or `patternProperties` key) repeats a part more than
    PATTERN_REPEATS times."""
    pending = [schema]
    while pending:
        value = pending.pop()
        if isinstance(value, list):
            pending.extend(value)
        if not isinstance(value, dict):
            continue
        patterns = [value["pattern"]] if isinstance(value.get("pattern"), str) else []
        if isinstance(value.get("patternProperties"), dict):
            patterns += list(value["patternProperties"])
        for pattern in patterns:
            count = pattern_repeats(pattern)
            if count > PATTERN_REPEATS.high:
                raise TrtspecError(f"response_format: the pattern {json.dumps(pattern)[:60]} repeats a part {count:,} "
                                   f"times; at most {PATTERN_REPEATS.high:g} (nested repetitions multiply)")
        pending.extend(value.values())


_COUNT = re.compile(r"\{([0-9]+)(?:,([0-9]*))?\}")  # {n}, {n,} and {n,m}
_CLASS = re.compile(r"\[\^?\]?(?:\\.|[^\]\\])*\]")  # [...], [^...], []...]


def pattern_repeats(pattern: str) -> int:
    """The most times a regular expression repeats any part of itself, nested counts multiplied:
    'a{3}' -> 3, '((a{100}){100}){100}' -> 1,000,000; 1 without counts ('a*' repeats freely: that
    costs the matcher nothing)."""
    most = [1]  # per open group: the largest count inside it so far
    inner, at = 1, 0  # inner: the largest count inside the atom just read (1 for a character)
    while at < len(pattern):
        char = pattern[at]
        count = _COUNT.match(pattern, at) if char == "{" else None
        if count:
            high = count[2] or count[1]
            most[-1] = max(most[-1], inner * (int(high) if len(high) < 10 else 10**9))
            at = count.end()
            continue
        if char == "(":
            most.append(1)
        elif char == ")" and len(most) > 1:
            inner = most.pop()
            most[-1] = max(most[-1], inner)
            at += 1
            continue
        klass = _CLASS.match(pattern, at) if char == "[" else None
        at = klass.end() if klass else at + (2 if char == "\\" else 1)
        inner = 1
    return max(most)
