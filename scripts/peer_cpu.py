"""Is trtspec faster than what people already run on a GGUF file? One table, one machine, one run.

The same prompts, thread count and token budget, greedy, through five systems on the same model file:

* `trtspec-ar`:       trtspec autoregressive (the pipeline without its drafter: `Pipeline.autoregressive()`);
* `trtspec-spec`:     trtspec speculative at `--block-size` B (the pair's drafter);
* `llama.cpp`:        llama-cpp-python's plain greedy decode (`Llama.create_completion`, temperature 0);
* `llama.cpp-lookup`: the same with llama.cpp's prompt-lookup speculation
                      (`LlamaPromptLookupDecoding(num_pred_tokens=10)` as its draft model);
* `transformers`:     `AutoModelForCausalLM.generate` (do_sample=False) in trtspec's dtype (or
                      `--transformers-dtype`).

Every system's speed is counted the same way: tokens generated / wall time of one generate call
(prefill included), median over prompts x repeats; `vs llama.cpp` is the median over calls of each
call's rate over llama.cpp plain's on the same prompt in the same repeat. Where a system times its
prefill itself (trtspec; llama.cpp plain, by its perf counters) the table also gives prefill (prompt
tokens per second) and decode alone (the tokens after the first over the time after prefill).
Calls are interleaved prompt by prompt (each system in turn), after one warm-up call each, so all
systems see the same machine state. llama.cpp tokenizes the prompt text itself (no BOS for SmolLM2,
as trtspec); transformers gets trtspec's token ids (its GGUF tokenizer would prepend `<|im_start|>`).
Each llama.cpp call starts from an empty cache (`Llama.reset()`), so none reuses an earlier prompt.

trtspec runs on the backend its commands choose here (`--backend auto`): eager bfloat16 on a CPU with
AMX, ONNX Runtime in float32 elsewhere (an engine built once into the cache).

llama-cpp-python and transformers are benchmark-only extras (`pip install 'trtspec[peer]'`; on a CPU
with AMX build llama-cpp-python with the flags in docs/benchmarks.md, "Peer benchmark on the CPU"); a
system whose package is missing is reported as skipped with the command that installs it.

    python scripts/peer_cpu.py --threads 1 --limit 24 --json peer-1t.json
    python scripts/peer_cpu.py --threads 2 --limit 24 --json peer-2t.json
    python scripts/peer_cpu.py --limit 2 --repeats 1 --systems trtspec-ar,trtspec-spec   # trtspec alone
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from trtspec.assets import target_source
from trtspec.commands.options import load_pipeline
from trtspec.device import cpu_flags
from trtspec.errors import TrtspecError
from trtspec.fileio import atomic_write_text, check_output_file
from trtspec.models.gguf import is_gguf
from trtspec.perf.bench import load_prompts
from trtspec.perf.machine import machine_info
from trtspec.runtime.request import GenerationConfig
from trtspec.runtime.schedule import AR, BlockChoice

SYSTEMS = ("trtspec-ar", "trtspec-spec", "llama.cpp", "llama.cpp-lookup", "transformers")
BASELINE = "llama.cpp"
LOOKUP_TOKENS = 10  # LlamaPromptLookupDecoding's num_pred_tokens
WARMUP_TOKENS = 8
LLAMA_CPP_FLAGS = ("-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON "
                   "-DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF "
                   "-DGGML_AMX_BF16=OFF")
# The flags only where the CPU has AMX (whose kernels GCC 12 miscompiles); elsewhere the native build is right.
INSTALL = {"llama_cpp": (f"CMAKE_ARGS=\"{LLAMA_CPP_FLAGS}\" " if "amx_tile" in cpu_flags() else "")
                        + "pip install 'llama-cpp-python>=0.3'",
           "transformers": "pip install 'transformers>=4.56'"}


@dataclass(frozen=True)
class Prompt:
    index: int
    text: str        # what trtspec and llama.cpp are given (the chat template's text with --chat)
    ids: list[int]   # trtspec's tokens of it: what transformers is given


@dataclass
class Call:
    """One generate call: what it produced and how long it took."""

    output: list[int] | str          # the tokens, or llama.cpp's text
    new_tokens: int
    seconds: float                   # wall time of the call
    prompt_tokens: int
    prefill_s: float | None = None   # the system's own prefill timer, where it has one
    tau: float | None = None         # trtspec: tokens committed per cycle

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Tokens after the first (which prefill yields) per second after prefill, where prefill is timed."""
        if self.prefill_s is None or self.new_tokens < 2:
            return None
        return (self.new_tokens - 1) / (self.seconds - self.prefill_s)


