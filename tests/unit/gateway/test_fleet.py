"""The real gateway in front of fake tokenizer and inference replicas (real gRPC on free
ports): it balances over the SERVING replicas with one shared call each, follows their health,
survives a replica that vanishes mid-stream, and reports its own health from theirs."""

from __future__ import annotations

import asyncio
import dataclasses
import signal
import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from aiserve.common.server import ServiceHandle, wait_for_serving
from aiserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from services.gateway.config import GatewayConfig
from services.gateway.fleet_clients import FleetCache
from services.gateway.ledger import Ledger
from services.gateway.pool import ReplicaPool
from services.gateway.replicas import State
from services.gateway.routing import Routes
from services.gateway.server import GatewayServicer, create_server
from tests.unit.gateway.server_fakes import MODEL, FakeCache, FakeInference, FakeTokenizer, Seen, fake_server
from tests.unit.gateway.test_server import tenant_keys

TIMEOUT_S = 10.0
ROOT = Path(__file__).resolve().parents[3]
HANG = 7  # a prompt of 7 words makes the fake inference hang after its first token


@dataclass
class Fleet:
    gateway: ServiceHandle
    tokenizer: ServiceHandle
    inference: list[ServiceHandle]
    seen: list[Seen]
    keys: dict[str, str]

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.gateway.port}"

    @property
    def servicer(self) -> GatewayServicer:
        assert isinstance(self.gateway.servicer, GatewayServicer)
        return self.gateway.servicer

    @property
    def routes(self) -> Routes:
        router = self.servicer.pipeline.backends.router
        assert isinstance(router, Routes)
        return router

    @property
    def pool(self) -> ReplicaPool:  # type: ignore[type-arg]
        """The gateway's inference replicas (of its settings' route)."""
        return self.routes.backends_of(MODEL).inference

    @property
    def ledger(self) -> Ledger:
        return self.servicer.accounting.ledger

    def replica_address(self, index: int) -> str:
        return f"127.0.0.1:{self.inference[index].port}"

    def auth(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.keys['payer']}"),)

    async def until(self, condition: Callable[[], bool]) -> None:
        """Wait (on the replicas' watches, no polling) until the gateway sees ``condition``."""
        await self.pool.wait_for(condition, TIMEOUT_S)

    def state(self, index: int) -> State:
        return next(r.state for r in self.pool.replicas if r.address == self.replica_address(index))


def gateway_config(tmp_path: Path, tokenizer: ServiceHandle, inference: list[ServiceHandle],
                   cache_address: str = "", generate_mux: bool = True) -> GatewayConfig:
    return GatewayConfig(
        port=0, http_port=0, metrics_port=0, default_model=MODEL,
        cache_address=cache_address, generate_mux=generate_mux,
        tokenizer_address=f"127.0.0.1:{tokenizer.port}",
        inference_address="ipv4:" + ",".join(f"127.0.0.1:{h.port}" for h in inference),
        keys_path=str(tmp_path / "keys.sqlite3"), ledger_path=str(tmp_path / "ledger.sqlite3"),
        admin_key_path=str(tmp_path / "admin.key"), prices=(f"{MODEL}=10/20/1000",),
        routes_path=str(tmp_path / "routes.sqlite3"),
    )


async def start_fleet(tmp_path: Path, cache_address: str = "", generate_mux: bool = True) -> Fleet:
    """Two SERVING fake inference replicas, a tokenizer, and a gateway that reports SERVING."""
    seen = [Seen(), Seen()]
    tokenizer = fake_server("tokenizer", FakeTokenizer())
    inference = [fake_server("inference", FakeInference(s)) for s in seen]
    keys = tenant_keys(tmp_path / "keys.sqlite3")
    gateway = await create_server(gateway_config(tmp_path, tokenizer, inference, cache_address, generate_mux))
    fleet = Fleet(gateway, tokenizer, inference, seen, keys)
    for handle in (tokenizer, *inference, gateway):
        await handle.start()
        await handle.begin_serving()
    await wait_for_serving(fleet.address, TIMEOUT_S)
    await fleet.until(lambda: len(fleet.pool.replicas.usable()) == 2)  # the gateway sees both
    return fleet


