"""`trtspec bench --concurrency`: throughput and latency under a closed loop of concurrent clients.

For each concurrency c, c clients share one continuous-batching engine (c slots); each client
sends the next prompt of the set as soon as its previous request finished, until every prompt
ran once. That is done for AR twice (through the same backend: the pipeline without its drafter,
what `serve --block-size AR` runs, and as AR requests inside the speculative engine that `auto`
runs, row "AR/pair", which is what an `auto` server's AR requests cost), each requested block
size and `auto` (BlockPilot, load-aware), `repeats` times, each repeat in an order
rotated by one (the host's state drifts over a run; no row should always run first or last), and the
medians are reported, each row also against the fastest of AR and the fixed sizes (`vs_best`, and
`vs_best_paired`: the median of the per-repeat ratios, and `vs_best_ci95`: how far the host's noise
lets `vs_best` be trusted). Greedy requests are also compared with the same request decoded alone.

Throughput is the steady state's: the tokens committed while all c clients had a request in flight
(from the start to the moment the first client finds no prompt left), over that time. After that
moment the run drains at fewer than c clients, and how long the drain lasts depends on the one
slowest request (a speculative request's length in cycles varies with its acceptance; an AR
request's does not), so whole-run figures at 8 or 16 clients over 32 prompts measured the drain as
much as the concurrency. The whole run's figure is reported too (`job_tokens_per_s`).
"""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from trtspec.runtime.request import Generation, GenerationConfig
from trtspec.runtime.engine import EngineConfig
from trtspec.runtime.sampling import SamplingConfig
from trtspec.runtime.schedule import AR, BlockChoice
from trtspec.runtime.stats import mean_tau, pooled_ceiling_fraction, schedule_counts


@dataclass
class LoadRun:
    """One (concurrency, block size) over the prompt set, `repeats` times."""

    concurrency: int
    choice: BlockChoice
    in_pair: bool = False  # an AR run inside the pair's (speculative) engine rather than the target's own
    seconds: list[float] = field(default_factory=list)            # wall time per repeat
    steady: list[tuple[int, float]] = field(default_factory=list)  # (tokens, seconds) while every client was busy
    generations: list[list[Generation]] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)
    identical: int | None = None
    compared: int = 0

    @property
    def throughput_repeats(self) -> list[float]:
        """Steady-state tokens per second of each repeat."""
        return [tokens / seconds for tokens, seconds in self.steady]

    @property
    def job_throughput_repeats(self) -> list[float]:
        """Tokens per second of each whole repeat, drain included."""
        return [sum(g.stats.new_tokens for g in run) / s for run, s in zip(self.generations, self.seconds)]

    @property
    def name(self) -> str:
        return self.choice.name + ("/pair" if self.choice.ar and self.in_pair else "")

    @property
    def throughput(self) -> float:
        return statistics.median(self.throughput_repeats)

    def to_dict(self, ar: "LoadRun", best: "LoadRun") -> dict:
        stats = [g.stats for run in self.generations for g in run]
        return {
            "concurrency": self.concurrency,
            "block_size": self.name,
            "engine": "pair" if self.in_pair or not self.choice.ar else "target",
            "throughput_tokens_per_s": self.throughput,
            "job_tokens_per_s": statistics.median(self.job_throughput_repeats),
            "speedup_vs_ar": self.throughput / ar.throughput,
            # against the fastest of AR and the fixed sizes at this concurrency: the ratio of the medians,
            # and the median of each repeat's ratio (a repeat's rows run back to back: a host whose speed
            # drifts over the run slows both sides of it alike)
            "best_fixed": best.name,
            "vs_best": self.throughput / best.throughput,
            "vs_best_paired": statistics.median(a / b for a, b in zip(self.throughput_repeats,
                                                                      best.throughput_repeats)),
            "vs_best_ci95": paired_interval(self.throughput_repeats, best.throughput_repeats),
            "latency_p50_s": float(np.percentile(self.latencies, 50)),
            "latency_p99_s": float(np.percentile(self.latencies, 99)),
            "ttft_p50_s": float(np.percentile(self.ttfts, 50)),
            "tau": mean_tau(stats),
            "ceiling_fraction": pooled_ceiling_fraction(stats),
            "batch_mean": statistics.fmean(s.batch_mean for s in stats),
            "chosen_block_sizes": schedule_counts(stats),
            "identical_to_serial": self.identical,
            "greedy_requests": self.compared,
            "throughput_repeats": self.throughput_repeats,
        }


def paired_interval(ours: list[float], theirs: list[float], resamples: int = 4000,
                    seed: int = 0) -> list[float]:
    """95% bootstrap interval of median(ours) / median(theirs): the repeats are resampled in pairs,
    since a repeat's rows ran back to back and the host's drift moved both sides of a pair alike.
    On a noisy host single repeats of one row spread widely, so a ratio a few percent under 1 over
    a few repeats can be a tie; the interval says whether it is. It does not count that the best
    row was picked as the largest of several noisy medians (which favours it)."""
    a, b = np.asarray(ours, float), np.asarray(theirs, float)
    picks = np.random.default_rng(seed).integers(0, len(a), (resamples, len(a)))
    ratios = np.median(a[picks], axis=1) / np.median(b[picks], axis=1)
    return [float(x) for x in np.percentile(ratios, [2.5, 97.5])]


