"""The canary judgement on synthetic figures: worse on each figure, better, too few requests,
noise (a tiny absolute difference with a big ratio; one bad window between good ones), its
settings' checks, the loop with an injected sleep, and the metrics hook."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence

import pytest
from prometheus_client import CollectorRegistry

from aiserve.common.config import ConfigError, load_config
from services.gateway.canary_judge import (
    KEEP,
    CanaryJudge,
    CanaryMetrics,
    Decision,
    JudgeConfig,
    Pairing,
    Verdict,
    compare,
    judge_loop,
)
from services.gateway.config import GatewayConfig
from services.gateway.domain import VersionFigures

CONFIG = JudgeConfig()
STABLE = VersionFigures(requests=1000, error_rate=0.01, ttft_p50_ms=80, ttft_p95_ms=180, tpot_p50_ms=30,
                       tpot_p95_ms=45, ttft_samples=900, tpot_samples=900)


def canary(**changes: float) -> VersionFigures:
    """The stable figures with a canary's share of the requests and the given changes."""
    return dataclasses.replace(STABLE, **{"requests": 100, "ttft_samples": 90, "tpot_samples": 90, **changes})


@pytest.mark.parametrize(("changes", "reason"), [
    ({"error_rate": 0.05}, "canary error rate 5.0% > stable 1.0% + 2 points and x 1.5"),
    ({"ttft_p95_ms": 412}, "canary ttft p95 412 ms > stable 180 ms x 1.5 and + 50 ms"),
    ({"tpot_p95_ms": 90}, "canary tpot p95 90 ms > stable 45 ms x 1.5 and + 10 ms"),
], ids=["errors", "ttft", "tpot"])
def test_a_canary_worse_on_one_figure_is_rolled_back_naming_it(changes: dict[str, float], reason: str) -> None:
    assert compare(STABLE, canary(**changes), CONFIG) == Verdict(Decision.ROLL_BACK, reason)


def test_a_canary_as_good_or_better_is_kept() -> None:
    assert compare(STABLE, canary(), CONFIG) == KEEP
    better = canary(error_rate=0.0, ttft_p95_ms=90, tpot_p95_ms=20)
    assert compare(STABLE, better, CONFIG) == KEEP
    # Just inside each margin: worse, but not by enough.
    assert compare(STABLE, canary(error_rate=0.03, ttft_p95_ms=270, tpot_p95_ms=67), CONFIG) == KEEP


def test_both_the_ratio_and_the_absolute_margin_must_be_passed() -> None:
    fast = dataclasses.replace(STABLE, ttft_p95_ms=20, tpot_p95_ms=4, error_rate=0.0)
    # Three times slower, but only 40 ms / 8 ms: noise at these sizes.
    tiny = dataclasses.replace(fast, requests=100, ttft_p95_ms=60, tpot_p95_ms=12)
    assert compare(fast, tiny, CONFIG) == KEEP
    # 0% -> 1.5% errors: an infinite ratio, but 1.5 points is inside the 2-point margin.
    assert compare(fast, dataclasses.replace(tiny, error_rate=0.015), CONFIG) == KEEP
    # A high stable error rate: 2 points more is below x 1.5.
    assert compare(canary(error_rate=0.10), canary(error_rate=0.13), CONFIG) == KEEP
    assert compare(canary(error_rate=0.10), canary(error_rate=0.16), CONFIG).decision is Decision.ROLL_BACK


def test_too_few_requests_on_either_side_is_not_judged() -> None:
    worse = canary(error_rate=0.5)
    verdict = compare(STABLE, dataclasses.replace(worse, requests=20), CONFIG)
    assert (verdict.decision, verdict.needed) == (Decision.TOO_FEW, 30)
    assert "canary 20" in verdict.reason
    assert compare(dataclasses.replace(STABLE, requests=49), worse, CONFIG).needed == 1
    assert compare(STABLE, dataclasses.replace(worse, requests=50), CONFIG).decision is Decision.ROLL_BACK


