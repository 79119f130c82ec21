"""Whether a canary version is worse than its route's stable version, and the loop that rolls a
worse one back (docs/rollouts.md, "The judgement"; docs/decisions.md, decision 50).

``compare`` is the rule on one pair of windows: too few requests on either side -> TOO_FEW;
else the first figure the canary is worse on (error rate, TTFT p95, TPOT p95) -> ROLL_BACK
naming the figure, both values and the margins; else KEEP. "Worse" needs both a ratio and an
absolute margin, so a tiny difference between two small numbers never trips a ratio.
``CanaryJudge`` holds one canary's streak: it rolls back only after ``canary_rollback_after``
worse judgements in a row. ``judge_loop`` judges every canary every ``canary_judge_interval_s``
and rolls back through a callback; ``CanaryMetrics.on_verdict`` counts verdicts and rollbacks.

No grpc, no pb: the gateway gives the loop plain figures and callbacks.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter

from aiserve.common.logging import get_logger
from services.gateway.domain import VersionFigures
from services.gateway.judge_config import JudgeConfig

log = get_logger("canary_judge")


class Decision(enum.Enum):
    KEEP = "keep"
    ROLL_BACK = "roll_back"
    TOO_FEW = "too_few"


@dataclass(frozen=True, slots=True)
class Verdict:
    """A judgement of one canary. ``reason`` names the figure, both values and the margins (for
    ROLL_BACK; for KEEP while a streak of worse judgements is under way); ``needed``: the
    requests the short side still lacks (TOO_FEW)."""

    decision: Decision
    reason: str = ""
    needed: int = 0


KEEP = Verdict(Decision.KEEP)


def compare(stable: VersionFigures, canary: VersionFigures, config: JudgeConfig) -> Verdict:
    """The rule on one pair of windows, without any memory of earlier ones."""
    needed = max(config.canary_min_requests - stable.requests, config.canary_min_requests - canary.requests)
    if needed > 0:
        return Verdict(Decision.TOO_FEW, f"each side needs {config.canary_min_requests} requests in the window: "
                                         f"stable has {stable.requests}, canary {canary.requests}", needed)
    for reason in (_worse_errors(stable, canary, config), _worse_ttft(stable, canary, config),
                   _worse_tpot(stable, canary, config)):
        if reason:
            return Verdict(Decision.ROLL_BACK, reason)
    return KEEP


def _worse_errors(stable: VersionFigures, canary: VersionFigures, config: JudgeConfig) -> str:
    s, c = stable.error_rate, canary.error_rate
    if c > s + config.canary_error_rate_margin and c > s * config.canary_error_rate_ratio:
        return (f"canary error rate {c:.1%} > stable {s:.1%} + {config.canary_error_rate_margin * 100:g} points "
                f"and x {config.canary_error_rate_ratio:g}")
    return ""


def _worse_ttft(stable: VersionFigures, canary: VersionFigures, config: JudgeConfig) -> str:
    if min(stable.ttft_samples, canary.ttft_samples) < config.canary_min_requests:
        return ""  # mostly cache hits or failures: too few first tokens to compare
    return _worse_latency("ttft p95", stable.ttft_p95_ms, canary.ttft_p95_ms, config.canary_ttft_p95_ratio,
                          config.canary_ttft_p95_margin_ms)


def _worse_tpot(stable: VersionFigures, canary: VersionFigures, config: JudgeConfig) -> str:
    if min(stable.tpot_samples, canary.tpot_samples) < config.canary_min_requests:
        return ""
    return _worse_latency("tpot p95", stable.tpot_p95_ms, canary.tpot_p95_ms, config.canary_tpot_p95_ratio,
                          config.canary_tpot_p95_margin_ms)


def _worse_latency(figure: str, s: float, c: float, ratio: float, margin_ms: float) -> str:
    if c > s * ratio and c > s + margin_ms:
        return f"canary {figure} {c:.0f} ms > stable {s:.0f} ms x {ratio:g} and + {margin_ms:g} ms"
    return ""


class CanaryJudge:
    """One canary's judgements: ROLL_BACK only after ``canary_rollback_after`` worse ones in a row.

    A better window ends the streak; a TOO_FEW window leaves it as it is (no evidence either
    way, e.g. a lull in traffic)."""

    def __init__(self, config: JudgeConfig) -> None:
        self.config = config
        self.streak = 0
        """Worse judgements in a row so far."""

    def judge(self, stable: VersionFigures, canary: VersionFigures) -> Verdict:
        verdict = compare(stable, canary, self.config)
        if verdict.decision is Decision.TOO_FEW:
            return verdict
        if verdict.decision is Decision.KEEP:
            self.streak = 0
            return verdict
        self.streak += 1
        if self.streak >= self.config.canary_rollback_after:
            return verdict
        return Verdict(Decision.KEEP, f"{verdict.reason} ({self.streak} of "
                                      f"{self.config.canary_rollback_after} in a row to roll back)")


@dataclass(frozen=True, slots=True)
class Pairing:
    """One canary of a route (with weight above 0) and the route's stable version, with figures."""

    route: str
    stable: str
    """name@version of the stable version."""
    stable_figures: VersionFigures
    canary: str
    canary_figures: VersionFigures


