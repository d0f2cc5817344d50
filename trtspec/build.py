"""`trtspec build`: export the step graphs once and compile them for one backend.

Output: an engine directory with the graphs (`*.onnx`, `*.plan`, or `*.pt2`: torch.export programs or
AOTInductor packages), the tokenizer and
`manifest.json`. Everything is written into a staging directory that replaces the output only
once the build has finished and checked itself against eager PyTorch, so an interrupted or
failed build never leaves a directory that looks complete.
"""

from __future__ import annotations

import functools
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from trtspec import __version__
from trtspec.engines import int4
from trtspec.engines import onnxruntime as ort_engine
from trtspec.engines import tensorrt as trt_engine
from trtspec.engines import torch as torch_engine
from trtspec.device import MODEL_DTYPES, resolve_device, resolve_dtype
from trtspec.errors import TrtspecError
from trtspec.export.bindings import DRAFT, MAX_BATCH, MAX_BLOCK_SIZE, TARGET, graph_specs, target_graph_in_place
from trtspec.export.cache import export_cached, graph_key
from trtspec.export.exporter import MIN_COMPILED_BLOCK_SIZE, export_onnx, export_program, step_modules
from trtspec.fileio import ENGINE, check_output_dir, staged_directory
from trtspec.engines.manifest import BACKENDS, TOKENIZER_DIR, Manifest, checkpoint_sha256, record_artifacts
from trtspec.models import load_drafter, load_target
from trtspec.models.draft_vocab import DRAFTER_VOCAB_DIR, ids_sha256, select as select_draft_vocab
from trtspec.blockpilot.policy import drafter_policy, load_policy

POLICY_DIR = "policy"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json",
                   "special_tokens_map.json")
CHECK_TOLERANCE = 1e-3  # max |logit difference| vs eager torch at float32 for a build to pass its self-check
WEIGHTS = ("float", "int4")
# The drafter's matmul weights: auto = int8 on an ONNX Runtime CPU engine (its float32 weights are
# most of a draft call's fixed cost; the rounding moves acceptance only, never output), float elsewhere.
DRAFT_WEIGHTS = ("auto", "float", "int8")


@dataclass(frozen=True)
class BuildConfig:
    block_sizes: tuple[int, ...] = (8, 12, 16, 20, 24)
    backend: str = "auto"
    dtype: str = "auto"
    device: str = "auto"
    max_context: int | None = None
    policy: Path | None = None  # a BlockPilot policy directory to ship inside the engine
    max_batch: int = 16         # requests one decode call may batch (TensorRT profiles; serving)
    draft_vocab: int | None = None      # K: the draft graph computes only the K most frequent ids' logits
    draft_counts: Path | None = None    # the counts behind K [default: the drafter's draft_vocab/]
    weights: str = "float"  # float: the dtype's own; int4: the target's matmuls as ONNX Runtime MatMulNBits
    draft_weights: str = "auto"  # the drafter's matmuls: float, or int8 (MatMulNBits); auto: DRAFT_WEIGHTS

    def __post_init__(self) -> None:
        if not self.block_sizes or any(not MIN_COMPILED_BLOCK_SIZE <= b <= MAX_BLOCK_SIZE for b in self.block_sizes):
            raise TrtspecError(f"engine block sizes must be in [{MIN_COMPILED_BLOCK_SIZE}, {MAX_BLOCK_SIZE}], "
                               f"got {list(self.block_sizes)}")
        if self.backend not in ("auto", *BACKENDS):
            raise TrtspecError(f"backend must be auto, {', '.join(BACKENDS)}; got {self.backend!r}")
        if not 1 <= self.max_batch <= MAX_BATCH:
            raise TrtspecError(f"--max-batch must be in [1, {MAX_BATCH}], got {self.max_batch}")
        if self.max_context is not None and self.max_context < 2:
            raise TrtspecError(f"--max-context must be >= 2, got {self.max_context}")
        if self.weights not in WEIGHTS:
            raise TrtspecError(f"--weights must be one of {', '.join(WEIGHTS)}, got {self.weights!r}")
        if self.draft_weights not in DRAFT_WEIGHTS:
            raise TrtspecError(f"--draft-weights must be one of {', '.join(DRAFT_WEIGHTS)}, got {self.draft_weights!r}")
        for option, value in (("--weights", self.weights), ("--draft-weights", self.draft_weights)):
            if value in ("int4", "int8") and self.backend not in ("auto", "onnxruntime"):
                raise TrtspecError(f"{option} {value} is ONNX Runtime's MatMulNBits format; use --backend onnxruntime "
                                   f"(got --backend {self.backend})")


