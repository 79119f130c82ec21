"""A pool of replicas over real sockets: a dns:/// target's replicas added and removed as its
name's answer changes (the name server's answer is the test's), and a request waiting for a
pool that is still connecting."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from aiserve.common.errors import Unavailable
from aiserve.common.server import ServiceHandle
from services.gateway.metrics import ReplicaCollector
from services.gateway.pool import ReplicaPool
from services.gateway.replica_clients import TokenizerClients
from services.gateway.replicas import State
from services.gateway.targets import GetAddrInfo, parse_target
from tests.unit.gateway.server_fakes import FakeTokenizer, fake_server

TIMEOUT_S = 10.0


@pytest.fixture
async def tokenizer() -> AsyncIterator[ServiceHandle]:
    handle = fake_server("tokenizer", FakeTokenizer())
    await handle.start()
    await handle.begin_serving()
    try:
        yield handle
    finally:
        await handle.stop(0)


def pool_of(text: str, getaddrinfo: GetAddrInfo | None = None) -> ReplicaPool[TokenizerClients]:
    return ReplicaPool("tokenizer", "m@1", parse_target("tokenizer_address", text), TokenizerClients, 0.05,
                       lambda: None, getaddrinfo)


async def test_a_dns_target_is_the_replicas_its_name_resolves_to_as_the_answer_changes(
        tokenizer: ServiceHandle) -> None:
    port = tokenizer.port
    answer = ["127.0.0.1"]

    async def getaddrinfo(host: str, wanted: int, **kwargs: Any) -> list[tuple[Any, ...]]:
        assert (host, wanted) == ("tokenizer.aiserve.svc", port)
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port)) for ip in answer]

    pool = pool_of(f"dns:///tokenizer.aiserve.svc:{port}", getaddrinfo)
    serving, silent = f"127.0.0.1:{port}", f"127.0.0.2:{port}"  # nothing listens on 127.0.0.2
    try:
        replica = await pool.pick_ready(timeout_s=TIMEOUT_S)  # waits for the name and the watch
        assert replica.address == serving and replica.state is State.SERVING
        answer.append("127.0.0.2")  # a second replica appears: added, and seen unreachable
        await pool.wait_for(lambda: silent in pool.replicas.addresses()
                            and all(r.has_answered for r in pool.replicas), TIMEOUT_S)
        assert {r.address: r.state for r in pool.replicas} == {serving: State.SERVING, silent: State.UNREACHABLE}
        assert {pool.pick().address for _ in range(4)} == {serving}
        answer.remove("127.0.0.1")  # the first one leaves the answer: removed
        await pool.wait_for(lambda: pool.replicas.addresses() == (silent,), TIMEOUT_S)
        with pytest.raises(Unavailable, match=rf"tokenizer unavailable: no replica SERVING \({silent}: UNAVAILABLE"):
            pool.pick()
    finally:
        await pool.close()


async def test_a_request_waits_for_a_new_replica_to_answer_not_longer(tokenizer: ServiceHandle) -> None:
    pool = pool_of(f"127.0.0.1:{tokenizer.port}")
    try:
        assert pool.is_settling  # its watch has not answered yet
        assert (await pool.pick_ready(timeout_s=TIMEOUT_S)).address == f"127.0.0.1:{tokenizer.port}"
        await tokenizer.set_serving(False, "draining")
        await pool.wait_for(lambda: not pool.replicas.usable(), TIMEOUT_S)
        started = asyncio.get_running_loop().time()
        with pytest.raises(Unavailable, match="draining"):
            await pool.pick_ready(timeout_s=TIMEOUT_S)  # settled: refused at once
        assert asyncio.get_running_loop().time() - started < 1.0
    finally:
        await pool.close()


async def test_the_replica_gauges_count_known_and_serving_replicas_at_scrape_time(tokenizer: ServiceHandle) -> None:
    registry = CollectorRegistry()
    pool = pool_of(f"ipv4:127.0.0.1:{tokenizer.port},127.0.0.2:{tokenizer.port}")  # nothing listens on .2
    registry.register(ReplicaCollector(lambda: [pool]))
    labels = {"model": "m@1", "service": "tokenizer"}
    try:
        await pool.wait_for(lambda: all(r.has_answered for r in pool.replicas), TIMEOUT_S)
        assert registry.get_sample_value("aiserve_gateway_replicas", labels) == 2
        assert registry.get_sample_value("aiserve_gateway_healthy_replicas", labels) == 1
        await tokenizer.set_serving(False, "draining")
        await pool.wait_for(lambda: not pool.replicas.usable(), TIMEOUT_S)
        assert registry.get_sample_value("aiserve_gateway_healthy_replicas", labels) == 0  # reported, at 0
    finally:
        await pool.close()
