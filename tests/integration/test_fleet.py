"""Two inference replicas behind one gateway, as real processes: load sharing, a replica taken
out by its probe and back, the gateway's health, and a replica killed under load."""

from __future__ import annotations

import asyncio
import io
import json
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import grpc
import pytest
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from aiserve.store import ModelStore
from aiserve.v1 import (
    admin_pb2,
    admin_pb2_grpc,
    cache_pb2,
    cache_pb2_grpc,
    gateway_pb2,
    gateway_pb2_grpc,
    inference_pb2,
    inference_pb2_grpc,
    status_pb2,
)
from suite.runner import Suite
from tests.integration.conftest import (
    auth,
    config_for_tests,
    dev_key,
    eventually,
    ledger_rows,
    new_request_id,
    run_suite,
)
from tests.integration.test_e2e import TIMEOUT_S, chat_request

REPLICAS = ("inference-0", "inference-1")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, store: ModelStore) -> Iterator[Suite]:
    home = tmp_path_factory.mktemp("aiserve-fleet")
    config = config_for_tests(home, store.root, inference_replicas=2)
    config.extra_env.update({
        "AISERVE_INFERENCE_MAX_NUM_SEQS": "32",
        "AISERVE_INFERENCE_KV_CACHE_BYTES": str(1 << 30),
        "AISERVE_INFERENCE_MAX_SEQ_LEN": "1024",
        "AISERVE_INFERENCE_HEALTH_PROBE_INTERVAL_S": "0.2",
    })
    for name in REPLICAS:
        config.instance_env[name] = {"AISERVE_INFERENCE_FAULT_FILE": str(fault_file(home, name))}
    yield from run_suite(config)


def fault_file(home: Path, name: str) -> Path:
    return home / f"fault-{name}"


async def wait_health(address: str, wanted: int, timeout_s: float = 60) -> None:
    """Block until ``address`` reports ``wanted`` over Health.Watch (an event, no polling)."""
    async with aio.insecure_channel(address) as channel:
        call = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=timeout_s)
        async for reply in call:
            if reply.status == wanted:
                call.cancel()
                return
    raise AssertionError(f"{address} never reported {wanted}")


async def fleet_status(suite: Suite) -> admin_pb2.FleetStatus:
    key = suite.admin_key_path.read_text().strip()
    async with aio.insecure_channel(suite.config.address("gateway")) as channel:
        return await admin_pb2_grpc.AdminStub(channel).GetFleetStatus(
            admin_pb2.FleetStatusRequest(), metadata=auth(key), timeout=10)


async def gateway_sees(suite: Suite, name: str, state: int) -> None:
    """Wait until the gateway's view of replica ``name`` is ``state`` (its watch is a stream
    inside the gateway; nothing announces its change to a client, so this asks again)."""
    address = suite.config.address(name)
    deadline = time.monotonic() + 60
    while True:
        status = await fleet_status(suite)
        if any(b.address.endswith(address) and b.state == state for b in status.backends):
            return
        assert time.monotonic() < deadline, f"the gateway never saw {name} as {state}: {status}"
        await asyncio.sleep(0.1)


async def num_requests(suite: Suite) -> dict[str, int]:
    counts = {}
    for name in REPLICAS:
        async with aio.insecure_channel(suite.config.address(name)) as channel:
            stats = await inference_pb2_grpc.InferenceStub(channel).Stats(
                inference_pb2.InferenceStatsRequest(), timeout=10)
            counts[name] = stats.num_requests
    return counts


async def complete_many(suite: Suite, n: int, max_new_tokens: int = 8) -> list[gateway_pb2.CompleteResponse]:
    key = dev_key(suite)
    async with aio.insecure_channel(suite.config.address("gateway")) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        return await asyncio.gather(*(
            stub.Complete(chat_request(f"Count to {i}.", max_new_tokens, cache=gateway_pb2.CACHE_POLICY_BYPASS),
                          metadata=auth(key), timeout=TIMEOUT_S)
            for i in range(n)))


