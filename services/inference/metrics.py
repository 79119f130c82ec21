"""The inference service's Prometheus collectors, read at scrape time: the engine
(``EngineStats`` and the step histograms of ``engine_stats.py``), the CUDA device, and a wrapper
that gives every one of them the ``model`` label (the name@version this process serves), so a
dashboard can tell a canary's replicas from the stable version's."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from aiserve.common.server import rss_bytes
from services.inference.batch_engine import BatchEngine
from services.inference.engine_stats import Distribution

P = "aiserve_inference_"


def histogram(family: HistogramMetricFamily, d: Distribution) -> HistogramMetricFamily:
    """``family`` (unlabelled) holding ``d``: its bounds as ``le``, then +Inf."""
    bounds = [*(f"{float(b)}" for b in d.bounds), "+Inf"]
    family.add_metric([], list(zip(bounds, d.cumulative, strict=True)), d.total)
    return family


class EngineCollector(Collector):
    """Prometheus view of ``BatchEngine.stats()`` and its step histograms, read at scrape time
    (no per-step updates of a metric object)."""

    def __init__(self, engine: BatchEngine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        """One snapshot of the engine as metric families (called by the registry at scrape time)."""
        s = self.engine.stats()
        rss = rss_bytes()
        yield GaugeMetricFamily(P + "running", "Sequences in the running batch", value=s.num_running)
        yield GaugeMetricFamily(P + "queue_length", "Requests waiting for the model", value=s.num_waiting)
        yield GaugeMetricFamily(P + "kv_total_bytes", "KV cache size (slots + prefix store)", value=s.kv_total_bytes)
        yield GaugeMetricFamily(P + "kv_used_bytes", "KV cache bytes held now", value=s.kv_used_bytes)
        yield GaugeMetricFamily(P + "kv_free_bytes", "KV cache bytes free now", value=s.kv_free_bytes)
        yield GaugeMetricFamily(P + "kv_share_of_rss", "KV cache size / resident memory",
                                value=s.kv_total_bytes / rss if rss else 0.0)
        yield GaugeMetricFamily(P + "kv_usage_ratio", "KV cache in use, 0-1 (used / total bytes; what "
                                "refuse_long_above compares)", value=s.kv_used_bytes / s.kv_total_bytes
                                if s.kv_total_bytes else 0.0)
        yield CounterMetricFamily(P + "prefix_lookups", "Prefix-cache lookups", value=s.prefix_lookups)
        yield CounterMetricFamily(P + "prefix_hits", "Prefix-cache lookups that hit", value=s.prefix_hits)
        yield CounterMetricFamily(P + "prefix_hit_tokens", "Prompt tokens reused", value=s.prefix_hit_tokens)
        yield CounterMetricFamily(P + "steps", "Engine steps", value=s.num_steps)
        yield CounterMetricFamily(P + "generated_tokens", "Tokens generated", value=s.num_generated_tokens)
        yield CounterMetricFamily(P + "preemptions", "Sequences preempted", value=s.num_preemptions)
        yield CounterMetricFamily(P + "step_errors", "Engine steps that failed", value=s.num_step_errors)
        yield CounterMetricFamily(P + "draft_tokens", "Draft tokens computed (speculative decoding)",
                                  value=s.num_draft_tokens)
        yield CounterMetricFamily(P + "accepted_draft_tokens", "Draft tokens the model confirmed",
                                  value=s.num_accepted_draft_tokens)
        yield histogram(HistogramMetricFamily(P + "step_seconds", "Seconds an engine step took on the device "
                                              "(inputs, forward, sampling)"), self.engine.steps.seconds())
        yield histogram(HistogramMetricFamily(P + "step_tokens", "Tokens an engine step computed "
                                              "(prompt chunks, decode tokens, drafts)"), self.engine.steps.tokens())


@dataclass(frozen=True, slots=True)
class DeviceFigures:
    """A GPU's memory as torch's allocator sees it, and its utilisation (None: unknown)."""

    allocated_bytes: int
    reserved_bytes: int
    total_bytes: int
    utilization: float | None
    """Share of the last sample period a kernel ran, 0..1 (NVML; None without it)."""


def cuda_figures(device: torch.device) -> DeviceFigures:
    """``device``'s figures from torch.cuda; utilisation only where NVML answers (pynvml)."""
    try:
        utilization: float | None = torch.cuda.utilization(device) / 100
    except Exception:  # noqa: BLE001 - pynvml missing or NVML unusable: the rest is still true
        utilization = None
    return DeviceFigures(int(torch.cuda.memory_allocated(device)), int(torch.cuda.memory_reserved(device)),
                         int(torch.cuda.get_device_properties(device).total_memory), utilization)


class DeviceCollector(Collector):
    """The GPU's memory and utilisation at scrape time (registered on CUDA only); ``read`` is
    ``cuda_figures`` in the service, a fake in tests (no GPU needed to test the export)."""

    def __init__(self, read: Callable[[], DeviceFigures]) -> None:
        self._read = read

    def collect(self) -> Iterator[Metric]:
        f = self._read()
        yield GaugeMetricFamily(P + "gpu_memory_allocated_bytes", "GPU memory held by tensors (torch allocator)",
                                value=f.allocated_bytes)
        yield GaugeMetricFamily(P + "gpu_memory_reserved_bytes", "GPU memory reserved by torch's caching allocator",
                                value=f.reserved_bytes)
        yield GaugeMetricFamily(P + "gpu_memory_total_bytes", "The GPU's memory", value=f.total_bytes)
        if f.utilization is not None:
            yield GaugeMetricFamily(P + "gpu_utilization_ratio", "Share of the last sample period a kernel ran "
                                    "on the GPU (NVML), 0..1", value=f.utilization)


class WithLabels(Collector):
    """``inner``'s metrics with ``labels`` added to every sample (a constant ``model`` label for
    all of a process's inference metrics, without each metric repeating it)."""

    def __init__(self, inner: Collector, labels: Mapping[str, str]) -> None:
        self._inner, self._labels = inner, dict(labels)

    def collect(self) -> Iterable[Metric]:
        for family in self._inner.collect():
            family.samples = [s._replace(labels={**self._labels, **s.labels}) for s in family.samples]
            yield family