Generate = Callable[[Prompt, int], Call]  # (prompt, max new tokens) -> the call


@dataclass
class System:
    name: str
    label: str
    generate: Generate | None = None
    skipped: str | None = None                      # why it did not run
    calls: dict[tuple[int, int], Call] = field(default_factory=dict)  # (repeat, prompt) -> call


def skipped(name: str, label: str, module: str, exc: ImportError) -> System:
    why = "is not installed" if exc.name == module else f"cannot be imported ({exc})"
    return System(name, label, skipped=f"{module} {why}: {INSTALL[module]}")


def timed(run: Callable[[], Call]) -> Call:
    """`run()` with its `seconds` set to the call's wall time."""
    began = time.perf_counter()
    call = run()
    call.seconds = time.perf_counter() - began
    return call


# -- the systems ------------------------------------------------------------------------------------

def trtspec_systems(pipeline, block_size: int) -> list[System]:
    """AR through the drafter-less baseline of the same pipeline, and speculative at `block_size`."""
    baseline = pipeline.autoregressive()

    def through(pipe, block: BlockChoice) -> Generate:
        def generate(prompt: Prompt, max_new_tokens: int) -> Call:
            def run() -> Call:
                result = pipe.generate(prompt.text, GenerationConfig(block=block, max_new_tokens=max_new_tokens))
                stats = result.generation.stats
                return Call(result.tokens, len(result.tokens), 0.0, stats.prompt_tokens, stats.prefill_s,
                            None if block.ar else stats.tau)
            return timed(run)
        return generate

    return [System("trtspec-ar", "trtspec AR", through(baseline, AR)),
            System("trtspec-spec", f"trtspec speculative B={block_size}",
                   through(pipeline, BlockChoice(block_size)))]


def llama_cpp_systems(gguf: Path | None, threads: int, n_ctx: int) -> list[System]:
    """llama-cpp-python on the GGUF file: plain greedy, and with prompt lookup."""
    names = [("llama.cpp", "llama.cpp"), ("llama.cpp-lookup", f"llama.cpp prompt lookup ({LOOKUP_TOKENS})")]
    try:
        import llama_cpp
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    except ImportError as exc:
        return [skipped(name, label, "llama_cpp", exc) for name, label in names]
    if gguf is None:
        return [System(name, label, skipped="llama.cpp reads GGUF files; --target is not one") for name, label in names]

    def through(llm) -> Generate:
        def generate(prompt: Prompt, max_new_tokens: int) -> Call:
            llm.reset()  # no prefix of an earlier call reused: every call prefills its whole prompt
            llama_cpp.llama_perf_context_reset(llm.ctx)

            def run() -> Call:
                out = llm.create_completion(prompt.text, max_tokens=max_new_tokens, temperature=0.0, top_k=1,
                                            top_p=1.0, min_p=0.0, repeat_penalty=1.0)
                usage = out["usage"]
                return Call(out["choices"][0]["text"], usage["completion_tokens"], 0.0, usage["prompt_tokens"])

            call = timed(run)
            perf = llama_cpp.llama_perf_context(llm.ctx)
            if perf.n_p_eval == call.prompt_tokens:  # else its "prompt" batches include lookup's verifies
                call.prefill_s = perf.t_p_eval_ms / 1e3
            return call
        return generate

    def load(**options):
        return llama_cpp.Llama(model_path=str(gguf), n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx,
                               verbose=False, **options)

    draft = LlamaPromptLookupDecoding(num_pred_tokens=LOOKUP_TOKENS)
    return [System(names[0][0], names[0][1], through(load())),
            System(names[1][0], names[1][1], through(load(draft_model=draft)))]


