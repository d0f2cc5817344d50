"""The output processor: a request's committed token ids in, its text out, ended at its first stop string.

The engine runs one per request when it has a tokenizer: each cycle's tokens are detokenized
incrementally (`trtspec.tokenizer.TextStream`, with the config's `keep_stop` and `skip_special`),
and a stop string (`GenerationConfig.stop`) ends the request at once, with finish reason "stop" and
the tokens through the one that completed it.
So text is cut in one place for every caller, as vLLM v1's OutputProcessor does; the controller
below it knows only token ids.
"""

from __future__ import annotations

from trtspec.tokenizer import TextCodec, TextStream


class OutputProcessor:
    """One request's text: pieces as its tokens are committed, which join to exactly its text."""

    def __init__(self, codec: TextCodec, stops: tuple[str, ...] = (), keep_stop: bool = False,
                 skip_special: bool = True, streamed: bool = True):
        self.stream = TextStream(codec, stops, keep_stop, skip_special)
        # Unstreamed and without stop strings, nothing reads the text before the end: it is decoded
        # once in `finish` (token by token it cost ~15 us a token, 2% of a small model's batch-1 decode).
        self.deferred = not streamed and not stops

    @property
    def stopped(self) -> bool:
        """Whether the text reached a stop string: the request ends here."""
        return self.stream.stopped

    @property
    def text(self) -> str:
        return self.stream.text

    def push(self, tokens: list[int]) -> tuple[str, list[int]]:
        """The text these tokens complete ('' when none yet) and the tokens the request returns:
        all of them, or, at a stop string, those through the one that completed it."""
        if self.deferred:
            return "", tokens
        before = len(self.stream.tokens)
        piece = self.stream.push(tokens)
        return piece, tokens[:len(self.stream.tokens) - before] if self.stream.stopped else tokens

    def finish(self, tokens: list[int]) -> str:
        """The rest of the text once the request has ended (`tokens`: all it returns): bytes held
        back, such as an unfinished UTF-8 sequence; a stop string may end among them."""
        return self.stream.finish(tokens)
