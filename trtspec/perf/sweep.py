"""The one sweep behind every measurement: prompts x block-size choices x repeats.

bench, label-blocks, host profiling, preflight and the GPU check all run it. Each repeat goes
through the prompts, and at each prompt every choice (autoregressive decoding first, when asked)
takes its turn, and at each choice every variant (another backend, another controller): a
machine's drift over a run (clocks, other jobs) reaches them all alike, where one choice over the
whole set after another would hand it to whichever ran last (docs/benchmarks.md). Request i of
repeat r gets the seed base + r * n_prompts + i (base: the sampling seed, default 0;
runtime.sampling.derive_seed), the same for AR, every choice and every variant, so T > 0
reproduces and compares like for like.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field, replace
from typing import Callable, Generic, Sequence, TypeVar

from tqdm import tqdm

from trtspec.runtime.request import Generation, GenerationConfig
from trtspec.runtime.sampling import SamplingConfig, derive_seed
from trtspec.runtime.schedule import BlockChoice

WARMUP_TOKENS = 8  # tokens of the warm-up request: first-call overheads stay out of the figures

P = TypeVar("P")  # a prompt: text, or token ids
T = TypeVar("T")  # what one request yields
Request = Callable[[BlockChoice, P, GenerationConfig], T]


@dataclass(frozen=True)
class Sweep:
    choices: tuple[BlockChoice, ...]
    max_new_tokens: int
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    repeats: int = 1
    with_ar: bool = True   # autoregressive decoding first, the baseline of every speed-up
    warmup: bool = False   # one short request per variant and choice before measuring

    @property
    def schedule(self) -> tuple[BlockChoice, ...]:
        """What each repeat runs, in order."""
        return ((BlockChoice(1),) if self.with_ar else ()) + tuple(self.choices)

    def seed(self, repeat: int, prompt: int, n_prompts: int) -> int:
        """The seeding rule, written once."""
        return derive_seed(self.sampling.seed, repeat * n_prompts + prompt)

    def config(self, choice: BlockChoice, seed: int, max_new_tokens: int | None = None) -> GenerationConfig:
        return GenerationConfig(block=choice, max_new_tokens=max_new_tokens or self.max_new_tokens,
                                sampling=replace(self.sampling, seed=seed))


@dataclass
class SweepResult(Generic[T]):
    schedule: tuple[BlockChoice, ...]
    results: list[list[list[list[T]]]]  # [variant][choice][repeat][prompt]

    def of(self, choice_index: int, variant: int = 0) -> list[list[T]]:
        """[repeat][prompt] results of one choice (index into `schedule`) through one variant."""
        return self.results[variant][choice_index]


def run_sweep(variants: Sequence[Request], prompts: Sequence, sweep: Sweep, *, desc: str = "sweep",
              progress: bool = True) -> SweepResult:
    """Run every request of `sweep` over `prompts` through each of `variants`."""
    schedule, n = sweep.schedule, len(prompts)
    if sweep.warmup:
        for variant in variants:
            for choice in schedule:
                variant(choice, prompts[0], sweep.config(choice, sweep.seed(0, 0, n),
                                                         min(WARMUP_TOKENS, sweep.max_new_tokens)))
    results = [[[] for _ in schedule] for _ in variants]
    total = sweep.repeats * len(schedule) * n * len(variants)
    with tqdm(total=total, desc=desc, unit="req", file=sys.stderr, disable=not progress, dynamic_ncols=True) as bar:
        for repeat in range(sweep.repeats):
            bar.set_postfix_str(f"repeat {repeat + 1}/{sweep.repeats}")
            for per_choice in results:
                for per_repeat in per_choice:
                    per_repeat.append([])
            for index, prompt in enumerate(prompts):
                for c, choice in enumerate(schedule):
                    config = sweep.config(choice, sweep.seed(repeat, index, n))
                    for v, variant in enumerate(variants):
                        results[v][c][repeat].append(variant(choice, prompt, config))
                        bar.update()
    return SweepResult(schedule, results)


def pipeline_requests(pipeline) -> Request:
    """Requests decoded by a Pipeline; AR goes through its drafter-less baseline."""
    baseline = pipeline.autoregressive()

    def request(choice: BlockChoice, prompt: str, config: GenerationConfig) -> Generation:
        return (baseline if choice.ar else pipeline).generate(prompt, config).generation

    return request
