"""`trtspec serve --replicas N`: the same OpenAI-compatible app as replicas on Ray Serve.

Two deployments. `trtspec-engine`: N replicas, each one process that owns one engine and runs
`OpenAIServer`'s FastAPI app (loaded with the options `trtspec serve` was given), so routes,
request checks, streaming and metrics are those of the single-process server. `trtspec-server`:
the HTTP ingress, a thin forwarder without a model (no CPU reserved), that hands each request to
an engine replica through a deployment handle, where Ray Serve's router picks the replica with
the shorter queue (of two drawn), and streams its answer back. Ray Serve restarts a replica
whose process dies (its health check asks the engine) and scales the engine replicas between
`min_replicas` and `max_replicas` on ongoing requests when autoscaling is asked.

Why the ingress is separate: a replica that dies takes its connections with it, and the proxy
would end those answers as if they were complete. The ingress outlives it: a request that has
not sent its client anything yet is retried on another replica (RETRIES), and a stream that has
started ends with an error event (`data: {"error": ...}`, then `[DONE]`), which OpenAI's clients
raise as an error.

Metrics: each replica's families (vLLM's and trtspec's) are mirrored every METRICS_PERIOD_S into
Ray's metrics (`ray.util.metrics` gauges, names with ':' written '_', Ray's `ray_` prefix in front)
with the replica's id as the `engine` label and a `replica` tag, so the scrape of Ray's metrics
export sees every replica of the deployment; `/metrics` through the ingress is one replica's own.

Ray is an optional extra (`pip install 'trtspec[ray]'`), imported only here.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import re
import signal
import threading
import time

from trtspec.errors import TrtspecError
from trtspec.serving.ray_options import APP_NAME, ENGINE, INGRESS, ReplicaOptions, Scaling

METRICS_PERIOD_S = 2.0
RETRIES = 3  # further replicas a request is offered when the one serving it dies before answering
NO_FAILURE_HANDLER = "RAY_DISABLE_FAILURE_SIGNAL_HANDLER"


def _ray():
    # Ray answers SIGTERM to a driver with its failure handler (a stack dump, then an abort) from the
    # moment ray.init connects: off in this process (read once, as Ray is imported); the cluster's
    # processes, started later without the variable, keep theirs.
    given = os.environ.get(NO_FAILURE_HANDLER)
    os.environ[NO_FAILURE_HANDLER] = "1"
    try:
        import ray
        from ray import serve
    except ImportError:
        raise TrtspecError("--replicas needs Ray Serve: pip install 'trtspec[ray]'") from None
    finally:
        if given is None:
            del os.environ[NO_FAILURE_HANDLER]
        else:
            os.environ[NO_FAILURE_HANDLER] = given
    return ray, serve


def build_server(options: ReplicaOptions):
    """On a replica: the pipeline and its server, started (a replica that cannot load fails here,
    and Ray Serve reports it), with its metrics mirrored into Ray's."""
    import torch

    from trtspec.commands.options import load_pipeline
    from trtspec.runtime.engine import EngineConfig
    from trtspec.serving.metrics import ServingMetrics
    from trtspec.serving.app import OpenAIServer

    _, serve = _ray()
    if options.threads:
        torch.set_num_threads(options.threads)
    replica = serve.get_replica_context().replica_id.unique_id
    pipeline = load_pipeline(**options.load)
    metrics = ServingMetrics(model_name=options.served_model_name, engine=replica, vllm_prefix=options.metrics_prefix)
    server = OpenAIServer(pipeline, EngineConfig(max_running=options.max_concurrency, max_queued=options.max_queued),
                          model_name=options.served_model_name, block_size=options.block_size, metrics=metrics,
                          max_body_bytes=options.max_body_bytes, read_timeout_s=options.read_timeout_s,
                          api_key=options.api_key, replica={"id": replica, "pid": os.getpid()})
    server.start()
    threading.Thread(target=_mirror_metrics, args=(metrics.registry, replica), name="trtspec-ray-metrics",
                     daemon=True).start()
    return server


class EngineReplica:
    """The `trtspec-engine` deployment: one engine and its OpenAI app, which answers the requests
    the ingress forwards."""

    def __init__(self, options: ReplicaOptions):
        self.server = build_server(options)

    async def forward(self, request: dict, body: bytes):
        """The app's ASGI messages for one request (`request`: method, path, query_string and
        headers), as the app sends them. When the ingress stops reading (its client left), the app
        sees the client disconnect, which cancels the request's engine work."""
        messages: asyncio.Queue = asyncio.Queue()
        gone, delivered = asyncio.Event(), False

        async def receive() -> dict:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "scheme": "http",
                 "method": request["method"], "path": request["path"], "raw_path": request["path"].encode(),
                 "query_string": request["query_string"], "headers": request["headers"], "root_path": "",
                 "client": None, "server": None}
        app = asyncio.ensure_future(self.server.app(scope, receive, messages.put))
        app.add_done_callback(lambda task: messages.put_nowait(None if task.cancelled() or task.exception() is None
                                                               else task.exception()))
        try:
            while (message := await messages.get()) is not None:
                if isinstance(message, BaseException):  # the app failed before answering: a bug, reported as 500
                    raise message
                yield message
        finally:
            gone.set()

    def check_health(self) -> None:
        """Ray Serve's health check: a replica whose engine has stopped is restarted."""
        engine = self.server.engine
        if engine is None or not engine.alive:
            raise RuntimeError("the engine has stopped")


