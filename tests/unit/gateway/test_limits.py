"""Rate limits and budgets reject exactly at their limits (a fake clock drives the refill)."""

from __future__ import annotations

import math

import pytest

from aiserve.common.errors import ResourceExhausted
from services.gateway.limits import Limits, TokenBucket, period_bounds
from services.gateway.tenants import Tenant, Tier

JAN_15 = 1736942400.0  # 2025-01-15T12:00:00Z


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0
        self.wall = JAN_15

    def tick(self, seconds: float) -> None:
        self.now += seconds
        self.wall += seconds


def plan(rpm: int = 60, tpm: int = 1000, budget: int = 0) -> Tier:
    return Tier("free", 0, rpm, tpm, budget)


def make_limits(clock: Clock, spent: int = 0, period: str = "month") -> Limits:
    return Limits(period, lambda tenant, since_ms: spent, clock=lambda: clock.now, wall=lambda: clock.wall)


ACME = Tenant("acme", "free")


def test_token_bucket_refills_continuously_and_never_above_capacity() -> None:
    bucket = TokenBucket(10, 1.0, now=0.0)
    assert bucket.take(10, 0.0) == 0.0
    assert bucket.take(1, 0.0) == pytest.approx(1.0)  # seconds until one token is back
    assert bucket.take(1, 1.0) == 0.0
    bucket.give(100, 1.0)
    assert bucket.level == 10
    assert math.isinf(bucket.take(11, 1.0))


def test_requests_per_minute_rejects_exactly_the_first_request_over_the_limit() -> None:
    clock = Clock()
    limits = make_limits(clock)
    for _ in range(3):
        limits.admit(ACME, plan(rpm=3))
    with pytest.raises(ResourceExhausted) as info:
        limits.admit(ACME, plan(rpm=3))
    assert "requests_per_minute limit of 3" in info.value.message
    assert info.value.retry_after_ms == 20_000  # one request per 20 s comes back
    assert info.value.trailing_metadata == (("retry-after-ms", "20000"),)
    clock.tick(19.999)
    with pytest.raises(ResourceExhausted):
        limits.admit(ACME, plan(rpm=3))
    clock.tick(0.001)
    limits.admit(ACME, plan(rpm=3))


def test_tenants_have_separate_buckets() -> None:
    limits = make_limits(Clock())
    limits.admit(ACME, plan(rpm=1))
    limits.admit(Tenant("other", "free"), plan(rpm=1))
    with pytest.raises(ResourceExhausted):
        limits.admit(ACME, plan(rpm=1))


def test_tokens_per_minute_are_reserved_then_settled() -> None:
    clock = Clock()
    limits = make_limits(clock)
    first = limits.reserve(ACME, plan(tpm=100), tokens=60, cost_micros=0)
    with pytest.raises(ResourceExhausted) as info:  # 60 reserved + 41 > 100
        limits.reserve(ACME, plan(tpm=100), tokens=41, cost_micros=0)
    assert "tokens_per_minute limit of 100" in info.value.message
    second = limits.reserve(ACME, plan(tpm=100), tokens=40, cost_micros=0)  # exactly at the limit
    limits.settle(first, tokens=20, cost_micros=0)  # used 20 of 60: 40 come back
    limits.settle(first, tokens=0, cost_micros=0)  # idempotent
    third = limits.reserve(ACME, plan(tpm=100), tokens=40, cost_micros=0)
    with pytest.raises(ResourceExhausted):
        limits.reserve(ACME, plan(tpm=100), tokens=1, cost_micros=0)
    # the two live reservations hold the whole minute: 40 + 40 of 100, with 20 used by the first
    assert first.is_settled and (second.tokens, third.tokens) == (40, 40)
    assert not second.is_settled and not third.is_settled
    assert limits._tokens["acme"].level == pytest.approx(0.0)


def test_a_request_larger_than_the_whole_limit_gets_no_retry_hint() -> None:
    limits = make_limits(Clock())
    with pytest.raises(ResourceExhausted) as info:
        limits.reserve(ACME, plan(tpm=100), tokens=101, cost_micros=0)
    assert info.value.retry_after_ms is None and info.value.trailing_metadata == ()


def test_budget_admits_exactly_up_to_the_limit_counting_in_flight_reservations() -> None:
    clock = Clock()
    limits = make_limits(clock, spent=400)  # already billed this month, read from the ledger
    a = limits.reserve(ACME, plan(budget=1000), tokens=1, cost_micros=300)
    b = limits.reserve(ACME, plan(budget=1000), tokens=1, cost_micros=300)  # 400 + 600 = 1000: exactly
    with pytest.raises(ResourceExhausted) as info:
        limits.reserve(ACME, plan(budget=1000), tokens=1, cost_micros=1)
    assert "budget of 1000 micros per month" in info.value.message
    # The rest of January: 2025-01-15T12:00Z -> 2025-02-01T00:00Z.
    assert info.value.retry_after_ms == (16 * 86_400 + 12 * 3600) * 1000
    limits.settle(a, tokens=1, cost_micros=100)  # cost less than reserved: 200 come back
    c = limits.reserve(ACME, plan(budget=1000), tokens=1, cost_micros=200)
    with pytest.raises(ResourceExhausted):
        limits.reserve(ACME, plan(budget=1000), tokens=1, cost_micros=1)
    budget = limits._budgets["acme"]
    # spent 400 + 100 (a, settled); b and c still in flight: exactly the budget of 1000
    assert (budget.spent_micros, budget.reserved_micros) == (500, b.cost_micros + c.cost_micros) == (500, 500)


def test_a_refused_reservation_sets_nothing_aside() -> None:
    limits = make_limits(Clock())
    with pytest.raises(ResourceExhausted):  # over the budget: the tokens are not taken either
        limits.reserve(ACME, plan(tpm=100, budget=10), tokens=100, cost_micros=11)
    limits.reserve(ACME, plan(tpm=100, budget=10), tokens=100, cost_micros=10)


def test_budget_period_rolls_over_and_rereads_the_ledger() -> None:
    clock = Clock()
    reads: list[int] = []

    def spent(tenant: str, since_ms: int) -> int:
        reads.append(since_ms)
        return 0

    limits = Limits("day", spent, clock=lambda: clock.now, wall=lambda: clock.wall)
    limits.reserve(ACME, plan(budget=10), tokens=1, cost_micros=10)
    with pytest.raises(ResourceExhausted):
        limits.reserve(ACME, plan(budget=10), tokens=1, cost_micros=10)
    clock.tick(86_400)
    r = limits.reserve(ACME, plan(budget=20), tokens=1, cost_micros=10)  # new day, old one still in flight
    with pytest.raises(ResourceExhausted):
        limits.reserve(ACME, plan(budget=20), tokens=1, cost_micros=1)
    assert len(reads) == 2 and reads[1] - reads[0] == 86_400_000
    # the new day keeps counting yesterday's reservation still in flight, plus r's
    assert r.cost_micros == 10 and limits._budgets["acme"].reserved_micros == 20


@pytest.mark.parametrize(("period", "key", "days"), [("day", "2025-01-15", 1), ("month", "2025-01", 31)])
def test_period_bounds(period: str, key: str, days: int) -> None:
    got_key, start_ms, end_ms = period_bounds(JAN_15, period)
    assert got_key == key and end_ms - start_ms == days * 86_400_000
    _, _, end_of_december = period_bounds(1735603200.0, "month")  # 2024-12-31
    assert end_of_december == 1735689600000  # 2025-01-01T00:00Z
