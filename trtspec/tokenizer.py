"""Text in and out: the target directory's tokenizer, chat template and stop ids."""

from __future__ import annotations

from pathlib import Path

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from trtspec.errors import CheckpointError, TrtspecError
from trtspec.limits import parse_int
from trtspec.models.checkpoint import checkpoint_dir, read_optional_json
from trtspec.validate import Fields, token_ids


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

    def encode(self, text: str, chat: bool = False) -> list[int]:
        if chat:
            return self.encode_chat([{"role": "user", "content": text}])
        return self.tokenizer.encode(text).ids

    def encode_chat(self, messages: list[dict], label: str = "--chat") -> list[int]:
        """The ids of a conversation ({role, content} messages) in the chat template, ready for the reply."""
        return self.tokenizer.encode(self.apply_chat_template(messages, label), add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def apply_chat_template(self, messages: str | list[dict], label: str = "--chat") -> str:
        """The prompt text of one user message, or of a conversation of {role, content} messages."""
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        if not self.chat_template:
            raise TrtspecError(f"{label}: the target has no chat_template (tokenizer_config.json or chat_template.jinja)")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_template_error
        try:
            text = env.from_string(self.chat_template).render(
                messages=messages, add_generation_prompt=True,
                bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        except Exception as exc:  # noqa: BLE001 - a template is user code: it may raise anything while rendering
            message = " ".join(str(exc).split()) or type(exc).__name__
            raise TrtspecError(f"{label}: the target's chat template failed ({type(exc).__name__}: {message})") from None
        if not isinstance(text, str):
            raise TrtspecError(f"{label}: the target's chat template did not render text")
        return text

    def stop_id(self, value: str) -> int:
        """A `--stop` value: a token id, or text that is exactly one token."""
        token = parse_int(value)  # ASCII digits only: '²'.isdigit() is True, but it is text, not an id
        if token is not None:
            if token >= self.tokenizer.get_vocab_size(with_added_tokens=True):
                raise TrtspecError(f"--stop {value}: no such token id")
            return token
        token = self.tokenizer.token_to_id(value)
        if token is not None:
            return token
        ids = self.tokenizer.encode(value, add_special_tokens=False).ids
        if len(ids) != 1:
            raise TrtspecError(f"--stop {value!r} is {len(ids)} tokens; stops must be single tokens or ids")
        return ids[0]

    def streamer(self) -> DecodeStream:
        """Incremental detokenizer: `.step(tokenizer, id)` returns new text once it is complete UTF-8."""
        return DecodeStream(skip_special_tokens=True)


def _raise_template_error(message: str):
    raise TemplateError(message)


class TextStream:
    """Committed token ids in, text pieces out, which join to exactly the decoded text (cut before
    the first stop string, if any). Every front end streams through it: Pipeline.generate, the
    Triton model and `trtspec serve`. Text that could still begin a stop string, and the bytes
    of an unfinished UTF-8 sequence, are held back until they cannot / until `finish`."""

    def __init__(self, codec: "TextCodec", stops: tuple[str, ...] = ()):
        self.codec, self.stops = codec, stops
        self.decoder = codec.streamer()
        self.text = ""       # all decoded text so far (until a stop: then the text before it)
        self.sent = 0        # characters of `text` handed out
        self.tokens: list[int] = []
        self.stopped = False

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
            whole = self.codec.decode(tokens)
            if whole.startswith(self.text) and len(whole) > len(self.text):  # bytes the decoder held back
                self._extend(whole[len(self.text):])
            self.tokens = list(tokens)
        return self._take(final=True)

    def _extend(self, piece: str) -> None:
        start = max(0, len(self.text) - max(map(len, self.stops), default=0))
        self.text += piece
        found = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        if found:
            self.text, self.stopped = self.text[:min(found)], True

    def _take(self, final: bool) -> str:
        end = len(self.text)
        if not final and not self.stopped:
            for stop in self.stops:  # hold back a tail that may begin a stop string
                for k in range(min(len(stop) - 1, end), 0, -1):
                    if self.text.endswith(stop[:k]):
                        end = min(end, len(self.text) - k)
                        break
        piece, self.sent = self.text[self.sent:end], max(self.sent, end)
        return piece
