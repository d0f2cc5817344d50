"""The Triton python-backend model: every request of a model instance joins one batched engine.

Triton imports this through the generated `model.py` of a repository made by
`trtspec triton-repo`. Requests carry `text_input` and optional `max_tokens`, `temperature`,
`seed`, `block_size` (0 = auto), `grow_to` (a growing block B:G; 0 = none) and `stream`; responses
carry `text_output` and `stats` (JSON, including `batch_mean`: how many requests shared this
request's cycles on average, `queue_s` and `ttft_s`).

Each instance owns one `trtspec.runtime.engine.Engine` (a background thread that decodes all its
requests together). `execute()` only translates each request and submits it, then returns at
once, so the next requests join the running batch instead of waiting for the instance; every
response goes back through the request's response sender:

* NAME_stream (decoupled) sends each cycle's committed text as the cycle commits, then a final
  empty response with the statistics (`stream` false: one response with the whole text).
* NAME is not decoupled (Triton's HTTP and unary gRPC endpoints refuse decoupled models), but
  it answers the same way: one response per request, sent when the request finishes.

The engine thread's callbacks only queue events; one *outbox* thread per instance turns them
into text and responses and sends them, and every CANCEL_POLL_S asks Triton which requests the
client has cancelled (a closed stream, a dropped call) and withdraws them from the engine, which
frees their slots before its next cycle. A bad request gets its own error response (HTTP 400; a
full queue: 503) and the others keep decoding.
"""

from __future__ import annotations

import json
import queue
import threading
import time

import numpy as np

try:  # only importable inside Triton's python backend stub
    import triton_python_backend_utils as pb_utils
except ImportError:  # pragma: no cover - imported for documentation or tests outside Triton
    pb_utils = None

from trtspec.errors import Cancelled, TrtspecError
from trtspec.runtime.engine import Busy
from trtspec.tokenizer import TextStream
from trtspec.serving.triton import ENGINE_PARAMETERS

DEFAULT_MAX_TOKENS = 256
CANCEL_POLL_S = 0.05  # asking Triton is a round trip to the server process: at most this often
LOAD_POLL_S = 0.5     # how often the engine's load gauges are refreshed


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


def _error(exc: BaseException, code: str):
    """An error response in one line, with Triton's error code `code` where the backend has codes
    (INVALID_ARG: HTTP 400; UNAVAILABLE: 503; CANCELLED; INTERNAL: 500)."""
    message = " ".join(str(exc).split())
    code = getattr(pb_utils.TritonError, code, None)
    error = pb_utils.TritonError(message, code) if code is not None else pb_utils.TritonError(message)
    return pb_utils.InferenceResponse(error=error)


def _response(text: str, stats: dict | None):
    tensors = [pb_utils.Tensor("text_output", np.array([text.encode("utf-8")], dtype=np.object_)),
               pb_utils.Tensor("stats", np.array([json.dumps(stats or {}).encode()], dtype=np.object_))]
    return pb_utils.InferenceResponse(output_tensors=tensors)


class _Call:
    """One Triton request in flight: its response sender, the engine's handle and, when it
    streams, the text sent so far. Only the outbox thread touches it after submission."""

    def __init__(self, sender, stream=None):
        self.sender, self.stream = sender, stream  # stream: a TextStream when the call streams
        self.request = None  # the engine's Request, once submitted
        self.finished = False