async def stop_fleet(fleet: Fleet) -> None:
    for handle in (fleet.gateway, fleet.tokenizer, *fleet.inference):
        await handle.stop(0)


@pytest.fixture
async def fleet(tmp_path: Path) -> AsyncIterator[Fleet]:
    started = await start_fleet(tmp_path)
    try:
        yield started
    finally:
        await stop_fleet(started)


def request(words: int = 3, max_new_tokens: int = 4) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(
        prompt=" ".join(["word"] * words), sampling=common_pb2.SamplingParams(max_new_tokens=max_new_tokens))


async def complete(fleet: Fleet, n: int) -> None:
    async with aio.insecure_channel(fleet.address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        for _ in range(n):
            reply = await stub.Complete(request(), metadata=fleet.auth(), timeout=TIMEOUT_S)
            assert reply.finish_reason == common_pb2.FINISH_REASON_LENGTH


async def test_requests_spread_over_both_replicas_with_one_shared_call_each(fleet: Fleet) -> None:
    await complete(fleet, 10)
    assert [len(s.request_ids) for s in fleet.seen] == [5, 5]  # round-robin
    assert [s.mux_calls for s in fleet.seen] == [1, 1]  # one GenerateMux call per replica, all requests on it


async def test_with_a_call_per_generation_each_still_picks_its_replica(tmp_path: Path) -> None:
    fleet = await start_fleet(tmp_path, generate_mux=False)
    try:
        await complete(fleet, 6)
        assert [len(s.request_ids) for s in fleet.seen] == [3, 3]
        assert [s.mux_calls for s in fleet.seen] == [0, 0]
    finally:
        await stop_fleet(fleet)


async def test_a_not_serving_replica_takes_no_request_until_it_serves_again(fleet: Fleet) -> None:
    await fleet.inference[0].set_serving(False, "maintenance")
    await fleet.until(lambda: fleet.state(0) is State.NOT_SERVING)
    replica = next(r for r in fleet.pool.replicas if r.address == fleet.replica_address(0))
    assert replica.reason == "maintenance"  # its own reason, from its Status
    await complete(fleet, 4)
    assert [len(s.request_ids) for s in fleet.seen] == [0, 4]
    await fleet.inference[0].set_serving(True)
    await fleet.until(lambda: fleet.state(0) is State.SERVING)
    await complete(fleet, 4)
    assert [len(s.request_ids) for s in fleet.seen] == [2, 6]


async def test_a_replica_that_vanishes_mid_stream_fails_its_streams_and_the_rest_go_on(fleet: Fleet) -> None:
    async with aio.insecure_channel(fleet.address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        calls = {f"kill-{i}": stub.Generate(request(words=HANG, max_new_tokens=50),
                                            metadata=(*fleet.auth(), ("x-request-id", f"kill-{i}")), timeout=30)
                 for i in range(6)}
        for call in calls.values():
            assert list((await call.read()).token_ids) == [10]  # each is running, on one replica or the other
        on_dead = set(fleet.seen[1].request_ids)
        assert len(on_dead) == 3
        await fleet.inference[1].server.stop(None)  # abruptly: no NOT_SERVING first
        loop = asyncio.get_running_loop()
        started = loop.time()
        for request_id in sorted(on_dead):
            with pytest.raises(grpc.RpcError) as info:
                await asyncio.wait_for(calls[request_id].read(), 2.0)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert f"inference replica {fleet.replica_address(1)} went away (request_id={request_id})" in \
                info.value.details()
        assert loop.time() - started < 2.0
        await complete(fleet, 6)  # at once, the watch may not have seen it yet: none fails
        for request_id, call in calls.items():
            if request_id not in on_dead:
                call.cancel()
    await fleet.ledger.flush()
    rows = fleet.ledger.query("SELECT request_id, status FROM usage WHERE status = 'UNAVAILABLE'", ())
    assert sorted(rows) == [(request_id, "UNAVAILABLE") for request_id in sorted(on_dead)]
    assert fleet.seen[0].mux_calls == 1


async def gateway_health(fleet: Fleet, wanted: int) -> None:
    """Watch the gateway's own health until it reports ``wanted``."""
    async with aio.insecure_channel(fleet.address) as channel:
        call = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""), timeout=TIMEOUT_S)
        async for reply in call:
            if reply.status == wanted:
                call.cancel()
                return


