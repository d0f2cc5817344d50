"""Structured output: OpenAI's `response_format` as a grammar, matched by llguidance.

llguidance (the grammar engine vLLM and SGLang use, a small Rust library with CPU wheels)
compiles a JSON schema or "any JSON object" into a grammar over the model's tokens and, at each
position, gives the tokens the grammar allows after those before it; trtspec.runtime.processing
masks each verify row with it. It is optional (`pip install 'trtspec[serve]'`), imported here only.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from typing import Any

from trtspec.errors import TrtspecError


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
    """A compiled grammar (llguidance's form) and the tokenizer it matches tokens of."""

    source: str                                        # what it was made from, for messages
    grammar: str
    tokenizer: Any = field(compare=False, repr=False)

    def matcher(self):
        """A fresh matcher at the grammar's start: one per request."""
        matcher = _llguidance().LLMatcher(self.tokenizer, self.grammar, log_level=0)
        if matcher.is_error():
            raise TrtspecError(f"response_format: {matcher.get_error()}")
        return matcher


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
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
    except (ValueError, TypeError) as error:
        raise TrtspecError(f"response_format: {error}") from None
    problem = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
    if problem and not problem.startswith("WARNING"):
        raise TrtspecError(f"response_format: the schema cannot be matched: {problem.splitlines()[0]}")
    return Grammar(kind, grammar, tokenizer)
