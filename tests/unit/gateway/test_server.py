"""The real gateway server in-process over real gRPC, in front of fake tokenizer and inference
services (port 0): what it passes downstream (deadline, priority, cancel) and what it bills."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import grpc
import prometheus_client
import pytest
from grpc import aio

from aiserve.common.server import ServiceHandle
from aiserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from services.gateway.config import GatewayConfig
from services.gateway.ledger import Ledger, UsageRow
from services.gateway.server import GatewayServicer, create_server
from services.gateway.tenants import KeyStore, Tenant
from tests.unit.gateway.server_fakes import MODEL, Seen, fake_backends

TIMEOUT_S = 10.0


@dataclass
class Gateway:
    address: str
    keys: dict[str, str]
    seen: Seen
    handle: ServiceHandle
    submitted: asyncio.Queue[str]
    """Request ids of the ledger rows the gateway queued, in order (an error row is queued, not
    awaited, before the call's status goes out)."""

    @property
    def ledger(self) -> Ledger:
        assert isinstance(self.handle.servicer, GatewayServicer)
        return self.handle.servicer.accounting.ledger

    def auth(self, tenant: str) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.keys[tenant]}"),)

    def rows(self) -> list[tuple[object, ...]]:
        """The committed usage rows (read on a connection of their own, as another process would)."""
        return self.ledger.query(
            "SELECT request_id, tenant, api, status, prompt_tokens, completion_tokens, "
            "compute_ms, kv_peak_bytes, cost_micros FROM usage ORDER BY id",
            (),
        )


def tenant_keys(path: Path) -> dict[str, str]:
    """A free and a paid tenant with a key each, in a new key store at ``path``."""
    store = KeyStore(path)
    try:
        for tenant, tier in (("freebie", "free"), ("payer", "paid")):
            store.put_tenant(Tenant(tenant, tier))
        return {tenant: store.create_key(tenant)[1] for tenant in ("freebie", "payer")}
    finally:
        store.close()


def tell_submitted(gateway: Gateway) -> None:
    """Put the request id of every row the gateway's ledger queues on ``gateway.submitted``."""
    submit = gateway.ledger.submit

    def submit_and_tell(row: UsageRow) -> Future[None]:
        done = submit(row)
        gateway.submitted.put_nowait(row.request_id)
        return done

    gateway.ledger.submit = submit_and_tell  # type: ignore[method-assign]


@pytest.fixture(params=[True, False], ids=["generate-mux", "call-per-generation"])
async def gateway(tmp_path: Path, request: pytest.FixtureRequest) -> AsyncIterator[Gateway]:
    seen = Seen()
    backends = fake_backends(seen)
    config = GatewayConfig(
        port=0,
        http_port=0,
        metrics_port=0,
        generate_mux=request.param,
        tokenizer_address=f"127.0.0.1:{backends[0].port}",
        inference_address=f"127.0.0.1:{backends[1].port}",
        cache_address="",
        default_model=MODEL,
        keys_path=str(tmp_path / "keys.sqlite3"),
        ledger_path=str(tmp_path / "ledger.sqlite3"),
        routes_path=str(tmp_path / "routes.sqlite3"),
        prices=(f"{MODEL}=10/20/1000",),
    )
    keys = tenant_keys(tmp_path / "keys.sqlite3")
    handle = await create_server(config)
    gateway = Gateway(f"127.0.0.1:{handle.port}", keys, seen, handle, asyncio.Queue())
    tell_submitted(gateway)
    try:
        for h in (*backends, handle):
            await h.start()
        for h in backends:
            await h.begin_serving()  # the gateway routes only to SERVING replicas
        yield gateway
    finally:
        for h in (handle, *backends):
            await h.stop(0)


def request(words: int = 3, max_new_tokens: int = 4) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(
        prompt=" ".join(["word"] * words), sampling=common_pb2.SamplingParams(max_new_tokens=max_new_tokens)
    )


