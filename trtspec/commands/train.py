"""`trtspec generate-data` and `trtspec train-drafter`: the DFlash training recipe."""

from __future__ import annotations

from dataclasses import replace

import click

from trtspec import limits
from trtspec.commands.options import (BlockSizeType, Ranged, backend_option, device_options, limit_option,
                                      load_pipeline, max_new_tokens_option, sampling_config, sampling_options,
                                      target_option)
from trtspec.errors import TrtspecError
from trtspec.runtime.request import GenerationConfig
from trtspec.runtime.schedule import AR


def _layer_ids(value: str | None) -> tuple[int, ...]:
    if not value:
        return ()
    try:
        return tuple(int(v) for v in value.split(","))
    except ValueError:
        raise TrtspecError(f"--target-layer-ids must be comma-separated integers, got {value!r}") from None


def _initial_drafter(path: str | None, target, block_size: int, layer_ids: tuple[int, ...]):
    """The drafter `--init-from` names, checked against the flags that would otherwise shape it."""
    if path is None:
        return None
    from trtspec.models import load_drafter

    drafter = load_drafter(path, target)
    if drafter.config.block_size != block_size:
        raise TrtspecError(f"--init-from drafter has block size {drafter.config.block_size}, not {block_size}; "
                           "use expand-block to change a drafter's block size")
    if layer_ids and tuple(layer_ids) != tuple(drafter.config.target_layer_ids):
        raise TrtspecError(f"--target-layer-ids {','.join(map(str, layer_ids))} differs from the --init-from "
                           f"drafter's taps {','.join(map(str, drafter.config.target_layer_ids))}")
    return drafter


@click.command("generate-data", epilog="""\b
Example:
  trtspec generate-data --target ./Qwen3-4B --prompts prompts.jsonl -o train.jsonl --max-new-tokens 512
""")
@target_option
@click.option("--prompts", "prompts_file", required=True, metavar="FILE",
              help='JSONL of {"prompt": ...} lines (optional "prompt_ids" are used as given).')
@click.option("-o", "--output", required=True, metavar="FILE", help="JSONL to write (atomically).")
@max_new_tokens_option(256)
@limit_option
@click.option("--batch-size", type=Ranged(limits.COUNT), default=16, show_default=True, help="Prompts the engine decodes at once (any lengths; each request keeps its own seed).")
@sampling_options
@device_options
@backend_option
def generate_data(target, prompts_file, output, max_new_tokens, limit, batch_size, temperature, top_k, top_p,
                  seed, dtype, device, backend) -> None:
    """Continue each prompt with the target alone: the training set the recipe asks for. The target
    decodes through the backend `run` would use (with `auto`, the cached engine of the target and
    its bundled drafter where that is faster: the drafter's graphs then sit unused)."""
    from trtspec.fileio import check_output_file
    from trtspec.training.data import generate_data as generate, read_prompt_set

    check_output_file(output, (prompts_file, target))
    prompts = read_prompt_set(prompts_file, limit)
    config = GenerationConfig(block=AR, max_new_tokens=max_new_tokens,
                              sampling=sampling_config(temperature, top_k, top_p, seed))
    pipeline = load_pipeline(target, None, dtype, device, with_drafter=False, backend=backend)
    path = generate(pipeline, prompts, config, output, batch_size)
    click.echo(f"wrote {len(prompts)} continuations to {path}", err=True)


@click.command("draft-vocab", epilog="""\b
Examples:
  trtspec draft-vocab --data train.jsonl -o my-drafter/draft_vocab    # the drafter's own counts
  trtspec draft-vocab --target ./Qwen3-4B --data a.jsonl --corpus notes.txt -o counts
  trtspec run prompt.txt --draft-vocab 1024                            # then draft among 1024 ids
""")
@target_option
@click.option("--data", "data_files", multiple=True, metavar="FILE",
              help="generate-data output (the target's own continuations); its response tokens are counted. "
                   "Repeatable.")
@click.option("--corpus", "corpus_files", multiple=True, metavar="FILE", help="A UTF-8 text file, tokenized and "
              "counted whole. Repeatable.")
@click.option("-o", "--output", required=True, metavar="DIR",
              help="Directory to write (counts.safetensors, draft_vocab.json); inside a drafter directory as "
                   "draft_vocab/ it is that drafter's default.")
