"""The valid range of every numeric flag and request field, declared once.

The CLI's options (`trtspec.commands.options.ranged`), the configs behind them
(`SamplingConfig`, `GenerationConfig`, ...) and the Triton model's requests all check values
against these, so a range is stated in one place, refused before any work, and its message
names the flag or field. The README's table of ranges is this module.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass

from trtspec.errors import TrtspecError, field_error

INT32_MAX = 2**31 - 1
MAX_BLOCK_SIZE = 64  # the largest block any engine or decode call accepts (export.bindings re-exports it)
SEED_MAX = 2**63 - 1  # seeds are int64 (Triton's seed input); torch takes up to 2**64 - 1
_ASCII_INT = re.compile(r"[+-]?[0-9]+")


@dataclass(frozen=True)
class Limit:
    """A closed range [low, high] of integers or finite reals (`low_open`: (low, high])."""

    name: str
    low: float
    high: float
    integer: bool = True
    low_open: bool = False
    why: str = ""  # where the bound comes from, when it is not a fixed number (the machine's cores, ...)

    def describe(self) -> str:
        kind = "an integer" if self.integer else "a number"
        if math.isinf(self.high):
            return f"{kind} {'>' if self.low_open else '>='} {self.low:g}"
        high = {INT32_MAX: "2**31-1", SEED_MAX: "2**63-1"}.get(self.high, f"{self.high:g}")
        return f"{kind} in {'(' if self.low_open else '['}{self.low:g}, {high}]" + (f" ({self.why})" if self.why else "")

    def check(self, value, label: str | None = None):
        """`value` as int or float if it is in range; else a one-line TrtspecError naming `label`."""
        label = label or self.name
        number = _number(value, self.integer)
        if number is None or not (self.low < number if self.low_open else self.low <= number) or number > self.high:
            raise TrtspecError(f"{label} must be {self.describe()}, got {value!r}")
        return number

    def check_field(self, value, field: str):
        """`check` for a request field: refused with a FieldError that names it."""
        with field_error(field):
            return self.check(value, field)

    def parse(self, text: str, label: str | None = None):
        """A command-line value: ASCII digits for integers (no '²', '1_000' or '٣'), a float for reals."""
        text = text.strip()
        if self.integer:
            value = int(text) if _ASCII_INT.fullmatch(text) else text
        else:
            try:
                value = float(text)
            except ValueError:
                value = text
        return self.check(value, label)


def _number(value, integer: bool) -> int | float | None:
    """An int (or finite float) from a Python or numpy scalar; None for anything else (bool, str, NaN)."""
    if hasattr(value, "item") and not isinstance(value, (list, tuple, dict)):
        value = value.item()  # numpy scalars from a Triton request
    if isinstance(value, bool):
        return None
    if integer:
        return value if isinstance(value, int) else None
    if isinstance(value, (int, float)):
        value = float(value)
        return value if math.isfinite(value) else None
    return None


def cpu_cores() -> int:
    """The CPUs this process may run on (its affinity: a container's or taskset's share), else the machine's."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


DEVICE = re.compile(r"auto|cpu|cuda(:[0-9]+)?")


def check_device(device, label: str = "device") -> str:
    """A device name trtspec runs on: auto, cpu, cuda or cuda:N."""
    if not isinstance(device, str) or not DEVICE.fullmatch(device.strip()):
        raise TrtspecError(f"{label} must be auto, cpu, cuda or cuda:N, got {device!r}")
    return device.strip()


def parse_int(text: str) -> int | None:
    """A non-negative integer written in ASCII digits, else None (`str.isdigit` also accepts '²',
    which `int` refuses, and `int` accepts '1_000' and '٣')."""
    text = text.strip()
    return int(text) if re.fullmatch(r"[0-9]+", text) else None


