"""`trtspec run`: generate one continuation, streaming text and reporting statistics."""

from __future__ import annotations

import json
import sys

import click
from click.core import ParameterSource

from trtspec import limits
from trtspec.commands.options import (BlockSizeType, Ranged, backend_option, draft_vocab_options, drafting_options,
                                      engine_sizes, load_pipeline, max_new_tokens_option, model_options, policy_option,
                                      sampling_config, sampling_options)
from trtspec.errors import TrtspecError
from trtspec.runtime.request import DEFAULT_MAX_TOKENS, GenerationConfig, check_room
from trtspec.runtime.schedule import AR


def read_prompt(path: str) -> str:
    """The prompt text of a file, or of stdin for '-', as strict UTF-8."""
    try:
        data = sys.stdin.buffer.read() if path == "-" else open(path, "rb").read()
    except FileNotFoundError:
        raise TrtspecError(f"prompt file not found: {path}") from None
    except IsADirectoryError:
        raise TrtspecError(f"prompt path is a directory: {path}") from None
    except OSError as exc:
        raise TrtspecError(f"cannot read prompt file {path}: {exc.strerror}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        name = "stdin" if path == "-" else path
        raise TrtspecError(f"prompt {name} is not valid UTF-8 (byte {data[exc.start]:#04x} at offset {exc.start})") from None
    if not text.strip():
        raise TrtspecError("the prompt is empty")
    return text


@click.command(epilog="""\b
Examples:
  trtspec run prompt.txt                            # the default pair: SmolLM2-135M-Instruct + smollm2-b16
  trtspec run prompt.txt --target ./Qwen3-4B --drafter ./Qwen3-4B-DFlash-b16
  echo "def fib(n):" | trtspec run - --block-size 12 --json
  trtspec run prompt.txt --ar                       # autoregressive baseline
  trtspec run prompt.txt --compare-ar               # ... and the speed-up over it, same backend
  trtspec run prompt.txt --engine build/engine      # a built engine (trtspec build)
  trtspec run prompt.txt --backend eager            # the checkpoints in PyTorch, no engine
  trtspec run prompt.txt --draft-vocab 1024         # draft among the 1024 most frequent tokens
  trtspec run prompt.txt --stop $'\\n\\n' --stop-token-id 151645  # end before a blank line, or after that token
  trtspec run --batch prompts.jsonl --max-running 8 # many prompts decoded together, JSON lines out
""")
@click.argument("prompt_file", metavar="PROMPT_FILE", required=False)
@model_options
@backend_option
@click.option("--block-size", type=BlockSizeType(),
              help="Block size B in [2, 64] (proposes B-1 tokens per cycle); B:G grows to G for the cycle after "
                   "one that fills a block of B; auto: BlockPilot chooses once after prefill; AR (or 1): --ar. "
                   "[default: auto with a policy, else the drafter's]")
@policy_option
@draft_vocab_options
@sampling_options
@drafting_options
@max_new_tokens_option(DEFAULT_MAX_TOKENS, "An asked-for count beyond the context's room after the prompt is "
                       "refused, as serve refuses a request's max_tokens; the default is capped at the context.")
@click.option("--max-context", type=Ranged(limits.MAX_CONTEXT), metavar="N", help="Cap on prompt + output tokens. [default: the model's]")
@click.option("--stop", multiple=True, metavar="TEXT",
              help="Stop string, matched in the decoded text: the output ends before it (--stop $'\\n\\n'); "
                   "repeatable, up to 16 of up to 1024 characters. Text is text: 'Ċ' is the character, not a token.")
@click.option("--stop-token-id", "stop_token_ids", multiple=True, type=Ranged(limits.TOKEN_ID), metavar="ID",
              help="Stop token id: the output ends after it (--stop-token-id 151645); repeatable. "
                   "EOS ids are always stops.")
@click.option("--chat", is_flag=True, help="Wrap the prompt in the target's chat template.")
@click.option("--ar", is_flag=True, help="Decode autoregressively with the target alone (baseline).")
@click.option("--compare-ar", is_flag=True,
              help="Also decode the prompt autoregressively through the same backend and report the speed-up "
                   "(decode tokens/s over AR's; greedy: whether the outputs are identical).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of streaming text.")
@click.option("--batch", "batch_file", metavar="FILE",
              help='Instead of PROMPT_FILE, decode every prompt of a JSONL file of {"prompt": ...} lines together '
                   "(continuous batching); one JSON line per prompt, in order, goes to stdout.")
@click.option("--max-running", type=Ranged(limits.BATCH), default=8, show_default=True, metavar="N",
              help="With --batch: requests decoded together.")
def run(prompt_file, target, drafter, engine, dtype, device, backend, block_size, policy, draft_vocab, draft_counts,
        temperature, top_k, top_p, seed, max_new_tokens, max_context, stop, stop_token_ids, chat, ar, compare_ar,
        as_json, batch_file, max_running, **drafting) -> None:
    """Generate a continuation of PROMPT_FILE ('-' reads stdin), or of every prompt of --batch FILE.

    Text streams to stdout as it is committed and statistics go to stderr; with --json one
    object {"text", "tokens", "stats"} is printed at the end.
    """
    if block_size is not None and block_size.ar:
        ar, block_size = True, None  # --block-size AR (or 1), as a request's block_size: the target alone
    if ar and block_size is not None:
        raise TrtspecError("--ar decodes one token at a time; drop --block-size")
    if ar and (draft_vocab is not None or draft_counts is not None):
        raise TrtspecError("--ar decodes with the target alone; drop --draft-vocab/--draft-counts")
    if ar and compare_ar:
        raise TrtspecError("--compare-ar compares speculative decoding with --ar; drop one of them")
    if (prompt_file is None) == (batch_file is None):
        raise TrtspecError("give one PROMPT_FILE, or --batch FILE for a JSONL file of prompts")
    if batch_file is not None and compare_ar:
        raise TrtspecError("--compare-ar compares one request; for many, use trtspec bench --concurrency")
    from trtspec.tokenizer import check_stop_strings

    sampling = sampling_config(temperature, top_k, top_p, seed)
    check_stop_strings(stop)  # before any work; the tokenizer's part once the pipeline is loaded
    if batch_file is not None:
        from trtspec.training.data import read_prompt_set

        prompts = [record["prompt"] for record in read_prompt_set(batch_file)]
    else:
        prompt = read_prompt(prompt_file)
    pipeline = load_pipeline(target, drafter, dtype, device, with_drafter=not ar, max_context=max_context,
                             engine=engine, policy=policy, draft_vocab=draft_vocab, draft_counts=draft_counts,
                             backend=backend, block_sizes=engine_sizes([block_size] if block_size else []),
                             **drafting)
    if not ar and not pipeline.has_drafter:
        raise TrtspecError("give --drafter DIR for speculative decoding, or --ar for the target alone")
    stops, single_token_stops = pipeline.codec.stop_strings(stop)
    if click.get_current_context().get_parameter_source("max_new_tokens") is not ParameterSource.DEFAULT:
        for text in prompts if batch_file is not None else [prompt]:  # asked for: it must fit, as in serve
            check_room(len(pipeline.codec.encode(text, chat=chat)), max_new_tokens, pipeline.runner.max_context,
                       "--max-new-tokens")
    config = GenerationConfig(
        block=AR if ar else (block_size if block_size is not None else pipeline.default_block),
        max_new_tokens=max_new_tokens,
        stop_ids=pipeline.codec.stop_token_ids(stop_token_ids) + single_token_stops,
        stop=stops,
        sampling=sampling,
    )

    if batch_file is not None:
        _run_batch(pipeline, prompts, config, chat, max_running)
        return

    def stream(piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    result = pipeline.generate(prompt, config, chat=chat, on_text=None if as_json else stream)
    comparison = _compare_with_ar(pipeline, prompt, config, chat, result) if compare_ar else None
    if as_json:
        click.echo(json.dumps({**result.to_dict(), **({"compare_ar": comparison} if comparison else {})}))
    else:
        click.echo()
        click.echo(result.generation.stats.summary(), err=True)
        if comparison:
            same = {True: ", identical output", False: ", OUTPUT DIFFERS", None: ""}[comparison["identical"]]
            dtype = str(pipeline.dtype).removeprefix("torch.")
            if comparison["identical"] is False and dtype != "float32":
                same = (f", output parts from AR's at token {comparison['parted_at']} ({dtype}: "
                        "a block's verify and a one-token step round differently, so near-ties can fall either way; "
                        "--dtype float32 is exact)")
            speedup = "n/a" if comparison["speedup"] is None else f"{comparison['speedup']:.2f}x"
            click.echo(f"AR through the same backend: {comparison['ar_decode_tokens_per_s']:.1f} tok/s; "
                       f"speed-up {speedup}{same}", err=True)


def _run_batch(pipeline, prompts: list[str], config: GenerationConfig, chat: bool, max_running: int) -> None:
    """Every prompt through one continuous-batching engine; JSON lines in the file's order."""
    import time

    from trtspec.runtime.stats import mean_tau

    began = time.perf_counter()
    results = pipeline.generate_batch(prompts, [config] * len(prompts), chat=chat, max_running=max_running)
    seconds = time.perf_counter() - began
    for result in results:
        click.echo(json.dumps(result.to_dict()))
    stats = [r.generation.stats for r in results]
    tokens = sum(s.new_tokens for s in stats)
    click.echo(f"{len(results)} prompts, {tokens} new tokens in {seconds:.2f} s ({tokens / seconds:.1f} tok/s, "
               f"up to {max_running} together), mean tau {mean_tau(stats):.2f}", err=True)


def _compare_with_ar(pipeline, prompt: str, config: GenerationConfig, chat: bool, result) -> dict:
    """The same request decoded by the target alone, through the same backend and loop (one run each,
    so a rough figure: `trtspec bench` gives medians over many prompts and repeats)."""
    from dataclasses import replace

    baseline = pipeline.autoregressive().generate(prompt, replace(config, block=AR), chat=chat)
    ar_rate = baseline.generation.stats.decode_tokens_per_s
    rate = result.generation.stats.decode_tokens_per_s
    ours, theirs = result.generation.tokens, baseline.generation.tokens
    identical = ours == theirs if config.sampling.greedy else None
    parted = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
    return {"ar_decode_tokens_per_s": ar_rate, "speedup": rate / ar_rate if ar_rate else None,
            "identical": identical, "parted_at": parted if identical is False else None}
