"""BlockPilot commands: `label-blocks`, `train-policy`, `eval-policy`."""

from __future__ import annotations

from pathlib import Path

import click

from trtspec import limits
from trtspec.commands.options import (BlockSizeType, BlockSizesType, Ranged, backend_option, engine_sizes,
                                      limit_option, load_pipeline, max_new_tokens_option, model_options,
                                      output_option, sampling_config, sampling_options)
from trtspec.errors import TrtspecError


def _feature_kinds(text: str) -> tuple[str, ...]:
    from trtspec.blockpilot.policy import FEATURE_KINDS

    kinds = tuple(part.strip() for part in text.split(",") if part.strip())
    unknown = [k for k in kinds if k not in FEATURE_KINDS]
    if not kinds or unknown:
        raise TrtspecError(f"--features must be a comma-separated subset of {', '.join(FEATURE_KINDS)}; got {text!r}")
    return kinds


@click.command("label-blocks", epilog="""\b
Example:
  trtspec label-blocks --engine build/engine --prompts policy-prompts.jsonl -o build/labels-train.jsonl
""")
@model_options
@backend_option
@click.option("--prompts", "prompts_spec", required=True, metavar="humaneval|FILE",
              help='"humaneval" or a JSONL file of {"prompt": ...} lines.')
@click.option("--block-sizes", type=BlockSizesType(), default="12,16,20,24", show_default=True, metavar="B,B:G,...",
              help="Candidates: fixed block sizes, and growing blocks B:G (cycles at B; at G after one that "
                   "fills a block of B), whose B and G must be listed as fixed sizes too.")
@sampling_options
@max_new_tokens_option(128)
@limit_option
@output_option("-o", "--output", required=True, metavar="OUT.jsonl",
              help="Labels (JSONL) to write; prefill summaries go to OUT.features.safetensors.")
def label_blocks(target, drafter, engine, dtype, device, backend, prompts_spec, block_sizes, temperature, top_k, top_p, seed,
                 max_new_tokens, limit, output) -> None:
    """Run every prompt at every candidate block size and label it with the fastest one.

    The label is the block size with the highest modelled decode speed, tau over the backend's
    measured cost of one cycle at that block size (stored in the header); raw times are kept.
    Label on the backend the policy will serve on (--backend, as bench and run choose it): the
    cycle costs, and so the labels, differ between backends.
    """
    from trtspec.perf.bench import load_prompts
    from trtspec.blockpilot.labels import check_labels_output
    from trtspec.perf.labelling import LabelConfig, label_blocks as run_labels

    check_labels_output(output, (prompts_spec, engine, target, drafter))
    config = LabelConfig(choices=block_sizes, max_new_tokens=max_new_tokens,
                         sampling=sampling_config(temperature, top_k, top_p, seed if seed is not None else 0))
    name, prompts = load_prompts(prompts_spec, limit)
    pipeline = load_pipeline(target, drafter, dtype, device, engine=engine, backend=backend,
                             block_sizes=engine_sizes(block_sizes))
    labels = run_labels(pipeline, prompts, config, prompts_name=name)
    path = labels.write(output)
    counts = {c.name: labels.labels().count(c) for c in labels.choices}
    costs = ", ".join(f"B={c.size} {labels.cycle_cost(c.size) * 1e3:.2f} ms" for c in labels.fixed)
    click.echo(f"wrote {path}: {len(labels.records)} prompts; labels {counts}; cycle cost {costs}; "
               f"AR {labels.header['ar_token_s'] * 1e3:.2f} ms/token")


@click.command("train-policy", epilog="""\b
Examples:
  trtspec train-policy build/labels-train.jsonl -o build/policy
  trtspec train-policy build/labels-t0.jsonl build/labels-t1.jsonl -o build/policy   # greedy and sampled requests
  trtspec train-policy build/labels-train.jsonl -o build/policy --ablation   # compare feature sets first
  trtspec train-policy build/labels-train.jsonl -o build/policy --ablation --ar auto   # ... and AR as a candidate
""")
@click.argument("labels_paths", metavar="LABELS.jsonl...", nargs=-1, required=True)
@output_option("-o", "--output", required=True, metavar="DIR", help="Policy directory to write.")
@click.option("--features", default="last,mean,length", show_default=True,
              help="Prefill summaries to use: last (last position's features), mean (over the prompt), length, "
                   "confidence (the target's entropy and top-1 probability over the prompt's tail); sampled "
                   "(whether the request samples) is added when the label sets hold both greedy and sampled runs.")
@click.option("--hidden", type=Ranged(limits.COUNT), default=64, show_default=True)
@click.option("--steps", type=Ranged(limits.COUNT), default=600, show_default=True)
@click.option("--ar", "with_ar", type=click.Choice(["no", "yes", "auto"]), default="no", show_default=True,
              help="Also let the policy choose autoregressive decoding (no speculation) for a request; auto: "
                   "decided with the features by --ablation.")