def draft_vocab(target, data_files, corpus_files, output) -> None:
    """Count token ids, most frequent first, for --draft-vocab K (FR-Spec style draft vocabularies).

    Use the target's own continuations of prompts like the ones you will serve (generate-data),
    not the evaluation prompts. The counts and their sources are stored; K is chosen when loading.
    """
    from trtspec.assets import resolve_target
    from trtspec.fileio import DRAFT_VOCAB, check_output_dir, staged_directory
    from trtspec.models.target import load_target_config
    from trtspec.tokenizer import TextCodec
    from trtspec.training.draft_vocab import count_tokens

    inputs = (*data_files, *corpus_files)
    check_output_dir(output, DRAFT_VOCAB, (*inputs, target))
    if not inputs:
        raise TrtspecError("give --data FILE (generate-data output) or --corpus FILE to count tokens in")
    target_dir = resolve_target(target)
    config = load_target_config(target_dir)
    counts = count_tokens(TextCodec(target_dir), config.vocab_size, data_files, corpus_files, target_dir)
    with staged_directory(output, DRAFT_VOCAB, (*inputs, target_dir)) as staging:
        counts.save(staging)
    covered = ", ".join(f"{k}: {counts.coverage(k):.1%}" for k in (512, 1024, 2048, 4096) if k <= counts.vocab_size)
    click.echo(f"wrote {output}: {int(counts.counts.sum())} tokens over {int((counts.counts > 0).sum())} distinct ids "
               f"(vocabulary {counts.vocab_size}); share covered by the K most frequent: {covered}", err=True)


@click.command("train-drafter", epilog="""\b
Examples:
  trtspec train-drafter --data train.jsonl --block-size 16 -o my-drafter
  torchrun --nproc-per-node 8 -m trtspec train-drafter --target ./Qwen3-4B --data train.jsonl \\
      --block-size 16 --layers 5 --num-features 5 --anchors 512 -o Qwen3-4B-DFlash-b16
""")
@target_option
@click.option("--data", "data_file", required=True, metavar="FILE",
              help='JSONL of {"prompt", "response"} (e.g. from generate-data).')
@click.option("--block-size", type=BlockSizeType(plain=True), required=True, help="Block size B the drafter is trained for.")
@click.option("-o", "--output", required=True, metavar="DIR", help="Drafter directory to write (z-lab layout).")
@click.option("--layers", type=Ranged(limits.COUNT), default=1, show_default=True, help="Drafter decoder layers.")
@click.option("--num-features", type=Ranged(limits.COUNT), default=3, show_default=True,
              help="Target layers to tap (DFlash's default spread).")
@click.option("--target-layer-ids", metavar="I,J,...", help="Explicit target layers to tap (overrides --num-features).")
@click.option("--steps", type=Ranged(limits.COUNT), default=1000, show_default=True)
@click.option("--batch-size", type=Ranged(limits.COUNT), default=8, show_default=True, help="Sequences per step.")
@click.option("--anchors", type=Ranged(limits.COUNT), default=32, show_default=True, help="Blocks sampled per sequence each step.")
@click.option("--max-length", type=Ranged(limits.COUNT), default=512, show_default=True, help="Tokens kept per sequence.")
@click.option("--lr", type=Ranged(limits.POSITIVE_REAL), default=6e-4, show_default=True)
@click.option("--gamma", type=Ranged(limits.NON_NEGATIVE_REAL), default=0.0, help="Position-weight decay. [default: 7 for B=16, 5 for 10, 4 for 8]")
@click.option("--mask-token-id", type=Ranged(limits.TOKEN_ID), help="[default: the tokenizer's <|mask|> token]")
@click.option("--seed", type=Ranged(limits.SEED), default=0, show_default=True)
@click.option("--checkpoint-every", type=Ranged(limits.COUNT), default=100, show_default=True, help="Steps between resumable checkpoints.")
@click.option("--work", "work_dir", metavar="DIR", help="Checkpoint directory. [default: OUTPUT.work]")
@click.option("--feature-cache", metavar="DIR",
              help="Keep the target's features of every sequence here (a file per sequence, in a folder per "
                   "target and taps; ~3.5 KB a token for the default pair): a later run over the same "
                   "sequences reads them instead of running the target. [default: kept in memory only]")
@click.option("--init-from", metavar="DIR",
              help="Start from this drafter's weights (same block size; its layers and taps are kept), "
                   "e.g. to adapt a drafter to a changed target or to new data.")
