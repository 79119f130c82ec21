"""The supervisor and the drain, with real processes: a killed child is started again on its
port, one that cannot start makes the supervisor give up and stop the suite, and generations in
flight survive SIGTERM of the suite (gateway first), after which every process exits 0."""

from __future__ import annotations

import asyncio
import io
import json
import os
import signal
import sys
from collections.abc import AsyncIterator, Iterable
from pathlib import Path

import httpx
import pytest
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from aiserve.store import ModelStore
from aiserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from suite.runner import Suite, SuiteConfig
from suite.supervisor import GaveUp
from tests.integration.conftest import auth, config_for_tests, dev_key, log_records
from tests.integration.test_e2e import TIMEOUT_S, chat_request

NUM_STREAMS = 16


def config_for(home: Path, store: ModelStore) -> SuiteConfig:
    config = config_for_tests(home, store.root)
    config.restart_backoff_s = 0.2
    return config


@pytest.fixture
async def tokenizer_only(tmp_path: Path, store: ModelStore) -> AsyncIterator[Suite]:
    """A suite of one SERVING tokenizer (the cheapest service to restart), stopped at the end."""
    suite = Suite(config_for(tmp_path / "home", store))
    try:
        suite.start_service("tokenizer")
        await suite.wait_serving(("tokenizer",), timeout_s=TIMEOUT_S)
        yield suite
    finally:
        suite.stop()


async def health(address: str) -> int:
    async with aio.insecure_channel(address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT_S)
    return int(reply.status)


def supervisor_records(suite: Suite) -> list[dict[str, object]]:
    return [json.loads(line) for line in (suite.log_dir / "supervisor.log").read_text().splitlines()]


async def test_a_killed_service_is_restarted_on_its_port(tokenizer_only: Suite) -> None:
    suite, out = tokenizer_only, io.StringIO()
    port, first = suite.config.ports["tokenizer"], suite.processes["tokenizer"]
    supervisor = asyncio.create_task(suite.supervise(out))
    try:
        suite.kill("tokenizer")  # SIGKILL: a crash
        await suite.wait_restarted("tokenizer", 1, timeout_s=TIMEOUT_S)
        assert suite.restart_count("tokenizer") == 1
        assert first.returncode == -signal.SIGKILL and suite.processes["tokenizer"] is not first
        assert suite.config.ports["tokenizer"] == port  # the same port: a gateway's address stays right
        assert await health(suite.config.address("tokenizer")) == health_pb2.HealthCheckResponse.SERVING
        assert "tokenizer exited with code -9 unasked; restart 1" in out.getvalue()
        records = supervisor_records(suite)
        assert [(r["event"], r["instance"], r["restart"]) for r in records] == [
            ("restart", "tokenizer", 1), ("serving", "tokenizer", 1)]
        assert records[0]["exit_code"] == -signal.SIGKILL and records[0]["backoff_s"] == 0.2

        # A stop is not a crash: nothing restarts a service stopped on purpose.
        assert suite.stop_service("tokenizer") == 0
        suite.start_service("tokenizer")  # started again by hand; the supervisor watches this one now
        await suite.wait_serving(("tokenizer",), timeout_s=TIMEOUT_S)
        assert suite.restart_count("tokenizer") == 1
        assert await suite.shutdown() == {"tokenizer": 0}
        await asyncio.wait_for(supervisor, TIMEOUT_S)  # the suite stopped: the supervisor ends
        assert suite.restart_count("tokenizer") == 1 and not suite.processes
    finally:
        supervisor.cancel()


async def test_a_service_that_cannot_start_makes_the_supervisor_give_up(tokenizer_only: Suite) -> None:
    suite, out = tokenizer_only, io.StringIO()
    suite.config.restart_backoff_s, suite.config.restart_max_backoff_s = 0.05, 0.1
    suite.config.max_start_failures = 2
    supervisor = asyncio.create_task(suite.supervise(out))
    try:
        # From now on it cannot start: a setting out of range makes it exit 2 at once.
        suite.config.instance_env["tokenizer"] = {"AISERVE_TOKENIZER_GRACE_S": "9999"}
        suite.kill("tokenizer")
        with pytest.raises(GaveUp) as info:
            await asyncio.wait_for(supervisor, TIMEOUT_S)
    finally:
        supervisor.cancel()
    assert info.value.name == "tokenizer"
    message = str(info.value)
    assert "tokenizer failed to start 2 times in a row (last exit code 2)" in message
    assert "grace_s: must be 0..600" in message  # the tail of its log says why
    assert suite.restart_count("tokenizer") == 2
    assert not suite.processes  # it stopped everything
    assert [r["event"] for r in supervisor_records(suite)] == ["restart", "restart", "gave_up"]
    assert "giving up" in out.getvalue()


