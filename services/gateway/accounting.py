"""One billable request, from its API key to its usage row: the gateway's accounting.

``Accounting`` holds the key store, the limits, the price table, the ledger and the feedback
log. For each Generate or Complete call the servicer opens a ``RequestAccount`` (an async
context manager) that authenticates the caller, admits the request (requests per minute; tier
-> priority), reserves its maximum tokens and cost once the prompt is tokenized, and on the way
out settles the reservation and writes exactly one ledger row, whatever the outcome: on a
normal finish (``finish``) the row is committed before the caller sends the final message; on
an error, a cancel or a deadline the row is written as the call unwinds. As each row is built,
its outcome (``CallOutcome``) is told to the gateway's metrics, so they count exactly what the
ledger records. No grpc, no pb.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from types import TracebackType

from aiserve.common.errors import ApiError, Unauthenticated
from aiserve.common.logging import get_logger
from services.gateway.config import GatewayConfig
from services.gateway.domain import Final, GatewayRequest
from services.gateway.feedback import CountFeedback, Feedback, RepeatDetector
from services.gateway.ledger import Bucket, Ledger, Totals, UsageRow
from services.gateway.limits import Limits, Reservation
from services.gateway.pricing import PriceTable
from services.gateway.tenants import KeyStore, Tenant, Tier, tiers_from

log = get_logger("accounting")
# A call cancelled this close to its deadline is recorded as DEADLINE_EXCEEDED. The server's
# deadline runs later than the client's by the request's transit (and the client's own delay
# between reading its clock and sending), so the client's cancel at its deadline reaches us
# that much before ours; on the loaded 2-core machine that was seen above the former 5 ms.
DEADLINE_SLACK_S = 0.05

_BEARER = "bearer "
UNKNOWN_LABEL = "none"
"""The model of a call that ended before it was routed, the tier of one before its key was checked."""


@dataclass(frozen=True, slots=True)
class CallOutcome:
    """How one Generate/Complete call ended, as the metrics count it (one per ledger row).

    ``model`` is the name@version the call was routed to and ``tier`` its tenant's tier (both
    UNKNOWN_LABEL when it ended before that was known: never the client's own text, so a metric
    label cannot take arbitrarily many values). The tokens and cost are those billed: 0 for a
    call that was refused or failed."""

    model: str
    tier: str
    code: str
    prompt_tokens: int
    completion_tokens: int
    cost_micros: int


CountCall = Callable[[CallOutcome], None]


@dataclass(frozen=True, slots=True)
class Caller:
    """An authenticated tenant and what its tier (with its own limits) grants."""

    tenant: Tenant
    plan: Tier


class Accounting:
    """Tenants, limits, prices, the ledger and feedback, shared by all requests."""

    def __init__(self, config: GatewayConfig, keys: KeyStore, ledger: Ledger,
                 count_call: CountCall = lambda _: None, count_feedback: CountFeedback = lambda _: None) -> None:
        """``count_call`` sees every call's outcome as its row is written, ``count_feedback``
        every feedback row's kind (the gateway's metrics)."""
        self.config, self.keys, self.ledger = config, keys, ledger
        self.tiers = tiers_from(config)
        self.prices: PriceTable = config.price_table()
        self.limits = Limits(config.budget_period, ledger.spent)
        self.feedback = Feedback(ledger, config.max_feedback_comment_chars, count_feedback)
        self.repeats = RepeatDetector(config.repeat_window_s, config.repeat_similarity)
        self.count_call = count_call

    @classmethod
    def open(cls, config: GatewayConfig, count_call: CountCall = lambda _: None,
             count_feedback: CountFeedback = lambda _: None) -> Accounting:
        """Open (create if needed) the key store and the ledger the config names."""
        return cls(config, KeyStore(config.keys_file()), Ledger(config.ledger_file()), count_call, count_feedback)

    async def close(self) -> None:
        """Commit the rows still queued, then close the databases."""
        await asyncio.to_thread(self.ledger.close)
        self.keys.close()

    def authenticate(self, authorization: str) -> Caller:
        """The caller of an ``authorization: Bearer <key>`` header, or UNAUTHENTICATED."""
        if not authorization.lower().startswith(_BEARER):
            raise Unauthenticated("authorization: missing; send the metadata 'authorization: Bearer <API key>'")
        tenant = self.keys.authenticate(authorization[len(_BEARER):].strip())
        if tenant is None or tenant.tier not in self.tiers:
            raise Unauthenticated("authorization: unknown or revoked API key")
        return Caller(tenant, tenant.plan(self.tiers))

    def account(self, api: str, request_id: str, traceparent: str, timeout_s: float | None,
                user: str = "") -> RequestAccount:
        """A new account for one Generate/Complete call (``timeout_s``: the client's deadline;
        ``user``: the caller's own end-user id, recorded in the row)."""
        return RequestAccount(self, api, request_id, traceparent, timeout_s, user)

    async def usage(self, caller: Caller, since_ms: int | None, until_ms: int | None) -> tuple[Totals, list[Bucket]]:
        """The caller's own totals, and totals by day and model, for the period."""
        name = caller.tenant.name
        return await asyncio.gather(
            asyncio.to_thread(self.ledger.totals, name, since_ms, until_ms),
            asyncio.to_thread(self.ledger.buckets, name, since_ms, until_ms),
        )


def _question(req: GatewayRequest) -> str:
    """What the tenant asked: the raw prompt, or the chat's last user message."""
    if req.prompt is not None:
        return req.prompt
    users = [content for role, content in req.messages or () if role == "user"]
    return users[-1] if users else " ".join(content for _, content in req.messages or ())


class RequestAccount:
    """The accounting of one call. Use as ``async with``: exactly one ledger row comes out."""

    def __init__(self, accounting: Accounting, api: str, request_id: str, traceparent: str,
                 timeout_s: float | None, user: str = "") -> None:
        self._acc = accounting
        self.api, self.request_id, self.traceparent, self.user = api, request_id, traceparent, user
        self.started = time.monotonic()
        self.deadline = None if timeout_s is None else self.started + timeout_s
        self.caller: Caller | None = None
        self.model = accounting.config.default_model
        self.max_new_tokens = 0
        self.prompt_tokens = self.completion_tokens = 0
        self.reservation: Reservation | None = None
        self.is_recorded = False
        self.is_routed = False
        """Whether ``model`` is the name@version the pipeline routed the call to."""

    def authenticate(self, authorization: str) -> Caller:
        self.caller = self._acc.authenticate(authorization)
        return self.caller

    def admit(self, req: GatewayRequest) -> GatewayRequest:
        """Count the request against requests_per_minute; give it the tenant and its priority."""
        assert self.caller is not None, "authenticate first"
        tenant = self.caller.tenant
        self.model = req.model or self.model
        self.max_new_tokens = req.sampling.max_new_tokens
        self._acc.limits.admit(tenant, self.caller.plan)
        if (earlier := self._acc.repeats.observe(tenant.name, self.request_id, _question(req))) is not None:
            self._acc.feedback.repeated(tenant.name, earlier, self.request_id)
        return replace(req, tenant=tenant.name, priority=self.caller.plan.priority)

    def reserve(self, prompt_tokens: int, model: str) -> None:
        """The pipeline's admission hook, once the prompt is tokenized: reserve the request's
        maximum tokens and cost, or raise RESOURCE_EXHAUSTED."""
        assert self.caller is not None, "authenticate first"
        self.prompt_tokens, self.model, self.is_routed = prompt_tokens, model, True
        max_cost = self._acc.prices.max_cost(model, prompt_tokens, self.max_new_tokens)
        self.reservation = self._acc.limits.reserve(
            self.caller.tenant, self.caller.plan, prompt_tokens + self.max_new_tokens, max_cost)

    def streamed(self, num_tokens: int) -> None:
        """Tokens sent to the client so far (what a cancelled stream is billed for)."""
        self.completion_tokens += num_tokens

    async def finish(self, final: Final) -> None:
        """Settle and commit the row of a finished generation; returns once it is durable."""
        u = final.usage
        self.prompt_tokens, self.completion_tokens, self.model = u.prompt_tokens, u.completion_tokens, u.model
        self.is_routed = True
        used = 0 if u.cache_hit else u.prompt_tokens + u.completion_tokens
        row = self._row("OK", final.finish_reason, cost=u.cost_micros, used_tokens=used, cache_hit=u.cache_hit,
                        queue_ms=u.queue_ms, ttft_ms=u.ttft_ms, total_ms=u.total_ms, compute_ms=u.compute_ms,
                        kv_peak_bytes=u.kv_peak_bytes, cache_entry_id=u.cache_entry_id,
                        cache_similarity=u.cache_similarity)
        self._count(row, is_billed=True)
        await self._acc.ledger.record(row)

    async def __aenter__(self) -> RequestAccount:
        return self

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        if self.is_recorded:
            return
        status = self._status(exc)
        # A cancelled or expired generation is billed for the tokens it produced (the work was
        # done at the caller's request); a refused or failed one costs nothing.
        is_billed = status in {"CANCELLED", "DEADLINE_EXCEEDED"} and self.completion_tokens > 0
        cost = self._acc.prices.cost(self.model, self.prompt_tokens, self.completion_tokens, 0) if is_billed else 0
        used = self.prompt_tokens + self.completion_tokens if is_billed else 0
        reason = "cancelled" if status in {"CANCELLED", "DEADLINE_EXCEEDED"} else ("error" if status != "OK" else "")
        row = self._row(status, reason, cost=cost, used_tokens=used)
        self._count(row, is_billed)
        self._acc.ledger.submit(row)
        if status == "CANCELLED" and self.api == "Generate" and self.caller is not None:
            self._acc.feedback.abandoned(self.caller.tenant.name, self.request_id)
        if status == "INTERNAL":
            log.error("request_failed", api=self.api, error=repr(exc))

    def _status(self, exc: BaseException | None) -> str:
        if exc is None:
            return "OK"
        if isinstance(exc, ApiError):
            return exc.kind.name
        if isinstance(exc, asyncio.CancelledError | GeneratorExit):
            expired = self.deadline is not None and time.monotonic() >= self.deadline - DEADLINE_SLACK_S
            return "DEADLINE_EXCEEDED" if expired else "CANCELLED"
        return "INTERNAL"

    def _count(self, row: UsageRow, is_billed: bool) -> None:
        """Tell the metrics how the call ended (``is_billed``: its tokens were billed)."""
        self._acc.count_call(CallOutcome(
            model=self.model if self.is_routed else UNKNOWN_LABEL,
            tier=self.caller.plan.name if self.caller else UNKNOWN_LABEL, code=row.status,
            prompt_tokens=row.prompt_tokens if is_billed else 0,
            completion_tokens=row.completion_tokens if is_billed else 0, cost_micros=row.cost_micros))

    def _row(self, status: str, finish_reason: str, *, cost: int, used_tokens: int, cache_hit: bool = False,
             queue_ms: int = 0, ttft_ms: int = 0, total_ms: int | None = None, compute_ms: int = 0,
             kv_peak_bytes: int = 0, cache_entry_id: str = "", cache_similarity: float = 0.0) -> UsageRow:
        """Settle the reservation and build the row (marks the account recorded)."""
        if self.reservation is not None:
            self._acc.limits.settle(self.reservation, used_tokens, cost)
        self.is_recorded = True
        if total_ms is None:
            total_ms = int((time.monotonic() - self.started) * 1000)
        return UsageRow(
            request_id=self.request_id, tenant=self.caller.tenant.name if self.caller else "", api=self.api,
            model=self.model, status=status, finish_reason=finish_reason, prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens, cache_hit=cache_hit, queue_ms=queue_ms, ttft_ms=ttft_ms,
            total_ms=total_ms, compute_ms=compute_ms, kv_peak_bytes=kv_peak_bytes,
            cost_micros=cost, traceparent=self.traceparent, ended_at_ms=int(time.time() * 1000),
            cache_entry_id=cache_entry_id, cache_similarity=cache_similarity, user=self.user,
        )
