"""Tenants through the real suite: keys, limits and budgets at their exact edges, usage that
never mixes tenants, feedback, and the operator commands."""

from __future__ import annotations

import asyncio
import csv
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import grpc
import pytest
from grpc import aio

from aiserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from services.gateway.config import GatewayConfig
from suite.runner import Suite
from tests.integration.conftest import (
    auth,
    create_tenant,
    dev_key,
    ledger_rows,
    log_records,
    new_request_id,
)
from tests.integration.test_e2e import TIMEOUT_S, chat_request, complete, stream

MODEL = "smollm2-135m-instruct@0.1.2"
ROOT = Path(__file__).resolve().parents[2]
"""The repository root: ``python -m suite`` runs the command line from the checkout."""


async def rpc_error(call: object) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        await call  # type: ignore[misc]
    return info.value


def retry_after_ms(error: grpc.RpcError) -> int:
    return int(dict(error.trailing_metadata() or ())["retry-after-ms"])  # type: ignore[attr-defined]


async def prompt_tokens(suite: Suite, request: gateway_pb2.GenerateRequest) -> int:
    async with aio.insecure_channel(suite.config.address("gateway")) as channel:
        reply = await gateway_pb2_grpc.GatewayStub(channel).CountTokens(
            common_pb2.CountTokensRequest(chat=request.chat), metadata=auth(dev_key(suite)), timeout=TIMEOUT_S
        )
    return reply.token_count


async def test_missing_unknown_and_revoked_keys_are_unauthenticated_and_recorded(suite: Suite) -> None:
    tenant, key = create_tenant(suite.config.home, "revoked")
    request = chat_request("Say hi.", max_new_tokens=2, cache=gateway_pb2.CACHE_POLICY_BYPASS)
    assert (await complete(suite, request, key=key)).usage.completion_tokens > 0
    revoke = [sys.executable, "-m", "suite", "keys", "revoke", key.split("_")[1], "--home", str(suite.config.home)]
    # Revoked with the operator command while the gateway runs: its next call with the key fails.
    await asyncio.to_thread(subprocess.run, revoke, check=True, capture_output=True, timeout=60, cwd=ROOT)
    async with aio.insecure_channel(suite.config.address("gateway")) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        rid = new_request_id()
        for metadata in ((), auth("ais_12345678_" + "x" * 43), auth(key)):
            error = await rpc_error(stub.Complete(request, metadata=(*metadata, ("x-request-id", rid)), timeout=30))
            assert error.code() == grpc.StatusCode.UNAUTHENTICATED, error.details()
            assert "authorization" in error.details()
    await rows_committed(suite)
    refused = [(r.tenant, r.status, r.cost_micros) for r in ledger_rows(suite.config.home) if r.request_id == rid]
    assert refused == [("", "UNAUTHENTICATED", 0)] * 3


async def rows_committed(suite: Suite) -> None:
    """Return once every row the gateway queued before this call is committed.

    A refused call's row is queued for the ledger before its status is sent, not awaited (it
    costs nothing). The ledger's one writer commits rows in the order they were queued, and the
    row of an answered request is committed before its last message is sent: so when one more
    answer arrives, every row queued before it is committed. An event, not a polling loop."""
    request = chat_request("Say ok.", max_new_tokens=1, cache=gateway_pb2.CACHE_POLICY_BYPASS)
    await complete(suite, request)


async def test_requests_per_minute_reject_exactly_the_first_request_over_the_limit(suite: Suite) -> None:
    _, key = create_tenant(suite.config.home, "rpm", requests_per_minute=2)
    request = chat_request("Say yes.", max_new_tokens=1, cache=gateway_pb2.CACHE_POLICY_BYPASS)
    for _ in range(2):
        await complete(suite, request, key=key)
    async with aio.insecure_channel(suite.config.address("gateway")) as channel:
        call = gateway_pb2_grpc.GatewayStub(channel).Complete(request, metadata=auth(key), timeout=30)
        error = await rpc_error(call)
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "requests_per_minute limit of 2" in error.details()
    assert 0 < retry_after_ms(error) <= 30_000  # one request per 30 s comes back