def transformers_system(source: Path, dtype: torch.dtype) -> System:
    """transformers' own generate on the same file (or directory), in trtspec's dtype."""
    label = f"transformers generate ({str(dtype).removeprefix('torch.')})"
    try:
        from transformers import AutoModelForCausalLM
    except ImportError as exc:
        return skipped("transformers", label, "transformers", exc)
    if is_gguf(source):
        model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype)
    model.eval()
    eos = model.generation_config.eos_token_id
    pad = eos[0] if isinstance(eos, list) else eos

    def generate(prompt: Prompt, max_new_tokens: int) -> Call:
        ids = torch.tensor([prompt.ids])

        def run() -> Call:
            with torch.inference_mode():
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                     do_sample=False, pad_token_id=pad)
            tokens = out[0, ids.shape[1]:].tolist()
            return Call(tokens, len(tokens), 0.0, ids.shape[1])
        return timed(run)

    return System("transformers", label, generate)


# -- measuring and reporting ------------------------------------------------------------------------

def measure(systems: list[System], prompts: list[Prompt], repeats: int, max_new_tokens: int) -> None:
    """One warm-up call per system, then every prompt through every system in turn, `repeats` times."""
    running = [s for s in systems if s.generate is not None]
    for system in running:
        system.generate(prompts[0], min(WARMUP_TOKENS, max_new_tokens))
    for repeat in range(repeats):
        for prompt in prompts:
            for system in running:
                system.calls[repeat, prompt.index] = call = system.generate(prompt, max_new_tokens)
                print(f"  repeat {repeat + 1}, prompt {prompt.index + 1}: {system.name:16} "
                      f"{call.new_tokens:4d} tokens, {call.tokens_per_s:7.1f} tok/s", file=sys.stderr)