def ingress_app(options: ReplicaOptions):
    """The `trtspec-server` deployment's FastAPI app: every route forwarded to an engine replica."""
    from fastapi import FastAPI, Request
    from fastapi.responses import Response, StreamingResponse
    from ray.exceptions import RayActorError
    from ray.serve.exceptions import BackPressureError, ReplicaUnavailableError

    from trtspec.serving.app import error_response
    from trtspec.serving.body import read_body
    from trtspec.serving.protocol import ApiError

    _, serve = _ray()
    engines = serve.get_deployment_handle(ENGINE, app_name=APP_NAME).options(stream=True, _by_reference=False)
    app = FastAPI(title="trtspec", docs_url=None, redoc_url=None, openapi_url=None)
    lost = (RayActorError, ReplicaUnavailableError)  # the replica's process died or cannot be reached
    replica_died = ApiError(503, "the replica serving this request stopped; try again", "service_unavailable",
                            code="replica_died")

    async def forward(http: Request):
        try:  # the engine's limits are checked there again; these keep a huge body off the cluster
            body = await read_body(http, options.max_body_bytes, options.read_timeout_s) \
                if http.method in ("POST", "PUT", "PATCH") else b""
        except ApiError as error:
            return error_response(error)
        request = {"method": http.method, "path": http.url.path, "query_string": http.url.query.encode(),
                   "headers": list(http.headers.raw)}
        for attempt in range(RETRIES + 1):
            answer = engines.forward.remote(request, body)
            try:  # the status and the first piece of the body: until the client has these, a retry is safe
                start = await answer.__anext__()
                first = await answer.__anext__() if start["type"] == "http.response.start" else start
            except lost:
                answer.cancel()
                await asyncio.sleep(0.5 * (attempt + 1))  # the router learns the replica is gone
                continue
            except BackPressureError:
                return error_response(ApiError(429, "every replica's queue is full", "rate_limit_exceeded",
                                              code="queue_full"))
            break
        else:
            return error_response(replica_died)
        if not first.get("more_body"):
            return _raw(Response(first.get("body", b""), status_code=start["status"]), start["headers"])

        async def rest():
            try:
                yield first.get("body", b"")
                async for message in answer:
                    yield message.get("body", b"")
            except lost:  # the stream has started: it ends with an error event, as OpenAI's streams do
                error = error_response(replica_died).body.decode()
                yield f"data: {error}\n\ndata: [DONE]\n\n".encode()
            finally:
                answer.cancel()  # the client left early: the replica's app sees it disconnect
        return _raw(StreamingResponse(rest(), status_code=start["status"]), start["headers"])

    forward.__annotations__ = {"http": Request}  # this module's annotations are strings; FastAPI needs the class
    app.add_api_route("/{path:path}", forward, methods=["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"])
    return app


def _raw(response, headers: list):
    """The response with the engine replica's headers, as it sent them."""
    response.raw_headers = [(bytes(k), bytes(v)) for k, v in headers]
    return response


def _mirror_metrics(registry, replica: str) -> None:
    """Copy the replica's samples into Ray gauges (histogram buckets left out: their _sum and _count
    stay), every METRICS_PERIOD_S, for as long as the replica lives."""
    from ray.util.metrics import Gauge

    gauges: dict[str, tuple[Gauge, tuple[str, ...]]] = {}
    while True:
        for family in registry.collect():
            for sample in family.samples:
                if sample.name.endswith(("_bucket", "_created")):
                    continue
                name = re.sub(r"[^a-zA-Z0-9_]", "_", sample.name)
                keys = tuple(sorted(sample.labels)) + ("replica",)
                if name not in gauges:
                    gauges[name] = Gauge(name, description=family.documentation or name, tag_keys=keys), keys
                gauge, known = gauges[name]
                tags = {**sample.labels, "replica": replica}
                if set(tags) == set(known):
                    gauge.set(sample.value, tags=tags)
        time.sleep(METRICS_PERIOD_S)


def application(options: ReplicaOptions, scaling: Scaling):
    """The Ray Serve application: the ingress, bound to the engine deployment's replicas."""
    _, serve = _ray()
    engines = serve.deployment(EngineReplica, name=ENGINE, **scaling.engine_options(options)).bind(options)
    def builder():  # a plain function: Ray Serve calls it on each ingress replica (a partial would pass for an ASGI app)
        return ingress_app(options)
    return serve.deployment(serve.ingress(builder)(), name=INGRESS, **scaling.ingress_options()).bind(engines)