def test_latency_with_too_few_model_served_requests_is_not_compared() -> None:
    # Enough requests, but most were cache hits: 10 first tokens are no p95.
    slow = canary(ttft_p95_ms=900, tpot_p95_ms=300, ttft_samples=10, tpot_samples=10)
    assert compare(STABLE, slow, CONFIG) == KEEP
    assert compare(STABLE, dataclasses.replace(slow, error_rate=0.2), CONFIG).decision is Decision.ROLL_BACK


def test_one_bad_window_between_good_ones_does_not_roll_back() -> None:
    judge = CanaryJudge(CONFIG)
    slow = canary(ttft_p95_ms=500)
    first = judge.judge(STABLE, slow)
    assert first.decision is Decision.KEEP and "ttft p95 500 ms" in first.reason and "1 of 2" in first.reason
    assert judge.judge(STABLE, canary()) == KEEP  # the streak ends
    assert judge.judge(STABLE, slow).decision is Decision.KEEP
    assert judge.judge(STABLE, slow).decision is Decision.ROLL_BACK  # two in a row


def test_a_window_with_too_few_requests_neither_ends_nor_extends_a_streak() -> None:
    judge = CanaryJudge(CONFIG)
    slow = canary(ttft_p95_ms=500)
    assert judge.judge(STABLE, slow).decision is Decision.KEEP
    assert judge.judge(STABLE, canary(requests=3)).decision is Decision.TOO_FEW
    assert judge.streak == 1
    assert judge.judge(STABLE, slow).decision is Decision.ROLL_BACK


def test_rollback_after_one_judges_at_once() -> None:
    judge = CanaryJudge(JudgeConfig(canary_rollback_after=1))
    assert judge.judge(STABLE, canary(error_rate=0.5)).decision is Decision.ROLL_BACK


def test_the_defaults_are_valid() -> None:
    CONFIG.validate()
    assert (CONFIG.canary_judge_interval_s, CONFIG.canary_window_s, CONFIG.canary_min_requests,
            CONFIG.canary_rollback_after) == (30, 300, 50, 2)


@pytest.mark.parametrize(("field", "value"), [
    ("canary_judge_interval_s", 0.5), ("canary_judge_interval_s", 3601), ("canary_window_s", 5),
    ("canary_min_requests", 0), ("canary_error_rate_margin", -0.01), ("canary_error_rate_margin", 1.5),
    ("canary_error_rate_ratio", 0.9), ("canary_ttft_p95_ratio", 101), ("canary_tpot_p95_ratio", 0),
    ("canary_ttft_p95_margin_ms", -1), ("canary_tpot_p95_margin_ms", 700_000), ("canary_rollback_after", 0),
])
def test_a_setting_out_of_range_is_named(field: str, value: float) -> None:
    with pytest.raises(ConfigError, match=f"^{field}: must be .*, got {value}$"):
        dataclasses.replace(CONFIG, **{field: value}).validate()


class Stop(Exception):
    """Ends the loop once the script of figures is used up."""


class Script:
    """The loop's collaborators: figures per judgement, rollbacks and verdicts seen, the sleeps."""

    def __init__(self, rounds: Sequence[Sequence[Pairing] | Exception], failing_rollbacks: int = 0) -> None:
        self.rounds = list(rounds)
        self.failing_rollbacks = failing_rollbacks
        self.sleeps: list[float] = []
        self.rollbacks: list[tuple[str, str]] = []
        self.verdicts: list[tuple[str, Decision]] = []

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        if len(self.sleeps) > len(self.rounds):
            raise Stop
        await asyncio.sleep(0)

    async def read_figures(self) -> Sequence[Pairing]:
        current = self.rounds[len(self.sleeps) - 1]
        if isinstance(current, Exception):
            raise current
        return current

    async def rollback(self, route: str, reason: str) -> None:
        if self.failing_rollbacks:
            self.failing_rollbacks -= 1
            raise ConnectionError("route table busy")
        self.rollbacks.append((route, reason))

    def on_verdict(self, model: str, verdict: Verdict) -> None:
        self.verdicts.append((model, verdict.decision))

    async def run(self, config: JudgeConfig = CONFIG) -> None:
        with pytest.raises(Stop):
            await asyncio.wait_for(judge_loop(config, self.read_figures, self.rollback, self.on_verdict,
                                              sleep=self.sleep), timeout=5)