def event_time(suite: Suite, name: str, event: str) -> str:
    """The ISO timestamp of an instance's log record ``event`` (the last one)."""
    return [r for r in log_records(suite, name) if r.get("event") == event][-1]["timestamp"]  # type: ignore[return-value]


class Streams:
    """Generations through the gateway, each recording how it ended."""

    def __init__(self, suite: Suite) -> None:
        self.address, self.key = suite.config.address("gateway"), dev_key(suite)
        self.started = 0
        self.all_started = asyncio.Event()
        self.finished: list[gateway_pb2.GenerateResponse] = []

    async def one(self, i: int) -> gateway_pb2.GenerateResponse:
        request = chat_request(f"Write a long essay about the history of city number {i}.", max_new_tokens=64,
                               cache=gateway_pb2.CACHE_POLICY_BYPASS)
        async with aio.insecure_channel(self.address) as channel:
            call = gateway_pb2_grpc.GatewayStub(channel).Generate(request, timeout=TIMEOUT_S, metadata=auth(self.key))
            messages = []
            async for message in call:
                if not messages:
                    self.started += 1
                    if self.started == NUM_STREAMS:
                        self.all_started.set()
                messages.append(message)
        self.finished.append(messages[-1])
        return messages[-1]


async def test_generations_in_flight_survive_sigterm_of_the_suite(tmp_path: Path, store: ModelStore) -> None:
    config = config_for(tmp_path / "home", store)
    config.extra_env["AISERVE_GATEWAY_GRACE_S"] = "60"  # a busy CI machine: room to finish 16 streams
    suite = Suite(config)
    supervisor: asyncio.Task[None] | None = None
    try:
        await suite.start(timeout_s=300)
        supervisor = asyncio.create_task(suite.supervise(io.StringIO()))
        streams = Streams(suite)
        generations = [asyncio.create_task(streams.one(i)) for i in range(NUM_STREAMS)]
        await asyncio.wait_for(streams.all_started.wait(), TIMEOUT_S)
        in_flight = NUM_STREAMS - len(streams.finished)
        codes = await suite.shutdown()  # SIGTERM: the gateway drains first, then the backends stop
        lasts = await asyncio.wait_for(asyncio.gather(*generations), TIMEOUT_S)
        await asyncio.wait_for(supervisor, TIMEOUT_S)
    finally:
        if supervisor is not None:
            supervisor.cancel()
        suite.stop()
    assert in_flight >= NUM_STREAMS // 2, "the generations had finished before the suite was stopped"
    for last in lasts:
        assert last.HasField("usage") and last.usage.completion_tokens > 0
        assert last.finish_reason in (common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH)
    assert codes == dict.fromkeys(("gateway", "tokenizer", "inference", "cache"), 0)
    # The gateway had drained and exited before any backend began to stop.
    gateway_stopped = event_time(suite, "gateway", "stopped")
    assert all(gateway_stopped < event_time(suite, name, "stopping") for name in config.backend_names)
    assert all(suite.restart_count(name) == 0 for name in config.instance_names)


async def read_until(stdout: asyncio.StreamReader, needle: str, timeout_s: float) -> str:
    """What ``aiserve run`` printed up to and including the line holding ``needle``."""
    seen = ""
    while needle not in seen:
        line = await asyncio.wait_for(stdout.readline(), timeout_s)
        if not line:
            raise AssertionError(f"aiserve run ended before it printed {needle!r}:\n{seen}")
        seen += line.decode()
    return seen


