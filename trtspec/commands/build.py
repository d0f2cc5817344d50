"""`trtspec build`: compile the target and drafter into an engine directory."""

from __future__ import annotations

import click

from trtspec import limits
from trtspec.commands.options import (BlockSizesType, Ranged, device_options, draft_vocab_options, drafter_option,
                                      output_option, target_option)
from trtspec.errors import TrtspecError


@click.command(epilog="""\b
Examples:
  trtspec build -o build/engine                      # the default pair, block sizes 8,12,16,20,24, best backend
  trtspec build --block-sizes 16,24 --backend onnxruntime -o build/engine-ort
  trtspec build --target ./Qwen3-4B --drafter ./Qwen3-4B-DFlash-b16 --backend tensorrt --dtype bfloat16 -o engine
  trtspec build --block-sizes 8,12,16 --draft-vocab 1024 -o build/engine-k1024   # drafts among 1024 ids
  trtspec build --backend onnxruntime --weights int4 -o build/engine-int4   # 4-bit target matmuls (CPU)
  trtspec run prompt.txt --engine build/engine
""")
@target_option
@drafter_option
@click.option("--block-sizes", type=BlockSizesType(plain=True), default="8,12,16,20,24", show_default=True,
              metavar="B,B,...",
              help="Candidate block sizes; each gets its own optimization profile.")
@click.option("--backend", type=click.Choice(["auto", "onnxruntime", "tensorrt", "inductor", "torch"]), default="auto",
              show_default=True, help="auto = tensorrt with a GPU and TensorRT, else onnxruntime, else torch. "
              "inductor: the graphs compiled ahead of time by AOTInductor (C++ on a CPU, Triton kernels on "
              "CUDA; needs only torch and a compiler, takes minutes; compiled packages are cached).")
@device_options
@click.option("--weights", type=click.Choice(["float", "int4"]), default="float", show_default=True,
              help="float: weights in --dtype. int4: the target's matmul weights in 4-bit blocks of 32 with a scale "
              "and zero point each (ONNX Runtime's MatMulNBits, int8 kernels; --backend onnxruntime, CPU, float32): "
              "about a sixth of float32's bytes per token; outputs differ from float32 by the rounding.")
@click.option("--draft-weights", type=click.Choice(["auto", "float", "int8"]), default="auto", show_default=True,
              help="The drafter's matmul weights. int8: in 8-bit blocks of 32 (MatMulNBits; ONNX Runtime, CPU, "
              "float32): a small draft call costs mostly the reading of its weights, and the rounding moves how "
              "often drafts are accepted, never the output. auto: int8 where that is possible, float elsewhere.")
@click.option("--max-context", type=Ranged(limits.MAX_CONTEXT), metavar="N",
              help="Positions a request may fill. [default: the model's]")
@click.option("--max-batch", type=Ranged(limits.BATCH), default=16, show_default=True, metavar="N",
              help="Requests one decode call may batch (serving); sizes the TensorRT profiles' batch axis.")
@click.option("--policy", metavar="DIR", help="BlockPilot policy (trtspec train-policy) to ship in the engine; "
              "its block sizes must all be built. Runs then default to --block-size auto.")
@draft_vocab_options
@output_option("-o", "--output", required=True, metavar="DIR",
              help="Engine directory to write (replaces only a previous engine directory or an empty one).")
def build(target, drafter, block_sizes, backend, dtype, device, weights, draft_weights, max_context, max_batch, policy,
          draft_vocab, draft_counts, output) -> None:
    """Export the step graphs and compile them into an engine directory.

    The directory holds the compiled graphs, the tokenizer and manifest.json (backend, dtype,
    block sizes with their profile indices, max context, hashes of the source checkpoints).
    """
    from pathlib import Path

    from trtspec.assets import resolve_drafter, resolve_target
    from trtspec.build import BuildConfig, build_engine

    config = BuildConfig(block_sizes=block_sizes, backend=backend, dtype=dtype, device=device,
                         max_context=max_context, max_batch=max_batch, policy=Path(policy) if policy else None,
                         draft_vocab=draft_vocab, draft_counts=Path(draft_counts) if draft_counts else None,
                         weights=weights, draft_weights=draft_weights)
    drafter_dir = resolve_drafter(drafter, target)
    if drafter_dir is None:
        raise TrtspecError("give --drafter DIR: an engine holds the target and its drafter")
    manifest = build_engine(resolve_target(target), drafter_dir, Path(output), config)
    sizes = ", ".join(f"B={row['block_size']} (target profile {row['target_profile']}, draft profile "
                      f"{row['draft_profile']})" for row in manifest.block_size_table())
    click.echo(f"wrote {output}: {manifest.label} {manifest.dtype}, max context {manifest.max_context}; {sizes}; "
               f"self-check max |logit diff| target {manifest.check['target_max_abs_logit_diff']:.2e}, "
               f"draft {manifest.check['draft_max_abs_logit_diff']:.2e}"
               + (f"; BlockPilot policy over B={','.join(map(str, manifest.policy['block_sizes']))}"
                  if manifest.policy else "")
               + (f"; draft vocabulary {manifest.draft_vocab['size']}" if manifest.draft_vocab else ""))
