"""`trtspec triton-repo` and `trtspec triton-serve`."""

from __future__ import annotations

import signal
from pathlib import Path

import click

from trtspec import limits
from trtspec.commands.options import Ranged, drafting_options, output_option


@click.command("triton-repo", epilog="""\b
Example:
  trtspec build -o build/engine && trtspec triton-repo --engine build/engine -o build/triton-repo
  trtspec triton-serve build/triton-repo
""")
@click.option("--engine", "engine", required=True, metavar="DIR", help="Engine directory (trtspec build).")
@output_option("-o", "--output", required=True, metavar="REPO",
              help="Model repository to write (replaces only a previous one or an empty directory).")
@click.option("--name", default="trtspec", show_default=True, help="Model name (NAME and NAME_stream).")
@click.option("--instances", type=Ranged(limits.COUNT), default=1, show_default=True, help="Model instances (each loads the engine).")
@click.option("--threads", type=Ranged(limits.NON_NEGATIVE), default=0, show_default=True, help="CPU threads per instance (0 = torch's choice).")
@drafting_options
def triton_repo(engine, output, name, instances, threads, **drafting) -> None:
    """Generate a Triton model repository serving ENGINE (python backend, plain and streaming)."""
    from trtspec.runtime.engine import EngineConfig
    from trtspec.serving.triton import write_repository

    models = write_repository(Path(engine), Path(output), name, instances, threads,
                              EngineConfig(**drafting))
    click.echo(f"wrote {output}: models {', '.join(models)} over {engine}")


@click.command("triton-serve", epilog="""\b
Example:
  trtspec triton-serve build/triton-repo --http-port 8000 --grpc-port 8001
""")
@click.argument("repository", metavar="REPO")
@click.option("--http-port", type=int, default=8000, show_default=True)
@click.option("--grpc-port", type=int, default=8001, show_default=True)
@click.option("--metrics-port", type=int, default=8002, show_default=True)
@click.option("--address", default="127.0.0.1", show_default=True, help="Listen address (loopback by default).")
def triton_serve(repository, http_port, grpc_port, metrics_port, address) -> None:
    """Run tritonserver over REPO until Ctrl-C (or SIGTERM), then stop it cleanly.

    The engine of every model is verified first, as the runtime does (manifest and file hashes):
    a damaged engine is refused in one line before the server starts.
    """
    from trtspec.serving.triton import start_server, stop_server

    # Ctrl-C and `docker stop`/`kill` (SIGTERM) both stop the server cleanly, even when this process
    # was started with SIGINT ignored (as background jobs of a non-interactive shell are).
    for number in (signal.SIGINT, signal.SIGTERM):
        signal.signal(number, signal.default_int_handler)
    process, scratch = start_server(Path(repository), http_port, grpc_port, metrics_port, address)
    try:
        process.wait()
    except KeyboardInterrupt:
        pass  # Ctrl-C: stop the server below
    finally:
        code = stop_server(process, scratch)  # also removes the server's scratch directory
    raise SystemExit(code)