@click.option("--layers-from-target", is_flag=True,
              help="Start the drafter's layers as copies of the target's last ones (fc passing the deepest "
                   "tap through): learns far faster than random weights on a small budget.")
@click.option("--bf16-autocast/--no-bf16-autocast", "bf16_autocast", default=None,
              help="Forward passes in bfloat16 (weights and optimizer stay float32). "
                   "[default: on where bfloat16 matmuls are fast: CUDA, or a CPU with AMX/AVX512-BF16]")
@click.option("--draft-vocab", "draft_vocab", type=Ranged(limits.DRAFT_VOCAB), metavar="K",
              help="Train the drafter to propose among the K most frequent response ids of --data (the loss "
                   "computes K logits, not the vocabulary's: steps ~2x faster on a CPU); it then drafts with "
                   "--draft-vocab K by default. Ship the same file's counts (trtspec draft-vocab --data).")
@click.option("--soft-labels", "soft_labels", type=Ranged(limits.COUNT), metavar="K",
              help="Also learn the target's own next-token distribution at every position (its K likeliest "
                   "tokens, from the same target pass as the features: the whole stack and the LM head run), "
                   "what sampled requests accept drafts by; the response's token alone teaches only one sample "
                   "of it (or, greedily, its argmax). [default: off]")
@click.option("--soft-weight", type=Ranged(limits.SHARE), default=0.5, show_default=True,
              help="The soft labels' share of each position's loss (with --soft-labels).")
@device_options
def train_drafter(target, data_file, block_size, output, layers, num_features, target_layer_ids, steps,
                  batch_size, anchors, max_length, lr, gamma, mask_token_id, seed, checkpoint_every, work_dir,
                  feature_cache, init_from, layers_from_target, bf16_autocast, draft_vocab, soft_labels, soft_weight,
                  dtype, device) -> None:
    """Train a DFlash drafter for a frozen target (resumes from --work when restarted)."""
    from trtspec.device import fast_bfloat16
    from trtspec.fileio import CHECKPOINT, check_distinct_outputs, check_output_dir, check_work_dir
    from trtspec.training.data import read_training_data
    from trtspec.training.trainer import TrainConfig, tapped_layers, train_drafter as train, work_directory

    inputs, work_dir = (target, data_file, init_from), work_directory(output, work_dir)
    check_output_dir(output, CHECKPOINT, inputs)
    check_distinct_outputs(output, work_dir)
    check_work_dir(work_dir, inputs)
    if feature_cache is not None:
        check_work_dir(feature_cache, inputs, "the feature cache", "--feature-cache")
    pipeline = load_pipeline(target, None, "float32" if dtype == "auto" else dtype, device, with_drafter=False)
    start = _initial_drafter(init_from, pipeline.target, block_size, _layer_ids(target_layer_ids))
    if start is not None:
        layers, mask_token_id = start.config.num_hidden_layers, start.config.mask_token_id
        target_layer_ids = ",".join(map(str, start.config.target_layer_ids))
    if mask_token_id is None:
        mask_token_id = pipeline.codec.tokenizer.token_to_id("<|mask|>")
        if mask_token_id is None:
            raise TrtspecError("the tokenizer has no <|mask|> token; pass --mask-token-id")
    config = TrainConfig(block_size=block_size, num_layers=layers, num_features=num_features,
                         target_layer_ids=_layer_ids(target_layer_ids), mask_token_id=mask_token_id,
                         steps=steps, batch_size=batch_size, anchors_per_sequence=anchors, max_length=max_length,
                         lr=lr, gamma=gamma, seed=seed, checkpoint_every=checkpoint_every,
                         layers_from_target=layers_from_target, draft_vocab=draft_vocab or 0,
                         soft_labels=soft_labels or 0, soft_weight=soft_weight,
                         bfloat16_autocast=fast_bfloat16(pipeline.target.device) if bf16_autocast is None
                         else bf16_autocast,
                         lineage={"initialised_from": dict(start.config.lineage)} if start else {})
    if start is None:  # duplicate or excess taps: refused now, not after reading the data
        tapped_layers(config, pipeline.target.config.num_hidden_layers)
    sequences = read_training_data(data_file, pipeline.codec, pipeline.target.config.vocab_size)
    if start is not None:
        start.config = replace(start.config, lineage=dict(config.lineage))
    path = train(pipeline.target, sequences, config, output, work_dir, drafter=start, feature_store=feature_cache)
    click.echo(f"wrote drafter to {path}", err=True)
