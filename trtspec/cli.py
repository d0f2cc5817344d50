"""The `trtspec` command: the group, its error handling, and the commands it wires in.

Commands live one per module in `trtspec.commands` and are thin: validate, call the library,
print. Known errors (`TrtspecError`) become one line on stderr (`Error: ...`) and exit status 1;
set TRTSPEC_DEBUG=1 to see the traceback instead.
"""

from __future__ import annotations

import os

import click

from trtspec import __version__, limits
from trtspec.commands.bench import bench
from trtspec.commands.build import build
from trtspec.commands.dbloom import expand_block, preflight
from trtspec.commands.blockpilot import eval_policy, label_blocks, train_policy
from trtspec.commands.run import run
from trtspec.commands.serve import serve
from trtspec.commands.train import draft_vocab, generate_data, train_drafter
from trtspec.commands.triton import triton_repo, triton_serve
from trtspec.commands.options import THREADS
from trtspec.errors import TrtspecError


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
@click.option("--threads", envvar="TRTSPEC_THREADS", metavar="N",
              help=f"CPU threads for torch and ONNX Runtime, 1 to the cores ({limits.THREADS.high:g} here; env "
                   "TRTSPEC_THREADS). [default: torch's choice (the cores), except 1 for eager PyTorch on a model "
                   "under 256 MiB, which more threads only slow down]")
@click.pass_context
def cli(ctx: click.Context, threads: str | None) -> None:
    """trtspec: lossless speculative decoding with block-diffusion (DFlash) drafters."""
    if threads is not None:  # checked here, inside invoke, so a bad value is one line like every other
        from_env = ctx.get_parameter_source("threads") == click.core.ParameterSource.ENVIRONMENT
        threads = limits.THREADS.parse(threads, "TRTSPEC_THREADS" if from_env else "--threads")
    ctx.meta[THREADS] = threads  # None: commands that load a model choose (commands.options._choose_threads)
    if threads is not None:
        import torch
        torch.set_num_threads(threads)


for command in (run, build, bench, generate_data, draft_vocab, train_drafter, label_blocks, train_policy, eval_policy,
                preflight, expand_block, serve, triton_repo, triton_serve):
    cli.add_command(command)


def main() -> None:
    """Console-script entry point."""
    cli(prog_name="trtspec")