@click.option("--ablation", is_flag=True,
              help="Before training, compare feature sets (and, with --ar auto, AR as a candidate or not) by "
                   "5-fold cross-validation (fewer folds on fewer prompts) on these labels and train on the simplest within one standard error of the "
                   "fastest; `sampled` alone (no prefill summary: the best fixed size per regime) comes first.")
def train_policy(labels_paths, output, features, hidden, steps, with_ar, ablation) -> None:
    """Train a BlockPilot policy (a small MLP, expected-regret loss) on label-blocks output: one
    label set, or several (e.g. the same prompts labelled greedy and at T = 1) with the same
    candidates."""
    import torch
    from trtspec.fileio import POLICY, check_output_dir
    from trtspec.blockpilot.evaluation import best_fixed_block_size
    from trtspec.blockpilot.labels import features_path, read_labels
    from trtspec.blockpilot.training import (feature_ablation, simplest_within_one_error, train_policy as fit,
                                             with_regime)

    check_output_dir(output, POLICY, [p for path in labels_paths for p in (path, features_path(Path(path)))])
    if with_ar == "auto" and not ablation:
        raise TrtspecError("--ar auto is decided by cross-validation; add --ablation (or choose --ar yes or no)")
    sets = [read_labels(path) for path in labels_paths]
    labels = sets[0]
    if any(other.choices != labels.choices for other in sets[1:]):
        raise TrtspecError("the label sets were labelled at different block sizes ("
                           + "; ".join(f"{path}: {','.join(c.name for c in s.choices)}"
                                       for path, s in zip(labels_paths, sets)) + "): label them alike")
    kinds, ar = _feature_kinds(features), with_ar == "yes"
    info = {}
    if ablation:
        table = feature_ablation(sets, hidden, steps, ar_options=(False, True) if with_ar == "auto" else (ar,))
        for (name, ar_option), row in table.items():
            click.echo(f"features {name + (' + AR' if ar_option else ''):>33}: cross-validated modelled speed-up "
                       f"{row['modelled_speedup']:.3f}x (+-{row['standard_error']:.3f}), mean regret "
                       f"{row['mean_regret']:.2%}", err=True)
        name, ar = simplest_within_one_error(table)
        kinds = _feature_kinds(name)
        info["ablation"] = [{"features": n, "ar": a, **row} for (n, a), row in table.items()]
    kinds = with_regime(kinds, sets)
    candidates = labels.candidates(ar)
    # each set's speeds come from its own cycle costs; the loss compares a row's candidates only
    policy = fit(torch.cat([s.inputs(kinds) for s in sets]), torch.cat([s.speeds(candidates) for s in sets]),
                 candidates, kinds, hidden=hidden, steps=steps)
    policy.info.update(info, best_fixed_block_size=best_fixed_block_size(sets),
                       labels=", ".join(f"{s.header['prompts']} (T={s.header['temperature']:g})" for s in sets),
                       backend=labels.header["backend"])
    policy.save(output)
    click.echo(f"wrote {output}: BlockPilot over B={','.join(c.name for c in candidates)}, features "
               f"{','.join(kinds)}, trained on {sum(len(s.records) for s in sets)} labelled runs (best fixed B over "
               f"{'the sets' if len(sets) > 1 else 'them'}: {policy.info['best_fixed_block_size']})")


@click.command("eval-policy", epilog="""\b
Example:
  trtspec eval-policy --policy build/policy --labels build/labels-humaneval.jsonl --json eval.json
""")
@click.option("--policy", "policy_dir", required=True, metavar="DIR")
@click.option("--labels", "labels_path", required=True, metavar="LABELS.jsonl",
              help="Held-out labels (label-blocks on prompts the policy was not trained on).")
@click.option("--fixed-block-size", type=BlockSizeType(plain=True), metavar="B",
              help="The fixed block size to beat. [default: the best one on the policy's training labels]")
@output_option("--json", "json_path", metavar="OUT", help="Also write the report as JSON.")
def eval_policy(policy_dir, labels_path, fixed_block_size, json_path) -> None:
    """Compare every fixed block size, BlockPilot and the per-prompt oracle on held-out labels."""
    from trtspec.perf.bench import write_json
    from trtspec.fileio import check_output_file
    from trtspec.blockpilot.evaluation import evaluate_policy, format_evaluation
    from trtspec.blockpilot.labels import features_path, read_labels
    from trtspec.blockpilot.policy import load_policy

    if json_path:
        check_output_file(json_path, (policy_dir, labels_path, features_path(Path(labels_path))))
    labels = read_labels(labels_path)
    sizes = tuple(c.size for c in labels.fixed)
    policy = load_policy(policy_dir, sizes)
    fixed = fixed_block_size or policy.info.get("best_fixed_block_size")
    if fixed not in sizes:
        raise TrtspecError(f"--fixed-block-size must be one of {', '.join(map(str, sizes))}")
    report = evaluate_policy(policy, labels, fixed)
    click.echo(format_evaluation(report))
    if json_path:
        click.echo(f"wrote {write_json(report, json_path)}", err=True)
