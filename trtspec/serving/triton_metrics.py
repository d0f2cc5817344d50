"""The serving metrics through Triton: `trtspec.serving.metrics` as python-backend custom metrics.

Triton serves its own Prometheus endpoint (the metrics port, `/metrics`); a python-backend model
adds families to it with `pb_utils.MetricFamily`. `TritonMetrics` is `ServingMetrics` (the same
observations, families, names, help, labels and buckets, declared once in FAMILIES) with every
family mirrored there instead of in a prometheus_client registry. Each model instance is its own
process with its own engine, so every series also carries `model` and `instance` labels.
"""

from __future__ import annotations

from trtspec.serving.metrics import FAMILIES, PREFIX, Family, OneSeries, ServingMetrics


class _Series:
    """One labelled series of a Triton metric family, with prometheus_client's method names."""

    def __init__(self, metric):
        self.metric = metric

    def inc(self, amount: float = 1.0) -> None:
        self.metric.increment(float(amount))

    def set(self, value: float) -> None:
        self.metric.set(float(value))

    def observe(self, value: float) -> None:
        self.metric.observe(float(value))


class _Family(OneSeries):
    """A Triton metric family that answers like a prometheus_client metric: `.labels(*values)`
    for a labelled family, `.inc()`/`.set()`/`.observe()` for one without labels."""

    def __init__(self, pb_utils, family: Family, base: dict[str, str]):
        kinds = {"counter": pb_utils.MetricFamily.COUNTER, "gauge": pb_utils.MetricFamily.GAUGE,
                 "histogram": pb_utils.MetricFamily.HISTOGRAM}
        # prometheus_client exposes a counter as NAME_total; Triton exposes the name it is given
        name = PREFIX + family.name + ("_total" if family.kind == "counter" else "")
        self.family = pb_utils.MetricFamily(name=name, description=family.help, kind=kinds[family.kind])
        self.spec, self.base = family, base
        self.series: dict[tuple[str, ...], _Series] = {}

    def labels(self, *values) -> _Series:
        key = tuple(map(str, values))
        series = self.series.get(key)
        if series is None:
            if len(key) != len(self.spec.labels):
                raise ValueError(f"{self.spec.name} takes labels {self.spec.labels}, got {key}")
            labels = {**self.base, **dict(zip(self.spec.labels, key))}
            extra = {"buckets": list(self.spec.buckets)} if self.spec.kind == "histogram" else {}
            series = self.series[key] = _Series(self.family.Metric(labels=labels, **extra))
        return series

class TritonMetrics(ServingMetrics):
    """ServingMetrics whose families are Triton custom metrics of one model instance."""

    def __init__(self, pb_utils, model: str, instance: str):
        super().__init__()  # the bookkeeping (lock, pooled histograms); its own registry goes unused
        base = {"model": model, "instance": instance}
        self.families = {family.name: _Family(pb_utils, family, base) for family in FAMILIES}
