"""Text in and out: the target directory's tokenizer, chat template and stop ids."""

from __future__ import annotations

from pathlib import Path

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from trtspec.errors import CheckpointError, TrtspecError
from trtspec.limits import STOP_CHARS, STOPS, parse_int
from trtspec.models.checkpoint import checkpoint_dir, read_optional_json
from trtspec.validate import Fields, lone_surrogate, token_ids


def _token_text(value) -> str | None:
    """tokenizer_config.json stores special tokens either as strings or as AddedToken dicts."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _chat_template(fields: Fields) -> str | None:
    """tokenizer_config.json's chat_template: a string, or Hugging Face's list of {name, template}
    (the one named "default" is used)."""
    value = fields.raw("chat_template", None)
    if value is None or isinstance(value, str):
        return value
    named = fields.items("chat_template", dict, "{name, template} objects")
    templates = {t.get("name"): t.get("template") for t in named}
    if not isinstance(templates.get("default"), str):
        fields.fail("chat_template", f"lists templates {sorted(map(str, templates))} but no \"default\" one "
                                     "with a string template")
    return templates["default"]


class TextCodec:
    def __init__(self, path: str | Path):
        directory = checkpoint_dir(path, "target")
        tokenizer_file = directory / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise CheckpointError(f"target: missing tokenizer.json in {directory}")
        try:
            self.tokenizer = Tokenizer.from_file(str(tokenizer_file))
        except Exception as exc:  # the tokenizers library raises a bare Exception on bad files
            raise CheckpointError(f"target: cannot read {tokenizer_file} ({exc})") from None
        settings_file = directory / "tokenizer_config.json"
        settings = Fields(read_optional_json(settings_file, "target tokenizer"), settings_file)
        self.chat_template = _chat_template(settings)
        template_file = directory / "chat_template.jinja"
        if self.chat_template is None and template_file.is_file():
            try:
                self.chat_template = template_file.read_text(encoding="utf-8")
            except UnicodeDecodeError:
                raise CheckpointError(f"target: {template_file} is not valid UTF-8") from None
        self.bos_token = _token_text(settings.data.get("bos_token"))
        self.eos_token = _token_text(settings.data.get("eos_token"))
        ids = []
        for name in ("generation_config.json", "config.json"):
            path = directory / name
            ids += token_ids(Fields(read_optional_json(path, "target"), path), "eos_token_id")
        self.stop_ids: tuple[int, ...] = tuple(dict.fromkeys(ids))
        self._longest_token: int | None = None  # UTF-8 bytes of the longest vocabulary entry (text_bytes_cap)

    def encode(self, text: str, chat: bool = False) -> list[int]:
        if chat:
            return self.encode_chat([{"role": "user", "content": text}])
        check_text(text)
        return self.tokenizer.encode(text).ids

    def encode_unlocked(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """`encode(text)` with the GIL released while the tokenizer works (its encode_batch releases
        it, encode does not): a long text tokenized on a worker thread then leaves the process's
        other threads (a server's streams) running. A chat template's text takes
        `add_special_tokens=False`, as in `encode_chat`."""
        check_text(text)
        return self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def text_bytes_cap(self, tokens: int) -> int:
        """A byte length no text of fewer than `tokens` tokens reaches: each token covers at most
        the UTF-8 bytes of the longest vocabulary entry, doubled for normalizers that shorten text
        (NFC composes). A longer text is refused as too long without tokenizing it."""
        if self._longest_token is None:
            vocab = self.tokenizer.get_vocab(with_added_tokens=True)
            self._longest_token = max((len(key.encode("utf-8", "surrogatepass")) for key in vocab), default=1)
        return 2 * tokens * self._longest_token

    def encode_chat(self, messages: list[dict], label: str = "--chat") -> list[int]:
        """The ids of a conversation ({role, content} messages) in the chat template, ready for the reply."""
        text = self.apply_chat_template(messages, label)
        check_text(text, label)
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: str | list[dict], label: str = "--chat", *,
                            add_generation_prompt: bool = True, continue_final_message: bool = False,
                            template_kwargs: dict | None = None) -> str:
        """The prompt text of one user message, or of a conversation of {role, content} messages.
        `template_kwargs` are passed to the template (Qwen3's `enable_thinking`, ...);
        `continue_final_message`: the text ends with the last message's content, open, so the model
        continues it (no generation prompt)."""
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        if not self.chat_template:
            raise TrtspecError(f"{label}: the target has no chat_template (tokenizer_config.json or chat_template.jinja)")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_template_error
        try:
            text = env.from_string(self.chat_template).render({
                **(template_kwargs or {}), "messages": messages,
                "add_generation_prompt": add_generation_prompt and not continue_final_message,
                "bos_token": self.bos_token or "", "eos_token": self.eos_token or ""})
        except Exception as exc:  # noqa: BLE001 - a template is user code: it may raise anything while rendering
            message = " ".join(str(exc).split()) or type(exc).__name__
            raise TrtspecError(f"{label}: the target's chat template failed ({type(exc).__name__}: {message})") from None
        if not isinstance(text, str):
            raise TrtspecError(f"{label}: the target's chat template did not render text")
        if continue_final_message:
            final = messages[-1]["content"] if messages else ""
            end = text.rfind(final) if final else -1
            if end < 0:
                raise TrtspecError(f"{label}: the chat template's text does not hold the final message, so it "
                                   "cannot be continued")
            text = text[:end + len(final)]
        return text

    def stop_strings(self, values, label: str = "--stop") -> tuple[tuple[str, ...], tuple[int, ...]]:
        """Stop strings, matched in the decoded text (TextStream cuts the text before the first);
        returns them and the ids of those that are exactly one token, which also end decoding at
        that token. Their count and lengths are checked before any is tokenized; a raw vocabulary
        key ('Ċ') is text like any other, never a token."""
        values = check_stop_strings(values, label)
        ids = []
        for value in values:
            single = self.tokenizer.encode(value, add_special_tokens=False).ids
            if len(single) != 1:
                continue
            if self.decode(single) == value:
                ids.append(single[0])
            elif self.tokenizer.decode(single, skip_special_tokens=False) == value:
                raise TrtspecError(f"{label} {_shown(value)} is a special token, which never appears in the text: "
                                   f"stop at its id instead ({_ID_FORM.get(label, 'a stop token id')} {single[0]})")
        return tuple(dict.fromkeys(values)), tuple(dict.fromkeys(ids))

    def stop_token_ids(self, values, label: str = "--stop-token-id") -> tuple[int, ...]:
        """Stop token ids (the output ends after the first): each an integer id of the vocabulary."""
        values = list(values)
        if len(values) > STOPS.high:
            raise TrtspecError(f"{label}: at most {STOPS.high:g} stop token ids, got {len(values)}")
        vocab = self.tokenizer.get_vocab_size(with_added_tokens=True)
        ids = []
        for value in values:
            token = value.item() if hasattr(value, "item") else value  # numpy scalars from a Triton request
            if isinstance(token, str):
                token = parse_int(token)  # ASCII digits only: '²'.isdigit() is True, but it is not an id
            if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab:
                raise TrtspecError(f"{label}: {_shown(value)} is not a token id in 0..{vocab - 1}")
            ids.append(token)
        return tuple(dict.fromkeys(ids))

    def streamer(self, skip_special_tokens: bool = True) -> DecodeStream:
        """Incremental detokenizer: `.step(tokenizer, id)` returns new text once it is complete UTF-8."""
        return DecodeStream(skip_special_tokens=skip_special_tokens)


def _raise_template_error(message: str):
    raise TemplateError(message)


_ID_FORM = {"--stop": "--stop-token-id", "stop": "stop_token_ids"}  # where a stop string's label says ids go


def _shown(value) -> str:
    """A value for a one-line message: its repr, shortened."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_stop_strings(values, label: str = "--stop") -> list[str]:
    """Stop strings checked without the tokenizer (cheap, so a request is refused before any work):
    at most STOPS of them, each text of 1 to STOP_CHARS characters."""
    values = list(values)
    if len(values) > STOPS.high:
        raise TrtspecError(f"{label}: at most {STOPS.high:g} stop strings, got {len(values)}")
    for value in values:
        if not isinstance(value, str):
            raise TrtspecError(f"{label}: stop strings are text, got {_shown(value)}")
        if not value or len(value) > STOP_CHARS.high:
            raise TrtspecError(f"{label}: a stop string holds 1 to {STOP_CHARS.high:g} characters, got {len(value)}")
        check_text(value, f"{label} {_shown(value)}")
    return values


def check_text(text: str, label: str = "the text") -> None:
    """Refuse text with lone surrogates (what Python makes of bytes that are not UTF-8 in argv or a
    JSON "\\ud800" escape): it is not Unicode text, and the tokenizer cannot take it."""
    where = lone_surrogate(text)
    if where is not None:
        raise TrtspecError(f"{label} is not valid text: it holds a lone surrogate (U+{ord(text[where]):04X} at "
                           f"character {where}), e.g. bytes that are not UTF-8")


class TextStream:
    """Committed token ids in, text pieces out, which join to exactly the decoded text (cut before
    the first stop string, if any). Every front end streams through it: Pipeline.generate, the
    Triton model and `trtspec serve`. Text that could still begin a stop string, and the bytes
    of an unfinished UTF-8 sequence, are held back until they cannot / until `finish`. Each
    character is looked at once per stop string (`_StopMatch`): the work is linear in the text.
    `keep_stop`: the text ends with the stop string instead (vLLM's include_stop_str_in_output);
    `skip_special`: special tokens (EOS, ...) decode to nothing (the default) or to their text."""

    def __init__(self, codec: "TextCodec", stops: tuple[str, ...] = (), keep_stop: bool = False,
                 skip_special: bool = True):
        self.codec, self.stops = codec, tuple(stops)
        self.keep_stop, self.skip_special = keep_stop, skip_special
        self.decoder = codec.streamer(skip_special)
        self._match = _StopMatch(self.stops) if self.stops else None
        self._sent: list[str] = []  # the pieces handed out
        self._held = ""             # decoded text not handed out yet (a possible stop's beginning, or new)
        self.tokens: list[int] = []
        self.stopped = False

    @property
    def text(self) -> str:
        """All decoded text so far (after a stop: the text before it)."""
        return "".join(self._sent) + self._held

    def push(self, tokens: list[int]) -> str:
        """The text that can be sent after these tokens ('' when none); stops at a stop string."""
        for token in tokens:
            if self.stopped:
                break
            self.tokens.append(token)
            piece = self.decoder.step(self.codec.tokenizer, token)
            if piece:
                self._extend(piece)
        return self._take(final=False)

    def finish(self, tokens: list[int]) -> str:
        """The rest once the request has ended (`tokens`: all it committed)."""
        if not self.stopped:
            whole, text = self.codec.decode(tokens, self.skip_special), self.text
            if whole.startswith(text) and len(whole) > len(text):  # bytes the decoder held back
                self._extend(whole[len(text):])
            self.tokens = list(tokens)
        return self._take(final=True)

    def _extend(self, piece: str) -> None:
        # A stop cannot begin in text already sent: that text ended no possible stop beginning.
        cut = self._match.feed(piece) if self._match is not None else None
        self._held += piece
        if cut is not None:
            if self.keep_stop:
                cut -= len(self._match.matched)
            self._held, self.stopped = self._held[:len(self._held) - cut], True

    def _take(self, final: bool) -> str:
        keep = self._match.longest if self._match is not None and not final and not self.stopped else 0
        piece, self._held = self._held[:len(self._held) - keep], self._held[len(self._held) - keep:]
        if piece:
            self._sent.append(piece)
        return piece


class _StopMatch:
    """Knuth-Morris-Pratt matching of every stop string against text fed piece by piece: for each
    stop, the length of its longest beginning that ends the text so far. Those lengths say how
    much of the text to hold back, and a length reaching the whole stop is a match; each new
    character costs amortized O(1) per stop, whatever the stops' lengths."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = stops
        self.fallback = [_kmp_fallback(stop) for stop in stops]
        self.ends = [0] * len(stops)  # per stop: characters of its beginning that end the text
        self.matched = ""             # the stop that `feed` found

    @property
    def longest(self) -> int:
        """Characters at the end of the text that may begin a stop."""
        return max(self.ends)

    def feed(self, piece: str) -> int | None:
        """None, or (when a stop ends inside `piece`) how many characters at the end of the text,
        counted back from its end, begin with the earliest such stop and are cut."""
        cut = None
        for i, (stop, fallback) in enumerate(zip(self.stops, self.fallback)):
            k, j = self.ends[i], 0
            while j < len(piece):
                if k == 0:  # skip to the next character that begins the stop (C speed)
                    j = piece.find(stop[0], j)
                    if j < 0:
                        j = len(piece)
                        break
                    k, j = 1, j + 1
                else:
                    char = piece[j]
                    while k and stop[k] != char:
                        k = fallback[k - 1]
                    k, j = k + (stop[k] == char), j + 1
                if k == len(stop):
                    back = len(piece) - j + k  # from the end of the text: farther back is earlier
                    if cut is None or back > cut:
                        cut, self.matched = back, stop
                    break
            self.ends[i] = k
        return cut


def _kmp_fallback(stop: str) -> list[int]:
    """KMP's failure function: [i] is the longest proper beginning of stop[:i + 1] that also ends it."""
    fallback, k = [0] * len(stop), 0
    for i in range(1, len(stop)):
        while k and stop[i] != stop[k]:
            k = fallback[k - 1]
        k += stop[i] == stop[k]
        fallback[i] = k
    return fallback
