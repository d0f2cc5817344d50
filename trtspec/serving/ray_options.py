"""What `trtspec serve --replicas N` deploys with, as data (`trtspec.serving.ray_serve` deploys
it): what every replica loads and serves with, how many replicas and their resources, and the
`serve deploy` config file that carries both to an existing cluster. Importable without Ray.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from trtspec.errors import TrtspecError
from trtspec.serving.door import MAX_BODY_BYTES, READ_TIMEOUT_S

if TYPE_CHECKING:  # torch comes with it: loaded on the replicas, not by `trtspec serve --help`
    from trtspec.runtime.schedule import BlockChoice

APP_NAME = "trtspec"
ENGINE, INGRESS = "trtspec-engine", "trtspec-server"  # the deployments' names
# A stopping replica checks for requests still in flight this often (Ray's default: every 2 s, so an
# idle server took ~5 s to stop on Ctrl-C); it still waits for them up to Ray's graceful timeout.
SHUTDOWN = {"graceful_shutdown_wait_loop_s": 0.25}


@dataclass(frozen=True)
class ReplicaOptions:
    """What every replica loads and serves with: `load` holds load_pipeline's arguments;
    `block_size` the requests' default, parsed once where it entered (the command line, or a
    deploy config's text: `app_builder`)."""

    load: dict
    max_concurrency: int = 8
    max_queued: int = 64
    block_size: BlockChoice | None = None
    served_model_name: str = "model"
    api_key: str | None = None
    metrics_prefix: str = "vllm:"
    max_body_bytes: int = MAX_BODY_BYTES
    read_timeout_s: float = READ_TIMEOUT_S
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

    def _replica_count(self) -> dict:
        if self.min_replicas is not None or self.max_replicas is not None:
            return {"autoscaling_config": {"min_replicas": self.min_replicas or 1,
                                           "max_replicas": self.max_replicas or max(self.replicas, 1),
                                           "target_ongoing_requests": self.target_ongoing_requests}}
        return {"num_replicas": self.replicas}

    def check_fits(self, cores: int) -> None:
        """Refuse, in one line, more engine replicas than a local cluster of `cores` CPUs can place
        (Ray would wait for ever for the CPUs of the rest)."""
        most = max(self.replicas, self.max_replicas or 0, self.min_replicas or 0)
        ceiling = int(cores / self.num_cpus + 1e-9)
        if most > ceiling:
            raise TrtspecError(f"--replicas {most} needs {most * self.num_cpus:g} CPUs (--replica-cpus {self.num_cpus:g} "
                               f"each); this machine has {cores}, room for {ceiling}: lower --replicas or "
                               "--replica-cpus, or join a larger cluster with --ray-address")

    def engine_options(self, options: ReplicaOptions) -> dict:
        """The engine deployment's: its replicas' resources, the requests one takes at once (its
        slots and queue; beyond, Ray Serve queues them) and a health check that asks the engine."""
        return {"ray_actor_options": {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus},
                "max_ongoing_requests": options.max_concurrency + options.max_queued,
                "health_check_period_s": 2.0, "health_check_timeout_s": 30.0, **SHUTDOWN, **self._replica_count(),
                **self.extra}

    def ingress_options(self) -> dict:
        """The ingress's: as many replicas as the engine (a forwarder per engine spreads the
        streaming work over the nodes), no CPU reserved (it only forwards bytes)."""
        return {"ray_actor_options": {"num_cpus": 0}, "max_ongoing_requests": 1024, **SHUTDOWN, **self._replica_count()}


def deploy_config(options: ReplicaOptions, scaling: Scaling, host: str, port: int) -> dict:
    """A `serve deploy` config for an existing cluster: the application is built by
    `trtspec.serving.ray_serve:app_builder` from these arguments."""
    deployments = [{"name": ENGINE, **scaling.engine_options(options)}, {"name": INGRESS, **scaling.ingress_options()}]
    block = options.block_size  # in the file as its name: app_builder parses it back
    return {"proxy_location": "EveryNode", "http_options": {"host": host, "port": port},
            "applications": [{"name": APP_NAME, "route_prefix": "/", "import_path": "trtspec.serving.ray_serve:app_builder",
                              "args": {"options": {**asdict(options), "block_size": block and block.name},
                                       "scaling": asdict(scaling)},
                              "deployments": deployments}]}