def pair(figures: VersionFigures, canary_model: str = "m@2", route: str = "m") -> Pairing:
    return Pairing(route, "m@1", STABLE, canary_model, figures)


SLOW = canary(ttft_p95_ms=500)


async def test_the_loop_rolls_a_canary_back_after_two_worse_judgements() -> None:
    script = Script([[pair(SLOW)], [pair(SLOW)], []])
    await script.run()
    assert script.sleeps == [30, 30, 30, 30]
    assert script.rollbacks == [("m", "canary ttft p95 500 ms > stable 180 ms x 1.5 and + 50 ms")]
    assert script.verdicts == [("m@2", Decision.KEEP), ("m@2", Decision.ROLL_BACK)]


async def test_the_loop_survives_a_failed_read_and_retries_a_failed_rollback() -> None:
    script = Script([[pair(SLOW)], RuntimeError("no figures"), [pair(SLOW)], [pair(SLOW)]], failing_rollbacks=1)
    await script.run()
    assert len(script.rollbacks) == 1  # the first try failed; the next judgement rolled back
    assert script.verdicts == [("m@2", Decision.KEEP), ("m@2", Decision.ROLL_BACK)]


async def test_the_loop_keeps_a_streak_per_canary_and_forgets_canaries_that_left() -> None:
    script = Script([
        [pair(SLOW, "m@2"), pair(canary(), "m@3")],
        [pair(canary(), "m@3")],  # m@2 left (weight 0 or removed) ...
        [pair(SLOW, "m@2"), pair(SLOW, "m@3")],  # ... so its streak starts again
    ])
    await script.run()
    assert script.rollbacks == []
    assert [d for _, d in script.verdicts] == [Decision.KEEP] * 5


async def test_one_rollback_per_route_even_with_two_bad_canaries() -> None:
    worse = canary(error_rate=0.5)
    script = Script([[pair(worse, "m@2"), pair(worse, "m@3"), pair(worse, "x@2", route="x")]])
    await script.run(JudgeConfig(canary_rollback_after=1))
    assert [route for route, _ in script.rollbacks] == ["m", "x"]
    assert script.verdicts == [("m@2", Decision.ROLL_BACK), ("x@2", Decision.ROLL_BACK)]


def test_the_metrics_count_verdicts_and_rollbacks_by_model() -> None:
    registry = CollectorRegistry()
    metrics = CanaryMetrics(registry)
    metrics.on_verdict("m@2", KEEP)
    metrics.on_verdict("m@2", Verdict(Decision.ROLL_BACK, "worse"))
    metrics.on_verdict("m@3", Verdict(Decision.TOO_FEW, "few", 10))
    value = registry.get_sample_value
    assert value("aiserve_gateway_canary_rollbacks_total", {"model": "m@2"}) == 1
    assert value("aiserve_gateway_canary_rollbacks_total", {"model": "m@3"}) is None
    assert value("aiserve_gateway_canary_judgements_total", {"model": "m@2", "decision": "keep"}) == 1
    assert value("aiserve_gateway_canary_judgements_total", {"model": "m@3", "decision": "too_few"}) == 1


def test_the_settings_embed_in_the_gateways_under_their_own_names() -> None:
    """Each name is unique among the gateway's settings, so AISERVE_GATEWAY_CANARY_* reaches it."""
    config = load_config(GatewayConfig, "gateway", [], {"AISERVE_GATEWAY_CANARY_WINDOW_S": "120",
                                                        "AISERVE_GATEWAY_CANARY_ROLLBACK_AFTER": "3"})
    assert (config.judge.canary_window_s, config.judge.canary_rollback_after) == (120.0, 3)
    with pytest.raises(ConfigError, match="^canary_window_s: must be"):
        load_config(GatewayConfig, "gateway", [], {"AISERVE_GATEWAY_CANARY_WINDOW_S": "1"})