async def test_tokens_per_minute_admit_exactly_up_to_the_limit(suite: Suite) -> None:
    request = chat_request("Say no.", max_new_tokens=4, cache=gateway_pb2.CACHE_POLICY_BYPASS)
    needed = await prompt_tokens(suite, request) + 4  # reserved: prompt + max_new_tokens
    _, exact = create_tenant(suite.config.home, "tpm-exact", tokens_per_minute=needed)
    _, short = create_tenant(suite.config.home, "tpm-short", tokens_per_minute=needed - 1)
    reply = await complete(suite, request, key=exact)
    assert reply.usage.prompt_tokens + 4 == needed
    error = await rpc_error(complete(suite, request, key=short))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"tokens_per_minute limit of {needed - 1}" in error.details()


async def test_budget_admits_exactly_up_to_the_reserved_maximum_cost(suite: Suite) -> None:
    request = chat_request("Name a fruit.", max_new_tokens=4, cache=gateway_pb2.CACHE_POLICY_BYPASS)
    tokens = await prompt_tokens(suite, request)
    max_cost = GatewayConfig().price_table().max_cost(MODEL, tokens, 4)
    _, exact = create_tenant(suite.config.home, "budget-exact", budget_micros=max_cost)
    _, short = create_tenant(suite.config.home, "budget-short", budget_micros=max_cost - 1)
    first = await complete(suite, request, key=exact)
    assert 0 < first.usage.cost_micros <= max_cost
    for key in (exact, short):  # exact: spent + the next maximum > budget; short: never fits
        error = await rpc_error(complete(suite, request, key=key))
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "budget" in error.details() and retry_after_ms(error) > 0
    async with aio.insecure_channel(suite.config.address("gateway")) as channel:
        usage = await gateway_pb2_grpc.GatewayStub(channel).GetUsage(
            gateway_pb2.UsageRequest(), metadata=auth(exact), timeout=TIMEOUT_S
        )
    assert usage.total.requests == 2 and usage.total.cost_micros == first.usage.cost_micros


async def test_three_tenants_90_concurrent_requests_each_sees_only_its_own_usage(suite: Suite) -> None:
    tenants = [create_tenant(suite.config.home, f"usage{i}", tier) for i, tier in enumerate(("free", "paid", "free"))]
    sent: dict[str, set[str]] = defaultdict(set)

    async def one(i: int) -> None:
        tenant, key = tenants[i % 3]
        rid = new_request_id()
        sent[tenant].add(rid)
        # Five questions per tenant, each asked six times: some answers come from the cache.
        request = chat_request(f"Tenant {i % 3} asks question {i % 5}: name a colour.", max_new_tokens=3)
        if i % 2:
            await stream(suite, request, request_id=rid, key=key)
        else:
            await complete(suite, request, key=key, request_id=rid)

    await asyncio.gather(*(one(i) for i in range(90)))
    async with aio.insecure_channel(suite.config.address("gateway")) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        for tenant, key in tenants:
            usage = await stub.GetUsage(gateway_pb2.UsageRequest(), metadata=auth(key), timeout=TIMEOUT_S)
            rows = ledger_rows(suite.config.home, tenant)
            assert usage.tenant == tenant
            assert {r.request_id for r in rows} == sent[tenant] and len(rows) == 30
            assert (
                usage.total.requests,
                usage.total.prompt_tokens,
                usage.total.completion_tokens,
                usage.total.cost_micros,
            ) == (
                len(rows),
                sum(r.prompt_tokens for r in rows),
                sum(r.completion_tokens for r in rows),
                sum(r.cost_micros for r in rows),
            )
            assert sum(b.totals.cost_micros for b in usage.buckets) == usage.total.cost_micros
            assert {b.model for b in usage.buckets} == {MODEL}
            assert all(r.status == "OK" for r in rows) and usage.total.cost_micros > 0


