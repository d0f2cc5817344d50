"""`trtspec serve`: the OpenAI-compatible HTTP server (trtspec.serving.app, run by trtspec.serving.server)."""

from __future__ import annotations

import os

import click

from trtspec import limits
from trtspec.commands.options import (THREADS, BlockSizeType, Ranged, backend_option, draft_vocab_options,
                                      drafting_options, engine_sizes, load_pipeline, model_options, output_option,
                                      policy_option)
from trtspec.errors import TrtspecError
from trtspec.serving.door import MAX_BODY_BYTES, READ_TIMEOUT_S

API_KEY_ENV = "TRTSPEC_API_KEY"


@click.command(epilog="""\b
Examples:
  trtspec serve                                     # the default pair, as smollm2, on http://127.0.0.1:8000
  trtspec --threads 2 serve --port 8080 --max-concurrency 4
  trtspec serve --target ./Qwen3-4B --drafter ./Qwen3-4B-DFlash-b16 --served-model-name qwen3-4b
  trtspec serve --engine build/engine --block-size 12:24
  curl -s http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
       -d '{"model": "smollm2", "prompt": "def fib(n):", "max_tokens": 32}'
  curl -s http://127.0.0.1:8000/metrics | grep spec_decode
\b
Requests take OpenAI's fields (max_tokens [default 256, as triton-serve's and run's], temperature
[default 0: greedy], top_p, top_k, seed, stop, stop_token_ids, stream, stream_options, user, n,
logprobs, logit_bias, penalties, response_format), vLLM's ignore_eos, min_tokens, min_p,
continuous_usage_stats, include_stop_str_in_output, skip_special_tokens and chat template fields
(chat_template_kwargs, add_generation_prompt, continue_final_message), plus block_size ("16",
"6:16", "auto", "AR"); any other field is refused by name unless at its default
(nothing is silently ignored). vLLM's /tokenize, /detokenize and /version are served too. Every
response carries a "trtspec" object with the block size run, tau, histogram and ceiling fraction.
--host 0.0.0.0 or :: (every interface) is taken as asked, with a warning; an empty host is refused.
""")
@model_options
@policy_option
@backend_option
@draft_vocab_options
@drafting_options
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Listen address: loopback by default; every interface only when named (0.0.0.0 or ::, "
                   "with a warning on stderr); an empty host is refused.")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True,
              help="Listen port (0: any free port; the URL is printed).")
@click.option("--max-concurrency", type=Ranged(limits.CONCURRENCY), default=8, show_default=True, metavar="N",
              help="Requests decoded together (the engine's slots).")
@click.option("--max-queued", type=Ranged(limits.COUNT), default=64, show_default=True, metavar="N",
              help="Requests waiting for a slot; beyond this a request gets HTTP 429.")
@click.option("--block-size", type=BlockSizeType(),
              help="Default block size of requests without a block_size field: B, B:G, auto or AR. "
                   "[default: auto with a policy, else the drafter's]")
@click.option("--max-context", type=Ranged(limits.MAX_CONTEXT), metavar="N",
              help="Cap on prompt + output tokens. [default: the model's]")
@click.option("--served-model-name", metavar="NAME",
              help="The model name clients give. [default: smollm2 for the default target, else the target's "
                   "directory or file name]")
@click.option("--api-key", envvar=API_KEY_ENV, metavar="KEY", callback=lambda ctx, param, value: _api_key(value),
              help="Require `Authorization: Bearer KEY` on every route (401 otherwise) but /health and /metrics. "
                   "[env: TRTSPEC_API_KEY]")
@click.option("--max-body-bytes", type=Ranged(limits.COUNT), default=MAX_BODY_BYTES, show_default=True, metavar="N",
              help="Largest request body; a larger one gets HTTP 413 (declared or sent).")
@click.option("--read-timeout", type=Ranged(limits.POSITIVE_REAL), default=READ_TIMEOUT_S, show_default=True,
              metavar="S", help="Seconds a client gets to send a request's head, and then its body (408).")
