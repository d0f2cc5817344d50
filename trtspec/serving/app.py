"""`trtspec serve`'s ASGI app: the routes, the API key, and the door between them and the engine.

The event loop only routes: a body is read with a size limit and a deadline (`body.read_body`),
then decoded, checked and tokenized on the door's threads (`protocol.parse_request`), submitted to
the engine one engine request per choice, and answered by `responses.Answer`.

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health, GET /metrics,
and vLLM's POST /tokenize, POST /detokenize, GET /version.
Errors use OpenAI's JSON shape: 400 bad request, 404 unknown model or route, 429 queue full,
503 shutting down. A client that disconnects cancels its request, which frees its slot.
"""

from __future__ import annotations

import asyncio
import secrets
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from trtspec import __version__
from trtspec.errors import FieldError, TrtspecError
from trtspec.runtime.engine import Busy
from trtspec.runtime.schedule import BlockChoice
from trtspec.serving.body import decode_body, read_body
from trtspec.serving.door import MAX_BODY_BYTES, READ_TIMEOUT_S
from trtspec.serving.metrics import CONTENT_TYPE, VLLM_PREFIX, ServingMetrics
from trtspec.serving.frontend import LoopBridge, Reply, short_repr
from trtspec.serving.protocol import (ApiError, ParsedRequest, bad_request, parse_detokenize, parse_request,
                                      parse_tokenize)
from trtspec.serving.responses import Answer

DOOR_THREADS = 2            # requests decoded, checked and tokenized at once, off the event loop
JSON_VALUES_BESIDES_PROMPT = 10_000  # a large body holds at most max_context + this many JSON values


def error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.payload(), status_code=error.status, headers=error.headers())


OPEN_ROUTES = ("/health", "/metrics")  # what a server with an API key answers without it, as vLLM