def closed_loop(engine, prompts: list[list[int]], config: GenerationConfig, clients: int,
                run: LoadRun) -> None:
    """`clients` threads, each submitting the next prompt when its last request finished. The
    steady state ends when the first client finds no prompt left: the tokens the requests sent so
    far have committed by then count (with fewer prompts than 2 x clients, the whole run does)."""
    order, lock, results, sent, steady = iter(range(len(prompts))), threading.Lock(), [None] * len(prompts), [], []

    def client() -> None:
        while True:
            with lock:
                index = next(order, None)
                if index is None:
                    if not steady:
                        steady.append((sum(len(r.tokens) for r in sent), time.perf_counter() - began))
                    return
                request = engine.submit(prompts[index], config)
                sent.append(request)
            results[index] = request.result()
            run.latencies.append(time.perf_counter() - request.submitted)
            run.ttfts.append(results[index].stats.ttft_s)

    began = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    run.seconds.append(time.perf_counter() - began)
    run.generations.append(results)
    whole = (sum(g.stats.new_tokens for g in results), run.seconds[-1])
    run.steady.append(steady[0] if len(prompts) >= 2 * clients and steady[0][0] else whole)


def run_load(pipeline, prompts: list[str], choices: tuple[BlockChoice, ...], concurrencies: tuple[int, ...],
             max_new_tokens: int, sampling: SamplingConfig, repeats: int = 1, progress=None) -> list[dict]:
    """Every (concurrency, AR + choice) run; rows as in `LoadRun.to_dict`."""
    ids = [pipeline.codec.encode(p) for p in prompts]
    baseline = pipeline.autoregressive()
    serial = None
    if sampling.greedy:  # greedy output is the same at every block size: one AR pass is the reference
        alone = GenerationConfig(block=AR, max_new_tokens=max_new_tokens)
        serial = [baseline.generate(prompt, alone).tokens for prompt in prompts]
    rows = []
    for clients in concurrencies:
        config = EngineConfig(max_running=clients, max_queued=clients)
        engines = {True: baseline.engine(config), False: pipeline.engine(config)}  # keyed by "the target's own"
        try:
            runs = [LoadRun(clients, AR), LoadRun(clients, AR, in_pair=True)] + [LoadRun(clients, c) for c in choices]
            warm = [ids[0]] * clients
            for run in runs:  # warm-up: each engine and block size once
                closed_loop(engines[run.choice.ar and not run.in_pair], warm, _config(run.choice, 8, sampling),
                            clients, LoadRun(clients, run.choice))
            for repeat in range(repeats):
                for run in runs[repeat % len(runs):] + runs[:repeat % len(runs)]:  # none always first or last
                    closed_loop(engines[run.choice.ar and not run.in_pair], ids,
                                _config(run.choice, max_new_tokens, sampling), clients, run)
                    if progress is not None:
                        progress(run)
        finally:
            for engine in engines.values():
                engine.close()
        chooser = engines[False].chooser
        best = max((run for run in runs if not run.choice.auto), key=lambda run: run.throughput)
        for run in runs:
            if serial is not None:
                outputs = [g.tokens for repeat in run.generations for g in repeat]
                run.compared = len(outputs)
                run.identical = sum(a == b for a, b in zip(outputs, serial * repeats))
            rows.append(run.to_dict(runs[0], best))
            if run.choice.auto and chooser is not None:  # what load-aware BlockPilot judged by
                rows[-1]["cycle_costs_ms"] = chooser.costs.to_dict()  # timed at the first start here (then cached)
                measured = {}  # and what the engine's own cycles took: size -> batch -> median ms
                for (size, batch), ms in sorted(chooser.measured().items()):
                    measured.setdefault(str(size), {})[str(batch)] = ms
                rows[-1]["measured_cycle_ms"] = measured
                rows[-1]["learnt_tau"] = {str(b): chooser.tau(b, not sampling.greedy)  # pooled by cycles
                                          for b in chooser.costs.cycle_ms if b > 1}
                rows[-1]["decisions"] = dict(chooser.decisions)  # kept the policy's choice / smaller / ar / load
    return rows


def _config(choice: BlockChoice, max_new_tokens: int, sampling: SamplingConfig) -> GenerationConfig:
    return GenerationConfig(block=choice, max_new_tokens=max_new_tokens, sampling=sampling)


def format_table(rows: list[dict]) -> str:
    lines = [f"{'clients':>7}  {'B':>7}  {'tok/s':>8}  {'vs AR':>6}  {'vs best':>7}  {'95% interval':>12}  {'job tok/s':>9}  {'p50 s':>6}  {'p99 s':>6}  "
             f"{'TTFT p50':>8}  {'tau':>5}  {'ceiling':>7}  {'batch':>5}  identical"]
    for r in rows:
        identical = "-" if r["identical_to_serial"] is None else f"{r['identical_to_serial']}/{r['greedy_requests']}"
        lines.append(f"{r['concurrency']:>7}  {r['block_size']:>7}  {r['throughput_tokens_per_s']:>8.1f}  "
                     f"{r['speedup_vs_ar']:>5.2f}x  {r['vs_best']:>6.2f}x  {_interval(r['vs_best_ci95']):>12}  {r['job_tokens_per_s']:>9.1f}  {r['latency_p50_s']:>6.2f}  "
                     f"{r['latency_p99_s']:>6.2f}  {r['ttft_p50_s']:>8.3f}  {r['tau']:>5.2f}  "
                     f"{r['ceiling_fraction']:>7.1%}  {r['batch_mean']:>5.1f}  {identical}")
    return "\n".join(lines)


def _interval(bounds: list[float]) -> str:
    return f"{bounds[0]:.2f}-{bounds[1]:.2f}x"