ReadFigures = Callable[[], Awaitable[Sequence[Pairing]]]
Rollback = Callable[[str, str], Awaitable[None]]
"""``rollback(route, reason)``: the route's canaries to weight 0, as the Admin Rollback rpc."""
OnVerdict = Callable[[str, Verdict], None]
"""``on_verdict(canary model, verdict)`` after every judgement that took effect."""


async def judge_loop(config: JudgeConfig, read_figures: ReadFigures, rollback: Rollback, on_verdict: OnVerdict,
                     sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
    """Every ``canary_judge_interval_s``: judge every canary ``read_figures`` gives and roll back
    each route with a ROLL_BACK; ``on_verdict`` hears every verdict that took effect (a
    ROLL_BACK once its rollback is done). Runs until cancelled. A failing read or rollback is
    logged and tried again at the next judgement (the streak stays, so a failed rollback is
    retried then)."""
    judges: dict[tuple[str, str], CanaryJudge] = {}
    while True:
        await sleep(config.canary_judge_interval_s)
        try:
            pairings = await read_figures()
        except Exception as exc:  # noqa: BLE001 - the loop must outlive a bad read
            log.error("canary_figures_failed", error=repr(exc))
            continue
        judges = {_key(p): judges.get(_key(p)) or CanaryJudge(config) for p in pairings}  # forget the others
        rolled_back: set[str] = set()
        for pairing in pairings:
            if pairing.route in rolled_back:  # its rollback took every canary of the route to 0
                del judges[_key(pairing)]
            elif await _judge_one(pairing, judges[_key(pairing)], rollback, on_verdict):
                rolled_back.add(pairing.route)
                del judges[_key(pairing)]  # given weight again later, it starts a new streak


def _key(pairing: Pairing) -> tuple[str, str]:
    """A streak belongs to one canary against one stable version (a promote starts a new one)."""
    return pairing.stable, pairing.canary


async def _judge_one(pairing: Pairing, judge: CanaryJudge, rollback: Rollback, on_verdict: OnVerdict) -> bool:
    """Judge one canary, roll its route back if it must; True when it was rolled back."""
    verdict = judge.judge(pairing.stable_figures, pairing.canary_figures)
    if verdict.decision is Decision.ROLL_BACK:
        log.warning("canary_rollback", route=pairing.route, canary=pairing.canary, stable=pairing.stable,
                    reason=verdict.reason)
        try:
            await rollback(pairing.route, verdict.reason)
        except Exception as exc:  # noqa: BLE001 - judged again at the next interval
            log.error("canary_rollback_failed", route=pairing.route, canary=pairing.canary, error=repr(exc))
            return False
    on_verdict(pairing.canary, verdict)
    return verdict.decision is Decision.ROLL_BACK


class CanaryMetrics:
    """The judgement's Prometheus counters, in the gateway server's registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.judgements = Counter("aiserve_gateway_canary_judgements_total", "Canary judgements by verdict",
                                  ["model", "decision"], registry=registry)
        self.rollbacks = Counter("aiserve_gateway_canary_rollbacks_total",
                                 "Canaries the gateway's judgement rolled back", ["model"], registry=registry)

    def on_verdict(self, model: str, verdict: Verdict) -> None:
        """Count one verdict on canary ``model`` (pass as judge_loop's ``on_verdict``)."""
        self.judgements.labels(model, verdict.decision.value).inc()
        if verdict.decision is Decision.ROLL_BACK:
            self.rollbacks.labels(model).inc()