async def test_streamed_and_unary_are_billed_identically_and_the_row_is_committed_first(gateway: Gateway) -> None:
    async with aio.insecure_channel(gateway.address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        meta = gateway.auth("payer")
        messages = [
            m async for m in stub.Generate(request(), metadata=(*meta, ("x-request-id", "s-1")), timeout=TIMEOUT_S)
        ]
        committed = gateway.rows()  # the final message was received: its row must already be there
        reply = await stub.Complete(request(), metadata=(*meta, ("x-request-id", "u-1")), timeout=TIMEOUT_S)
    assert [r[0] for r in committed] == ["s-1"]
    streamed = messages[-1].usage
    # 3 prompt tokens x 10 + 4 completion x 20 + 250 ms x 1000 / s = 30 + 80 + 250.
    assert streamed.cost_micros == reply.usage.cost_micros == 360
    rows = gateway.rows()
    assert [r[:4] for r in rows] == [("s-1", "payer", "Generate", "OK"), ("u-1", "payer", "Complete", "OK")]
    assert rows[0][4:] == rows[1][4:] == (3, 4, 250, 65536, 360)


async def test_tier_priority_and_the_clients_deadline_go_downstream(gateway: Gateway) -> None:
    async with aio.insecure_channel(gateway.address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        await stub.Complete(request(), metadata=gateway.auth("freebie"), timeout=3.0)
        await stub.Complete(request(), metadata=gateway.auth("payer"), timeout=TIMEOUT_S)
    free_priority, paid_priority = gateway.seen.priorities
    assert paid_priority > free_priority
    # Each generation gets what is left of its own client's deadline (gRPC's timeout header
    # rounds it up a little), never the gateway's own default of 600 s. No lower bound but 0:
    # how long routing and rendering take is up to the machine.
    short, long = gateway.seen.remaining_s
    assert 0 < short <= 3.0 + 0.5
    assert 0 < long <= TIMEOUT_S + 0.5


async def test_client_cancel_cancels_the_generation_and_is_recorded(gateway: Gateway) -> None:
    async with aio.insecure_channel(gateway.address) as channel:
        call = gateway_pb2_grpc.GatewayStub(channel).Generate(
            request(words=7, max_new_tokens=50),
            metadata=(*gateway.auth("payer"), ("x-request-id", "c-1")),
            timeout=TIMEOUT_S,
        )
        first = await call.read()
        assert list(first.token_ids) == [10]  # then the fake generation waits to be cancelled
        call.cancel()
        await asyncio.wait_for(gateway.seen.cancelled.wait(), TIMEOUT_S)
        assert await asyncio.wait_for(gateway.submitted.get(), TIMEOUT_S) == "c-1"
    await gateway.ledger.flush()
    # Billed for what it produced (7 prompt tokens, 1 generated; no compute reported yet):
    # 7 x 10 + 1 x 20 micros; and recorded as abandoned.
    assert gateway.rows() == [("c-1", "payer", "Generate", "CANCELLED", 7, 1, 0, 0, 90)]
    assert gateway.ledger.query("SELECT kind FROM feedback WHERE request_id = 'c-1'", ()) == [("abandoned",)]


async def test_deadline_expiry_cancels_downstream(gateway: Gateway) -> None:
    async with aio.insecure_channel(gateway.address) as channel:
        with pytest.raises(grpc.RpcError) as info:
            await gateway_pb2_grpc.GatewayStub(channel).Complete(
                request(words=7, max_new_tokens=50), metadata=gateway.auth("payer"), timeout=2.0
            )
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await asyncio.wait_for(gateway.seen.cancelled.wait(), TIMEOUT_S)


async def test_every_rpc_needs_a_valid_key(gateway: Gateway) -> None:
    async with aio.insecure_channel(gateway.address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        bad = (("authorization", "Bearer ais_00000000_not-a-real-key-at-all-no"),)
        calls = [
            stub.Complete(request(), timeout=TIMEOUT_S),
            stub.Complete(request(), metadata=bad, timeout=TIMEOUT_S),
            stub.CountTokens(common_pb2.CountTokensRequest(prompt="hi"), metadata=bad, timeout=TIMEOUT_S),
            stub.GetUsage(gateway_pb2.UsageRequest(), metadata=bad, timeout=TIMEOUT_S),
            stub.SubmitFeedback(gateway_pb2.FeedbackRequest(request_id="x", rating=1), metadata=bad, timeout=TIMEOUT_S),
        ]
        for call in calls:
            with pytest.raises(grpc.RpcError) as info:
                await call
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "authorization" in info.value.details()


async def test_the_gateway_counts_in_its_own_registry(gateway: Gateway) -> None:
    async with aio.insecure_channel(gateway.address) as channel:
        await gateway_pb2_grpc.GatewayStub(channel).Complete(request(), metadata=gateway.auth("payer"),
                                                             timeout=TIMEOUT_S)
    labels = {"model": MODEL, "finish_reason": "length", "cache_hit": "false"}
    registry = gateway.handle.registry
    assert registry.get_sample_value("aiserve_gateway_requests_total", labels) == 1.0
    assert registry.get_sample_value("aiserve_gateway_tokens_total", {"kind": "completion", "tier": "paid"}) == 4.0
    assert registry.get_sample_value("aiserve_gateway_cost_micros_total", {"tier": "paid"}) == 360.0
    assert registry.get_sample_value("aiserve_gateway_cache_lookups_total", {"outcome": "hit_cancelled"}) == 0.0
    # not in the process-wide default registry, which a second server would share
    assert prometheus_client.REGISTRY.get_sample_value("aiserve_gateway_requests_total", labels) is None


async def test_every_call_is_counted_by_model_tier_and_code_and_feedback_by_kind(gateway: Gateway) -> None:
    """An answer, a refused key and a rating, as the metrics count them; the replicas gauge."""
    async with aio.insecure_channel(gateway.address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        await stub.Complete(request(), metadata=(*gateway.auth("freebie"), ("x-request-id", "m-1")), timeout=TIMEOUT_S)
        with pytest.raises(grpc.RpcError):
            await stub.Complete(request(), metadata=(("authorization", "Bearer nope"),), timeout=TIMEOUT_S)
        await stub.SubmitFeedback(gateway_pb2.FeedbackRequest(request_id="m-1", rating=-1),
                                  metadata=gateway.auth("freebie"), timeout=TIMEOUT_S)
    value = gateway.handle.registry.get_sample_value
    assert value("aiserve_gateway_calls_total", {"model": MODEL, "tier": "free", "code": "OK"}) == 1
    assert value("aiserve_gateway_calls_total", {"model": "none", "tier": "none", "code": "UNAUTHENTICATED"}) == 1
    assert value("aiserve_gateway_tokens_total", {"kind": "prompt", "tier": "free"}) == 3
    assert value("aiserve_gateway_feedback_total", {"kind": "bad"}) == 1
    assert value("aiserve_gateway_feedback_total", {"kind": "good"}) == 0
    for service in ("tokenizer", "inference"):  # both fake backends are SERVING
        assert value("aiserve_gateway_replicas", {"model": MODEL, "service": service}) == 1
        assert value("aiserve_gateway_healthy_replicas", {"model": MODEL, "service": service}) == 1