async def test_the_gateway_is_not_serving_while_no_inference_replica_is(fleet: Fleet) -> None:
    for handle in fleet.inference:
        await handle.set_serving(False, "loading")
    await gateway_health(fleet, health_pb2.HealthCheckResponse.NOT_SERVING)
    assert fleet.gateway.reason.startswith("inference: no replica SERVING (")
    assert f"{fleet.replica_address(0)}: loading" in fleet.gateway.reason
    await fleet.inference[1].begin_serving()
    await gateway_health(fleet, health_pb2.HealthCheckResponse.SERVING)
    await complete(fleet, 2)
    assert [len(s.request_ids) for s in fleet.seen] == [0, 2]


async def test_without_its_cache_the_gateway_serves_uncached(tmp_path: Path) -> None:
    cache = FakeCache()
    server = fake_server("cache", cache)
    await server.start()
    await server.begin_serving()
    fleet = await start_fleet(tmp_path, cache_address=f"127.0.0.1:{server.port}")
    backends = fleet.servicer.pipeline.backends
    assert isinstance(backends.cache, FleetCache)
    caches = backends.cache.pool
    available = fleet.gateway.registry
    try:
        # SERVING waited for the cache's first answer, so the first request is cached
        assert available.get_sample_value("aiserve_gateway_cache_available") == 1.0
        await complete(fleet, 1)
        assert (cache.lookups, cache.stores) == (1, 1)
        await server.server.stop(None)  # the cache goes away
        await caches.wait_for(lambda: not caches.replicas.usable(), TIMEOUT_S)
        assert available.get_sample_value("aiserve_gateway_cache_available") == 0.0
        assert fleet.gateway.is_serving  # the gateway does not need its cache
        await complete(fleet, 2)  # generated: nothing looked up, nothing stored
        assert (cache.lookups, cache.stores) == (1, 1)
        assert sum(len(s.request_ids) for s in fleet.seen) == 3
    finally:
        await stop_fleet(fleet)


async def test_tokenizer_replicas_share_the_work_and_one_going_away_is_left_out(tmp_path: Path) -> None:
    fakes = [FakeTokenizer(), FakeTokenizer()]
    tokenizers = [fake_server("tokenizer", fake) for fake in fakes]
    inference = fake_server("inference", FakeInference(Seen()))
    config = dataclasses.replace(
        gateway_config(tmp_path, tokenizers[0], [inference]),
        tokenizer_address="ipv4:" + ",".join(f"127.0.0.1:{h.port}" for h in tokenizers))
    fleet = Fleet(await create_server(config), tokenizers[0], [inference], [], tenant_keys(tmp_path / "keys.sqlite3"))
    pool = fleet.routes.backends_of(MODEL).tokenizers
    try:
        for handle in (*tokenizers, inference, fleet.gateway):
            await handle.start()
            await handle.begin_serving()
        await pool.wait_for(lambda: len(pool.replicas.usable()) == 2, TIMEOUT_S)
        await complete(fleet, 4)
        assert [f.tokenized for f in fakes] == [2, 2]
        assert [f.mux_calls for f in fakes] == [1, 1]  # one DetokenizeMux call per replica
        await tokenizers[0].server.stop(None)
        await pool.wait_for(lambda: len(pool.replicas.usable()) == 1, TIMEOUT_S)
        await complete(fleet, 2)
        assert [f.tokenized for f in fakes] == [2, 4]
        assert fleet.gateway.is_serving  # one tokenizer replica is enough
    finally:
        for handle in (fleet.gateway, *tokenizers, inference):
            await handle.stop(0)


