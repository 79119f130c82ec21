"""The canary judgement's settings, apart from the rule (canary_judge.py) so that the gateway's
settings can embed them without importing the rule's domain types."""

from __future__ import annotations

from dataclasses import dataclass

from aiserve.common.config import require


@dataclass(frozen=True, slots=True)
class JudgeConfig:
    """When and how the gateway judges its canaries (services/gateway/canary_judge.py)."""

    canary_judge_interval_s: float = 30.0
    """Seconds between two judgements of every canary. 1..3600."""
    canary_window_s: float = 300.0
    """Seconds of finished requests each judgement compares (the figures' window). 10..86400."""
    canary_min_requests: int = 50
    """Requests each side needs in the window before it is judged (else TOO_FEW). 1..1000000."""
    canary_error_rate_margin: float = 0.02
    """The canary's error rate must exceed the stable one by more than this (absolute, 0.02 = 2
    percentage points) ... 0..1."""
    canary_error_rate_ratio: float = 1.5
    """... and be more than this many times the stable one to count as worse. 1..100."""
    canary_ttft_p95_ratio: float = 1.5
    """The canary's TTFT p95 must be more than this many times the stable one ... 1..100."""
    canary_ttft_p95_margin_ms: float = 50.0
    """... and more than this many ms above it to count as worse. 0..600000."""
    canary_tpot_p95_ratio: float = 1.5
    """The canary's time per output token p95 must be more than this many times the stable one
    ... 1..100."""
    canary_tpot_p95_margin_ms: float = 10.0
    """... and more than this many ms above it to count as worse. 0..600000."""
    canary_rollback_after: int = 2
    """Worse judgements in a row that roll the canary back (1 = the first). 1..100."""

    def validate(self) -> None:
        """Raise ConfigError naming the first setting out of range and its limit."""
        self._within("canary_judge_interval_s", 1, 3600, " s")
        self._within("canary_window_s", 10, 86_400, " s")
        self._within("canary_min_requests", 1, 1_000_000)
        self._within("canary_error_rate_margin", 0, 1)
        for name in ("canary_error_rate_ratio", "canary_ttft_p95_ratio", "canary_tpot_p95_ratio"):
            self._within(name, 1, 100)
        for name in ("canary_ttft_p95_margin_ms", "canary_tpot_p95_margin_ms"):
            self._within(name, 0, 600_000, " ms")
        self._within("canary_rollback_after", 1, 100)

    def _within(self, name: str, low: float, high: float, unit: str = "") -> None:
        value = getattr(self, name)
        require(low <= value <= high, f"{name}: must be {low}..{high}{unit}, got {value}")
