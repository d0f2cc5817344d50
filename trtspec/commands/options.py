"""Options shared by several commands, declared once."""

from __future__ import annotations

import functools

import click

from trtspec.errors import TrtspecError
from trtspec.runtime.sampling import SamplingConfig


def _stack(*decorators):
    def apply(function):
        for decorator in reversed(decorators):
            function = decorator(function)
        return function
    return apply


target_option = click.option(
    "--target", "target", metavar="DIR",
    help="Hugging Face Qwen3 directory (config.json, safetensors, tokenizer.json). [default: bundled demo target]")
drafter_option = click.option(
    "--drafter", "drafter", metavar="DIR|NAME",
    help="DFlash drafter directory (z-lab layout) or a bundled name such as demo-b16. "
         "[default: demo-b16 with the demo target]")
device_options = _stack(
    click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16", "float16"]), default="auto",
                 show_default=True, help="auto = float32 on CPU, bfloat16 on CUDA."),
    click.option("--device", default="auto", show_default=True, help="auto, cpu, cuda or cuda:N."),
)
engine_option = click.option(
    "--engine", "engine", metavar="DIR",
    help="Run a built engine directory (trtspec build) instead of the checkpoints; --target/--drafter, "
         "if given, must be the checkpoints it was built from.")
model_options = _stack(target_option, drafter_option, engine_option, device_options)
policy_option = click.option(
    "--policy", "policy", metavar="DIR",
    help="BlockPilot policy (trtspec train-policy) for --block-size auto. [default: the engine's, if it has one]")


class BlockSizeType(click.ParamType):
    """A block size B, a growing block B:G, or "auto" (BlockPilot chooses per request): a BlockChoice."""

    name = "B|B:G|auto"

    def convert(self, value, param, ctx):
        from trtspec.runtime.schedule import BlockChoice

        # a TrtspecError, not click's usage error: one line and exit 1, like every other bad input
        return value if isinstance(value, BlockChoice) else BlockChoice.parse(value)
sampling_options = _stack(
    click.option("--temperature", type=float, default=0.0, show_default=True, help="0 = greedy."),
    click.option("--top-k", type=int, default=0, show_default=True, help="Sample from the k likeliest (0 = off)."),
    click.option("--top-p", type=float, default=1.0, show_default=True, help="Nucleus sampling mass (1 = off)."),
    click.option("--seed", type=int, help="Seed for sampling at T > 0. [default: random]"),
)


def sampling_config(temperature: float, top_k: int, top_p: float, seed: int | None) -> SamplingConfig:
    return SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)


@functools.cache
def _pipeline_class():
    from trtspec.api import Pipeline
    return Pipeline


def load_pipeline(target: str | None, drafter: str | None, dtype: str, device: str, *,
                  with_drafter: bool = True, max_context: int | None = None, engine: str | None = None,
                  policy: str | None = None):
    """Resolve model arguments (bundled names, defaults) and load them once."""
    from trtspec.assets import resolve_drafter, resolve_target

    if engine is not None:
        pipeline = _pipeline_class()(
            resolve_target(target) if target else None, resolve_drafter(drafter, target) if drafter else None,
            engine=engine, policy=policy if with_drafter else None, device=device, max_context=max_context)
        built = str(pipeline.dtype).removeprefix("torch.")
        if dtype not in ("auto", built):
            raise TrtspecError(f"the engine was built for {built}; drop --dtype or rebuild with --dtype {dtype}")
        return pipeline.autoregressive() if not with_drafter else pipeline
    drafter_dir = resolve_drafter(drafter, target) if with_drafter else None
    return _pipeline_class()(resolve_target(target), drafter_dir, dtype=dtype, device=device,
                             max_context=max_context, policy=policy if with_drafter else None)
