"""Per-tenant rate limits (token buckets) and budgets, enforced by reservation.

Requests per minute: one bucket per tenant, capacity = the per-minute limit (a burst of one
minute's worth), refilled continuously. Tokens per minute and the budget are *reserved* at
admission for the request's maximum (prompt + max_new_tokens tokens, ``PriceTable.max_cost``)
and *settled* at its end with what it really used, so concurrent requests can never overshoot a
limit together. All checks run on the event loop without awaiting in between, so they are
atomic. No grpc, no pb.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

from aiserve.common.errors import ResourceExhausted
from services.gateway.tenants import Tenant, Tier


class TokenBucket:
    """``capacity`` tokens, refilled at ``rate_per_s``; starts full."""

    def __init__(self, capacity: float, rate_per_s: float, now: float) -> None:
        self.capacity, self.rate_per_s = capacity, rate_per_s
        self.level, self.updated = capacity, now

    def _refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.updated) * self.rate_per_s)
        self.updated = now

    def take(self, amount: float, now: float) -> float:
        """Take ``amount`` and return 0, or take nothing and return the seconds until it would
        fit (``inf`` if it never can)."""
        self._refill(now)
        if amount <= self.level:
            self.level -= amount
            return 0.0
        if amount > self.capacity:
            return math.inf
        return (amount - self.level) / self.rate_per_s

    def give(self, amount: float, now: float) -> None:
        """Return unused tokens (never above capacity)."""
        self._refill(now)
        self.level = min(self.capacity, self.level + amount)


@dataclass(slots=True)
class Reservation:
    """What admission set aside for one request, until ``Limits.settle``."""

    tenant: str
    tokens: int
    cost_micros: int
    is_settled: bool = False


@dataclass(slots=True)
class _Budget:
    period: str
    spent_micros: int
    reserved_micros: int = 0


def period_bounds(unix_s: float, period: str) -> tuple[str, int, int]:
    """(key, start ms, end ms) of the UTC ``period`` ("day" or "month") containing ``unix_s``."""
    now = datetime.fromtimestamp(unix_s, UTC)
    if period == "day":
        start = now.replace(hour=0, minute=0, second=0, microsecond=0)
        end = datetime.fromtimestamp(start.timestamp() + 86_400, UTC)
        key = start.strftime("%Y-%m-%d")
    else:
        start = now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
        end = start.replace(year=start.year + (start.month == 12), month=start.month % 12 + 1)
        key = start.strftime("%Y-%m")
    return key, int(start.timestamp() * 1000), int(end.timestamp() * 1000)


def _retry_ms(seconds: float) -> int | None:
    return None if math.isinf(seconds) else max(1, math.ceil(seconds * 1000))


class Limits:
    """Rate limits and budgets of every tenant this gateway has seen.

    ``spent(tenant, since_ms)`` reads what the ledger billed (once per tenant and period, so a
    restarted gateway keeps counting); ``clock`` (monotonic) drives the buckets and ``wall``
    (Unix seconds) the budget periods; both are injectable for tests.
    """

    def __init__(self, budget_period: str, spent: Callable[[str, int], int],
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time) -> None:
        self.budget_period = budget_period
        self._spent, self._clock, self._wall = spent, clock, wall
        self._requests: dict[str, TokenBucket] = {}
        self._tokens: dict[str, TokenBucket] = {}
        self._budgets: dict[str, _Budget] = {}

    def admit(self, tenant: Tenant, plan: Tier) -> None:
        """Count one request against requests_per_minute, or raise ResourceExhausted."""
        bucket = self._bucket(self._requests, tenant.name, plan.requests_per_minute)
        wait_s = bucket.take(1, self._clock())
        if wait_s:
            raise ResourceExhausted(
                f"tenant {tenant.name}: over its requests_per_minute limit of {plan.requests_per_minute}",
                _retry_ms(wait_s))

    def reserve(self, tenant: Tenant, plan: Tier, tokens: int, cost_micros: int) -> Reservation:
        """Set aside ``tokens`` of tokens_per_minute and ``cost_micros`` of the budget, or raise
        ResourceExhausted (nothing is set aside then)."""
        budget = self._budget(tenant.name, self._wall()) if plan.budget_micros else None
        if budget is not None and budget.spent_micros + budget.reserved_micros + cost_micros > plan.budget_micros:
            _, _, end_ms = period_bounds(self._wall(), self.budget_period)
            raise ResourceExhausted(
                f"tenant {tenant.name}: over its budget of {plan.budget_micros} micros per {self.budget_period} "
                f"(spent {budget.spent_micros}, reserved {budget.reserved_micros}, this request may cost "
                f"{cost_micros})", max(1, end_ms - int(self._wall() * 1000)))
        bucket = self._bucket(self._tokens, tenant.name, plan.tokens_per_minute)
        wait_s = bucket.take(tokens, self._clock())
        if wait_s:
            raise ResourceExhausted(
                f"tenant {tenant.name}: this request may use {tokens} tokens (prompt + max_new_tokens), over "
                f"its tokens_per_minute limit of {plan.tokens_per_minute}", _retry_ms(wait_s))
        if budget is not None:
            budget.reserved_micros += cost_micros
        return Reservation(tenant.name, tokens, cost_micros if budget is not None else 0)

    def settle(self, reservation: Reservation, tokens: int, cost_micros: int) -> None:
        """Replace the reservation by what the request used (idempotent)."""
        if reservation.is_settled:
            return
        reservation.is_settled = True
        if (bucket := self._tokens.get(reservation.tenant)) is not None:
            bucket.give(max(reservation.tokens - tokens, 0), self._clock())
        if reservation.cost_micros and (budget := self._budgets.get(reservation.tenant)) is not None:
            budget.reserved_micros -= reservation.cost_micros
            budget = self._budget(reservation.tenant, self._wall())
            budget.spent_micros += cost_micros

    def _bucket(self, buckets: dict[str, TokenBucket], tenant: str, per_minute: int) -> TokenBucket:
        bucket = buckets.get(tenant)
        if bucket is None or bucket.capacity != per_minute:  # new tenant, or its limit changed
            fresh = TokenBucket(per_minute, per_minute / 60, self._clock())
            if bucket is not None:
                fresh.level = min(bucket.level, fresh.capacity)
            buckets[tenant] = bucket = fresh
        return bucket

    def _budget(self, tenant: str, unix_s: float) -> _Budget:
        """The tenant's budget state for the current period, read from the ledger once per period."""
        key, start_ms, _ = period_bounds(unix_s, self.budget_period)
        budget = self._budgets.get(tenant)
        if budget is None or budget.period != key:
            reserved = budget.reserved_micros if budget is not None else 0
            budget = self._budgets[tenant] = _Budget(key, self._spent(tenant, start_ms), reserved)
        return budget
