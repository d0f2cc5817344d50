"""The Triton python-backend model: every request of a model instance joins one batched engine.

Triton imports this through the generated `model.py` of a repository made by
`trtspec triton-repo`. Requests carry `text_input` and, optional, every field of
`trtspec.runtime.request.REQUEST_FIELDS` (max_tokens, temperature, top_p, top_k, seed, penalties,
...: the names, defaults and ranges of `trtspec serve`), `block_size` (0 = auto), `grow_to` (a
growing block B:G; 0 = none), `stream`, `stop` (stop strings: the text ends before the first),
`stop_token_ids` (the text ends after the first), and `logit_bias` and `response_format` (JSON, as
OpenAI's); responses carry `text_output` and `stats` (JSON, including `batch_mean`: how many
requests shared this request's cycles on average, `queue_s` and `ttft_s`).

Each instance owns one `trtspec.runtime.engine.Engine` (a background thread that decodes all its
requests together). `execute()` only copies each request's inputs, checking what is cheap to
check (sizes: at most limits.STOPS stops of bounded bytes, a prompt no larger than the context
can hold), and returns at once, so the next requests join the running batch instead of waiting
for the instance. One *preparing* thread per instance does the work proportional to a request's
size (decoding its text, tokenizing with the GIL released, preparing its stops) and submits it,
so one client's large input never holds the threads that stream the others' responses. Every
response goes back through the request's response sender:

* NAME_stream (decoupled) sends each cycle's committed text as the cycle commits, then a final
  empty response with the statistics (`stream` false: one response with the whole text).
* NAME is not decoupled (Triton's HTTP and unary gRPC endpoints refuse decoupled models), but
  it answers the same way: one response per request, sent when the request finishes.

The engine thread's callbacks only queue events (`trtspec.serving.frontend.Bridge`: the tokens
and their text, detokenized and ended at the stop strings by the engine, as for `trtspec serve`);
one *outbox* thread per instance turns them into responses and sends them, and every
CANCEL_POLL_S asks Triton which requests the client has cancelled (a closed stream, a dropped
call) and withdraws them from the engine, which frees their slots before its next cycle. A bad
request gets its own error response (HTTP 400; a full queue: 503) and the others keep decoding.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from dataclasses import replace

import numpy as np

try:  # only importable inside Triton's python backend stub
    import triton_python_backend_utils as pb_utils
except ImportError:  # pragma: no cover - imported for documentation or tests outside Triton
    pb_utils = None

from trtspec.errors import Cancelled, TrtspecError
from trtspec.limits import STOP_CHARS, STOPS
from trtspec.runtime.request import REQUEST_FIELDS, Generation, check_room, request_config
from trtspec.runtime.engine import Busy
from trtspec.runtime.schedule import BlockChoice
from trtspec.serving.frontend import (COMMIT, FINISH, TEXT, Bridge, Reply, check_json_text, logit_bias,
                                      response_format, stops)
from trtspec.serving.logprobs import completion_logprobs, entries
from trtspec.serving.triton import ENGINE_PARAMETERS, JSON_INPUTS, SCALAR_INPUTS

CANCEL_POLL_S = 0.05  # asking Triton is a round trip to the server process: at most this often
LOAD_POLL_S = 0.5     # how often the engine's load gauges are refreshed
MAX_JSON_BYTES = 2**20  # a logit_bias or response_format input

# optional one-value inputs and their defaults: None is the field's own (block_size: the model's)
SCALARS = {**{spec.name: None for spec in REQUEST_FIELDS}, **{name: default for name, _, default in SCALAR_INPUTS}}


def _values(request, name: str, most: int | None = None):
    """The input `name` as a flat numpy array (None when absent), refused when it holds more than
    `most` values (before any of them is read)."""
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return None
    values = tensor.as_numpy().reshape(-1)
    if most is not None and values.size > most:
        raise TrtspecError(f"{name}: at most {most} values, got {values.size}")
    return values


def _scalar(request, name: str, default):
    values = _values(request, name)
    if values is None:
        return default
    if values.size != 1:
        raise TrtspecError(f"{name} must hold exactly one value, got {values.size}")
    return values[0].item() if hasattr(values[0], "item") else values[0]


def _utf8(raw, label: str) -> str:
    """A BYTES element as text: strict UTF-8 (which also refuses encoded lone surrogates)."""
    if not isinstance(raw, bytes):
        raise TrtspecError(f"{label} must be BYTES (UTF-8 text)")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise TrtspecError(f"{label} is not valid UTF-8 (byte {raw[exc.start]:#04x} at offset {exc.start})") from None


def _json(raw, label: str):
    """A JSON BYTES input decoded (None when absent)."""
    if raw is None:
        return None
    try:
        value = json.loads(_utf8(raw, label))
    except (ValueError, RecursionError):
        raise TrtspecError(f"{label} is not valid JSON") from None
    check_json_text(value, label)
    return value


class _Inputs:
    """One request's inputs, copied out of Triton's tensors by execute() and checked for size only
    (cheap); the preparing thread turns them into token ids, stops and a config."""

    def __init__(self, request, prompt_cap: int, context: int):
        text = _scalar(request, "text_input", None)
        if text is None:
            raise TrtspecError("text_input is required")
        if isinstance(text, bytes) and len(text) > prompt_cap:
            raise TrtspecError(f"text_input is {len(text)} bytes: no text over {prompt_cap} bytes fits the "
                               f"{context} tokens of the context")
        self.text = text
        self.scalars = {name: _scalar(request, name, default) for name, default in SCALARS.items()}
        given = _values(request, "stop", STOPS.high)
        self.stops = [] if given is None else list(given)
        for stop in self.stops:  # a character is at most 4 UTF-8 bytes: longer ones cannot be valid
            if isinstance(stop, bytes) and len(stop) > 4 * STOP_CHARS.high:
                raise TrtspecError(f"stop: a stop string holds 1 to {STOP_CHARS.high:g} characters, "
                                   f"got {len(stop)} bytes")
        ids = _values(request, "stop_token_ids", STOPS.high)
        self.stop_token_ids = [] if ids is None else list(ids)
        self.json = {name: _scalar(request, name, None) for name in JSON_INPUTS}
        for name, raw in self.json.items():
            if isinstance(raw, bytes) and len(raw) > MAX_JSON_BYTES:
                raise TrtspecError(f"{name}: at most {MAX_JSON_BYTES} bytes of JSON, got {len(raw)}")


def _error(exc: BaseException, code: str):
    """An error response in one line, with Triton's error code `code` where the backend has codes
    (INVALID_ARG: HTTP 400; UNAVAILABLE: 503; CANCELLED; INTERNAL: 500)."""
    message = " ".join(str(exc).split())
    code = getattr(pb_utils.TritonError, code, None)
    error = pb_utils.TritonError(message, code) if code is not None else pb_utils.TritonError(message)
    return pb_utils.InferenceResponse(error=error)


def _response(text: str, stats: dict | None, logprobs: dict | None = None):
    tensors = [pb_utils.Tensor("text_output", np.array([text.encode("utf-8")], dtype=np.object_)),
               pb_utils.Tensor("stats", np.array([json.dumps(stats or {}).encode()], dtype=np.object_)),
               pb_utils.Tensor("logprobs", np.array([json.dumps(logprobs).encode()], dtype=np.object_))]
    return pb_utils.InferenceResponse(output_tensors=tensors)


class _Call:
    """One Triton request in flight: its response sender and its reply (the engine's handle, once
    prepared). Only the outbox thread touches it after submission."""

    def __init__(self, sender):
        self.sender = sender
        self.reply: Reply | None = None
        self.sends = False   # whether it sends each cycle's text (a decoupled stream)
        self.finished = False


class _Outbox:
    """The instance's sending thread: events from the engine thread and from execute() become
    responses, in order; between events it polls the live calls for cancellation."""

    COMMIT, TEXT, FINISH = COMMIT, TEXT, FINISH  # a request's Bridge delivers these
    LIVE, REFUSED, STOP = "live", "refused", "stop"

    def __init__(self, decoupled: bool, engine, codec, metrics=None):
        self.decoupled, self.engine, self.codec, self.metrics = decoupled, engine, codec, metrics
        self.events: queue.SimpleQueue = queue.SimpleQueue()
        self.live: set[_Call] = set()
        self.thread = threading.Thread(target=self._run, name="trtspec-outbox", daemon=True)
        self.thread.start()

    def put(self, kind: str, call: _Call | None = None, payload=None) -> None:
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
                    self.metrics.observe_load(load.queued, load.running, load.block_sizes, load.slots)
                    next_load = time.monotonic() + LOAD_POLL_S
            except Exception as exc:  # noqa: BLE001 - one failed send must not stop the others
                _log_error(f"trtspec: sending a response failed: {exc!r}")

    def _handle(self, kind: str, call: _Call, payload) -> None:
        if kind == self.LIVE:
            if not call.finished:  # a request may finish before it is registered
                self.live.add(call)
        elif kind == self.COMMIT:
            call.reply.commit(payload)
        elif kind == self.TEXT:
            call.sender.send(_response(payload, None))
        elif kind == self.FINISH:
            call.finished = True
            self.live.discard(call)
            self._finish(call)
        elif kind == self.REFUSED:
            call.finished = True
            code = ("UNAVAILABLE" if isinstance(payload, Busy) else "INVALID_ARG" if isinstance(payload, TrtspecError)
                    else "INTERNAL")
            if code != "INVALID_ARG":
                self._failed("rejected" if code == "UNAVAILABLE" else "error")
            call.sender.send(_error(payload, code), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def _finish(self, call: _Call) -> None:
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        try:
            generation = call.reply.end()
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
        self._done(call, generation)

    def _done(self, call: _Call, generation: Generation) -> None:
        """The final response of a finished request: its text (when it does not stream: a streamed
        one's was sent as it came), its statistics and, when asked, its tokens' logprobs (OpenAI's
        completions form)."""
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        request = call.reply.request
        stats, logprobs = generation.stats.to_dict(), None
        if request.config.logprobs is not None:
            count = len(generation.tokens)  # the tokens through a stop string, when one ended it
            logprobs = completion_logprobs(self.codec, entries(generation.tokens, request.logprobs[:count]))
        call.sender.send(_response("" if call.sends else generation.text, stats, logprobs), flags=final)

    def _failed(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.observe_failed(reason)

    def _poll_cancelled(self) -> None:
        for call in list(self.live):
            is_cancelled = getattr(call.sender, "is_cancelled", None)  # absent before request cancellation
            if is_cancelled is not None and is_cancelled():
                call.reply.request.cancel()  # the engine frees its slot and finishes it with Cancelled
                self.live.discard(call)


class _Preparer:
    """The instance's preparing thread: a request's inputs become token ids, stops and a config,
    and the request is submitted to the engine (or refused), in arrival order. Its work grows with
    the request's size, so it runs here, never on the threads that stream responses."""

    def __init__(self, prepare, outbox: _Outbox):
        self.prepare, self.outbox = prepare, outbox
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="trtspec-prepare", daemon=True)
        self.thread.start()

    def put(self, call: _Call, inputs: _Inputs) -> None:
        self.inbox.put((call, inputs))

    def stop(self, timeout: float = 60.0) -> None:
        """Submit what is waiting, then end."""
        self.inbox.put(None)
        self.thread.join(timeout)

    def _run(self) -> None:
        while (item := self.inbox.get()) is not None:
            call, inputs = item
            try:
                self.prepare(call, inputs)
            except Exception as exc:  # noqa: BLE001 - TrtspecError (Busy included): only this request fails
                if not isinstance(exc, TrtspecError):
                    _log_error(f"trtspec: preparing a request failed: {exc!r}")
                self.outbox.put(_Outbox.REFUSED, call, exc)
            else:
                self.outbox.put(_Outbox.LIVE, call)


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

        config = json.loads(args["model_config"])
        parameters = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        threads = int(parameters.get("threads", "0"))
        if threads > 0:
            torch.set_num_threads(threads)
        self.pipeline = Pipeline(engine=parameters["engine_dir"], device=parameters.get("device", "auto"))
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(config)
        self.engine = self.pipeline.engine(EngineConfig(**{key: kind(parameters[key])
                                                           for key, kind in ENGINE_PARAMETERS.items() if key in parameters}))
        self.outbox = _Outbox(self.decoupled, self.engine, self.pipeline.codec,
                              _metrics(args["model_name"], args["model_instance_name"]))
        self.context = self.pipeline.runner.max_context
        self.prompt_cap = self.pipeline.codec.text_bytes_cap(self.context)
        self.preparer = _Preparer(self._submit, self.outbox)

    def execute(self, requests):
        """Copy each request's inputs (refusing oversized ones) for the preparing thread, and return
        at once; the outbox answers them."""
        for request in requests:
            call = _Call(request.get_response_sender())
            try:
                inputs = _Inputs(request, self.prompt_cap, self.context)
            except Exception as exc:  # noqa: BLE001 - refused at the door: only this request fails
                self.outbox.put(_Outbox.REFUSED, call, exc)
            else:
                self.preparer.put(call, inputs)
        return None

    def _block(self, size: int | None, grow_to: int) -> BlockChoice:
        """The request's block_size and grow_to inputs (none: the model's default; on the wire 0 is
        auto) as a BlockChoice, which refuses a size out of range or a growth that does not grow."""
        if size is None:
            default = self.pipeline.default_block
            return replace(default, grow_to=grow_to) if grow_to else default
        return BlockChoice(size or None, grow_to)

    def _submit(self, call: _Call, inputs: _Inputs) -> None:
        """Tokenize, prepare the stops and submit (on the preparing thread)."""
        codec = self.pipeline.codec
        texts, stop_ids = stops([_utf8(stop, "stop") for stop in inputs.stops], inputs.stop_token_ids, codec)
        scalars, structured = inputs.scalars, {name: _json(raw, name) for name, raw in inputs.json.items()}
        vocab = self.pipeline.vocab_size
        config = request_config(scalars, self._block(scalars["block_size"], scalars["grow_to"]), stop_ids, texts,
                                logit_bias=logit_bias(structured["logit_bias"], vocab),
                                grammar=response_format(structured["response_format"], codec, vocab))
        ids = codec.encode_unlocked(_utf8(inputs.text, "text_input"))  # an empty one: refused at submit
        if scalars["max_tokens"] is not None:  # as serve and run: an asked-for count must fit (the default is capped)
            check_room(len(ids), config.max_new_tokens, self.context, "max_tokens")
        call.sends = self.decoupled and bool(scalars["stream"])
        call.reply = Reply(self.outbox.metrics)
        bridge = Bridge(lambda kind, payload: self.outbox.put(kind, call, payload))
        # a call that does not stream is answered from its generation at the end
        call.reply.request = self.engine.submit(ids, config, bridge.on_commit if call.sends else None,
                                                bridge.on_finish, on_text=bridge.on_text if call.sends else None)

    def finalize(self) -> None:
        """Unload: submit what is being prepared, withdraw what is left (its clients get their final
        response), then stop sending."""
        self.preparer.stop()
        self.engine.close(cancel=True)
        self.outbox.stop()