async def test_two_replicas_share_64_concurrent_requests(fleet: Suite) -> None:
    before = await num_requests(fleet)
    replies = await complete_many(fleet, 64)
    assert all(r.usage.completion_tokens > 0 for r in replies)
    after = await num_requests(fleet)
    served = {name: after[name] - before[name] for name in REPLICAS}
    assert sum(served.values()) == 64, served
    assert all(0.3 * 64 <= count <= 0.7 * 64 for count in served.values()), served


async def test_a_replica_failing_its_probe_gets_no_requests_and_comes_back(fleet: Suite) -> None:
    fault = fault_file(fleet.config.home, "inference-1")
    fault.touch()
    try:
        await wait_health(fleet.config.address("inference-1"), health_pb2.HealthCheckResponse.NOT_SERVING)
        await gateway_sees(fleet, "inference-1", status_pb2.SERVING_STATE_NOT_SERVING)
        status = await fleet_status(fleet)
        down = [b for b in status.backends if b.address.endswith(fleet.config.address("inference-1"))]
        assert "fault injected" in down[0].reason
        assert status.gateway.state == status_pb2.SERVING_STATE_SERVING  # one replica is enough
        before = await num_requests(fleet)
        await complete_many(fleet, 16)
        after = await num_requests(fleet)
        assert after["inference-1"] == before["inference-1"]
        assert after["inference-0"] - before["inference-0"] == 16
    finally:
        fault.unlink(missing_ok=True)
    await wait_health(fleet.config.address("inference-1"), health_pb2.HealthCheckResponse.SERVING)
    await gateway_sees(fleet, "inference-1", status_pb2.SERVING_STATE_SERVING)
    before = await num_requests(fleet)
    await complete_many(fleet, 16)
    after = await num_requests(fleet)
    assert after["inference-1"] > before["inference-1"]


async def test_the_gateway_is_not_serving_while_no_inference_replica_is(fleet: Suite) -> None:
    gateway = fleet.config.address("gateway")
    faults = [fault_file(fleet.config.home, name) for name in REPLICAS]
    for fault in faults:
        fault.touch()
    try:
        await wait_health(gateway, health_pb2.HealthCheckResponse.NOT_SERVING)
        status = await fleet_status(fleet)  # Admin still answers: the gateway is up, not serving
        assert status.gateway.state == status_pb2.SERVING_STATE_NOT_SERVING
        assert "inference" in status.gateway.reason
        async with aio.insecure_channel(gateway) as channel:
            with pytest.raises(grpc.RpcError) as info:
                await gateway_pb2_grpc.GatewayStub(channel).Complete(
                    chat_request("Hi", 4, cache=gateway_pb2.CACHE_POLICY_BYPASS),
                    metadata=auth(dev_key(fleet)), timeout=TIMEOUT_S)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        for fault in faults:
            fault.unlink(missing_ok=True)
    await wait_health(gateway, health_pb2.HealthCheckResponse.SERVING)
    assert (await complete_many(fleet, 2))[0].usage.completion_tokens > 0