async def test_a_replica_that_fails_the_pairing_check_is_not_picked(tmp_path: Path) -> None:
    seen = [Seen(), Seen()]
    tokenizer = fake_server("tokenizer", FakeTokenizer())
    inference = [fake_server("inference", FakeInference(seen[0])),
                 fake_server("inference", FakeInference(seen[1], tokenizer_sha256="fff"))]
    keys = tenant_keys(tmp_path / "keys.sqlite3")
    fleet = Fleet(await create_server(gateway_config(tmp_path, tokenizer, inference)), tokenizer, inference, seen, keys)
    try:
        for handle in (tokenizer, *inference, fleet.gateway):
            await handle.start()
            await handle.begin_serving()
        await fleet.until(lambda: fleet.state(0) is State.SERVING and fleet.state(1) is State.SERVING)
        await complete(fleet, 4)
        assert [len(s.request_ids) for s in fleet.seen] == [4, 0]
        refused = next(r for r in fleet.pool.replicas if r.address == fleet.replica_address(1))
        assert not refused.is_usable and refused.reason.startswith("tokenizer mismatch: tokenizer serves")
        await inference[0].server.stop(None)  # only the refused replica is left: a deployment's mistake
        await fleet.until(lambda: fleet.state(0) is State.UNREACHABLE)
        async with aio.insecure_channel(fleet.address) as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            with pytest.raises(grpc.RpcError) as info:
                await stub.Complete(request(), metadata=fleet.auth(), timeout=TIMEOUT_S)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "tokenizer sha256" in (info.value.details() or "")  # what differs
    finally:
        for handle in (fleet.gateway, tokenizer, *inference):
            await handle.stop(0)


async def test_a_replica_killed_with_sigkill_under_load(tmp_path: Path) -> None:
    """A real process killed outright: its sockets close without a goodbye."""
    child = await asyncio.create_subprocess_exec(sys.executable, "-m", "tests.unit.gateway.fake_replica",
                                                 stdout=asyncio.subprocess.PIPE, cwd=ROOT)
    try:
        assert child.stdout is not None
        port = await asyncio.wait_for(announced_port(child.stdout), TIMEOUT_S)
        seen = [Seen()]
        tokenizer = fake_server("tokenizer", FakeTokenizer())
        local = fake_server("inference", FakeInference(seen[0]))
        config = dataclasses.replace(gateway_config(tmp_path, tokenizer, [local]),
                                     inference_address=f"ipv4:127.0.0.1:{local.port},127.0.0.1:{port}")
        fleet = Fleet(await create_server(config), tokenizer, [local], seen, tenant_keys(tmp_path / "keys.sqlite3"))
        try:
            for handle in (tokenizer, local, fleet.gateway):
                await handle.start()
                await handle.begin_serving()
            await fleet.until(lambda: len(fleet.pool.replicas.usable()) == 2)
            await kill_under_load(fleet, child, f"127.0.0.1:{port}")
        finally:
            for handle in (fleet.gateway, tokenizer, local):
                await handle.stop(0)
    finally:
        if child.returncode is None:
            child.kill()
        await child.wait()


async def announced_port(stdout: asyncio.StreamReader) -> int:
    """The port line the child prints among its log lines."""
    while not (line := (await stdout.readline()).strip()).startswith(b"port="):
        assert line, "the fake replica exited before it listened"
    return int(line.removeprefix(b"port="))


async def kill_under_load(fleet: Fleet, child: asyncio.subprocess.Process, address: str) -> None:
    """Six hanging streams over both replicas; SIGKILL the child: its streams end at once,
    naming it and their request ids, and new requests all succeed."""
    async with aio.insecure_channel(fleet.address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        calls = {f"k-{i}": stub.Generate(request(words=HANG, max_new_tokens=50),
                                         metadata=(*fleet.auth(), ("x-request-id", f"k-{i}")), timeout=30)
                 for i in range(6)}
        for call in calls.values():
            await call.read()
        on_child = sorted(set(calls) - set(fleet.seen[0].request_ids))
        assert len(on_child) == 3
        child.send_signal(signal.SIGKILL)
        started = asyncio.get_running_loop().time()
        for request_id in on_child:
            with pytest.raises(grpc.RpcError) as info:
                await asyncio.wait_for(calls[request_id].read(), 2.0)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert f"inference replica {address} went away (request_id={request_id})" in info.value.details()
        assert asyncio.get_running_loop().time() - started < 2.0
        await complete(fleet, 6)
        for request_id in set(calls) - set(on_child):
            calls[request_id].cancel()