def best_backend() -> str:
    if trt_engine.available():
        return "tensorrt"
    return "onnxruntime" if ort_engine.available() else "torch"


def _resolve(config: BuildConfig) -> tuple[str, torch.device, str, dict[str, int]]:
    """The backend, device and dtype the build runs, and the graphs whose matmuls it quantizes, with
    their bits."""
    backend = best_backend() if config.backend == "auto" else config.backend
    device = resolve_device(config.device)
    if backend == "tensorrt" and not trt_engine.available():
        raise TrtspecError("--backend tensorrt needs the tensorrt package and a CUDA GPU; "
                           "use --backend onnxruntime (or torch) on this machine")
    if backend == "tensorrt":
        device = torch.device("cuda")
    if backend == "onnxruntime" and not ort_engine.available():
        raise TrtspecError("--backend onnxruntime needs onnxruntime: pip install 'trtspec[onnx]'")
    dtype = str(resolve_dtype(config.dtype, device, compiled=True)).removeprefix("torch.")
    if backend == "onnxruntime" and dtype == "bfloat16":
        raise TrtspecError("ONNX Runtime engines are float32 or float16; pass --dtype float32 or float16")
    cpu_float32 = backend == "onnxruntime" and device.type == "cpu" and dtype == "float32"
    for option, value in (("--weights", config.weights), ("--draft-weights", config.draft_weights)):
        if value in ("int4", "int8") and not cpu_float32:
            raise TrtspecError(f"{option} {value} builds an ONNX Runtime engine for the CPU in float32 (MatMulNBits), "
                               f"not {backend} on {device.type} in {dtype}; pass --backend onnxruntime --device cpu "
                               "--dtype float32")
    quantized = {TARGET: int4.INT4["bits"]} if config.weights == "int4" else {}
    if config.draft_weights == "int8" or (config.draft_weights == "auto" and cpu_float32):
        quantized[DRAFT] = int4.DRAFT_BITS
    return backend, device, dtype, quantized


