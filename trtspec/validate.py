"""What trtspec reads from disk, checked where it enters: field by field, naming file and field.

Every reader of a user's file (model and drafter `config.json`, safetensors indexes, tokenizer
settings, training checkpoints, JSONL prompt and training sets) goes through these checks, so a
string where a number belongs, a list where an object belongs, a non-positive size or a truncated
file is one line, `FILE: FIELD must be ..., got ...`, and the code behind the door trusts what it
gets. Numeric ranges come from `trtspec.limits` (shared with flags and requests). Files with a
schema of their own are checked beside their reader, with these fields: the engine manifest in
`trtspec.engines.manifest`, BlockPilot's label sets and policies in `trtspec.blockpilot.labels`
and `trtspec.blockpilot.policy`.
"""

from __future__ import annotations

import gzip
import json
import math
import zlib
from pathlib import Path
from typing import Any, NoReturn

from trtspec.errors import TrtspecError
from trtspec.limits import Limit

_MISSING: Any = object()
POSITIVE_INT = Limit("value", 1, math.inf)
NON_NEGATIVE_INT = Limit("value", 0, math.inf)
POSITIVE = Limit("value", 0.0, math.inf, integer=False, low_open=True)
NON_NEGATIVE = Limit("value", 0.0, math.inf, integer=False)


class InputError(TrtspecError):
    """A file trtspec reads holds a field of the wrong type or out of range."""


