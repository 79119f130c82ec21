"""The inference collectors without a model: step distributions, the GPU gauges (a fake reader
stands in for torch.cuda, so the CUDA branch is tested on any machine) and the model label."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch
from prometheus_client import Counter, generate_latest
from prometheus_client.core import HistogramMetricFamily, Metric
from prometheus_client.registry import CollectorRegistry

from services.inference.engine_stats import STEP_SECONDS_BOUNDS, StepStats
from services.inference.metrics import DeviceCollector, DeviceFigures, WithLabels, cuda_figures, histogram

GIB = 1 << 30


def test_steps_fall_in_the_bucket_of_their_upper_bound_cumulatively() -> None:
    steps = StepStats()
    for elapsed_s, tokens in ((0.004, 1), (0.005, 8), (0.2, 300), (99.0, 5000)):
        steps.record(elapsed_s, tokens)
    seconds = steps.seconds()
    by_bound = dict(zip(seconds.bounds, seconds.cumulative, strict=False))
    assert by_bound[0.005] == 2  # 0.005 is <= its bound, as Prometheus' le says
    assert by_bound[0.1] == 2 and by_bound[0.25] == 3 and by_bound[30.0] == 3
    assert seconds.count == 4 and len(seconds.cumulative) == len(STEP_SECONDS_BOUNDS) + 1  # 99 s: only +Inf
    assert seconds.total == pytest.approx(99.209)
    per_step = steps.tokens()
    assert (per_step.count, per_step.total) == (4, 5309)


def test_a_distribution_is_exported_as_a_prometheus_histogram() -> None:
    steps = StepStats()
    steps.record(0.02, 16)
    steps.record(0.3, 64)
    registry = CollectorRegistry()

    class Steps:
        def collect(self) -> Iterator[Metric]:
            yield histogram(HistogramMetricFamily("aiserve_inference_step_seconds", "step time"), steps.seconds())

    registry.register(Steps())
    value = registry.get_sample_value
    assert value("aiserve_inference_step_seconds_bucket", {"le": "0.025"}) == 1
    assert value("aiserve_inference_step_seconds_bucket", {"le": "0.5"}) == 2
    assert value("aiserve_inference_step_seconds_bucket", {"le": "+Inf"}) == 2
    assert value("aiserve_inference_step_seconds_count") == 2
    assert value("aiserve_inference_step_seconds_sum") == pytest.approx(0.32)


def test_records_from_one_thread_and_reads_from_another_stay_consistent() -> None:
    """The engine's worker records while a scrape reads: each read's sum and count agree."""
    steps = StepStats()
    done = threading.Event()

    def work() -> None:
        for _ in range(50_000):
            steps.record(0.01, 1)  # one token a step: a consistent read has sum == count
        done.set()

    worker = threading.Thread(target=work)
    worker.start()
    reads = 0
    while not done.is_set():
        seen = steps.tokens()
        assert seen.total == seen.count
        reads += 1
    worker.join()
    assert steps.seconds().count == steps.tokens().count == 50_000 and reads > 0


def test_the_gpu_gauges_come_from_the_reader() -> None:
    registry = CollectorRegistry()
    registry.register(DeviceCollector(lambda: DeviceFigures(3 * GIB, 4 * GIB, 80 * GIB, 0.42)))
    value = registry.get_sample_value
    assert value("aiserve_inference_gpu_memory_allocated_bytes") == 3 * GIB
    assert value("aiserve_inference_gpu_memory_reserved_bytes") == 4 * GIB
    assert value("aiserve_inference_gpu_memory_total_bytes") == 80 * GIB
    assert value("aiserve_inference_gpu_utilization_ratio") == pytest.approx(0.42)


def test_without_nvml_the_utilisation_is_left_out_not_reported_as_zero() -> None:
    registry = CollectorRegistry()
    registry.register(DeviceCollector(lambda: DeviceFigures(GIB, GIB, 16 * GIB, None)))
    assert registry.get_sample_value("aiserve_inference_gpu_memory_allocated_bytes") == GIB
    assert b"aiserve_inference_gpu_utilization_ratio" not in generate_latest(registry)


def test_every_sample_of_the_wrapped_registry_gets_the_model_label_each_scrape() -> None:
    own, registry = CollectorRegistry(), CollectorRegistry()
    failures = Counter("aiserve_inference_probe_failures", "failures", registry=own)
    registry.register(DeviceCollector(lambda: DeviceFigures(GIB, GIB, 16 * GIB, None)))  # not wrapped
    registry.register(WithLabels(own, {"model": "m@1"}))
    failures.inc()
    assert registry.get_sample_value("aiserve_inference_probe_failures_total", {"model": "m@1"}) == 1
    assert registry.get_sample_value("aiserve_inference_probe_failures_total") is None
    failures.inc()  # a second scrape: labelled again, and the metric object itself untouched
    assert registry.get_sample_value("aiserve_inference_probe_failures_total", {"model": "m@1"}) == 2
    assert own.get_sample_value("aiserve_inference_probe_failures_total") == 2
    assert registry.get_sample_value("aiserve_inference_gpu_memory_total_bytes") == 16 * GIB


def test_cuda_figures_reads_torch_cuda_and_survives_a_missing_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.cuda's readers replaced (no GPU here): units converted, NVML's absence is None."""
    device = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d: 3 * GIB if d == device else 0)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d: 4 * GIB)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(total_memory=80 * GIB))
    monkeypatch.setattr(torch.cuda, "utilization", lambda d: 37)
    assert cuda_figures(device) == DeviceFigures(3 * GIB, 4 * GIB, 80 * GIB, 0.37)

    def no_nvml(d: torch.device) -> int:
        raise ModuleNotFoundError("pynvml does not seem to be installed")

    monkeypatch.setattr(torch.cuda, "utilization", no_nvml)
    assert cuda_figures(device).utilization is None
