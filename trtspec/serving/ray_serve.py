"""`trtspec serve --replicas N`: the same OpenAI-compatible app as replicas on Ray Serve.

Each replica is one process that owns one engine: `build_app` (run on the replica, by Ray Serve's
ingress) loads the pipeline with the options `trtspec serve` was given and returns
`OpenAIServer`'s FastAPI app, so routes, request checks, streaming and metrics are those of the
single-process server. Ray Serve's proxy spreads requests over the replicas by their queue length
(its default router), restarts a replica whose process dies (its health check), and scales their
number between `min_replicas` and `max_replicas` on ongoing requests when autoscaling is asked.

Metrics: each replica's families (vLLM's and trtspec's) are mirrored every METRICS_PERIOD_S into
Ray's metrics (`ray.util.metrics` gauges, names with ':' written '_', Ray's `ray_` prefix in front)
with the replica's id as the `engine` label and a `replica` tag, so the scrape of Ray's metrics
export sees every replica of the deployment; a replica's own `/metrics` is still served.

Ray is an optional extra (`pip install 'trtspec[ray]'`), imported only here.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from dataclasses import asdict, dataclass, field

from trtspec.errors import TrtspecError

METRICS_PERIOD_S = 2.0
APP_NAME = "trtspec"


@dataclass(frozen=True)
class ReplicaOptions:
    """What every replica loads and serves with: `load` holds load_pipeline's arguments."""

    load: dict
    max_concurrency: int = 8
    max_queued: int = 64
    block_size: str | None = None
    served_model_name: str = "model"
    api_key: str | None = None
    metrics_prefix: str = "vllm:"
    max_body_bytes: int = 0
    read_timeout_s: float = 0.0
    threads: int | None = None


@dataclass(frozen=True)
class Scaling:
    """Fixed replicas (`replicas`), or autoscaling between `min_replicas` and `max_replicas` on
    `target_ongoing_requests` per replica; each replica's resources."""

    replicas: int = 1
    min_replicas: int | None = None
    max_replicas: int | None = None
    target_ongoing_requests: float = 8.0
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    extra: dict = field(default_factory=dict)

    def deployment_options(self, max_ongoing: int) -> dict:
        options = {"ray_actor_options": {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus},
                   # requests a replica takes at once: its slots and queue (beyond, Ray Serve queues them)
                   "max_ongoing_requests": max_ongoing, "health_check_period_s": 2.0,
                   "health_check_timeout_s": 30.0}
        if self.min_replicas is not None or self.max_replicas is not None:
            options["autoscaling_config"] = {"min_replicas": self.min_replicas or 1,
                                             "max_replicas": self.max_replicas or max(self.replicas, 1),
                                             "target_ongoing_requests": self.target_ongoing_requests}
        else:
            options["num_replicas"] = self.replicas
        return {**options, **self.extra}


def _ray():
    try:
        import ray
        from ray import serve
    except ImportError:
        raise TrtspecError("--replicas needs Ray Serve: pip install 'trtspec[ray]'") from None
    return ray, serve


def build_app(options: ReplicaOptions):
    """On a replica: the pipeline, its server (started: a replica that cannot load fails here, and
    Ray Serve reports it), and the FastAPI app; its metrics mirrored into Ray's."""
    import torch

    from trtspec.commands.options import load_pipeline
    from trtspec.runtime.engine import EngineConfig
    from trtspec.runtime.schedule import BlockChoice
    from trtspec.serving.metrics import ServingMetrics
    from trtspec.serving.openai_server import OpenAIServer

    _, serve = _ray()
    if options.threads:
        torch.set_num_threads(options.threads)
    replica = serve.get_replica_context().replica_id.unique_id
    pipeline = load_pipeline(**options.load)
    block = BlockChoice.parse(options.block_size, allow_ar=True) if options.block_size else None
    metrics = ServingMetrics(model_name=options.served_model_name, engine=replica, vllm_prefix=options.metrics_prefix)
    server = OpenAIServer(pipeline, EngineConfig(max_running=options.max_concurrency, max_queued=options.max_queued),
                          model_name=options.served_model_name, block_size=block, metrics=metrics,
                          max_body_bytes=options.max_body_bytes, read_timeout_s=options.read_timeout_s,
                          api_key=options.api_key, replica={"id": replica, "pid": os.getpid()})
    server.start()
    threading.Thread(target=_mirror_metrics, args=(metrics.registry, replica), name="trtspec-ray-metrics",
                     daemon=True).start()
    return server.app


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
    """The Ray Serve application: one ingress deployment whose replicas each serve `build_app`."""
    _, serve = _ray()

    def builder():  # a plain function: Ray Serve calls it on each replica (a partial would pass for an ASGI app)
        return build_app(options)
    replica_class = serve.ingress(builder)()
    return serve.deployment(replica_class, name="trtspec-server",
                            **scaling.deployment_options(options.max_concurrency + options.max_queued)).bind()


def deploy_config(options: ReplicaOptions, scaling: Scaling, host: str, port: int) -> dict:
    """A `serve deploy` config for an existing cluster: the application is built by
    `trtspec.serving.ray_serve:app_builder` from these arguments."""
    deployment = {"name": "trtspec-server", **scaling.deployment_options(options.max_concurrency + options.max_queued)}
    return {"proxy_location": "EveryNode", "http_options": {"host": host, "port": port},
            "applications": [{"name": APP_NAME, "route_prefix": "/", "import_path": "trtspec.serving.ray_serve:app_builder",
                              "args": {"options": asdict(options), "scaling": asdict(scaling)},
                              "deployments": [deployment]}]}


def app_builder(args: dict):
    """`serve deploy`'s entry point: the application from deploy_config's arguments."""
    return application(ReplicaOptions(**args["options"]), Scaling(**args["scaling"]))


def run(options: ReplicaOptions, scaling: Scaling, *, address: str | None, host: str, port: int,
        on_ready=None) -> None:
    """Start or join a Ray cluster (`address`; None: a local one), deploy, and serve until SIGINT
    or SIGTERM; then the application is deleted (the cluster stays when it was joined)."""
    ray, serve = _ray()
    ray.init(address=address, ignore_reinit_error=True, logging_level="ERROR", log_to_driver=False,
             include_dashboard=False if address is None else None)
    try:
        serve.start(http_options={"host": host, "port": port}, proxy_location="EveryNode")
        try:
            serve.run(application(options, scaling), name=APP_NAME, route_prefix="/", blocking=False)
        except RuntimeError as error:  # a replica that cannot start: Ray Serve gives up after its retries
            first = str(error).strip().splitlines()
            raise TrtspecError(f"the deployment failed: {_replica_error(first)}") from None
        if on_ready is not None:
            on_ready()
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        while not stop.wait(1.0):
            pass
        serve.delete(APP_NAME)
    finally:
        serve.shutdown()
        ray.shutdown()


def _replica_error(lines: list[str]) -> str:
    """The line of Ray's report that says why a replica failed (a TrtspecError's own line when there is one)."""
    for line in lines:
        if "TrtspecError" in line or "CheckpointError" in line:
            return line.split("Error:", 1)[-1].strip()
    return lines[0] if lines else "unknown error"
