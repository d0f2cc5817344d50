"""Serving metrics in Prometheus form, the same for every front end (`trtspec serve`, the Triton model).

A front end feeds `ServingMetrics` what the engine reports: each finished request's `DecodeStats`
(`observe_finished`), each request that ended otherwise (`observe_failed`), and the engine's `Load`
(`observe_load`, e.g. right before a scrape). Nothing here knows about HTTP or Triton: `registry`
is a prometheus_client registry that a server renders (`render()`), and `FAMILIES` declares every
family once (name, kind, help, labels) for a front end with its own metric API to mirror.

Every family vLLM also exports has vLLM's name and prefix (`vllm:`, switchable with `prefix`), and
every series carries the `model_name` and `engine` labels vLLM's do, so vLLM's Grafana dashboards,
alerts and autoscalers read a trtspec server unchanged: the queue and running gauges, the KV-cache
usage gauge, token counters (generated tokens counted as they are committed), the request
histograms (TTFT, inter-token latency per token, end-to-end, queue, prefill, decode, lengths) and
the speculative-decoding counters: drafts (speculative cycles), draft tokens (B-1 per cycle),
accepted tokens, and accepted tokens per draft position (position p counts cycles that accepted at
least p+1 drafts; the last position of a block *is* its ceiling bin). What no peer exports keeps
the `trtspec_` prefix and is keyed by block size: cycles and ceiling cycles per block size,
BlockPilot's choices, running requests per block size, the pooled tau and the stranded-tau estimate
(DBloom: the tau the ceiling cycles would have reached had the block continued).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from trtspec.runtime.stats import (DecodeStats, accepted_at_least, committed_tokens, cut_histogram, decode_tokens,
                                   histogram_tau, pool_histograms)
from trtspec.runtime.schedule import BlockChoice

PREFIX = "trtspec_"      # trtspec's own families
VLLM_PREFIX = "vllm:"    # the families vLLM also exports, under its names
BASE_LABELS = ("model_name", "engine")  # on every series, as vLLM's
CONTENT_TYPE = CONTENT_TYPE_LATEST
# Request latencies in seconds (CPU demo models to large models on a GPU).
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TOKEN_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
LENGTH_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


@dataclass(frozen=True)
class Family:
    name: str            # without PREFIX; counters without the _total suffix prometheus_client adds
    kind: str            # counter, gauge or histogram
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()
    vllm: bool = False   # a family vLLM exports under this name: VLLM_PREFIX, else PREFIX


FAMILIES = (
    Family("spec_decode_num_drafts", "counter", "Speculative cycles (one draft block proposed and verified each).",
           vllm=True),
    Family("spec_decode_num_draft_tokens", "counter",
           "Draft tokens verified (B-1 per cycle of block size B, fewer in a narrowed one).", vllm=True),
    Family("spec_decode_num_accepted_tokens", "counter", "Draft tokens accepted by the target.", vllm=True),
    Family("spec_decode_num_accepted_tokens_per_pos", "counter",
           "Cycles whose draft at this position (0-based) was accepted; a block's last position is its ceiling bin.",
           ("position",), vllm=True),
    Family("spec_decode_cycles", "counter",
           "Decode cycles per block size schedule (B, B:G for a growing block, AR for autoregressive).",
           ("block_size",)),
    Family("spec_decode_ceiling_cycles", "counter",
           "Cycles that accepted their whole block, per block size schedule (the ceiling bin).", ("block_size",)),
    Family("spec_decode_copied_cycles", "counter",
           "Cycles whose leading drafts prompt lookup copied from the request's text, per block size schedule.",
           ("block_size",)),
    Family("blockpilot_choices", "counter", "Requests whose block size schedule BlockPilot chose (auto).",
           ("block_size",)),
    Family("spec_decode_stranded_tau_estimate", "gauge",
           "DBloom's stranded-tau estimate from the pooled histogram of the fixed block size so far: tau plus the "
           "tokens the ceiling cycles would have added had the block continued (requests that ran whole blocks "
           "only: a narrowed cycle cannot reach the ceiling).", ("block_size",)),
    Family("spec_decode_tau", "gauge", "Committed tokens per cycle (bonus included) of the pooled histogram so far.",
           ("block_size",)),
    Family("request_success", "counter", "Requests finished, by finish reason (stop, length).", ("finished_reason",),
           vllm=True),
    Family("request_failure", "counter", "Requests that did not finish: cancelled, rejected (queue full), error.",
           ("reason",)),
    Family("prompt_tokens", "counter", "Prompt tokens of finished requests.", vllm=True),
    Family("generation_tokens", "counter", "Tokens generated, counted as they are committed.", vllm=True),
    Family("num_preemptions", "counter", "Requests preempted (none: a request keeps its slot to its end).",
           vllm=True),
    Family("num_requests_waiting", "gauge", "Requests queued for a slot.", vllm=True),
    Family("num_requests_running", "gauge", "Requests in a slot (prefilling or decoding).", vllm=True),
    Family("kv_cache_usage_perc", "gauge", "KV-cache usage, 1 = full: the share of the engine's cache slots "
           "held by running requests (each slot holds a whole context).", vllm=True),
    Family("gpu_cache_usage_perc", "gauge", "The same as kv_cache_usage_perc (vLLM's older name).", vllm=True),
    Family("num_requests_running_by_block_size", "gauge", "Decoding requests per current block size.",
           ("block_size",)),
    Family("time_to_first_token_seconds", "histogram", "From submission to the first committed token.",
           buckets=LATENCY_BUCKETS, vllm=True),
    Family("inter_token_latency_seconds", "histogram", "Seconds between output tokens after the first, one "
           "observation per token (the tokens of one cycle share its interval).", buckets=TOKEN_LATENCY_BUCKETS,
           vllm=True),
    Family("time_per_output_token_seconds", "histogram", "Decode seconds per token after the first, per request.",
           buckets=TOKEN_LATENCY_BUCKETS, vllm=True),
    Family("e2e_request_latency_seconds", "histogram", "From submission to the end of the request.",
           buckets=LATENCY_BUCKETS, vllm=True),
    Family("request_queue_time_seconds", "histogram", "From submission to admission into a slot.",
           buckets=LATENCY_BUCKETS, vllm=True),
    Family("request_prefill_time_seconds", "histogram", "Seconds a request spent prefilling its prompt.",
           buckets=LATENCY_BUCKETS, vllm=True),
    Family("request_decode_time_seconds", "histogram", "Seconds a request spent decoding.",
           buckets=LATENCY_BUCKETS, vllm=True),
    Family("request_inference_time_seconds", "histogram", "Seconds a request spent in a slot (prefill and decode).",
           buckets=LATENCY_BUCKETS, vllm=True),
    Family("request_prompt_tokens", "histogram", "Prompt tokens per finished request.", buckets=LENGTH_BUCKETS,
           vllm=True),
    Family("request_generation_tokens", "histogram", "Generated tokens per finished request.",
           buckets=LENGTH_BUCKETS, vllm=True),
)


def accepted_per_position(histogram: list[int]) -> list[int]:
    """Cycles that accepted the draft at position p (at least p+1 drafts), p = 0 .. len-2."""
    return accepted_at_least(histogram)[1:]


class OneSeries:
    """For a family whose `.labels(*values)` gives its series: `.inc()`/`.set()`/`.observe()` on
    the one series of a family without labels of its own (prometheus_client's method names)."""

    def labels(self, *values):
        raise NotImplementedError

    def inc(self, amount: float = 1.0) -> None:
        self.labels().inc(amount)

    def set(self, value: float) -> None:
        self.labels().set(value)

    def observe(self, value: float) -> None:
        self.labels().observe(value)


class _Bound(OneSeries):
    """A prometheus_client family with its base label values given."""

    def __init__(self, metric, base: tuple[str, ...]):
        self.metric, self.base = metric, base

    def labels(self, *values):
        return self.metric.labels(*self.base, *map(str, values))


def metric_name(family: Family, vllm_prefix: str = VLLM_PREFIX) -> str:
    """The exposed name (counters without the _total suffix prometheus_client adds)."""
    return (vllm_prefix if family.vllm else PREFIX) + family.name


class ServingMetrics:
    """The metric families of one server process, in their own registry. Thread-safe. `model_name`
    and `engine` are the base labels of every series (vLLM's); `vllm_prefix` names the families
    vLLM also exports ("vllm:", so its dashboards work; "trtspec_" puts everything under one prefix)."""

    def __init__(self, registry: CollectorRegistry | None = None, *, model_name: str = "", engine: str = "0",
                 vllm_prefix: str = VLLM_PREFIX):
        self.registry = registry if registry is not None else CollectorRegistry()
        self._lock = threading.Lock()
        self._pooled: dict[int, list[int]] = {}   # fixed block size -> pooled histogram
        self._whole: dict[int, list[int]] = {}    # ... of the requests that ran whole blocks (no narrowed cycle)
        self._running_sizes: set[str] = set()
        self.families = {}
        for family in FAMILIES:
            kind = {"counter": Counter, "gauge": Gauge, "histogram": Histogram}[family.kind]
            extra = {"buckets": family.buckets} if family.buckets else {}
            metric = kind(metric_name(family, vllm_prefix), family.help, BASE_LABELS + family.labels,
                          registry=self.registry, **extra)
            self.families[family.name] = _Bound(metric, (model_name, engine))
        self.families["num_preemptions"].inc(0)  # exported from the start, at 0

    def __getitem__(self, name: str):
        return self.families[name]

    def observe_tokens(self, count: int) -> None:
        """`count` tokens generated (the generation counter, as they are committed)."""
        self.families["generation_tokens"].inc(count)

    def observe_finished(self, stats: DecodeStats, *, latency_s: float, ttft_s: float | None = None,
                         queue_s: float | None = None, intervals: Sequence[tuple[int, float]] = ()) -> None:
        """A request that finished (a stop or its limit): its decode statistics and timings.
        `intervals`: (tokens, seconds since the request's previous tokens) of each of its emissions
        after the first (whose latency is the TTFT), in the inter-token latency one observation per
        token, the tokens of one emission sharing its interval."""
        m, schedule = self.families, stats.schedule
        with self._lock:
            for count, interval_s in intervals:
                for _ in range(count):
                    m["inter_token_latency_seconds"].observe(interval_s / count)
            m["request_success"].labels(stats.finish_reason or "stop").inc()
            m["prompt_tokens"].inc(stats.prompt_tokens)
            m["request_prompt_tokens"].observe(stats.prompt_tokens)
            m["request_generation_tokens"].observe(stats.new_tokens)
            m["request_prefill_time_seconds"].observe(stats.prefill_s)
            m["request_decode_time_seconds"].observe(stats.decode_s)
            m["request_inference_time_seconds"].observe(stats.prefill_s + stats.decode_s)
            m["e2e_request_latency_seconds"].observe(latency_s)
            if ttft_s is not None:
                m["time_to_first_token_seconds"].observe(ttft_s)
            if queue_s is not None:
                m["request_queue_time_seconds"].observe(queue_s)
            if decode_tokens(stats.new_tokens) and stats.decode_s > 0:
                m["time_per_output_token_seconds"].observe(stats.decode_s / decode_tokens(stats.new_tokens))
            if stats.cycles:
                m["spec_decode_cycles"].labels(schedule).inc(stats.cycles)
            if stats.auto:
                m["blockpilot_choices"].labels(schedule).inc()
            if stats.block_size <= 1 or not stats.cycles:
                return
            accepted = committed_tokens(stats.histogram) - stats.cycles  # the bonus tokens are not drafts
            m["spec_decode_num_drafts"].inc(stats.cycles)
            m["spec_decode_num_draft_tokens"].inc(stats.draft_tokens)
            m["spec_decode_num_accepted_tokens"].inc(accepted)
            for position, count in enumerate(accepted_per_position(stats.histogram)):
                if count:
                    m["spec_decode_num_accepted_tokens_per_pos"].labels(str(position)).inc(count)
            m["spec_decode_ceiling_cycles"].labels(schedule).inc(stats.ceiling_cycles)
            if stats.copied_cycles:
                m["spec_decode_copied_cycles"].labels(schedule).inc(stats.copied_cycles)
            if not stats.grow_to:  # the stranded estimate reads one block size's histogram
                self._update_tau(stats.block_size, stats.histogram,
                                 whole=stats.draft_tokens == stats.cycles * (stats.block_size - 1))

    def _update_tau(self, block_size: int, histogram: list[int], whole: bool) -> None:
        """The pooled tau of the block size, and its stranded-tau estimate from the requests whose
        cycles all ran whole blocks (`whole`): in a narrowed cycle (prompt lookup's `--draft-width`)
        the ceiling is out of reach and the last positions are reached only by copies."""
        from trtspec.dbloom.histogram import Preflight

        def pool(into: dict[int, list[int]]) -> list[int]:
            into[block_size] = pool_histograms([into.get(block_size, []), cut_histogram(histogram, block_size)])
            return into[block_size]

        self.families["spec_decode_tau"].labels(str(block_size)).set(histogram_tau(pool(self._pooled)))
        if whole:
            pooled = pool(self._whole)
            estimate = Preflight(block_size, list(pooled), histogram_tau(pooled)).stranded_tau_estimate
            self.families["spec_decode_stranded_tau_estimate"].labels(str(block_size)).set(estimate)

    def observe_failed(self, reason: str) -> None:
        """A request that did not finish: "cancelled", "rejected" (queue full) or "error"."""
        self.families["request_failure"].labels(reason).inc()

    def observe_load(self, queued: int, running: int, block_sizes: tuple[int, ...] = (), slots: int = 0) -> None:
        """The engine's load (`Engine.load()`'s fields; `slots`: its cache slots, 0 if unknown)."""
        m = self.families
        with self._lock:
            m["num_requests_waiting"].set(queued)
            m["num_requests_running"].set(running)
            if slots:
                m["kv_cache_usage_perc"].set(running / slots)
                m["gpu_cache_usage_perc"].set(running / slots)
            counts: dict[str, int] = {}
            for name in (BlockChoice(size).name for size in block_sizes):  # AR spelled "AR", as everywhere
                counts[name] = counts.get(name, 0) + 1
            for size in self._running_sizes | counts.keys():
                m["num_requests_running_by_block_size"].labels(size).set(counts.get(size, 0))
            self._running_sizes |= counts.keys()

    def render(self) -> bytes:
        """The text exposition format (Content-Type: CONTENT_TYPE)."""
        return generate_latest(self.registry)
