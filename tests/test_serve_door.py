"""`trtspec serve` at the door: the event loop only routes (bodies read with a size limit and a
deadline, decoded and tokenized off the loop, stops checked before any work, hold-back linear in
the text), an API key, refusals in one line for fields that would be ignored, and a fuzz test of
the real server. Servers are real subprocesses (tests/test_serve.py's `Server`); every wait is
bounded."""

from __future__ import annotations

import json
import random
import socket
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from trtspec.assets import resolve_target
from trtspec.tokenizer import TextCodec, TextStream


@pytest.fixture(scope="module")
def codec() -> TextCodec:
    return TextCodec(resolve_target(None))


# -- TextStream: hold-back linear in the text ---------------------------------------------------------

def _naive_pieces(pieces: list[str], stops: tuple[str, ...]) -> list[str]:
    """What TextStream must hand out for these decoded pieces, computed the obvious quadratic way:
    cut before the earliest-starting stop present, hold back the longest tail that begins a stop."""
    text, sent, out = "", 0, []
    for piece in pieces:
        text += piece
        found = [i for i in (text.find(s) for s in stops) if i >= 0]
        if found:
            text = text[:min(found)]
            out.append(text[sent:])
            return out
        hold = max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
        out.append(text[sent:len(text) - hold])
        sent = len(text) - hold
    out.append(text[sent:])
    return out


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(alphabet="ab\n", max_size=60), stops=st.lists(st.text(alphabet="ab\n", min_size=1, max_size=6),
                                                                  min_size=1, max_size=4))
def test_text_stream_cuts_and_holds_back_like_the_naive_rule(codec, text, stops):
    ids = codec.encode(text) if text else []
    decoder, pieces = codec.streamer(), []
    for token in ids:
        piece = decoder.step(codec.tokenizer, token)
        pieces.append(piece or "")
    stream = TextStream(codec, tuple(stops))
    got = [stream.push([token]) for token in ids]
    got.append(stream.finish(ids))
    expected = _naive_pieces(pieces, tuple(stops))
    assert "".join(got) == "".join(expected)
    assert got[:len(expected) - 1] == expected[:-1]  # piece by piece: nothing held longer than needed


def test_text_stream_holds_back_in_linear_time(codec):
    """16 stop strings of 1000 characters that never begin the text: each pushed token used to test
    every beginning of every stop (16,000 slices of up to 1000 characters per token, 6 s here)."""
    ids = codec.encode("a" * 3000)
    stops = tuple(chr(ord("b") + i) + "a" * 999 for i in range(16))
    began = time.perf_counter()
    stream = TextStream(codec, stops)
    text = "".join(stream.push([token]) for token in ids) + stream.finish(ids)
    assert text == "a" * 3000 and not stream.stopped
    assert time.perf_counter() - began < 1.0