async def test_aiserve_run_with_two_replicas_drains_on_sigterm_and_exits_0(tmp_path: Path, store: ModelStore) -> None:
    home = tmp_path / "home"
    run = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "suite", "run", "--inference-replicas", "2",
        env=suite_env(home, store.root), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    assert run.stdout is not None
    try:
        banner = await read_until(run.stdout, "aiserve is SERVING", 300)
        banner += await read_until(run.stdout, "Ctrl-C", TIMEOUT_S)
        assert "inference-0:" in banner and "inference-1:" in banner
        assert (home / "admin.key").is_file()
        http = next(line.split()[1] for line in banner.splitlines() if line.strip().startswith("http:"))
        async with httpx.AsyncClient(timeout=TIMEOUT_S) as client:  # the address it announced serves
            assert (await client.get(http.removesuffix("/v1") + "/health")).json() == {"status": "serving"}
        run.send_signal(signal.SIGTERM)
        rest = (await asyncio.wait_for(run.stdout.read(), TIMEOUT_S)).decode()
        assert await asyncio.wait_for(run.wait(), TIMEOUT_S) == 0, rest
    finally:
        if run.returncode is None:  # it failed: stop it the way an operator would (it stops its children)
            run.send_signal(signal.SIGTERM)
            await asyncio.wait_for(run.wait(), TIMEOUT_S)
    stopped = next(line for line in rest.splitlines() if line.startswith("stopped: "))
    assert stopped.startswith("stopped: gateway exit 0, ")
    assert sorted(stopped.removeprefix("stopped: ").split(", ")) == sorted(
        f"{name} exit 0" for name in ("gateway", "tokenizer", "inference-0", "inference-1", "cache"))
    assert (home / "logs" / "inference-0.log").is_file() and (home / "logs" / "inference-1.log").is_file()


def children_of(pid: int) -> dict[str, int]:
    """The child processes of ``pid`` by the module they run (``services.tokenizer``: pid)."""
    found = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            argv = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
            found[argv[2].decode()] = int(child)
    return found


def still_running(pids: Iterable[int]) -> list[int]:
    return [pid for pid in pids if Path(f"/proc/{pid}").exists()]


def suite_env(home: Path, store_root: Path) -> dict[str, str]:
    """``aiserve run``'s environment: its own home and store, every port bound by the service."""
    env = {**os.environ, "AISERVE_HOME": str(home), "AISERVE_MODEL_STORE": str(store_root)}
    for service in ("gateway", "tokenizer", "inference", "cache"):
        env[f"AISERVE_{service.upper()}_PORT"] = env[f"AISERVE_{service.upper()}_METRICS_PORT"] = "0"
    env["AISERVE_GATEWAY_HTTP_PORT"] = "-1"  # a free port, announced (0 would turn HTTP off)
    return env


async def test_aiserve_run_gives_up_on_a_service_that_cannot_start_again(tmp_path: Path, store: ModelStore) -> None:
    link = tmp_path / "store"  # the model store, through a link the test can point elsewhere
    link.symlink_to(store.root)
    run = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "suite", "run", env=suite_env(tmp_path / "home", link),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    assert run.stdout is not None
    try:
        await read_until(run.stdout, "Ctrl-C", 300)
        children = children_of(run.pid)
        assert set(children) == {f"services.{name}" for name in ("gateway", "tokenizer", "inference", "cache")}
        (tmp_path / "empty").mkdir()
        link.unlink()
        link.symlink_to(tmp_path / "empty")  # from now on the model is not in the store
        os.kill(children["services.tokenizer"], signal.SIGKILL)
        # Five failed starts, 1 + 2 + 4 + 8 + 16 s apart, then it gives up and stops everything.
        rest = (await asyncio.wait_for(run.stdout.read(), 240)).decode()
        assert await asyncio.wait_for(run.wait(), TIMEOUT_S) == 1, rest
    finally:
        if run.returncode is None:
            run.send_signal(signal.SIGTERM)
            await asyncio.wait_for(run.wait(), TIMEOUT_S)
    assert "aiserve: tokenizer exited with code -9 unasked; restart 1 in 1.0s" in rest
    assert "restart 5 in 16.0s" in rest and "restart 6" not in rest
    assert "aiserve: tokenizer failed to start 5 times in a row (last exit code 2)" in rest
    assert "not in the store" in rest  # the end of the tokenizer's log says why
    assert not still_running(children.values())  # it stopped every service
