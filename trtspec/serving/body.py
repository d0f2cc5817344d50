"""A request's body, before any field is read: its bytes, refused past a size or a deadline
(`read_body`), and its JSON, refused when it is not text, too deep, or holds too many values
(`decode_body`). Bounded work whatever a client sends.
"""

from __future__ import annotations

import asyncio
import json
import json.scanner

from trtspec import limits
from trtspec.errors import FieldError
from trtspec.serving.frontend import check_json_text
from trtspec.serving.protocol import ApiError, bad_request

_C_DECODER_BYTES = 256 * 2**10  # larger bodies: json's pure-Python scanner, which lets the loop run


async def read_body(http, max_bytes: int, timeout_s: float) -> bytes:
    """The body, refused (413) past max_bytes, declared or sent, and (408) when it has not arrived
    within timeout_s: a client sending slowly cannot hold the door."""
    declared = http.headers.get("content-length", "")
    too_large = ApiError(413, f"the request body is larger than this server's limit of {max_bytes} "
                              "bytes (--max-body-bytes)", code="request_too_large")
    if declared.isdigit() and (len(declared) > 18 or int(declared) > max_bytes):
        raise too_large
    chunks: list[bytes] = []

    async def collect() -> None:
        size = 0
        async for chunk in http.stream():
            size += len(chunk)
            if size > max_bytes:
                raise too_large
            chunks.append(chunk)

    try:
        await asyncio.wait_for(collect(), timeout_s)  # asyncio.timeout would need Python 3.11
    except asyncio.TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {timeout_s:g} s (--read-timeout)",
                       code="request_timeout") from None
    return b"".join(chunks)


def decode_body(raw: bytes, max_values: int = limits.INT32_MAX):
    """A request body as JSON, or ApiError(400): not UTF-8, not JSON, nested too deep, an integer
    too long for Python to read, or a string with a lone surrogate (not Unicode text). A large body
    is decoded by json's pure-Python scanner, which lets other threads (the event loop) run, and
    refused past `max_values` values."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad_request(f"the request body is not UTF-8 (byte {exc.start})") from None
    decoder = json.JSONDecoder()
    if len(raw) > _C_DECODER_BYTES:
        _count_values(decoder, max_values)
        decoder.scan_once = json.scanner.py_make_scanner(decoder)
    try:
        body = decoder.decode(text)
    except RecursionError:
        raise bad_request("the request body is nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, and integers past Python's 4300-digit limit
        raise bad_request(f"the request body is not valid JSON ({' '.join(str(exc).split())[:200]})") from None
    try:
        check_json_text(body)
    except FieldError as exc:
        raise bad_request(str(exc), exc.field) from None
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
                raise bad_request(f"the request body holds more than {limit} JSON values")
            return scan(string, index)
        return scan_counted

    parse_object, parse_array = decoder.parse_object, decoder.parse_array
    decoder.parse_object = lambda where, strict, scan, *rest: parse_object(where, strict, counted(scan), *rest)
    decoder.parse_array = lambda where, scan: parse_array(where, counted(scan))
