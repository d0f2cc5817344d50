"""DBloom commands: `preflight` (is the block horizon capping tau?) and `expand-block`."""

from __future__ import annotations

import click

from trtspec import limits
from trtspec.commands.options import (BlockSizeType, Ranged, limit_option, load_pipeline, max_new_tokens_option,
                                      model_options, output_option, sampling_config, sampling_options)
from trtspec.errors import TrtspecError


@click.command(epilog="""\b
Examples:
  trtspec preflight                                   # the default pair on HumanEval at its block size
  trtspec preflight --engine build/engine --block-size 24 --json pre.json --plot pre.png
  trtspec preflight --drafter build/smollm2-b24 --block-size 24 --teacher-forced   # same contexts for every drafter
""")
@model_options
@click.option("--prompts", "prompts_spec", default="humaneval", show_default=True, metavar="humaneval|FILE")
@click.option("--block-size", type=BlockSizeType(plain=True), help="Block size to inspect. [default: the drafter's]")
@sampling_options
@max_new_tokens_option(128)
@limit_option
@output_option("--json", "json_path", metavar="OUT", help="Also write the report as JSON.")
@output_option("--plot", "plot_path", metavar="OUT.png", help="Also draw the histogram and per-position acceptance.")
@click.option("--teacher-forced", is_flag=True,
              help="Instead of decoding, start a block at every position of the target's greedy continuation "
                   "(the first --max-new-tokens), so every drafter and block size is measured on the same "
                   "contexts. Greedy only; runs the checkpoints.")
def preflight(target, drafter, engine, dtype, device, prompts_spec, block_size, temperature, top_k, top_p, seed,
              max_new_tokens, limit, json_path, plot_path, teacher_forced) -> None:
    """Acceptance histogram, per-position acceptance and stranded speed-up, with a recommendation."""
    from trtspec.perf.bench import load_prompts, write_json
    from trtspec.fileio import check_distinct_outputs, check_output_file
    from trtspec.dbloom.preflight import PLOT_SUFFIX, plot, run_preflight, run_teacher_forced

    inputs = (prompts_spec, engine, target, drafter)
    check_distinct_outputs(json_path, plot_path)
    if json_path:
        check_output_file(json_path, inputs)
    if plot_path:
        check_output_file(plot_path, inputs, suffix=PLOT_SUFFIX, what="--plot")
    if teacher_forced and temperature > 0:
        raise TrtspecError("--teacher-forced measures greedy acceptance; drop --temperature")
    if teacher_forced and engine is not None:
        raise TrtspecError("--teacher-forced runs the checkpoints: give --target and --drafter, not --engine")
    name, prompts = load_prompts(prompts_spec, limit)
    # the drafter's own acceptance over whole blocks: no copies from the text, no narrowed cycles
    pipeline = load_pipeline(target, drafter, dtype, device, engine=engine, prompt_lookup=0, draft_width=0,
                             confident_width=False)
    if not pipeline.has_drafter:
        raise TrtspecError("preflight inspects a drafter's acceptance; give --drafter DIR")
    if block_size is None:
        block_size = pipeline.drafter_block_size
    if teacher_forced:
        report = run_teacher_forced(pipeline, prompts, block_size, max_new_tokens)
    else:
        report = run_preflight(pipeline, prompts, block_size, max_new_tokens,
                               sampling_config(temperature, top_k, top_p, seed))
    click.echo(f"{name}: {len(prompts)} prompts, T={temperature:g}" + (", teacher-forced" if teacher_forced else ""))
    click.echo(report.format())
    if json_path:
        click.echo(f"wrote {write_json(report.to_dict(), json_path)}", err=True)
    if plot_path:
        plot(report, plot_path)
        click.echo(f"wrote {plot_path}", err=True)


@click.command("expand-block", epilog="""\b
Example:
  trtspec expand-block --drafter smollm2-b16 --to 24 --data build/smollm2/train.jsonl -o build/smollm2-b24
""")
@model_options
@click.option("--to", "to_block_size", type=BlockSizeType(plain=True), required=True, metavar="B1", help="The longer block size.")
@click.option("--data", "data_file", required=True, metavar="FILE", help='JSONL of {"prompt", "response"}.')
@output_option("-o", "--output", required=True, metavar="DIR", help="Drafter directory to write (z-lab layout).")
@click.option("--steps", type=Ranged(limits.COUNT), default=300, show_default=True, help="Steps of the growth curriculum.")
@click.option("--stages", type=Ranged(limits.COUNT), default=2, show_default=True, help="Block grown from B0 to B1 in this many stages.")
@click.option("--continue-steps", type=Ranged(limits.NON_NEGATIVE), default=0, show_default=True,
              help="Continuation fine-tuning at the original block size first.")
@click.option("--lr", type=Ranged(limits.POSITIVE_REAL), default=3e-4, show_default=True)
@click.option("--distill", "distill_weight", type=Ranged(limits.NON_NEGATIVE_REAL), default=0.0, show_default=True,
              help="In every stage past B0 (growth and settle), keep positions below B0 close to the "
                   "original drafter (weight of that KL term against the cross-entropy; 0 = off).")
@click.option("--settle-steps", type=Ranged(limits.NON_NEGATIVE), default=0, show_default=True,
              help="Finally train at B1 with the source's plain position decay, so the early positions, "
                   "which carry most of the acceptance, have the last word.")
@click.option("--batch-size", type=Ranged(limits.COUNT), default=8, show_default=True)
@click.option("--anchors", type=Ranged(limits.COUNT), default=16, show_default=True)
@click.option("--seed", type=Ranged(limits.SEED), default=0, show_default=True)
@click.option("--work", "work_dir", metavar="DIR", help="Stage checkpoints. [default: OUTPUT.work]")
def expand_block(target, drafter, engine, dtype, device, to_block_size, data_file, output, steps, stages,
                 continue_steps, lr, distill_weight, settle_steps, batch_size, anchors, seed, work_dir) -> None:
    """Post-train a drafter on a longer block with a curriculum that stresses the new positions.

    The result is an ordinary drafter directory; its config records the lineage (source block
    size, stages, steps) under trtspec_lineage.
    """
    from trtspec.fileio import CHECKPOINT, check_distinct_outputs, check_output_dir, check_work_dir
    from trtspec.training.data import read_training_data
    from trtspec.training.trainer import work_directory
    from trtspec.dbloom.expand import ExpandConfig, expand_block as expand

    inputs, work_dir = (target, drafter, data_file), work_directory(output, work_dir)
    check_output_dir(output, CHECKPOINT, inputs)
    check_distinct_outputs(output, work_dir)
    check_work_dir(work_dir, inputs)
    if engine is not None:
        raise TrtspecError("expand-block trains checkpoints; give --target/--drafter, not --engine")
    pipeline = load_pipeline(target, drafter, "float32" if dtype == "auto" else dtype, device)
    if not pipeline.has_drafter:
        raise TrtspecError("give --drafter DIR: the drafter to expand")
    config = ExpandConfig(to_block_size=to_block_size, steps=steps, stages=stages, continue_steps=continue_steps,
                          lr=lr, batch_size=batch_size, anchors_per_sequence=anchors, seed=seed,
                          distill_weight=distill_weight, settle_steps=settle_steps)
    sequences = read_training_data(data_file, pipeline.codec, pipeline.target.config.vocab_size)
    path = expand(pipeline.target, pipeline.drafter, sequences, config, output, work_dir)
    click.echo(f"wrote drafter to {path} (block size {to_block_size}, from {pipeline.drafter_block_size})", err=True)