async def test_get_usage_period_and_malformed_times(suite: Suite) -> None:
    _, key = create_tenant(suite.config.home, "period")
    await complete(suite, chat_request("Say ok.", max_new_tokens=1, cache=gateway_pb2.CACHE_POLICY_BYPASS), key=key)
    async with aio.insecure_channel(suite.config.address("gateway")) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        past = await stub.GetUsage(
            gateway_pb2.UsageRequest(since="2000-01-01T00:00:00Z"), metadata=auth(key), timeout=TIMEOUT_S
        )
        future = await stub.GetUsage(
            gateway_pb2.UsageRequest(since="2999-01-01T00:00:00+00:00"), metadata=auth(key), timeout=TIMEOUT_S
        )
        assert past.total.requests == 1 and future.total.requests == 0 and not future.buckets
        for bad in (gateway_pb2.UsageRequest(since="yesterday"), gateway_pb2.UsageRequest(until="2025-01-01T00:00")):
            error = await rpc_error(stub.GetUsage(bad, metadata=auth(key), timeout=TIMEOUT_S))
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert ("since" if bad.since else "until") in error.details()


async def test_feedback_only_on_the_callers_own_requests_and_cache_hits_reach_the_cache(suite: Suite) -> None:
    _, mine = create_tenant(suite.config.home, "fb-mine")
    _, theirs = create_tenant(suite.config.home, "fb-theirs")
    request = chat_request("Give me one word that rhymes with dog.", max_new_tokens=6)
    first_id, hit_id, their_id = new_request_id(), new_request_id(), new_request_id()
    await stream(suite, request, request_id=first_id, key=mine)
    hit, _ = await stream(suite, request, request_id=hit_id, key=mine)
    await complete(suite, chat_request("Say hi.", max_new_tokens=2), key=theirs, request_id=their_id)
    async with aio.insecure_channel(suite.config.address("gateway")) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)

        async def rate(request_id: str, rating: int, comment: str = "") -> gateway_pb2.FeedbackResponse:
            feedback = gateway_pb2.FeedbackRequest(request_id=request_id, rating=rating, comment=comment)
            return await stub.SubmitFeedback(feedback, metadata=auth(mine), timeout=TIMEOUT_S)

        await rate(first_id, 1, "good")
        reply = await rate(hit_id, -1, "wrong")
        # Another tenant's request id gets exactly the answer of an id nobody used.
        details = []
        for request_id in (their_id, "never-used"):
            error = await rpc_error(rate(request_id, 1))
            assert error.code() == grpc.StatusCode.NOT_FOUND
            details.append(error.details().replace(request_id, "<id>"))
        assert details[0] == details[1]
        assert (await rpc_error(rate(first_id, 5))).code() == grpc.StatusCode.INVALID_ARGUMENT
    # The negative rating of a cache hit was reported to the cache, within the feedback call.
    assert hit[-1].usage.cache_hit
    reported = [
        r
        for r in log_records(suite, "cache")
        if r.get("request_id") == reply.request_id and "ReportFeedback" in str(r.get("method"))
    ]
    assert reported and reported[-1]["code"] == "OK"


def test_keys_and_usage_commands(suite: Suite, tmp_path: Path) -> None:
    home = str(suite.config.home)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}

    def aiserve(*args: str) -> str:
        command = [sys.executable, "-m", "suite", *args, "--home", home]
        result = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
        assert result.returncode == 0, result.stderr
        return result.stdout

    key = aiserve("keys", "create", "--tenant", "cli-tenant", "--tier", "paid", "--budget-micros", "0").strip()
    assert key.startswith("ais_")
    listing = aiserve("keys", "list", "--tenant", "cli-tenant")
    assert f"ais_{key.split('_')[1]}\tcli-tenant\tpaid" in listing and key not in listing
    rid = new_request_id()
    asyncio.run(complete(suite, chat_request("Say one.", max_new_tokens=2), key=key, request_id=rid))
    out = tmp_path / "usage.csv"
    report = aiserve("usage", "--tenant", "cli-tenant", "--csv", str(out))
    assert "cli-tenant" in report and MODEL in report and "total: 1 requests" in report
    with out.open(newline="") as file:
        [row] = list(csv.DictReader(file))
    assert row["request_id"] == rid and row["status"] == "OK" and int(row["cost_micros"]) > 0