async def status_command(suite: Suite) -> tuple[int, dict[str, str]]:
    """``aiserve status --json`` as an operator runs it (a process of its own; the loop keeps
    running): its exit code and each replica's state by the inference instance's name."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "suite", "status", "--json", "--address", suite.config.address("gateway"),
        "--admin-key", suite.admin_key_path.read_text().strip(),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    output, errors = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode in (0, 1), errors.decode()
    rows = json.loads(output)["services"]
    states = {name: row["state"] for name in REPLICAS for row in rows
              if row["address"].endswith(suite.config.address(name))}
    assert set(states) == set(REPLICAS), rows
    return process.returncode, states


async def eventually_async(read: Callable[[], Awaitable[int]], wanted: int, timeout_s: float = 30) -> None:
    """Wait until ``read()`` gives ``wanted`` (stores reach the cache after the stream ended)."""
    deadline = time.monotonic() + timeout_s
    while (got := await read()) != wanted:
        assert time.monotonic() < deadline, f"got {got}, wanted {wanted}"
        await asyncio.sleep(0.05)


async def cache_entries(suite: Suite) -> int:
    async with aio.insecure_channel(suite.config.address("cache")) as channel:
        info = await cache_pb2_grpc.CacheStub(channel).Info(cache_pb2.CacheInfoRequest(), timeout=10)
        return info.entries


class Stream:
    """One long generation through the gateway, read until it ends or fails."""

    def __init__(self, stub: gateway_pb2_grpc.GatewayStub, key: str, i: int) -> None:
        self.request_id = new_request_id()
        request = chat_request(f"Write a long story about a lighthouse keeper named Keeper{i}.", 200)
        self.call = stub.Generate(request, timeout=TIMEOUT_S,
                                  metadata=auth(key) + (("x-request-id", self.request_id),))
        self.first_token = asyncio.Event()
        self.error: grpc.RpcError | None = None
        self.ended_at = 0.0
        self.finish_reason = 0

    async def run(self) -> None:
        try:
            async for message in self.call:
                self.first_token.set()
                if message.HasField("usage"):
                    self.finish_reason = message.finish_reason
        except grpc.RpcError as exc:
            self.error = exc
        self.ended_at = time.monotonic()


async def test_sigkill_of_a_replica_under_load(fleet: Suite) -> None:
    supervisor = asyncio.create_task(fleet.supervise(io.StringIO()))
    try:
        await sigkill_under_load(fleet)
    finally:
        supervisor.cancel()


async def sigkill_under_load(fleet: Suite) -> None:
    entries_before = await cache_entries(fleet)
    restarts = fleet.restart_count("inference-1")
    key = dev_key(fleet)
    async with aio.insecure_channel(fleet.config.address("gateway")) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        streams = [Stream(stub, key, i) for i in range(32)]
        tasks = [asyncio.ensure_future(s.run()) for s in streams]
        await asyncio.wait_for(asyncio.gather(*(s.first_token.wait() for s in streams)), TIMEOUT_S)
        fleet.kill("inference-1", signal.SIGKILL)
        killed_at = time.monotonic()
        # While inference-1 restarts (backoff, then loading), `aiserve status` shows it down...
        shown = asyncio.ensure_future(status_command(fleet))
        # ...and new requests right after the kill go to the surviving replica: none fails.
        after_kill = await complete_many(fleet, 16)
        assert all(r.usage.completion_tokens > 0 for r in after_kill)
        await asyncio.wait_for(asyncio.gather(*tasks), TIMEOUT_S)
        code, states = await shown
    failed = [s for s in streams if s.error is not None]
    held = [s for s in streams if s.error is None]
    assert failed and held, f"{len(failed)} failed, {len(held)} held: both replicas should have had streams"
    for s in failed:
        assert s.error is not None and s.error.code() == grpc.StatusCode.UNAVAILABLE, s.error
        assert s.request_id in (s.error.details() or "")
        assert s.ended_at - killed_at < 2.0, f"{s.request_id} ended {s.ended_at - killed_at:.2f}s after the kill"
    assert all(s.finish_reason for s in held)
    # Down: unreachable while it is gone, NOT_SERVING once restarted and still loading.
    assert code == 1 and states["inference-0"] == "SERVING", (code, states)
    assert states["inference-1"] in ("UNREACHABLE", "NOT_SERVING"), states
    failed_ids = {s.request_id for s in failed}
    await eventually(lambda: failed_ids <= {
        r.request_id for r in ledger_rows(fleet.config.home) if r.status == "UNAVAILABLE"},
        what="an UNAVAILABLE ledger row for each failed stream")
    # Nothing partial was cached: the finished streams were stored, the failed ones not.
    await eventually_async(lambda: cache_entries(fleet), entries_before + len(held))
    await fleet.wait_restarted("inference-1", restarts + 1, timeout_s=300)
    await gateway_sees(fleet, "inference-1", status_pb2.SERVING_STATE_SERVING)
    code, states = await status_command(fleet)
    assert code == 0 and set(states.values()) == {"SERVING"}, (code, states)
    before = await num_requests(fleet)
    await complete_many(fleet, 16)
    after = await num_requests(fleet)
    assert after["inference-1"] > before["inference-1"], "the restarted replica is back in rotation"