def app_builder(args: dict):
    """`serve deploy`'s entry point: the application from deploy_config's arguments."""
    from trtspec.runtime.schedule import BlockChoice

    fields, block = dict(args["options"]), args["options"].get("block_size")
    fields["block_size"] = None if block is None else BlockChoice.parse(block, allow_ar=True, label="block_size")
    return application(ReplicaOptions(**fields), Scaling(**args["scaling"]))


class _Stopped(BaseException):
    """SIGINT or SIGTERM: whatever the main thread is doing (starting the cluster, deploying,
    serving) is abandoned, and `run` stops what it started."""


def _stop_on_signals(stop) -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop)


def _adopt_orphans() -> None:
    """Linux: become the parent of descendants that lose theirs (a child subreaper), so that the
    processes of a local cluster outliving a raylet stopped mid-start (its agents) can be stopped
    (`_stop_leftovers`) rather than left running."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER


def _stop_leftovers() -> None:
    """SIGKILL (as `ray stop --force`) the Ray processes still among this process's descendants
    (/proc: Linux; elsewhere nothing is looked for), and reap those that are its children."""
    children, commands = {}, {}
    for pid in filter(str.isdigit, os.listdir("/proc") if os.path.isdir("/proc") else ()):
        with contextlib.suppress(OSError, IndexError, ValueError):
            parent = int(open(f"/proc/{pid}/stat", "rb").read().rsplit(b")", 1)[1].split()[1])
            commands[int(pid)] = open(f"/proc/{pid}/cmdline", "rb").read()
            children.setdefault(parent, []).append(int(pid))
    pending, killed = [os.getpid()], []
    while pending:
        for child in children.get(pending.pop(), ()):
            pending.append(child)
            if b"ray" in commands.get(child, b""):
                with contextlib.suppress(OSError):
                    os.kill(child, signal.SIGKILL)
                    killed.append(child)
    for child in set(killed) & set(children.get(os.getpid(), ())):
        with contextlib.suppress(ChildProcessError):
            os.waitpid(child, 0)


def run(options: ReplicaOptions, scaling: Scaling, *, address: str | None, host: str, port: int,
        on_start=None, on_ready=None) -> None:
    """Start or join a Ray cluster (`address`; None: a local one of this machine's CPUs), deploy,
    and serve until SIGINT or SIGTERM, which may come at any time, during the deployment too; then
    the application is deleted and Ray Serve and a local cluster stopped (a joined one stays)."""
    ray, serve = _ray()
    cores = None
    if address is None:
        from trtspec.limits import cpu_cores

        cores = cpu_cores()
        scaling.check_fits(cores)
        _adopt_orphans()
    if on_start is not None:
        on_start()
    stopping = threading.Event()

    def stop(*_):
        if not stopping.is_set():  # the first signal ends the wait; later ones never cut the clean-up
            stopping.set()
            raise _Stopped

    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    logging.getLogger("ray.serve").setLevel(logging.WARNING)  # its INFO lines at start and stop
    started = False
    try:
        _stop_on_signals(stop)
        try:
            ray.init(address=address, ignore_reinit_error=True, logging_level="ERROR", log_to_driver=False,
                     include_dashboard=False if address is None else None, num_cpus=cores)
        except SystemExit:  # SIGTERM while Ray starts: its own handler, in place meanwhile, exits
            raise _Stopped from None
        _stop_on_signals(stop)  # ray.init leaves Ray's own in place (a stack dump, then an abort)
        started = True
        serve.start(http_options={"host": host, "port": port}, proxy_location="EveryNode")
        try:
            serve.run(application(options, scaling), name=APP_NAME, route_prefix="/", blocking=False)
        except RuntimeError as error:  # a replica that cannot start: Ray Serve gives up after its retries
            first = str(error).strip().splitlines()
            raise TrtspecError(f"the deployment failed: {_replica_error(first)}") from None
        if on_ready is not None:
            on_ready()
        while True:
            time.sleep(3600)
    except _Stopped:
        pass
    finally:
        stopping.set()
        if started:
            with contextlib.suppress(Exception):
                serve.delete(APP_NAME)  # its replicas finish what they hold
            if address is not None:  # a local cluster stops with Ray (its controller killed first says so in red)
                serve.shutdown()
        ray.shutdown()
        if address is None:
            _stop_leftovers()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _replica_error(lines: list[str]) -> str:
    """The line of Ray's report that says why a replica failed (a TrtspecError's own line when there is one)."""
    for line in lines:
        if "TrtspecError" in line or "CheckpointError" in line:
            return line.split("Error:", 1)[-1].strip()
    return lines[0] if lines else "unknown error"
