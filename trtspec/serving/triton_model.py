"""The Triton python-backend model: one engine per model instance, one request at a time.

Triton imports this through the generated `model.py` of a repository made by
`trtspec triton-repo`. Requests carry `text_input` and optional `max_tokens`, `temperature`,
`seed`, `block_size` (0 = auto), `grow_to` (a growing block B:G; 0 = none) and `stream`; responses
carry `text_output` and `stats` (JSON).
In the decoupled (streaming) model each cycle's committed text is sent as it is produced,
followed by a final empty response with the statistics. A bad request gets its own error
response; the instance keeps serving the others. A request the client cancels (a closed stream,
a dropped call) stops decoding within a cycle or `CANCEL_POLL_S`, so the instance is free for the
next one instead of finishing work nobody will read.
"""

from __future__ import annotations

import json
import time
from typing import Callable

import numpy as np

try:  # only importable inside Triton's python backend stub
    import triton_python_backend_utils as pb_utils
except ImportError:  # pragma: no cover - imported for documentation or tests outside Triton
    pb_utils = None

from trtspec.errors import Cancelled, TrtspecError

DEFAULT_MAX_TOKENS = 256
CANCEL_POLL_S = 0.05  # asking Triton is a round trip to the server process: at most this often


def cancel_probe(is_cancelled: Callable[[], bool] | None) -> Callable[[], bool] | None:
    """A `cancelled` callable for `Pipeline.generate` that asks Triton at most every CANCEL_POLL_S."""
    if is_cancelled is None:  # a python backend older than request cancellation
        return None
    last = time.monotonic()

    def cancelled() -> bool:
        nonlocal last
        now = time.monotonic()
        if now - last < CANCEL_POLL_S:
            return False
        last = now
        return bool(is_cancelled())
    return cancelled


def _scalar(request, name: str, default):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return default
    value = tensor.as_numpy().reshape(-1)
    if value.size != 1:
        raise TrtspecError(f"{name} must hold exactly one value, got {value.size}")
    return value[0].item() if hasattr(value[0], "item") else value[0]


def _text(request) -> str:
    raw = _scalar(request, "text_input", None)
    if raw is None:
        raise TrtspecError("text_input is required")
    try:
        return raw.decode("utf-8") if isinstance(raw, bytes) else str(raw)
    except UnicodeDecodeError:
        raise TrtspecError("text_input is not valid UTF-8") from None


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        import torch

        from trtspec.api import Pipeline
        from trtspec.runtime.sampling import SamplingConfig

        config = json.loads(args["model_config"])
        parameters = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        threads = int(parameters.get("threads", "0"))
        if threads > 0:
            torch.set_num_threads(threads)
        self.pipeline = Pipeline(engine=parameters["engine_dir"], device=parameters.get("device", "auto"))
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(config)
        self._sampling = SamplingConfig

    def _config(self, request):
        """The request's fields as a GenerationConfig, whose checks (trtspec.limits, shared with the
        CLI) refuse out-of-range values: temperature >= 0 and finite, seed in [0, 2**63-1],
        max_tokens in [1, 2**31-1], block_size 0 (auto) or in [2, 64], grow_to 0 or above it."""
        from trtspec.runtime.decode import GenerationConfig

        seed = _scalar(request, "seed", None)
        sampling = self._sampling(temperature=_scalar(request, "temperature", 0.0), seed=seed)
        return GenerationConfig(block_size=_scalar(request, "block_size", self.pipeline.default_block_size),
                                grow_to=_scalar(request, "grow_to", 0),
                                max_new_tokens=_scalar(request, "max_tokens", DEFAULT_MAX_TOKENS), sampling=sampling)

    @staticmethod
    def _error(exc: Exception):
        """A per-request error, in one line; INVALID_ARG (HTTP 400) where the backend supports error codes."""
        message = " ".join(str(exc).split())
        code = getattr(pb_utils.TritonError, "INVALID_ARG", None)
        error = pb_utils.TritonError(message, code) if code is not None else pb_utils.TritonError(message)
        return pb_utils.InferenceResponse(error=error)

    @staticmethod
    def _response(text: str, stats: dict | None):
        tensors = [pb_utils.Tensor("text_output", np.array([text.encode("utf-8")], dtype=np.object_))]
        tensors.append(pb_utils.Tensor("stats", np.array([json.dumps(stats or {}).encode()], dtype=np.object_)))
        return pb_utils.InferenceResponse(output_tensors=tensors)

    def _generate(self, request, on_text=None, is_cancelled=None) -> tuple[str, dict]:
        result = self.pipeline.generate(_text(request), self._config(request), on_text=on_text,
                                        cancelled=cancel_probe(is_cancelled))
        stats = result.generation.stats.to_dict()
        return result.text, stats

    @staticmethod
    def _cancelled_response():
        code = getattr(pb_utils.TritonError, "CANCELLED", None)
        message = "the request was cancelled"
        error = pb_utils.TritonError(message, code) if code is not None else pb_utils.TritonError(message)
        return pb_utils.InferenceResponse(error=error)

    def execute(self, requests):
        if self.decoupled:
            for request in requests:
                self._stream(request)
            return None
        responses = []
        for request in requests:
            try:
                responses.append(self._response(*self._generate(request, is_cancelled=getattr(
                    request, "is_cancelled", None))))
            except TrtspecError as exc:
                responses.append(self._error(exc))
            except Cancelled:
                responses.append(self._cancelled_response())
        return responses

    def _stream(self, request) -> None:
        sender = request.get_response_sender()
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        is_cancelled = getattr(sender, "is_cancelled", None)
        try:
            stream = bool(_scalar(request, "stream", True))
            if stream:
                text, stats = self._generate(request, on_text=lambda piece: sender.send(self._response(piece, None)),
                                             is_cancelled=is_cancelled)
                sender.send(self._response("", stats), flags=final)
            else:
                sender.send(self._response(*self._generate(request, is_cancelled=is_cancelled)), flags=final)
        except TrtspecError as exc:
            sender.send(self._error(exc), flags=final)
        except Cancelled:
            sender.send(flags=final)  # nobody reads a response any more; only close the stream
