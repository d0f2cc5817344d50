"""The Python API: load a target (and drafter) once, then generate text for many requests.

The CLI and serving code are thin layers over `Pipeline`; it never touches click or globals.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import torch

from trtspec.assets import resolve_drafter, resolve_pair, resolve_target
from trtspec.errors import Cancelled, TrtspecError
from trtspec.limits import DRAFT_WIDTH, MAX_CONTEXT, PROMPT_LOOKUP, PROPOSAL_TEMPERATURE
from trtspec.engines.manifest import TOKENIZER_DIR, check_sources
from trtspec.models import load_drafter, load_target
from trtspec.models.draft_vocab import select as select_draft_vocab
from trtspec.blockpilot.policy import drafter_policy, load_policy
from trtspec.device import describe_device, resolve_device, resolve_dtype
from trtspec.export.bindings import PREFILL_LOGITS
from trtspec.runtime.engine import Engine, EngineConfig, LocalEngine
from trtspec.runtime.lookup import MIN_MATCH
from trtspec.runtime.request import Generation, GenerationConfig
from trtspec.runtime.runner import BatchRunner
from trtspec.runtime.sampling import DEFAULT_PROPOSAL_TEMPERATURE
from trtspec.runtime.schedule import AR, AUTO, BlockChoice
from trtspec.tokenizer import TextCodec

@dataclass
class TextResult:
    text: str
    generation: Generation

    @property
    def tokens(self) -> list[int]:
        return self.generation.tokens

    def to_dict(self) -> dict:
        return {"text": self.text, "tokens": self.tokens, "stats": self.generation.stats.to_dict()}


def batch_context(ids: list[list[int]], configs: list[GenerationConfig], model_context: int) -> int:
    """The cache positions a batch's requests can reach (the longest prompt and the largest token
    budget), as a power of two of at least 1,024 (few distinct runner shapes, whose cycle costs are
    measured once each), at most the model's context: zeroing caches for the model's whole context
    at every batch (3 GiB for the default pair at 8 slots) costs seconds before the first token."""
    needed = max((len(prompt) for prompt in ids), default=1) + max((c.max_new_tokens for c in configs), default=1)
    return min(model_context, max(1024, 1 << (needed - 1).bit_length()))


class Pipeline:
    """A loaded model pair: from checkpoint directories (eager PyTorch) or from a built engine
    directory (`engine=`; then `target`/`drafter`, when given, must be what it was built from).
    With a BlockPilot policy (`policy=`, the engine's own, or the drafter directory's `blockpilot/`) the
    default block choice is AUTO. `draft_vocab=K` makes the drafter propose among the K most frequent
    token ids (counts from `draft_counts` or the drafter directory's `draft_vocab/`; an engine
    carries the K it was built with). Model arguments are named as on the command line
    (`trtspec.assets`): `target` may also be a GGUF file (converted once into the cache) and
    `drafter` a bundled drafter's name; without an engine, `Pipeline()` is the default pair
    (SmolLM2-135M-Instruct and smollm2-b16). Sampled requests draw their drafts from the drafter at
    `proposal_temperature` x their temperature (0: its argmax, DFlash's rule), in every engine this
    pipeline makes whose EngineConfig leaves it unset; likewise `prompt_lookup` (runtime.lookup: drafts
    copied where the text's last N tokens occurred before; 0: off) and `draft_width` (with lookup, the
    positions a cycle without a long copy verifies; 0: whole blocks; default: 4 on a CPU, 0 elsewhere) and
    `confident_width` (a greedy request decoding alone verifies as many of its drafts as the drafter's
    confidence and the engine's timing say pay: runtime.widths; default on)."""

    def __init__(self, target: str | Path | None = None, drafter: str | Path | None = None, *,
                 engine: str | Path | None = None, policy: str | Path | None = None, dtype: str = "auto",
                 device: str = "auto", max_context: int | None = None, cuda_graphs: bool | None = None,
                 draft_vocab: int | None = None, draft_counts: str | Path | None = None,
                 proposal_temperature: float | None = None, prompt_lookup: int | None = None,
                 draft_width: int | None = None, confident_width: bool = True):
        torch_device = resolve_device(device)
        self.proposal_temperature = (DEFAULT_PROPOSAL_TEMPERATURE if proposal_temperature is None
                                     else PROPOSAL_TEMPERATURE.check(proposal_temperature))
        self.prompt_lookup = MIN_MATCH if prompt_lookup is None else PROMPT_LOOKUP.check(prompt_lookup)
        self.draft_width = None if draft_width is None else DRAFT_WIDTH.check(draft_width)
        self.confident_width = confident_width
        if engine is None:
            target, drafter = resolve_pair(target, drafter)
        else:  # what it was built from, if given
            target = resolve_target(target) if target is not None else None
            drafter = resolve_drafter(drafter, None) if drafter is not None else None
        self.target = self.drafter = None
        self.cuda_graphs = cuda_graphs
        if engine is not None:  # cuda_graphs: replay captured draft/verify calls (CUDA; default: see BatchRunner)
            self.runner = BatchRunner.open(engine, torch_device, cuda_graphs=cuda_graphs,
                                           max_context=max_context and MAX_CONTEXT.check(max_context))
            check_sources(self.runner.manifest, target, drafter)
            self.codec = TextCodec(Path(engine) / TOKENIZER_DIR)
            self.vocab_size = self.runner.manifest.target.vocab_size
            # the backend as reports name it: "onnxruntime int4 (target), int8 (draft)"
            self.backend, self.dtype = self.runner.manifest.label, self.runner.dtype
            trained = self.runner.manifest.drafter.block_size  # or the built size nearest to it
            self.drafter_block_size = min(self.runner.block_sizes, key=lambda b: abs(b - trained))
            built = (self.runner.manifest.draft_vocab or {}).get("size")
            if draft_counts is not None or draft_vocab not in (None, built):
                raise TrtspecError(f"the engine was built with {f'--draft-vocab {built}' if built else 'the full vocabulary'}"
                                   "; its draft vocabulary is fixed at build time: drop --draft-vocab/--draft-counts "
                                   "or rebuild the engine with them")
            self.draft_vocab_size, self.draft_ids = built, self.runner.draft_ids  # baked into the draft graph
        else:
            self.codec = TextCodec(target)
            self.target = load_target(target, resolve_dtype(dtype, torch_device), torch_device)
            self.vocab_size = self.target.config.vocab_size
            self.drafter = load_drafter(drafter, self.target) if drafter is not None else None
            if self.drafter is None and (draft_vocab is not None or draft_counts is not None):
                raise TrtspecError("--draft-vocab restricts the drafter's proposals; give a drafter too")
            chosen = select_draft_vocab(draft_vocab, draft_counts, drafter, self.target.config.vocab_size) \
                if self.drafter is not None else None
            if chosen is not None:
                self.drafter.use_draft_vocab(chosen[0])
            self.draft_vocab_size = chosen[0].numel() if chosen is not None else None
            self.draft_ids = chosen[0] if chosen is not None else None
            context = self.target.config.max_position_embeddings
            self.runner = BatchRunner.eager(self.target, self.drafter, 1, cuda_graphs,
                                            min(MAX_CONTEXT.check(max_context), context) if max_context else context)
            self.backend, self.dtype = "torch-eager", self.target.dtype
            self.drafter_block_size = self.drafter.config.block_size if self.drafter is not None else 1
        if policy is None and engine is not None and self.runner.manifest.policy:
            policy = Path(engine) / self.runner.manifest.policy["dir"]
        elif policy is None and engine is None:
            policy = drafter_policy(drafter)
        self.default_block = BlockChoice(self.drafter_block_size) if self.has_drafter else AR
        self.policy, self.policy_dir = None, policy
        if policy is not None:
            if not self.has_drafter:
                raise TrtspecError("a BlockPilot policy chooses the drafter's block size; give a drafter too")
            self.policy = load_policy(policy, self.runner.block_sizes).to(torch_device)
            self.default_block = AUTO
        self._local_engine: LocalEngine | None = None

    @property
    def has_drafter(self) -> bool:
        return self.runner.mask_token_id is not None

    def autoregressive(self) -> "Pipeline":
        """The same target, backend, tokenizer and context cap without the drafter: the AR
        baseline (eager: a target that computes no drafter features; graphs: verify(1))."""
        baseline = copy.copy(self)
        baseline.drafter = None
        baseline.runner = self._runner(1, drafter=False)
        baseline.default_block, baseline.policy, baseline._local_engine = AR, None, None
        return baseline

    def _runner(self, slots: int, drafter: bool = True, max_context: int | None = None) -> BatchRunner:
        """A runner of this pair and backend with caches for `slots` requests of up to `max_context`
        positions (default: the model's), graphs loaded once."""
        max_context = max_context or self.runner.max_context
        if self.target is not None:  # eager: without the drafter, a target step that computes no features
            return BatchRunner.eager(self.target, self.drafter if drafter and self.has_drafter else None, slots,
                                     self.cuda_graphs, max_context)
        return self.runner.with_slots(slots, max_context, drafter=drafter and self.has_drafter)

    @property
    def local_engine(self) -> LocalEngine:
        """The one-slot engine that decodes this pipeline's own requests, one at a time on the caller's
        thread (`generate`, bench, labels); servers and batches get engines of their own (`engine`)."""
        if self._local_engine is None:
            self._local_engine = LocalEngine(self.runner, self.policy, self._configured(EngineConfig(
                                             max_running=1, prefill_chunk=0)),
                                             stop_ids=tuple(self.codec.stop_ids), codec=self.codec)
        return self._local_engine

    def engine(self, config: EngineConfig = EngineConfig(), load_aware: bool = True) -> Engine:
        """A continuous-batching engine over this pair and backend on a background thread (its own
        caches, `config.max_running` slots); the tokenizer's stop ids apply to every request. With a
        policy and `load_aware`, the cycle costs of its block sizes are measured here (a few
        seconds, the first time on a machine; then read from the cache) and `auto` may choose AR
        when the batch is large enough that speculation no longer pays (trtspec.blockpilot.load).
        Close it when done."""
        return Engine(self.stepped_engine(config, load_aware))

    def stepped_engine(self, config: EngineConfig = EngineConfig(), load_aware: bool = True,
                       max_context: int | None = None) -> LocalEngine:
        """`engine` without its thread, for a caller that steps it itself (LocalEngine.generate); its
        requests fit in `max_context` positions each (default: the model's whole context)."""
        runner = self._runner(config.max_running, max_context=max_context)
        chooser = None
        if self.policy is not None and load_aware:
            from trtspec.blockpilot.costs import cached_costs
            from trtspec.blockpilot.load import LoadAwareChooser

            costs = cached_costs(runner, self.policy.block_sizes, self._timing_identity(runner))
            chooser = LoadAwareChooser(costs, self.policy.choices)
        return LocalEngine(runner, self.policy, self._configured(config), stop_ids=tuple(self.codec.stop_ids),
                           chooser=chooser, codec=self.codec)

    def _configured(self, config: EngineConfig) -> EngineConfig:
        """`config` with this pipeline's settings where it leaves them unset."""
        if config.proposal_temperature is None:
            config = replace(config, proposal_temperature=self.proposal_temperature)
        if config.prompt_lookup is None:
            config = replace(config, prompt_lookup=self.prompt_lookup)
        if config.draft_width is None:
            config = replace(config, draft_width=self.draft_width)  # None: the engine's default for its runner
        if config.confident_width is None:
            config = replace(config, confident_width=self.confident_width)
        return config

    def _timing_identity(self, runner: BatchRunner) -> dict:
        """What a cycle's time depends on besides the runner's own sizes: the graphs an engine was
        built into (their hashes), or the eager models' configurations, and where they run."""
        if runner.manifest is not None:
            models = {"artifacts": runner.manifest.artifacts}
        else:
            models = {"target": self.target.config.to_dict(), "drafter": self.drafter.config.to_zlab(),
                      "draft_vocab": self.draft_vocab_size}
        return {**models, "backend": self.backend, "dtype": str(runner.dtype), "device": describe_device(runner.device),
                "threads": torch.get_num_threads()}

    def prefill(self, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The target's prefill of `ids` alone: the logits of its last PREFILL_LOGITS positions and the
        drafter features of every position (BlockPilot's inputs; a divergence's trace)."""
        if self.local_engine.busy:
            raise TrtspecError("the pipeline is decoding; prefill between requests")
        with torch.inference_mode():
            logits, features = self.runner.prefill([0], [ids], [0], tail=PREFILL_LOGITS)
        return logits[0], features[0] if self.has_drafter else None

    def generate_batch(self, prompts: list[str], configs: list[GenerationConfig], *, chat: bool = False,
                       max_running: int = 8) -> list[TextResult]:
        """Decode many prompts together (continuous batching); results in the prompts' order, each
        ended at its first stop string (its config's `stop`)."""
        if len(prompts) != len(configs):
            raise TrtspecError(f"{len(prompts)} prompts but {len(configs)} configs")
        ids = [self.codec.encode(p, chat=chat) for p in prompts]
        engine = self.stepped_engine(EngineConfig(max_running=max_running),
                                     load_aware=any(c.block.auto for c in configs), max_context=batch_context(
                                         ids, configs, self.runner.max_context))
        generations = engine.generate(ids, configs)
        return [TextResult(g.text, g) for g in generations]

    def generate(self, prompt: str, config: GenerationConfig, *, chat: bool = False,
                 on_text: Callable[[str], None] | None = None,
                 cancelled: Callable[[], bool] | None = None) -> TextResult:
        """Decode `prompt`; `on_text` receives text pieces as tokens are committed, and together
        they are exactly the result's text. `cancelled` is asked after every cycle; when it says
        so, decoding stops there with `Cancelled` (a server frees its instance at once). The first
        of the config's stop strings (`stop`) in the text ends decoding: the text ends before it,
        the tokens with the one that completed it."""
        ids = self.codec.encode(prompt, chat=chat)  # an empty one is refused at the engine's door (check_request)

        def check_cancelled(_: int, tokens: list[int]) -> None:
            if cancelled():
                raise Cancelled("the request was cancelled")
        generation = self.local_engine.generate([ids], [config], None if cancelled is None else check_cancelled,
                                                on_text=None if on_text is None else lambda _, piece: on_text(piece))[0]
        return TextResult(generation.text, generation)