def median_or_none(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summary(system: System, baseline: System | None) -> dict:
    """A system's medians over its calls, and its ratio to the baseline's call on the same prompt and repeat."""
    calls = system.calls
    ratios = [call.tokens_per_s / baseline.calls[key].tokens_per_s for key, call in calls.items()
              if baseline is not None and key in baseline.calls]
    return {"tokens_per_s": median_or_none([c.tokens_per_s for c in calls.values()]),
            f"vs_{BASELINE}": median_or_none(ratios),
            "decode_tokens_per_s": median_or_none([c.decode_tokens_per_s for c in calls.values()
                                                   if c.decode_tokens_per_s is not None]),
            "prefill_tokens_per_s": median_or_none([c.prompt_tokens / c.prefill_s for c in calls.values()
                                                    if c.prefill_s]),
            "mean_new_tokens": statistics.fmean(c.new_tokens for c in calls.values()) if calls else None,
            "tau": median_or_none([c.tau for c in calls.values() if c.tau is not None])}


def first_difference(a: list[int] | str, b: list[int] | str) -> int | None:
    """Where two outputs part (None: identical); an output that is a prefix of the other parts at its end."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def agreement(system: System, reference: System, prompts: list[Prompt]) -> dict | None:
    """Per prompt, whether `system`'s first-repeat output equals `reference`'s, and where they part."""
    if not system.calls or not reference.calls:
        return None
    parts = [{"prompt": p.index, "parts_at": first_difference(system.calls[0, p.index].output,
                                                              reference.calls[0, p.index].output)} for p in prompts]
    unit = "character" if isinstance(reference.calls[0, 0].output, str) else "token"
    return {"system": system.name, "reference": reference.name, "unit": unit, "prompts": len(parts),
            "identical": sum(p["parts_at"] is None for p in parts), "per_prompt": parts}


def describe_agreement(found: dict) -> str:
    """One line: how many outputs are identical, and where the others part (never 'identical' when they are not)."""
    line = (f"{found['system']} vs {found['reference']}: identical output on "
            f"{found['identical']}/{found['prompts']} prompts")
    parted = [f"prompt {p['prompt'] + 1} at {found['unit']} {p['parts_at']}"
              for p in found["per_prompt"] if p["parts_at"] is not None]
    return line + (f"; parted: {', '.join(parted)}" if parted else "")


def format_table(header: str, systems: list[System], rows: dict[str, dict], agreements: list[dict]) -> str:
    def number(value: float | None, form: str = ".1f", suffix: str = "") -> str:
        return "-" if value is None else format(value, form) + suffix

    lines = [header, f"{'system':36}  {'tok/s':>7}  {'vs llama.cpp':>12}  {'decode tok/s':>12}  "
                     f"{'prefill tok/s':>13}  {'new tokens':>10}  {'tau':>5}"]
    for system in systems:
        if system.skipped:
            continue
        row = rows[system.name]
        lines.append(f"{system.label:36}  {number(row['tokens_per_s']):>7}  "
                     f"{number(row[f'vs_{BASELINE}'], '.2f', 'x'):>12}  {number(row['decode_tokens_per_s']):>12}  "
                     f"{number(row['prefill_tokens_per_s']):>13}  "
                     f"{number(row['mean_new_tokens']):>10}  {number(row['tau'], '.2f'):>5}")
    reasons = {s.skipped: [t.name for t in systems if t.skipped == s.skipped] for s in systems if s.skipped}
    lines += [f"skipped {', '.join(names)}: {reason}" for reason, names in reasons.items()]
    lines += [describe_agreement(found) for found in agreements]
    lines.append("tok/s: new tokens / wall time of one generate call (prefill included), median over prompts x "
                 "repeats; vs llama.cpp: median of per-call ratios (same prompt, same repeat); decode tok/s: "
                 "the tokens after the first over the time after prefill, where the system times its prefill")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[-3:]))
    parser.add_argument("--limit", type=int, default=24, help="HumanEval's first N prompts (default: 24).")
    parser.add_argument("--chat", action="store_true", help="Send each prompt in the target's chat template.")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads for every system (default: 1).")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="Token budget per call (default: 128).")
    parser.add_argument("--repeats", type=int, default=3, help="Passes over the prompts (default: 3).")
    parser.add_argument("--block-size", type=int, default=4, help="trtspec's speculative block size (default: 4).")
    parser.add_argument("--dtype", default="auto", help="trtspec's and transformers' dtype (default: auto, "
                                                        "bfloat16 on a CPU with AMX).")
    parser.add_argument("--transformers-dtype", choices=("float32", "bfloat16"),
                        help="transformers' own dtype (default: trtspec's, so their greedy outputs compare; issue "
                             "59's bar names transformers in bfloat16).")
    parser.add_argument("--backend", default=os.environ.get("TRTSPEC_BACKEND", "auto"),
                        help="trtspec's backend, as trtspec bench's (default: auto, or TRTSPEC_BACKEND: eager "
                             "bfloat16 on a CPU with AMX, else ONNX Runtime float32).")
    parser.add_argument("--engine", help="A built trtspec engine of the pair (e.g. trtspec build --weights int4) "
                                         "instead of --backend.")
    parser.add_argument("--max-context", type=int, help="trtspec's context cap (default: the model's).")
    parser.add_argument("--target", help="A GGUF file or HF directory (default: SmolLM2-135M-Instruct's GGUF).")
    parser.add_argument("--drafter", help="trtspec's drafter (default: the bundled one of the default target).")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"Which to run (default: {','.join(SYSTEMS)}).")
    parser.add_argument("--json", metavar="OUT", help="Also write every call's figures to OUT (atomically).")
    args = parser.parse_args(argv)
    args.systems = [name.strip() for name in args.systems.split(",") if name.strip()]
    unknown = sorted(set(args.systems) - set(SYSTEMS))
    if unknown or not args.systems:
        parser.error(f"--systems takes names among {', '.join(SYSTEMS)}; got {', '.join(unknown) or 'none'}")
    for name in ("limit", "threads", "max_new_tokens", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.json:
        check_output_file(args.json)
    torch.set_num_threads(args.threads)
    name, texts = load_prompts("humaneval", args.limit)
    pipeline = load_pipeline(args.target, args.drafter, args.dtype, "cpu", backend=args.backend, engine=args.engine,
                             block_sizes=(args.block_size,), max_context=args.max_context)
    if not pipeline.has_drafter:
        raise TrtspecError("trtspec-spec needs a drafter: give --drafter DIR with --target")
    if args.chat:  # the template's text; its special tokens are encoded as such (as trtspec bench --chat)
        texts = [pipeline.codec.apply_chat_template(text) for text in texts]
        name += " (chat)"
    prompts = [Prompt(i, text, pipeline.codec.encode(text)) for i, text in enumerate(texts)]
    source = target_source(args.target)
    n_ctx = max(len(p.ids) for p in prompts) + args.max_new_tokens + LOOKUP_TOKENS + 16

    systems = trtspec_systems(pipeline, args.block_size)
    if {"llama.cpp", "llama.cpp-lookup"} & set(args.systems):
        systems += llama_cpp_systems(source if is_gguf(source) else None, args.threads, n_ctx)
    if "transformers" in args.systems:
        dtype = getattr(torch, args.transformers_dtype) if args.transformers_dtype else pipeline.dtype
        systems.append(transformers_system(source, dtype))
    systems = [s for s in systems if s.name in args.systems]
    measure(systems, prompts, args.repeats, args.max_new_tokens)

    by_name = {s.name: s for s in systems}
    baseline = by_name.get(BASELINE)
    rows = {s.name: summary(s, baseline if baseline is not None and baseline.calls else None)
            for s in systems if not s.skipped}
    pairs = [("trtspec-spec", "trtspec-ar"), ("transformers", "trtspec-ar"), ("llama.cpp-lookup", "llama.cpp")]
    agreements = [found for a, b in pairs if a in by_name and b in by_name
                  for found in [agreement(by_name[a], by_name[b], prompts)] if found is not None]
    machine = machine_info(pipeline)
    header = (f"{name}: {len(prompts)} prompts x {args.repeats} repeats, greedy, max {args.max_new_tokens} new "
              f"tokens, {args.threads} thread(s) | trtspec {machine['backend']} {machine['dtype']} | "
              f"{machine['cpu']}, {machine['cpu_count']} cores")
    print(format_table(header, systems, rows, agreements))
    if args.json:
        report = {"settings": vars(args), "prompts": name, "n_prompts": len(prompts), "machine": machine,
                  "model": str(source), "versions": peer_versions(),
                  "systems": [{"name": s.name, "label": s.label, "skipped": s.skipped, **rows.get(s.name, {}),
                               "calls": [{"repeat": r, "prompt": p, **without_output(c)}
                                         for (r, p), c in s.calls.items()]} for s in systems],
                  "agreement": agreements}
        atomic_write_text(Path(args.json), json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}", file=sys.stderr)


def without_output(call: Call) -> dict:
    figures = asdict(call)
    del figures["output"]
    return {**figures, "tokens_per_s": call.tokens_per_s, "decode_tokens_per_s": call.decode_tokens_per_s}


def peer_versions() -> dict[str, str | None]:
    from importlib.metadata import PackageNotFoundError, version

    def installed(package: str) -> str | None:
        try:
            return version(package)
        except PackageNotFoundError:
            return None
    return {package: installed(package) for package in ("llama-cpp-python", "transformers", "torch", "gguf")}


if __name__ == "__main__":
    try:
        main()
    except TrtspecError as exc:
        sys.exit(f"Error: {exc}")