class _Outbox:
    """The instance's sending thread: events from the engine thread and from execute() become
    responses, in order; between events it polls the live calls for cancellation."""

    COMMIT, FINISH, LIVE, REFUSED, STOP = range(5)

    def __init__(self, codec, decoupled: bool, engine, metrics=None):
        self.codec, self.decoupled, self.engine, self.metrics = codec, decoupled, engine, metrics
        self.events: queue.SimpleQueue = queue.SimpleQueue()
        self.live: set[_Call] = set()
        self.thread = threading.Thread(target=self._run, name="trtspec-outbox", daemon=True)
        self.thread.start()

    def put(self, kind: int, call: _Call | None = None, payload=None) -> None:
        self.events.put((kind, call, payload))

    def stop(self, timeout: float = 30.0) -> None:
        self.put(self.STOP)
        self.thread.join(timeout)

    def _run(self) -> None:
        next_poll = next_load = time.monotonic() + CANCEL_POLL_S
        while True:
            try:
                kind, call, payload = self.events.get(timeout=max(next_poll - time.monotonic(), 0.0))
            except queue.Empty:
                kind = None
            if kind == self.STOP:
                return
            try:
                if kind is not None:
                    self._handle(kind, call, payload)
                if time.monotonic() >= next_poll:
                    self._poll_cancelled()
                    next_poll = time.monotonic() + CANCEL_POLL_S
                if self.metrics is not None and time.monotonic() >= next_load:
                    load = self.engine.load()
                    self.metrics.observe_load(load.queued, load.running, load.block_sizes)
                    next_load = time.monotonic() + LOAD_POLL_S
            except Exception as exc:  # noqa: BLE001 - one failed send must not stop the others
                _log_error(f"trtspec: sending a response failed: {exc!r}")

    def _handle(self, kind: int, call: _Call, payload) -> None:
        if kind == self.LIVE:
            if not call.finished:  # a request may finish before execute() registers it
                self.live.add(call)
        elif kind == self.COMMIT:
            piece = call.stream.push(payload)
            if piece:
                call.sender.send(_response(piece, None))
        elif kind == self.FINISH:
            call.finished = True
            self.live.discard(call)
            self._finish(call, payload)
        elif kind == self.REFUSED:
            call.finished = True
            code = "UNAVAILABLE" if isinstance(payload, Busy) else "INVALID_ARG"
            if code == "UNAVAILABLE":
                self._failed("rejected")
            call.sender.send(_error(payload, code), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def _finish(self, call: _Call, request) -> None:
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        try:
            generation = request.result(timeout=0)
        except Cancelled as exc:
            self._failed("cancelled")
            if self.decoupled:
                call.sender.send(flags=final)  # nobody reads a response any more; only close the stream
            else:  # a non-decoupled request must be answered once
                call.sender.send(_error(exc, "CANCELLED"), flags=final)
            return
        except TrtspecError as exc:
            self._failed("error")
            call.sender.send(_error(exc, "INVALID_ARG"), flags=final)
            return
        except Exception as exc:  # noqa: BLE001 - a bug: the request fails, the instance keeps serving
            self._failed("error")
            _log_error(f"trtspec: request failed: {exc!r}")
            call.sender.send(_error(exc, "INTERNAL"), flags=final)
            return
        if self.metrics is not None:
            first = request.first_token_at
            self.metrics.observe_finished(generation.stats, latency_s=time.perf_counter() - request.submitted,
                                          ttft_s=None if first is None else first - request.submitted,
                                          queue_s=generation.stats.queue_s)
        stats = generation.stats.to_dict()
        if call.stream is None:
            call.sender.send(_response(self.codec.decode(generation.tokens), stats), flags=final)
            return
        rest = call.stream.finish(generation.tokens)  # bytes held back (an unfinished UTF-8 sequence)
        if rest:
            call.sender.send(_response(rest, None))
        call.sender.send(_response("", stats), flags=final)

    def _failed(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.observe_failed(reason)

    def _poll_cancelled(self) -> None:
        for call in list(self.live):
            is_cancelled = getattr(call.sender, "is_cancelled", None)  # absent before request cancellation
            if is_cancelled is not None and is_cancelled():
                call.request.cancel()  # the engine frees its slot and finishes it with Cancelled
                self.live.discard(call)


def _metrics(model: str, instance: str):
    """The instance's serving metrics in Triton's /metrics, or None without prometheus_client
    (trtspec.serving.metrics' bookkeeping needs it) or custom metrics (a python backend before 22.12)."""
    if not hasattr(pb_utils, "MetricFamily"):
        return None
    try:
        from trtspec.serving.triton_metrics import TritonMetrics
    except ImportError as exc:
        logger = getattr(pb_utils, "Logger", None)
        if logger is not None:
            logger.log_warn(f"trtspec: no serving metrics in Triton's /metrics ({exc}; pip install prometheus_client)")
        return None
    return TritonMetrics(pb_utils, model, instance)


def _log_error(message: str) -> None:
    logger = getattr(pb_utils, "Logger", None)
    if logger is not None:
        logger.log_error(message)


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        import torch

        from trtspec.api import Pipeline
        from trtspec.runtime.engine import EngineConfig
        from trtspec.runtime.sampling import SamplingConfig

        config = json.loads(args["model_config"])
        parameters = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        threads = int(parameters.get("threads", "0"))
        if threads > 0:
            torch.set_num_threads(threads)
        self.pipeline = Pipeline(engine=parameters["engine_dir"], device=parameters.get("device", "auto"))
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(config)
        self._sampling = SamplingConfig
        self.engine = self.pipeline.engine(EngineConfig(**{key: int(parameters[key]) for key in ENGINE_PARAMETERS
                                                           if key in parameters}))
        self.outbox = _Outbox(self.pipeline.codec, self.decoupled, self.engine,
                              _metrics(args["model_name"], args["model_instance_name"]))

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

    def execute(self, requests):
        """Submit every request to the engine and return at once; the outbox answers them."""
        for request in requests:
            call = _Call(request.get_response_sender())
            try:
                self._submit(request, call)
            except TrtspecError as exc:  # refused at the door (Busy included): only this request fails
                self.outbox.put(_Outbox.REFUSED, call, exc)
            else:
                self.outbox.put(_Outbox.LIVE, call)
        return None

    def _submit(self, request, call: _Call) -> None:
        ids = self.pipeline.codec.encode(_text(request))
        if not ids:
            raise TrtspecError("the prompt is empty")
        config = self._config(request)
        on_commit = None
        if self.decoupled and bool(_scalar(request, "stream", True)):
            call.stream = TextStream(self.pipeline.codec)
            on_commit = lambda tokens: self.outbox.put(_Outbox.COMMIT, call, tokens)  # noqa: E731
        call.request = self.engine.submit(ids, config, on_commit=on_commit,
                                          on_finish=lambda request: self.outbox.put(_Outbox.FINISH, call, request))

    def finalize(self) -> None:
        """Unload: withdraw what is left (its clients get their final response), then stop sending."""
        self.engine.close(cancel=True)
        self.outbox.stop()
