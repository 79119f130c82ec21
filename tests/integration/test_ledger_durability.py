"""SIGKILL the gateway under load: no request whose final message was delivered loses its row."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

import grpc
from grpc import aio

from aiserve.common.paths import LEDGER_FILE
from aiserve.v1 import gateway_pb2, gateway_pb2_grpc
from suite.process import wait_exit
from suite.runner import BACKENDS, Suite, SuiteConfig
from tests.integration.conftest import auth, create_tenant, ledger_rows, new_request_id
from tests.integration.test_e2e import TIMEOUT_S, chat_request

NUM_REQUESTS = 16
KILL_AFTER = 4
"""Finished requests before the kill; the others are in flight or not yet started."""


class Load:
    """Generations through one gateway; remembers the requests whose final message arrived."""

    def __init__(self, address: str, key: str) -> None:
        self.address, self.key = address, key
        self.delivered: list[str] = []
        self.enough = asyncio.Event()
        """Set once KILL_AFTER final messages arrived."""

    async def one(self, i: int) -> None:
        rid = new_request_id()
        request = chat_request(f"Count to {i + 3}.", max_new_tokens=8, cache=gateway_pb2.CACHE_POLICY_BYPASS)
        async with aio.insecure_channel(self.address) as channel:
            call = gateway_pb2_grpc.GatewayStub(channel).Generate(
                request, metadata=(*auth(self.key), ("x-request-id", rid)), timeout=TIMEOUT_S
            )
            try:
                async for message in call:
                    if message.HasField("usage"):  # the final message reached the client
                        self.delivered.append(rid)
                        if len(self.delivered) >= KILL_AFTER:
                            self.enough.set()
            except grpc.RpcError:
                pass  # killed in flight: nothing was delivered, so nothing is owed


async def test_sigkill_under_load_loses_no_row_of_a_delivered_answer(suite: Suite, tmp_path: Path) -> None:
    # A second gateway of its own (own home, own ledger) in front of the suite's backends.
    config = SuiteConfig.for_tests(tmp_path / "home")
    for backend in BACKENDS:
        config.ports[backend] = suite.config.ports[backend]
    side = Suite(config)
    tenant, key = create_tenant(config.home, "durable", "paid")
    try:
        side.start_service("gateway")
        await side.wait_serving(("gateway",), timeout_s=120)
        load = Load(config.address("gateway"), key)
        requests = [asyncio.create_task(load.one(i)) for i in range(NUM_REQUESTS)]
        await asyncio.wait_for(load.enough.wait(), TIMEOUT_S)
        process = side.processes["gateway"]
        process.kill()  # SIGKILL: no handler, no flush, no goodbye
        await wait_exit(process)
        await asyncio.gather(*requests)
        delivered = load.delivered
        assert len(delivered) >= KILL_AFTER
        with sqlite3.connect(config.home / LEDGER_FILE) as db:
            assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        side.start_service("gateway")  # restart on the same ledger (and the same port)
        await side.wait_serving(("gateway",), timeout_s=120)
        rows = {r.request_id: r for r in ledger_rows(config.home, tenant)}
        assert set(delivered) <= set(rows), set(delivered) - set(rows)
        assert all(rows[rid].status == "OK" and rows[rid].cost_micros > 0 for rid in delivered)
        async with aio.insecure_channel(config.address("gateway")) as channel:
            usage = await gateway_pb2_grpc.GatewayStub(channel).GetUsage(
                gateway_pb2.UsageRequest(), metadata=auth(key), timeout=TIMEOUT_S
            )
        assert usage.total.requests == len(rows) >= len(delivered)
    finally:
        side.stop()