def lone_surrogate(text: str) -> int | None:
    """Where `text` holds a lone surrogate (what a JSON "\\ud800" escape or bytes that are not UTF-8
    become in Python), else None: such a string is not Unicode text and cannot be encoded or tokenized."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return exc.start
    return None


def _kind(value) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null",
            int: "an integer", float: "a number"}.get(type(value), type(value).__name__)


class Fields:
    """The fields of one JSON object read from `source` (a path, or `path:line`), checked one by one.

    Absent fields and JSON nulls take the given default; without a default they are required."""

    def __init__(self, data: Any, source: str | Path, prefix: str = ""):
        self.source, self.prefix = str(source), prefix
        if not isinstance(data, dict):
            where = f"{prefix.rstrip('.')} " if prefix else ""
            raise InputError(f"{self.source}: {where}must be a JSON object, got {_kind(data)}")
        self.data = data

    def fail(self, key: str, message: str) -> NoReturn:
        raise InputError(f"{self.source}: {self.prefix}{key} {message}")

    def has(self, key: str) -> bool:
        return self.data.get(key) is not None

    def raw(self, key: str, default=_MISSING):
        value = self.data.get(key)
        if value is None:
            if default is _MISSING:
                self.fail(key, "is missing")
            return default
        return value

    def integer(self, key: str, limit: Limit = NON_NEGATIVE_INT, default=_MISSING) -> int:
        value = self.raw(key, default)
        return value if value is default else self._checked(key, value, limit, integer=True)

    def number(self, key: str, limit: Limit = NON_NEGATIVE, default=_MISSING) -> float:
        value = self.raw(key, default)
        return value if value is default else self._checked(key, value, limit, integer=False)

    def _checked(self, key: str, value, limit: Limit, integer: bool):
        checked = Limit(limit.name, limit.low, limit.high, integer, limit.low_open)
        try:
            return checked.check(value)
        except TrtspecError:
            self.fail(key, f"must be {checked.describe()}, got {json.dumps(value)[:60]}")

    def boolean(self, key: str, default=_MISSING) -> bool:
        value = self.raw(key, default)
        if not isinstance(value, bool):
            self.fail(key, f"must be true or false, got {json.dumps(value)[:60]}")
        return value

    def text(self, key: str, default=_MISSING) -> str:
        value = self.raw(key, default)
        if value is not default and not isinstance(value, str):
            self.fail(key, f"must be a string, got {_kind(value)}")
        if value is not default:
            self._unicode(key, value)
        return value

    def _unicode(self, key: str, value: str) -> None:
        at = lone_surrogate(value)
        if at is not None:
            self.fail(key, f"is not valid text: it holds a lone surrogate (U+{ord(value[at]):04X} at character "
                           f"{at}, e.g. a \\u{ord(value[at]):04x} escape)")

    def obj(self, key: str, default=_MISSING) -> "Fields | None":
        value = self.raw(key, default)
        if value is default:
            return value
        if not isinstance(value, dict):
            self.fail(key, f"must be an object, got {_kind(value)}")
        return Fields(value, self.source, f"{self.prefix}{key}.")

    def items(self, key: str, kind: type, noun: str, default=_MISSING, nonempty: bool = False) -> list:
        """A list whose every element is of `kind` (a boolean is not an integer)."""
        value = self.raw(key, default)
        if value is default:
            return value
        if not isinstance(value, list) or any(isinstance(v, bool) or not isinstance(v, kind) for v in value):
            self.fail(key, f"must be a list of {noun}, got {json.dumps(value)[:60]}")
        if nonempty and not value:
            self.fail(key, "must not be empty")
        for index, item in enumerate(value if kind is str else ()):
            self._unicode(f"{key}[{index}]", item)
        return value

    def ints(self, key: str, default=_MISSING, nonempty: bool = False) -> list[int]:
        return self.items(key, int, "integers", default, nonempty)

    def strings(self, key: str, default=_MISSING, nonempty: bool = False) -> list[str]:
        return self.items(key, str, "strings", default, nonempty)


def read_json_object(path: Path, what: str, error: type[TrtspecError] = InputError) -> dict:
    """A JSON file that must hold an object, naming the file in any error."""
    if not path.is_file():
        raise error(f"{what}: missing {path.name} in {path.parent}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise error(f"{what}: {path} is not valid JSON ({exc})") from None
    except OSError as exc:
        raise error(f"{what}: cannot read {path} ({exc.strerror})") from None
    if not isinstance(data, dict):
        raise error(f"{what}: {path} must hold a JSON object, got {_kind(data)}")
    return data


def token_ids(fields: Fields, key: str, vocab_size: int | None = None) -> list[int]:
    """An id or list of ids (e.g. eos_token_id), each in [0, vocab_size)."""
    value = fields.raw(key, [])
    ids = value if isinstance(value, list) else [value]
    high = (vocab_size or 2**31) - 1
    if any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i <= high for i in ids):
        fields.fail(key, f"must be a token id or a list of token ids in [0, {high}], got {json.dumps(value)[:60]}")
    return ids


def safetensors_index(path: Path, what: str, error: type[TrtspecError] = InputError) -> dict[str, str]:
    """`weight_map` of a sharded checkpoint's index: tensor name -> shard file, every shard a file
    beside the index (no absolute paths, no `..`)."""
    fields = Fields(read_json_object(path, what, error), path)
    weight_map = fields.obj("weight_map")
    if not weight_map.data:
        raise error(f"{path}: weight_map is empty")
    for name, shard in weight_map.data.items():
        if not isinstance(shard, str) or not shard:
            raise error(f"{path}: weight_map.{name} must be a shard file name, got {json.dumps(shard)[:60]}")
        if Path(shard).is_absolute() or ".." in Path(shard).parts:
            raise error(f"{path}: weight_map.{name} must name a file beside the index, got {shard!r}")
        if not (path.parent / shard).is_file():
            raise error(f"{path}: weight_map.{name} names {shard}, which is missing")
    return dict(weight_map.data)


def jsonl_records(path: str | Path, required: tuple[str, ...] = ()) -> list[tuple[str, dict]]:
    """(`path:line`, record) per non-empty line of a JSONL file (gzip-compressed where its name ends
    in .gz), each an object holding `required`."""
    source = Path(path)
    if not source.is_file():
        raise InputError(f"file not found: {source}" if not source.exists() else f"not a file: {source}")
    records = []
    try:
        opened = gzip.open(source, "rt", encoding="utf-8") if source.suffix == ".gz" else source.open(encoding="utf-8")
        with opened as lines:
            for number, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise InputError(f"{source}:{number}: not valid JSON ({exc.msg})") from None
                if not isinstance(record, dict) or any(key not in record for key in required):
                    raise InputError(f"{source}:{number}: each line must be an object with {', '.join(required)}")
                records.append((f"{source}:{number}", record))
    except UnicodeDecodeError:
        raise InputError(f"{source} is not valid UTF-8") from None
    except (gzip.BadGzipFile, EOFError, zlib.error) as exc:
        raise InputError(f"{source} is not a whole gzip file ({exc or 'cut short'})") from None
    except OSError as exc:
        raise InputError(f"cannot read {source} ({exc.strerror})") from None
    if not records:
        raise InputError(f"{source} holds no records")
    return records


def prompt_record(fields: Fields, response: bool = False) -> dict:
    """A prompt-set line: "prompt" a string (non-empty to be continued), optional "prompt_ids" a
    non-empty list of token ids; with `response` (training data), "response" a string and optional
    "response_ids"."""
    record = {"prompt": fields.text("prompt")}
    if not response and not record["prompt"].strip() and not fields.has("prompt_ids"):
        fields.fail("prompt", "is empty")
    record["prompt_ids"] = fields.ints("prompt_ids", None, nonempty=True)
    if record["prompt_ids"] is not None and any(i < 0 for i in record["prompt_ids"]):
        fields.fail("prompt_ids", "must hold token ids >= 0")
    if response:
        record["response"] = fields.text("response")
        record["response_ids"] = fields.ints("response_ids", None)
        if record["response_ids"] is not None and any(i < 0 for i in record["response_ids"]):
            fields.fail("response_ids", "must hold token ids >= 0")
    return record


def check_token_range(source: str, field: str, ids: list[int], vocab_size: int) -> None:
    """Token ids read from a file must index the model's vocabulary."""
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise InputError(f"{source}: {field} holds token id {bad[0]}, outside the vocabulary (size {vocab_size})")


def load_tensors(path: Path, what: str) -> dict:
    """Every tensor of a safetensors file (features, policy weights), or one line if it is damaged."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not path.is_file():
        raise InputError(f"{what}: missing {path}")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise InputError(f"{what}: cannot read {path} ({str(exc).splitlines()[0] if str(exc) else 'damaged'})") from None


def training_checkpoint(path: Path, keys: tuple[str, ...]) -> dict:
    """A training checkpoint (`OUTPUT.work/checkpoint.pt`) holding `keys`; a truncated or foreign
    file is one line that says how to recover."""
    import pickle

    import torch

    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except (RuntimeError, EOFError, OSError, ValueError, pickle.UnpicklingError, AttributeError, ImportError,
            IndexError, KeyError, TypeError) as exc:
        reason = (str(exc).splitlines() or [type(exc).__name__])[0][:120]
        raise InputError(f"{path}: cannot read the training checkpoint ({reason}); it may be truncated - "
                         "delete it to start over, or pass another --work directory") from None
    missing = [k for k in keys if not isinstance(state, dict) or k not in state]
    if missing:
        raise InputError(f"{path}: not a trtspec training checkpoint (lacks {', '.join(missing)}); delete it "
                         "or pass another --work directory")
    return state