class _ApiKey:
    """ASGI middleware: every route but OPEN_ROUTES wants `Authorization: Bearer KEY` (401 otherwise,
    in OpenAI's shape), before its body is read."""

    def __init__(self, app, key: str):
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in OPEN_ROUTES:
            given = next((value for name, value in scope["headers"] if name == b"authorization"), b"")
            if not secrets.compare_digest(given, self.expected):
                refusal = ApiError(401, "a valid API key is required: send the header Authorization: Bearer KEY",
                                   code="invalid_api_key")
                await error_response(refusal)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class OpenAIServer:
    """The ASGI app over one pipeline and its engine. `app` is what uvicorn serves.

    The event loop only routes: a body is read with a size limit (`max_body_bytes`, else 413) and a
    deadline (`read_timeout_s`, else 408), then decoded, checked and tokenized on the door's
    threads (DOOR_THREADS), so one large or odd request never stalls the other clients' streams."""

    def __init__(self, pipeline, engine_config, *, model_name: str, block_size: BlockChoice | None = None,
                 metrics: ServingMetrics | None = None, metrics_prefix: str = VLLM_PREFIX,
                 max_body_bytes: int = MAX_BODY_BYTES,
                 read_timeout_s: float = READ_TIMEOUT_S, api_key: str | None = None, replica: dict | None = None):
        self.pipeline, self.codec, self.engine_config = pipeline, pipeline.codec, engine_config
        self.model_name = model_name
        self.default_block = block_size or pipeline.default_block
        self.metrics = metrics or ServingMetrics(model_name=model_name, vllm_prefix=metrics_prefix)
        self.max_body_bytes, self.read_timeout_s, self.api_key = max_body_bytes, read_timeout_s, api_key
        self.replica = replica  # on Ray Serve: which replica answered ({"id", "pid"}), in every trtspec object
        self.engine = None
        self.created = int(time.time())
        self.closing = False
        self._close_lock = threading.Lock()
        self._door = ThreadPoolExecutor(DOOR_THREADS, thread_name_prefix="trtspec-door")
        self.app = self._make_app()

    # -- life cycle ----------------------------------------------------------------------------
    def start(self) -> None:
        if self.engine is None:
            self.engine = self.pipeline.engine(self.engine_config)

    def close(self) -> None:
        """Stop the engine: what is still queued or running is cancelled (clients get their error)."""
        self.closing = True
        with self._close_lock:
            if self.engine is not None:
                self.engine.close(cancel=True)
                self.engine = None
        self._door.shutdown(wait=False, cancel_futures=True)

    def _make_app(self) -> FastAPI:
        @asynccontextmanager
        async def lifespan(app):
            self.start()
            try:
                yield
            finally:
                await asyncio.get_running_loop().run_in_executor(None, self.close)

        app = FastAPI(title="trtspec", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
        if self.api_key:
            app.add_middleware(_ApiKey, key=self.api_key)

        @app.exception_handler(ApiError)
        async def api_error(request, exc: ApiError):
            return error_response(exc)

        @app.exception_handler(HTTPException)
        async def http_error(request, exc: HTTPException):
            kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
            return error_response(ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", kind))

        @app.exception_handler(Exception)
        async def internal_error(request, exc: Exception):  # a bug: logged by uvicorn, answered in OpenAI's shape
            return error_response(ApiError(500, f"internal error ({type(exc).__name__})", "internal_error"))

        @app.exception_handler(RequestValidationError)
        async def validation_error(request, exc):
            return error_response(bad_request(str(exc)))

        @app.get("/health")
        async def health():
            if self.closing or self.engine is None:
                raise ApiError(503, "the server is shutting down", "service_unavailable")
            return {"status": "ok"}

        @app.get("/metrics")
        async def metrics():
            if self.engine is not None:
                load = self.engine.load()
                self.metrics.observe_load(load.queued, load.running, load.block_sizes, load.slots)
            return Response(self.metrics.render(), media_type=CONTENT_TYPE)

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [self._model_card()]}

        @app.get("/v1/models/{name:path}")
        async def model(name: str):
            self._check_model(name)
            return self._model_card()

        @app.get("/version")
        async def version():
            return {"version": __version__}

        @app.post("/tokenize")
        async def tokenize(request: HttpRequest):
            return await self._at_door(request, self._tokenize)

        @app.post("/detokenize")
        async def detokenize(request: HttpRequest):
            return await self._at_door(request, self._detokenize)

        @app.post("/v1/completions")
        async def completions(request: HttpRequest):
            return await self._handle(request, chat=False)

        @app.post("/v1/chat/completions")
        async def chat_completions(request: HttpRequest):
            return await self._handle(request, chat=True)

        return app

    def _model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "trtspec",
                "root": self.model_name, "parent": None, "max_model_len": self.pipeline.runner.max_context}

    def _check_model(self, name) -> None:
        if name != self.model_name:
            raise ApiError(404, f"The model {short_repr(name)} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")

    # -- requests ------------------------------------------------------------------------------
    async def _read_body(self, http: HttpRequest) -> bytes:
        return await read_body(http, self.max_body_bytes, self.read_timeout_s)

    async def _at_door(self, http: HttpRequest, work):
        """`work(body)` on the door's threads for one of vLLM's utility routes."""
        try:
            raw = await self._read_body(http)
        except ClientDisconnect:
            return Response(status_code=499)

        def run():
            body = decode_body(raw, self.pipeline.runner.max_context + JSON_VALUES_BESIDES_PROMPT)
            if not isinstance(body, dict):
                raise bad_request("the request body must be a JSON object")
            if body.get("model") is not None:
                self._check_model(body["model"])
            return work(body)
        return await asyncio.get_running_loop().run_in_executor(self._door, run)

    def _tokenize(self, body: dict) -> dict:
        context = self.pipeline.runner.max_context
        ids = parse_tokenize(body, self.codec, context)
        return {"count": len(ids), "max_model_len": context, "tokens": ids}

    def _detokenize(self, body: dict) -> dict:
        ids = parse_detokenize(body, self.codec.tokenizer.get_vocab_size(with_added_tokens=True))
        return {"prompt": self.codec.decode(ids)}

    def _parse(self, raw: bytes, chat: bool) -> ParsedRequest:
        """The door's work, on its threads: decode, check and tokenize one body."""
        body = decode_body(raw, self.pipeline.runner.max_context + JSON_VALUES_BESIDES_PROMPT)
        if not isinstance(body, dict) or not isinstance(body.get("model"), str):
            raise bad_request("model must be given, as a string", "model")
        self._check_model(body["model"])
        return parse_request(body, self.codec, self.default_block, chat, self.pipeline.runner.max_context,
                             self.pipeline.vocab_size)

    async def _handle(self, http: HttpRequest, chat: bool):
        try:
            raw = await self._read_body(http)
        except ClientDisconnect:
            return Response(status_code=499)  # nobody is listening
        try:
            parsed = await asyncio.get_running_loop().run_in_executor(self._door, self._parse, raw, chat)
        except RuntimeError:  # the door is shut: the server is shutting down
            if not self.closing:
                raise
            raise ApiError(503, "the server is shutting down", "service_unavailable") from None
        if self.closing or self.engine is None:
            raise ApiError(503, "the server is shutting down", "service_unavailable")
        loop, choices = asyncio.get_running_loop(), []
        try:
            for index in range(parsed.n):
                bridge = LoopBridge(loop)
                reply = Reply(self.metrics)
                reply.request = self.engine.submit(parsed.prompt_ids, parsed.choice_config(index), bridge.on_commit,
                                                   bridge.on_finish, on_text=bridge.on_text)
                choices.append((reply, bridge))
        except TrtspecError as exc:
            for reply, _ in choices:  # all the choices or none
                reply.request.cancel()
            if isinstance(exc, Busy):
                self.metrics.observe_failed("rejected")
                raise ApiError(429, str(exc), "rate_limit_exceeded", code="queue_full") from None
            field = exc.field if isinstance(exc, FieldError) else None
            raise bad_request(str(exc), "messages" if chat and field == "prompt" else field) from None
        answer = Answer(parsed, choices, f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", codec=self.codec,
                        metrics=self.metrics, model_name=self.model_name, replica=self.replica)
        if parsed.stream:
            return StreamingResponse(answer.stream(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await answer.complete(http)
