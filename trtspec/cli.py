"""The `trtspec` command. Commands are thin: validate, call the library, print.

Known errors (`TrtspecError`) become one line on stderr (`Error: ...`) and exit status 1; set
TRTSPEC_DEBUG=1 to see the traceback instead.
"""

from __future__ import annotations

import json
import os
import sys

import click

from trtspec import __version__
from trtspec.engines.eager import MAX_BLOCK_SIZE
from trtspec.errors import TrtspecError
from trtspec.runtime.decode import GenerationConfig
from trtspec.runtime.sampling import SamplingConfig


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


class TrtspecGroup(click.Group):
    """Turns known errors into click's one-line `Error: ...` and exit status 1."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except TrtspecError as exc:
            if os.environ.get("TRTSPEC_DEBUG"):
                raise
            raise click.ClickException(str(exc)) from None


@click.group(cls=TrtspecGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="trtspec")
def cli() -> None:
    """trtspec: lossless speculative decoding with block-diffusion (DFlash) drafters."""


@cli.command(epilog="""\b
Examples:
  trtspec run prompt.txt --target ./Qwen3-4B --drafter ./Qwen3-4B-DFlash-b16
  echo "def fib(n):" | trtspec run - --target T --drafter D --block-size 12 --json
  trtspec run prompt.txt --target T --ar            # autoregressive baseline
""")
@click.argument("prompt_file", metavar="PROMPT_FILE")
@click.option("--target", "target_dir", required=True, metavar="DIR",
              help="Hugging Face Qwen3 directory (config.json, safetensors, tokenizer.json).")
@click.option("--drafter", "drafter_dir", metavar="DIR", help="DFlash drafter directory (z-lab layout).")
@click.option("--block-size", type=int, metavar="N",
              help="Block size B in [2, 64]; proposes B-1 tokens per cycle. [default: the drafter's]")
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0 = greedy.")
@click.option("--top-k", type=int, default=0, show_default=True, help="Sample from the k likeliest (0 = off).")
@click.option("--top-p", type=float, default=1.0, show_default=True, help="Nucleus sampling mass (1 = off).")
@click.option("--seed", type=int, help="Seed for sampling at T > 0. [default: random]")
@click.option("--max-new-tokens", type=int, default=256, show_default=True)
@click.option("--max-context", type=int, metavar="N", help="Cap on prompt + output tokens. [default: the model's]")
@click.option("--stop", multiple=True, metavar="TOKEN",
              help="Extra stop token (id or single-token text); repeatable. EOS ids are always stops.")
@click.option("--chat", is_flag=True, help="Wrap the prompt in the target's chat template.")
@click.option("--ar", is_flag=True, help="Decode autoregressively with the target alone (baseline).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of streaming text.")
@click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16", "float16"]), default="auto",
              show_default=True, help="auto = float32 on CPU, bfloat16 on CUDA.")
@click.option("--device", default="auto", show_default=True, help="auto, cpu, cuda or cuda:N.")
def run(prompt_file, target_dir, drafter_dir, block_size, temperature, top_k, top_p, seed,
        max_new_tokens, max_context, stop, chat, ar, as_json, dtype, device) -> None:
    """Generate a continuation of PROMPT_FILE ('-' reads stdin).

    Text streams to stdout as it is committed and statistics go to stderr; with --json one
    object {"text", "tokens", "stats"} is printed at the end.
    """
    from trtspec.api import Pipeline

    if not ar and drafter_dir is None:
        raise TrtspecError("give --drafter DIR for speculative decoding, or --ar for the target alone")
    if ar and block_size is not None:
        raise TrtspecError("--ar decodes one token at a time; drop --block-size")
    if block_size is not None and not 2 <= block_size <= MAX_BLOCK_SIZE:
        raise TrtspecError(f"block size must be in [2, {MAX_BLOCK_SIZE}], got {block_size} "
                           "(use --ar for autoregressive decoding)")
    sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    prompt = read_prompt(prompt_file)
    pipeline = Pipeline(target_dir, None if ar else drafter_dir, dtype=dtype, device=device,
                        max_context=max_context)
    config = GenerationConfig(
        block_size=1 if ar else (block_size if block_size is not None else pipeline.default_block_size),
        max_new_tokens=max_new_tokens,
        stop_ids=tuple(pipeline.codec.stop_id(s) for s in stop),
        sampling=sampling,
    )

    def stream(piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    result = pipeline.generate(prompt, config, chat=chat, on_text=None if as_json else stream)
    if as_json:
        click.echo(json.dumps(result.to_dict()))
    else:
        click.echo()
        click.echo(result.generation.stats.summary(), err=True)


def main() -> None:
    """Console-script entry point."""
    cli(prog_name="trtspec")