# Sampling. Logits are shifted by their maximum before dividing by T, so a tiny T approaches greedy
# decoding instead of overflowing the softmax. Sampling runs in float32, where a T or top-p below
# its smallest normal number (SAMPLING_RESOLUTION, ~1.2e-38) rounds to 0 (1e-50 would divide 0 by
# 0): SamplingConfig decodes both as their limit, greedy (the likeliest token), in every path.
SAMPLING_RESOLUTION = 2.0**-126  # float32's smallest normal number (torch.finfo(torch.float32).tiny)
TEMPERATURE = Limit("temperature", 0.0, math.inf, integer=False)
TOP_K = Limit("top-k", -1, INT32_MAX)            # 0 or -1 (vLLM's) = off; k >= vocabulary is off too
TOP_P = Limit("top-p", 0.0, 1.0, integer=False, low_open=True)
SEED = Limit("seed", 0, SEED_MAX)
# A sampled request's drafts are drawn at this fraction of its temperature (0: the drafter's argmax).
PROPOSAL_TEMPERATURE = Limit("proposal temperature", 0.0, math.inf, integer=False)
# Prompt lookup copies drafts where the text's last N or more tokens occurred before (0: off); it
# looks up suffixes of at most 4 tokens (trtspec.runtime.lookup).
PROMPT_LOOKUP = Limit("prompt lookup", 0, 4)
# With prompt lookup, a cycle whose copy is shorter verifies this many positions, the drafter filling
# them (0: every cycle verifies its whole block; 1: cycles without a copy are autoregressive steps).
DRAFT_WIDTH = Limit("draft width", 0, MAX_BLOCK_SIZE)
# Requests and prompt sets.
MAX_NEW_TOKENS = Limit("max new tokens", 1, INT32_MAX)
MAX_CONTEXT = Limit("max context", 2, INT32_MAX)
LIMIT = Limit("limit", 1, INT32_MAX)             # first N prompts
BATCH = Limit("batch", 1, 64)                    # requests decoded together (export.bindings.MAX_BATCH)
# Requests a continuous-batching engine decodes together (serve --max-concurrency, the Triton
# model's max_running): each holds a KV cache for the whole context, so the memory those need is
# also checked against the device's before they are allocated (trtspec.runtime.memory).
GPU_MEMORY_FRACTION = Limit("gpu memory fraction", 0.0, 1.0, integer=False, low_open=True)
CONCURRENCY = Limit("concurrency", 1, 4096)
CHOICES = Limit("n", 1, 16)                                          # choices one request asks for (each an engine request)
MIN_TOKENS = Limit("min_tokens", 0, INT32_MAX)
MIN_P = Limit("min_p", 0.0, 1.0, integer=False)
PENALTY = Limit("penalty", -2.0, 2.0, integer=False)                  # frequency and presence penalties (OpenAI's range)
REPETITION_PENALTY = Limit("repetition_penalty", 0.0, 2.0, integer=False, low_open=True)
LOGIT_BIAS = Limit("logit_bias", -100.0, 100.0, integer=False)       # one token's bias (OpenAI's range)
LOGPROBS = Limit("logprobs", 0, 20)                                   # top alternatives per token (vLLM's default cap)
COUNT = Limit("count", 1, INT32_MAX)             # repeats, batch sizes, steps, layers, instances, ...
NON_NEGATIVE = Limit("count", 0, INT32_MAX)      # optional steps, triton-repo's threads per instance (0 = default)
# CPU threads (--threads, TRTSPEC_THREADS): each is an OS thread per thread pool (torch's, and
# ONNX Runtime's per session), so more than the cores only contend, and thousands exhaust the
# process limit.
THREADS = Limit("threads", 1, cpu_cores(), why="the CPU cores this process may use")
POSITIVE_REAL = Limit("value", 0.0, math.inf, integer=False, low_open=True)  # learning rates
NON_NEGATIVE_REAL = Limit("value", 0.0, math.inf, integer=False)             # weights, decays (0 = default)
SHARE = Limit("share", 0.0, 1.0, integer=False)                               # a loss term's share
TOKEN_ID = Limit("token id", 0, INT32_MAX)
# Stops of one request (`run --stop/--stop-token-id`, the Triton model's stop/stop_token_ids):
# counted, and each string's length checked, before any of them is tokenized.
STOPS = Limit("stops", 0, 16)                    # stop strings, and stop token ids, each
STOP_CHARS = Limit("stop string length", 1, 1024)
DRAFT_VOCAB = Limit("draft vocabulary size", 2, INT32_MAX)  # K most frequent ids; <= the vocabulary (checked on load)
BLOCK_SIZE = Limit("block size", 2, MAX_BLOCK_SIZE)  # 1 is autoregressive decoding (--ar), not a block
# response_format: the most times a JSON schema's `pattern` may repeat a part of itself, nested counts
# multiplied (trtspec.runtime.grammar): llguidance gives up partway through an unanchored a{1000}.
PATTERN_REPEATS = Limit("pattern repetition", 1, 512)


def check_block_size(size, label: str = "block size") -> int:
    """`size` if it is a block size in [2, MAX_BLOCK_SIZE] (what every flag, config and request allows)."""
    return BLOCK_SIZE.check(size, label)