@click.option("--metrics-prefix", type=click.Choice(["vllm:", "trtspec_"]), default="vllm:", show_default=True,
              help="Prefix of the /metrics families vLLM also exports (vllm: lets vLLM's dashboards read them "
                   "unchanged); trtspec's own families are always trtspec_.")
@click.option("--graceful-shutdown", type=Ranged(limits.NON_NEGATIVE_REAL), default=10.0, show_default=True,
              metavar="S", help="On SIGINT/SIGTERM, seconds in-flight requests get to finish before they are cancelled.")
@click.option("--replicas", type=Ranged(limits.COUNT), metavar="N",
              help="Serve N replicas of the server on Ray Serve (each its own process and engine), on a local "
                   "Ray cluster or the one --ray-address names; needs trtspec[ray]. [default: one process, no Ray]")
@click.option("--ray-address", metavar="ADDR", help="A running Ray cluster to deploy on (e.g. 10.0.0.1:6379, auto).")
@click.option("--min-replicas", type=Ranged(limits.COUNT), metavar="N",
              help="With --replicas: autoscale from N replicas on ongoing requests.")
@click.option("--max-replicas", type=Ranged(limits.COUNT), metavar="N", help="With --replicas: autoscale up to N.")
@click.option("--target-ongoing-requests", type=Ranged(limits.POSITIVE_REAL), default=8.0, show_default=True,
              metavar="N", help="With autoscaling: ongoing requests per replica it aims at.")
@click.option("--replica-cpus", type=Ranged(limits.POSITIVE_REAL), default=1.0, show_default=True, metavar="N",
              help="CPUs Ray reserves for each replica.")
@click.option("--replica-gpus", type=Ranged(limits.NON_NEGATIVE_REAL), default=0.0, show_default=True, metavar="N",
              help="GPUs Ray reserves for each replica (1 for an engine on its own GPU).")
@output_option("--ray-config", type=click.Path(dir_okay=False), metavar="FILE",
              help="With --replicas: write a `serve deploy` config (YAML) for an existing cluster to FILE and exit.")