def build_engine(target_dir: Path, drafter_dir: Path, output: Path, config: BuildConfig,
                 progress: bool = True) -> Manifest:
    inputs = (target_dir, drafter_dir, config.policy, config.draft_counts)
    check_output_dir(output, ENGINE, inputs)  # before any work: never replace what is not an old engine
    backend, device, dtype, quantized = _resolve(config)
    policy = None
    if config.policy is not None:
        policy = load_policy(config.policy, tuple(config.block_sizes))
    # else the drafter's own for these weights, if the engine can serve its sizes
    elif (shipped_dir := drafter_policy(drafter_dir, config.weights)) is not None:
        shipped = load_policy(shipped_dir)
        policy = shipped if set(shipped.block_sizes) <= set(config.block_sizes) else None
    # Export on the CPU in float32 unless the engine's dtype needs otherwise; TensorRT/ORT move it.
    export_device = device if backend in ("torch", "inductor") else torch.device("cpu")
    target = load_target(target_dir, MODEL_DTYPES[dtype], export_device)
    drafter = load_drafter(drafter_dir, target)
    chosen = select_draft_vocab(config.draft_vocab, config.draft_counts, drafter_dir, target.config.vocab_size)
    if chosen is not None:
        drafter.use_draft_vocab(chosen[0])
    max_context = min(config.max_context or target.config.max_position_embeddings,
                      target.config.max_position_embeddings)
    block_sizes = sorted(config.block_sizes)
    modules = step_modules(target, drafter)
    specs = graph_specs(target.config, drafter.config, drafter.draft_vocab_size)
    # The TensorRT optimization profiles of these graphs; recorded for every backend (a TensorRT
    # build uses exactly this table), so it can be inspected and checked on any machine.
    table = trt_engine.profile_table(specs, block_sizes, max_context, config.max_batch)
    feature_layers = tuple(drafter.config.target_layer_ids)
    in_place = in_place_target(backend, target, export_device)
    if in_place:
        specs[TARGET] = target_graph_in_place(target.config, len(feature_layers))
    sources = {"target": checkpoint_sha256(target_dir), "drafter": checkpoint_sha256(drafter_dir)}
    # What each graph is made of: the target's graph reads only the target and which of its layers
    # feed the drafter, so a new drafter or draft vocabulary for the same target reuses it; the
    # draft graph also holds the target's embedding and head.
    graph_sources = {
        TARGET: {"target": sources["target"], "feature_layers": list(feature_layers)},
        DRAFT: {**sources, "draft_vocab": ids_sha256(chosen[0]) if chosen is not None else None}}
    steps = [(name, stage) for name in modules for stage in
             (("export", "compile") if backend in ("tensorrt", "inductor") else
              ("export", "quantize") if name in quantized else ("export",))] + [("engine", "self-check")]
    with staged_directory(output, ENGINE, inputs) as staging, tqdm(
            total=len(steps), desc="build", unit="step", file=sys.stderr, disable=not progress,
            dynamic_ncols=True) as bar:
        files = {}
        for name, stage in steps[:-1]:
            bar.set_postfix_str(f"{stage} {name}")
            if stage == "export":  # from the graph cache when an earlier build exported the same graph
                suffix = ".pt2" if backend in ("torch", "inductor") else ".onnx"
                files[name] = f"{name}.export.pt2" if backend == "inductor" else f"{name}{suffix}"
                optimize = suffix == ".onnx" and (backend == "tensorrt" or name in quantized)  # export_onnx says why
                key = graph_key(name, suffix, specs[name], sources=graph_sources[name], max_context=max_context,
                                dtype=target.dtype, device=export_device, optimize=optimize)
                if name == TARGET and in_place:  # written operator by operator (export/ort_target.py)
                    from trtspec.export.ort_target import write_target_graph

                    write = functools.partial(write_target_graph, target, feature_layers,
                                              max_context + MAX_BLOCK_SIZE, specs[name])
                else:
                    write = functools.partial(_export, modules[name], specs[name], max_context, target.dtype,
                                              export_device, optimize=optimize)
                export_cached(staging / files[name], key, write)
            elif stage == "quantize":  # 4-bit MatMul weights, cached like the float graph they come from
                suffix = f".int{quantized[name]}.onnx"
                graph = f"{name}{suffix}"
                key = graph_key(name, suffix, specs[name], max_context=max_context, dtype=target.dtype,
                                device=export_device, sources={**graph_sources[name],
                                                               "weights": int4.quantizer_identity(quantized[name])})
                export_cached(staging / graph, key, functools.partial(int4.quantize_weights, staging / files[name],
                                                                      bits=quantized[name]))
                (staging / files[name]).unlink()
                files[name] = graph
            elif backend == "inductor":  # an AOTInductor package, cached per machine like the graph it compiles
                package = f"{name}.pt2"
                key = graph_key(name, ".aoti.pt2", specs[name], max_context=max_context, dtype=target.dtype,
                                device=export_device, sources={**graph_sources[name],
                                                               "compiled_for": torch_engine.compiled_for(device)})
                export_cached(staging / package, key,
                              functools.partial(torch_engine.compile_package, staging / files[name]))
                (staging / files[name]).unlink()
                files[name] = package
            else:
                plan = f"{name}.plan"
                trt_engine.build_plan(staging / files[name], staging / plan, table[name],
                                      timing_cache=output.parent / ".trtspec-timing.cache")
                (staging / files[name]).unlink()  # the plan replaces the graph it was built from
                files[name] = plan
            bar.update()
        _copy_tokenizer(target_dir, staging / TOKENIZER_DIR)
        if policy is not None:
            policy.save(staging / POLICY_DIR)
        if chosen is not None:  # the counts behind the ids baked into the draft graph, with their provenance
            (staging / DRAFTER_VOCAB_DIR).mkdir()
            chosen[1].save(staging / DRAFTER_VOCAB_DIR)
        manifest = Manifest(
            backend=backend, dtype=dtype, max_context=max_context, block_sizes=block_sizes, max_batch=config.max_batch,
            profiles=trt_engine.profile_keys(block_sizes),
            target_config=target.config.to_dict(), drafter_config=drafter.config.to_zlab(),
            sources=sources,
            artifacts=record_artifacts(staging),
            graphs={name: {"file": files[name], **specs[name].to_dict()} for name in modules},
            tensorrt_profiles=table, trtspec_version=__version__,
            policy={"dir": POLICY_DIR, "block_sizes": list(policy.block_sizes),
                    "choices": [c.name for c in policy.choices], "features": list(policy.kinds)}
            if policy is not None else None,
            draft_vocab={"dir": DRAFTER_VOCAB_DIR, "size": int(chosen[0].numel()),
                         "ids_sha256": ids_sha256(chosen[0])}
            if chosen is not None else None,
            weights=int4.manifest_weights(quantized, ort_engine.version()) if quantized else None)
        manifest.write(staging)
        bar.set_postfix_str("self-check")
        manifest.check = self_check(staging, device, target, drafter, block_sizes, exact=set(specs) - set(quantized))
        manifest.write(staging)
        bar.update()
    return manifest


