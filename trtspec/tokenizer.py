"""Text in and out: the target directory's tokenizer, chat template and stop ids."""

from __future__ import annotations

from pathlib import Path

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from trtspec.errors import CheckpointError, TrtspecError
from trtspec.models.checkpoint import checkpoint_dir, read_optional_json


def _token_text(value) -> str | None:
    """tokenizer_config.json stores special tokens either as strings or as AddedToken dicts."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _as_ids(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, list) else [value])]


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
        settings = read_optional_json(directory / "tokenizer_config.json", "target tokenizer")
        self.chat_template = settings.get("chat_template")
        template_file = directory / "chat_template.jinja"
        if self.chat_template is None and template_file.is_file():
            self.chat_template = template_file.read_text(encoding="utf-8")
        self.bos_token = _token_text(settings.get("bos_token"))
        self.eos_token = _token_text(settings.get("eos_token"))
        generation = read_optional_json(directory / "generation_config.json", "target generation config")
        model = read_optional_json(directory / "config.json", "target")
        self.stop_ids: tuple[int, ...] = tuple(dict.fromkeys(
            _as_ids(generation.get("eos_token_id")) + _as_ids(model.get("eos_token_id"))))

    def encode(self, text: str, chat: bool = False) -> list[int]:
        if chat:
            return self.tokenizer.encode(self.apply_chat_template(text), add_special_tokens=False).ids
        return self.tokenizer.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def apply_chat_template(self, user_message: str) -> str:
        if not self.chat_template:
            raise TrtspecError("--chat: the target has no chat_template (tokenizer_config.json or chat_template.jinja)")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_template_error
        try:
            return env.from_string(self.chat_template).render(
                messages=[{"role": "user", "content": user_message}], add_generation_prompt=True,
                bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        except TemplateError as exc:
            raise TrtspecError(f"--chat: the chat template failed: {exc}") from None

    def stop_id(self, value: str) -> int:
        """A `--stop` value: a token id, or text that is exactly one token."""
        if value.isdigit():
            token = int(value)
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