@click.pass_context
def serve(ctx, target, drafter, engine, dtype, device, backend, policy, draft_vocab, draft_counts, host, port,
          max_concurrency, max_queued, block_size, max_context, served_model_name, api_key, max_body_bytes,
          read_timeout, metrics_prefix, graceful_shutdown, replicas, ray_address, min_replicas, max_replicas,
          target_ongoing_requests, replica_cpus, replica_gpus, ray_config, **drafting) -> None:
    """Serve the model over HTTP with OpenAI's API (completions, chat completions, streaming),
    plus /health and Prometheus /metrics, until Ctrl-C or SIGTERM."""
    from pathlib import Path

    if replicas is None and (ray_address or min_replicas or max_replicas or ray_config):
        raise TrtspecError("--ray-address, --min-replicas, --max-replicas and --ray-config go with --replicas N")
    if served_model_name is None:
        from trtspec.assets import DEFAULT_TARGET, target_source

        source = engine if engine is not None and target is None else target_source(target)
        default = engine is None and target in (None, DEFAULT_TARGET)  # (a local ./smollm2 has that name too)
        served_model_name = DEFAULT_TARGET if default else Path(source).resolve().name
    # load_pipeline's arguments: this process loads them, or each Ray Serve replica does
    load = {"target": target, "drafter": drafter, "dtype": dtype, "device": device, "max_context": max_context,
            "engine": engine, "policy": policy, "draft_vocab": draft_vocab, "draft_counts": draft_counts,
            "backend": backend, "block_sizes": engine_sizes([block_size] if block_size else []),
            **drafting}
    if replicas is not None:
        from trtspec.serving import ray_options, ray_serve

        if engine is not None:
            from trtspec.engines.manifest import read_manifest

            read_manifest(Path(engine))  # a bad engine directory: one line here, not a failing deployment
        options = ray_options.ReplicaOptions(
            load=load, max_concurrency=max_concurrency, max_queued=max_queued,
            block_size=block_size, served_model_name=served_model_name,
            api_key=api_key or None, metrics_prefix=metrics_prefix, max_body_bytes=max_body_bytes,
            read_timeout_s=read_timeout, threads=ctx.meta.get(THREADS))
        scaling = ray_options.Scaling(replicas=replicas, min_replicas=min_replicas, max_replicas=max_replicas,
                                      target_ongoing_requests=target_ongoing_requests, num_cpus=replica_cpus,
                                      num_gpus=replica_gpus)
        if ray_config:
            import json

            from trtspec.fileio import atomic_write_text

            atomic_write_text(Path(ray_config), json.dumps(ray_options.deploy_config(options, scaling, host, port),
                                                             indent=2) + "\n")  # JSON is YAML
            click.echo(f"trtspec serve: wrote {ray_config}; deploy it with: serve deploy {ray_config}", err=True)
            return
        if port == 0:  # Ray Serve's proxy binds the port itself: pick a free one now
            from trtspec.serving.server import listen_socket

            with listen_socket(host, 0) as probe:
                port = probe.getsockname()[1]
        ray_serve.run(options, scaling, address=ray_address, host=host, port=port, on_start=lambda: click.echo(
            f"trtspec serve: deploying {replicas} replicas with Ray Serve ({ray_address or 'a local cluster'}); "
            "Ctrl-C stops it", err=True), on_ready=lambda: click.echo(
            f"trtspec serve: {served_model_name}, {replicas} replicas on Ray Serve, on http://{host}:{port} "
            f"(OpenAI API at /v1)", err=True))
        return

    try:
        import prometheus_client

        from trtspec.serving.app import OpenAIServer
        from trtspec.serving.server import listen_socket, listens_everywhere, serve as run_server, socket_url
    except ImportError as exc:
        raise TrtspecError(f"trtspec serve needs the serve extra (pip install 'trtspec[serve]'): {exc}") from None
    from trtspec.runtime.engine import EngineConfig

    prometheus_client.disable_created_metrics()  # *_created series: one per label set, noise to a scraper
    config = EngineConfig(max_running=max_concurrency, max_queued=max_queued)
    sock = listen_socket(host, port)  # before the model loads: a port in use is refused at once
    try:
        pipeline = load_pipeline(**load)
        if block_size is not None:
            _check_block_size(pipeline, block_size)
        server = OpenAIServer(pipeline, config, model_name=served_model_name, block_size=block_size,
                              max_body_bytes=max_body_bytes, read_timeout_s=read_timeout, api_key=api_key or None,
                              metrics_prefix=metrics_prefix)
        server.start()  # the engine and its caches now: one that cannot fit is one line, not a stack at start-up
    except BaseException:
        sock.close()
        raise
    url = socket_url(sock)
    if listens_everywhere(sock):
        click.echo(f"trtspec serve: warning: listening on every interface ({host}): anyone who can reach this "
                   f"machine can use the server{'' if api_key else '; --api-key KEY requires a key'}", err=True)
    click.echo(f"trtspec serve: {served_model_name} on {url} (OpenAI API at {url}/v1, metrics at {url}/metrics)",
               err=True)
    run_server(server, sock, graceful_s=graceful_shutdown)


def _api_key(value: str | None) -> str | None:
    """The key, refused when empty: an empty key would serve every route open without a word (click
    reads an empty TRTSPEC_API_KEY as unset), and one with surrounding whitespace could never match
    (HTTP strips it from the header)."""
    if value is None:
        value = os.environ.get(API_KEY_ENV)
    if value is not None and not value.strip():
        raise TrtspecError(f"--api-key is empty (or {API_KEY_ENV} is set but empty): give a key, or leave both out to "
                           "serve without one")
    if value is not None and value != value.strip():
        raise TrtspecError("--api-key must not begin or end with whitespace (HTTP drops it from the header)")
    return value


def _check_block_size(pipeline, choice) -> None:
    """Refuse at start a default block size the pipeline cannot run (else every request without a
    block_size field would be refused)."""
    from trtspec.runtime.request import check_block

    try:
        check_block(pipeline.runner, choice, pipeline.policy)
    except TrtspecError as exc:
        raise TrtspecError(f"--block-size {choice.name}: {exc}") from None