def in_place_target(backend: str, target, device: torch.device) -> bool:
    """Whether the engine's target graph is `export.ort_target`'s (fused operators, KV cache updated
    in place, rows packed) rather than the exported one: every ONNX Runtime engine on the CPU whose
    target it can write. SmolLM2-135M, 1 thread, rows over 300 cached positions, ms (exported -> in
    place): float32 AR step 37.4 -> 33.9, verify(16) 74.8 -> 67.8, 8 rows x verify(4) 161 -> 126, 2 x
    verify(4) beside 6 AR steps 104 -> 76; 4-bit AR step 15.3 -> 11.1 (docs/engines.md, "The in-place
    target graph"). Its attention needs ONNX Runtime 1.32 (an older one, e.g. onnxruntime-gpu's, keeps
    the exported graph)."""
    if backend != "onnxruntime":
        return False
    import onnxruntime

    from trtspec.export import ort_target  # onnx: an ONNX Runtime build's, not every build's

    release = tuple(int(part) for part in onnxruntime.__version__.split(".")[:2])
    return release >= ort_target.MIN_ONNXRUNTIME and ort_target.supports(target, device)


def _export(module: torch.nn.Module, spec, max_context: int, dtype: torch.dtype, device: torch.device,
            path: Path, *, optimize: bool) -> None:
    """ONNX, or a torch.export program (torch and inductor backends), by the file's suffix."""
    if path.suffix == ".pt2":
        torch.export.save(export_program(module, spec, max_context, dtype, device), str(path))
    else:
        export_onnx(module, spec, max_context, dtype, device, path, optimize=optimize)


def _copy_tokenizer(source: Path, destination: Path) -> None:
    destination.mkdir()
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, destination / name)


def _check_prompt(vocab_size: int) -> list[int]:
    """The self-check's fixed prompt: 24 token ids drawn with seed 0."""
    return torch.randint(2, vocab_size, (24,), generator=torch.Generator().manual_seed(0)).tolist()


def self_check(directory: Path, device: torch.device, target, drafter, block_sizes: list[int],
               exact: set[str] = frozenset((TARGET, DRAFT))) -> dict:
    """Run the built engine's prefill, verify(B) and draft(B) on a fixed prompt and compare them
    with the eager modules; in float32, refuse the build if a graph in `exact` differs by more than
    the tolerance (or, for the draft, proposes another token). A graph of lower precision (float16,
    quantized weights) records its difference only."""
    from trtspec.runtime.runner import BatchRunner

    prompt = _check_prompt(target.config.vocab_size)
    compiled = BatchRunner.open(directory, device, max_context=len(prompt) + max(block_sizes))
    eager = BatchRunner.eager(target, drafter, 1, max_context=compiled.max_context)
    worst = {TARGET: 0.0, DRAFT: 0.0}
    with torch.inference_mode():
        for block_size in block_sizes:
            (logits_g, features_g), (logits_e, features_e) = (r.prefill([0], [prompt], [0], tail=len(prompt))
                                                              for r in (compiled, eager))
            block = torch.tensor([[prompt[-1]] + [drafter.config.mask_token_id] * (block_size - 1)])
            drafts_g, proposal_g = compiled.draft([0], [features_g[0]], block, [len(prompt)])
            drafts_e, proposal_e = eager.draft([0], [features_e[0]], block, [len(prompt)])
            block = torch.cat((block[:, :1], drafts_e.cpu()), dim=1)
            verified = compiled.verify([0], block, [len(prompt)])[0], eager.verify([0], block, [len(prompt)])[0]
            for graph, pairs in ((TARGET, ((logits_g, logits_e), verified)), (DRAFT, ((proposal_g, proposal_e),))):
                worst[graph] = max(worst[graph], *((g.float().cpu() - e.float().cpu()).abs().max().item()
                                                   for g, e in pairs))
            agree = (drafts_g.cpu() == drafts_e.cpu()).float().mean().item()
            failed = [graph for graph in exact if worst[graph] > CHECK_TOLERANCE or (graph == DRAFT and agree < 1.0)]
            if target.dtype == torch.float32 and failed:
                raise TrtspecError(f"self-check failed at block size {block_size}: max |logit difference| "
                                   f"{max(worst[g] for g in failed):.2e} ({', '.join(sorted(failed))}), draft "
                                   f"agreement {agree:.0%} (the engine does not reproduce PyTorch)")
    return {"max_abs_logit_diff": max(worst.values()), "target_max_abs_logit_diff": worst[TARGET],
            "draft_max_abs_logit_diff": worst[DRAFT], "block_sizes": block_sizes, "prompt_tokens": len(prompt)}
