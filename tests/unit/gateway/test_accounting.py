"""Every call writes exactly one ledger row, whatever its outcome (real SQLite, no gRPC)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import pytest

from aiserve.common.errors import InvalidArgument, ResourceExhausted, Unauthenticated, Unavailable
from aiserve.common.finish import FinishReason
from services.gateway.accounting import Accounting, CallOutcome
from services.gateway.config import GatewayConfig
from services.gateway.domain import Final, GatewayRequest, UsageRecord
from services.gateway.ledger import Ledger, UsageRow
from services.gateway.tenants import KeyStore, Tenant
from services.gateway.validation import SamplingInput, resolve_sampling

MODEL = "smollm2-135m-instruct@0.1.2"


@pytest.fixture
async def accounting(tmp_path: Path) -> AsyncIterator[tuple[Accounting, str]]:
    config = GatewayConfig(keys_path=str(tmp_path / "keys.sqlite3"), ledger_path=str(tmp_path / "ledger.sqlite3"))
    keys = KeyStore(config.keys_file())
    keys.put_tenant(Tenant("acme", "free", requests_per_minute=2, budget_micros=10_000_000))
    _, key = keys.create_key("acme")
    acc = Accounting(config, keys, Ledger(config.ledger_file()))
    try:
        yield acc, f"Bearer {key}"
    finally:
        await acc.close()


def request(text: str = "hello") -> GatewayRequest:
    return GatewayRequest("rid", text, None, resolve_sampling(SamplingInput(max_new_tokens=8), GatewayConfig()))


def rows(acc: Accounting) -> list[UsageRow]:
    return acc.ledger.rows()


async def test_a_finished_request_is_committed_with_its_usage_and_settles(accounting: tuple[Accounting, str]) -> None:
    acc, auth = accounting
    async with acc.account("Generate", "r1", "00-abc-01", 30.0) as account:
        account.authenticate(auth)
        req = account.admit(request())
        assert req.tenant == "acme" and req.priority == acc.tiers["free"].priority
        account.reserve(5, MODEL)
        assert acc.limits._budgets["acme"].reserved_micros == acc.prices.max_cost(MODEL, 5, 8)
        cost = acc.prices.cost(MODEL, 5, 3, 40)
        usage = UsageRecord(5, 3, False, 1, 2, 3, MODEL, cost, compute_ms=40, kv_peak_bytes=4096)
        await account.finish(Final(FinishReason.STOP, usage))
        assert [r.request_id for r in rows(acc)] == ["r1"]  # committed before finish returns
    [row] = rows(acc)
    assert (row.tenant, row.status, row.cost_micros, row.compute_ms, row.kv_peak_bytes, row.traceparent) == (
        "acme",
        "OK",
        cost,
        40,
        4096,
        "00-abc-01",
    )
    budget = acc.limits._budgets["acme"]
    assert budget.reserved_micros == 0 and budget.spent_micros == cost


@pytest.mark.parametrize(
    ("error", "status"),
    [
        (InvalidArgument("prompt: bad"), "INVALID_ARGUMENT"),
        (Unavailable("down"), "UNAVAILABLE"),
        (RuntimeError("bug"), "INTERNAL"),
    ],
)
async def test_errors_write_one_row_with_their_code_and_cost_nothing(
    accounting: tuple[Accounting, str], error: Exception, status: str
) -> None:
    acc, auth = accounting
    with pytest.raises(type(error)):
        async with acc.account("Complete", "r2", "", None) as account:
            account.authenticate(auth)
            account.admit(request())
            account.reserve(5, MODEL)
            raise error
    await acc.ledger.flush()  # error rows are queued, not waited for
    [row] = rows(acc)
    assert (row.status, row.cost_micros, row.finish_reason) == (status, 0, "error")
    assert acc.limits._budgets["acme"].reserved_micros == 0


async def test_unknown_key_and_rate_limit_are_recorded_too(accounting: tuple[Accounting, str]) -> None:
    acc, auth = accounting
    with pytest.raises(Unauthenticated):
        async with acc.account("Generate", "anon", "", None) as account:
            account.authenticate("Bearer ais_00000000_nope-nope-nope-nope-nope")
    for i in range(3):  # requests_per_minute = 2
        try:
            async with acc.account("Generate", f"rl{i}", "", None) as account:
                account.authenticate(auth)
                account.admit(request(f"question number {i} about something else entirely"))
        except ResourceExhausted as exc:
            assert i == 2 and exc.retry_after_ms
    await acc.ledger.flush()
    assert [(r.request_id, r.tenant, r.status) for r in rows(acc)] == [
        ("anon", "", "UNAUTHENTICATED"),
        ("rl0", "acme", "OK"),
        ("rl1", "acme", "OK"),
        ("rl2", "acme", "RESOURCE_EXHAUSTED"),
    ]


async def test_a_cancelled_stream_is_billed_for_what_it_produced_and_marked_abandoned(
    accounting: tuple[Accounting, str],
) -> None:
    acc, auth = accounting
    with pytest.raises(asyncio.CancelledError):
        async with acc.account("Generate", "r3", "", 60.0) as account:
            account.authenticate(auth)
            account.admit(request())
            account.reserve(5, MODEL)
            account.streamed(2)
            raise asyncio.CancelledError
    await acc.ledger.flush()
    [row] = rows(acc)
    assert (row.status, row.completion_tokens, row.cost_micros) == ("CANCELLED", 2, acc.prices.cost(MODEL, 5, 2, 0))
    assert acc.ledger.query("SELECT kind FROM feedback WHERE request_id = 'r3'", ()) == [("abandoned",)]


@pytest.mark.parametrize(("left_s", "status"), [(0.02, "DEADLINE_EXCEEDED"), (5.0, "CANCELLED")])
async def test_a_cancel_at_the_deadline_is_a_deadline(accounting: tuple[Accounting, str], left_s: float,
                                                      status: str) -> None:
    """The client's cancel at its deadline arrives a little before the server's deadline."""
    acc, auth = accounting
    with pytest.raises(asyncio.CancelledError):
        async with acc.account("Complete", "r4", "", 60.0) as account:
            account.authenticate(auth)
            account.deadline = time.monotonic() + left_s
            raise asyncio.CancelledError
    await acc.ledger.flush()
    [row] = rows(acc)
    assert row.status == status


async def test_a_repeated_question_is_a_passive_signal_on_the_earlier_request(
    accounting: tuple[Accounting, str],
) -> None:
    acc, auth = accounting
    for rid in ("first", "again"):
        async with acc.account("Generate", rid, "", None) as account:
            account.authenticate(auth)
            account.admit(request("What is the capital of France?"))
    await acc.ledger.flush()
    assert acc.ledger.query("SELECT request_id, kind, related_request_id FROM feedback", ()) == [
        ("first", "repeat", "again")
    ]


async def test_every_outcome_is_counted_once_with_what_it_billed(tmp_path: Path) -> None:
    """Answered, cancelled after 2 tokens, refused before routing, unknown key: one outcome each,
    the model only once routed and the tier only once authenticated."""
    config = GatewayConfig(keys_path=str(tmp_path / "keys.sqlite3"), ledger_path=str(tmp_path / "ledger.sqlite3"))
    keys = KeyStore(config.keys_file())
    keys.put_tenant(Tenant("acme", "paid"))
    key = f"Bearer {keys.create_key('acme')[1]}"
    seen: list[CallOutcome] = []
    acc = Accounting(config, keys, Ledger(config.ledger_file()), seen.append)
    try:
        async with acc.account("Complete", "ok", "", None) as account:
            account.authenticate(key)
            account.admit(request("one"))
            account.reserve(5, MODEL)
            await account.finish(Final(FinishReason.STOP, UsageRecord(5, 3, False, 1, 2, 3, MODEL, 70)))
        with pytest.raises(asyncio.CancelledError):
            async with acc.account("Generate", "gone", "", 60.0) as account:
                account.authenticate(key)
                account.admit(request("two"))
                account.reserve(5, MODEL)
                account.streamed(2)
                raise asyncio.CancelledError
        with pytest.raises(InvalidArgument):
            async with acc.account("Complete", "bad", "", None) as account:
                account.authenticate(key)
                account.admit(replace(request("three"), model="whatever-the-client-wrote"))
                raise InvalidArgument("prompt: bad")
        with pytest.raises(Unauthenticated):
            async with acc.account("Complete", "anon", "", None) as account:
                account.authenticate("Bearer nope")
    finally:
        await acc.close()
    cancelled_cost = acc.prices.cost(MODEL, 5, 2, 0)
    assert seen == [
        CallOutcome(MODEL, "paid", "OK", 5, 3, 70),
        CallOutcome(MODEL, "paid", "CANCELLED", 5, 2, cancelled_cost),
        CallOutcome("none", "paid", "INVALID_ARGUMENT", 0, 0, 0),
        CallOutcome("none", "none", "UNAUTHENTICATED", 0, 0, 0),
    ]
