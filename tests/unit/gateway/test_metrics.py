"""The gateway's latency histograms: SLO targets as bucket bounds, and what each one observes."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from aiserve.common.finish import FinishReason
from services.gateway.accounting import CallOutcome
from services.gateway.config import GatewayConfig
from services.gateway.domain import Final, UsageRecord
from services.gateway.metrics import GatewayMetrics, with_targets


def final(completion_tokens: int, ttft_ms: int, total_ms: int, queue_ms: int = 30) -> Final:
    return Final(FinishReason.STOP, UsageRecord(prompt_tokens=10, completion_tokens=completion_tokens, cache_hit=False,
                                                queue_ms=queue_ms, ttft_ms=ttft_ms, total_ms=total_ms, model="m@1",
                                                cost_micros=5))


def test_targets_become_bucket_bounds_once_and_in_order() -> None:
    assert with_targets((0.1, 1.0, 5.0), 1.7, 1.0) == [0.1, 1.0, 1.7, 5.0]


def test_a_generation_is_observed_in_each_histogram() -> None:
    registry = CollectorRegistry()
    metrics = GatewayMetrics(registry, GatewayConfig(slo_ttft_s=1.7, slo_tpot_s=0.06, slo_e2e_s=9.0))
    metrics.record(final(completion_tokens=5, ttft_ms=200, total_ms=1000))
    labels = {"model": "m@1"}
    value = registry.get_sample_value
    assert value("aiserve_gateway_ttft_seconds_sum", labels) == pytest.approx(0.2)
    assert value("aiserve_gateway_ttft_seconds_bucket", {**labels, "le": "1.7"}) == 1  # the target is a bound
    assert value("aiserve_gateway_e2e_seconds_bucket", {**labels, "le": "9.0"}) == 1
    assert value("aiserve_gateway_queue_seconds_sum", labels) == pytest.approx(0.03)
    assert value("aiserve_gateway_output_tokens_sum", labels) == 5
    # (1000 - 200) ms over the 4 tokens after the first
    assert value("aiserve_gateway_time_per_output_token_seconds_sum", labels) == pytest.approx(0.2)
    assert value("aiserve_gateway_time_per_output_token_seconds_bucket", {**labels, "le": "0.06"}) == 0


def test_a_one_token_answer_has_no_time_per_token() -> None:
    registry = CollectorRegistry()
    GatewayMetrics(registry).record(final(completion_tokens=1, ttft_ms=100, total_ms=100))
    assert registry.get_sample_value("aiserve_gateway_time_per_output_token_seconds_count", {"model": "m@1"}) is None
    assert registry.get_sample_value("aiserve_gateway_ttft_seconds_count", {"model": "m@1"}) == 1


def test_slo_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="slo_ttft_s"):
        GatewayConfig(slo_ttft_s=0).validate()


def test_calls_are_counted_by_model_tier_and_code_and_bill_by_tier() -> None:
    registry = CollectorRegistry()
    metrics = GatewayMetrics(registry)
    metrics.count_call(CallOutcome("m@1", "paid", "OK", 10, 5, 300))
    metrics.count_call(CallOutcome("m@1", "paid", "CANCELLED", 10, 2, 120))
    metrics.count_call(CallOutcome("none", "free", "RESOURCE_EXHAUSTED", 0, 0, 0))
    value = registry.get_sample_value
    assert value("aiserve_gateway_calls_total", {"model": "m@1", "tier": "paid", "code": "OK"}) == 1
    assert value("aiserve_gateway_calls_total", {"model": "m@1", "tier": "paid", "code": "CANCELLED"}) == 1
    assert value("aiserve_gateway_calls_total", {"model": "none", "tier": "free", "code": "RESOURCE_EXHAUSTED"}) == 1
    assert value("aiserve_gateway_tokens_total", {"kind": "prompt", "tier": "paid"}) == 20
    assert value("aiserve_gateway_tokens_total", {"kind": "completion", "tier": "paid"}) == 7
    assert value("aiserve_gateway_cost_micros_total", {"tier": "paid"}) == 420
    assert value("aiserve_gateway_cost_micros_total", {"tier": "free"}) == 0


def test_feedback_is_counted_by_kind_every_kind_from_zero() -> None:
    registry = CollectorRegistry()
    metrics = GatewayMetrics(registry)
    assert registry.get_sample_value("aiserve_gateway_feedback_total", {"kind": "bad"}) == 0
    metrics.count_feedback("bad")
    metrics.count_feedback("bad")
    metrics.count_feedback("abandoned")
    assert registry.get_sample_value("aiserve_gateway_feedback_total", {"kind": "bad"}) == 2
    assert registry.get_sample_value("aiserve_gateway_feedback_total", {"kind": "abandoned"}) == 1
    assert registry.get_sample_value("aiserve_gateway_feedback_total", {"kind": "good"}) == 0
