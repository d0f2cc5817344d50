"""OpenAI's `logprobs` objects from the engine's per-token log-probabilities
(`trtspec.runtime.request.TokenLogprob`: the target's own distribution, before processing and
temperature, as vLLM returns by default).

Completions: {"tokens", "token_logprobs", "top_logprobs", "text_offset"} (with `echo`, the prompt's
tokens first, the very first without a log-probability). Chat: {"content": [{"token", "logprob",
"bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}. A token's text is its own decoding, so
a token holding part of a character shows the replacement character; "bytes" gives its UTF-8.
"""

from __future__ import annotations

from trtspec.runtime.request import TokenLogprob

Entry = tuple[int, TokenLogprob | None]  # a token id and its log-probability (None: the prompt's first)


def token_text(codec, token: int) -> str:
    return codec.decode([token], skip_special_tokens=False)


def entries(tokens: list[int], logprobs: list[TokenLogprob | None]) -> list[Entry]:
    return list(zip(tokens, logprobs))


def completion_logprobs(codec, listed: list[Entry], offset: int = 0) -> dict:
    """The completions form; `offset`: the text offset of the first token."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token, entry in listed:
        text = token_text(codec, token)
        out["tokens"].append(text)
        out["token_logprobs"].append(None if entry is None else entry.logprob)
        out["top_logprobs"].append(None if entry is None else
                                   {token_text(codec, t): lp for t, lp in entry.top} or None)
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def chat_logprobs(codec, listed: list[Entry]) -> dict:
    """The chat completions form."""
    def one(token: int, logprob: float) -> dict:
        text = token_text(codec, token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
    return {"content": [{**one(token, entry.logprob), "top_logprobs": [one(t, lp) for t, lp in entry.top]}
                        for token, entry in listed if entry is not None]}
