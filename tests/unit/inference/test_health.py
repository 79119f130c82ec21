"""Inference health that tells the truth: the engine's probe on the real model, and the health
loop seen over real gRPC (grpc.health.v1 Watch, the Status rpc, the server's metrics)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path

import grpc
import pytest
import torch
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.registry import CollectorRegistry

from aiserve.common.config import ConfigError, config_with
from aiserve.common.server import ServiceHandle
from aiserve.store import Manifest, ModelStore
from aiserve.v1 import inference_pb2, inference_pb2_grpc, status_pb2, status_pb2_grpc
from services.inference.batch_engine import BatchEngine
from services.inference.config import InferenceConfig
from services.inference.engine_config import EngineConfig, KVCacheConfig, SchedulerConfig
from services.inference.health import (
    HealthConfig,
    InferenceHealth,
    Verdict,
    host_free_bytes,
    memory_verdict,
)
from services.inference.health_probe import ProbeFailed
from services.inference.llama import LlamaModel
from services.inference.request import GenerateRequest, TokenEvent
from services.inference.server import InferenceServicer, create_server
from tests.unit.inference.engine_probes import TIMEOUT_S, Events, StepGate
from tests.unit.inference.test_server import own_metric

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
PROMPT = [1, 9690, 198, 19556, 30, 2, 198, 1, 520, 9531, 198]


# --- the engine's probe -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def model(model_dir: Path, two_torch_threads: None) -> LlamaModel:
    return LlamaModel.load(model_dir, "cpu", torch.float32)


@asynccontextmanager
async def running(model: LlamaModel, max_num_seqs: int = 4) -> AsyncIterator[BatchEngine]:
    scheduler = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=128)
    kv = KVCacheConfig(kv_cache_bytes=64 << 20, max_seq_len=256, prefix_cache_fraction=0.0)
    engine = BatchEngine(model, frozenset({2}), EngineConfig(256, scheduler, kv))
    engine.start()
    try:
        yield engine
    finally:
        await engine.stop()


def request(name: str, prompt: list[int], max_new: int) -> GenerateRequest:
    return GenerateRequest(request_id=name, prompt_token_ids=tuple(prompt), max_new_tokens=max_new,
                           ignore_eos=True)


def ids_of(events: Events) -> list[int]:
    return [i for e in events.items if isinstance(e, TokenEvent) for i in e.token_ids]


async def test_the_probe_runs_the_real_model_and_checks_its_output(
        model: LlamaModel, monkeypatch: pytest.MonkeyPatch) -> None:
    async with running(model) as engine:
        assert await engine.probe(TIMEOUT_S) > 0
        forward = model.forward
        calls: list[int] = []

        def counted(*args: object) -> torch.Tensor:
            calls.append(1)
            return forward(*args)  # type: ignore[arg-type]

        monkeypatch.setattr(model, "forward", counted)
        await engine.probe(TIMEOUT_S)
        assert calls == [1]  # one forward of the model per probe

        def poisoned(*args: object) -> torch.Tensor:
            return forward(*args) * float("nan")  # type: ignore[arg-type]

        monkeypatch.setattr(model, "forward", poisoned)
        with pytest.raises(ProbeFailed, match="not finite"):
            await engine.probe(TIMEOUT_S)
        monkeypatch.undo()
        await engine.probe(TIMEOUT_S)
        assert engine.stats().num_requests == 0  # probes are not generations


async def test_the_probe_runs_beside_a_full_batch_and_changes_nothing(model: LlamaModel) -> None:
    """Four sequences fill every slot and a fifth waits: probes pass at once (behind no queue),
    take no slot, preempt no one, and every sequence makes the tokens it makes without them."""
    prompts = [PROMPT[: 4 + i] for i in range(5)]
    async with running(model) as engine:
        reference = [Events() for _ in prompts]
        for i, (prompt, events) in enumerate(zip(prompts, reference, strict=True)):
            engine.submit(request(f"ref{i}", prompt, 120), events)
        await asyncio.gather(*(e.last() for e in reference))

        probed = [Events() for _ in prompts]
        for i, (prompt, events) in enumerate(zip(prompts, probed, strict=True)):
            engine.submit(request(f"r{i}", prompt, 120), events)
        await asyncio.gather(*(e.until(1) for e in probed[:4]))  # the batch is full
        for _ in range(3):
            await engine.probe(TIMEOUT_S)
            stats = engine.stats()
            assert (stats.num_running, stats.num_waiting) == (4, 1)  # the fifth still waits
            assert stats.kv_used_bytes == 4 * engine.cache.slot_bytes
        assert probed[4].items == []
        await asyncio.gather(*(e.last() for e in probed))
        assert [ids_of(e) for e in probed] == [ids_of(e) for e in reference]
        assert all(len(ids_of(e)) == 120 for e in probed)
        assert engine.stats().num_preemptions == 0
        assert engine.stats().num_requests == 10


async def test_a_probe_stuck_behind_a_step_times_out(model: LlamaModel, monkeypatch: pytest.MonkeyPatch) -> None:
    async with running(model) as engine:
        gate = StepGate(engine, monkeypatch)
        events = Events()
        engine.submit(request("held", PROMPT, 2), events)
        await gate.entered()
        reports: list[tuple[bool, str]] = []

        async def report(serving: bool, reason: str) -> None:
            reports.append((serving, reason))

        registry = CollectorRegistry()
        health = InferenceHealth(HealthConfig(health_probe_timeout_s=0.1), engine.probe, lambda: None,
                                 engine.step_errors(), report, registry)
        assert await health.check() == Verdict(False, "probe timed out after 0.1s")
        assert registry.get_sample_value("aiserve_inference_health_check_passed") == 0
        gate.release()
        await events.last()
        # Then the checks pass again. A probe now waits for no step, yet on a loaded 2-core machine
        # one may still take over 0.1 s (a timing, not a state), so the checks
        # repeat until one passes, each failure reported and counted as the first was.
        deadline = time.monotonic() + TIMEOUT_S
        while (verdict := await health.check()) != Verdict(True):
            assert verdict == Verdict(False, "probe timed out after 0.1s") and time.monotonic() < deadline
        failures = len(reports) - 1
        assert reports == [(False, "probe timed out after 0.1s")] * failures + [(True, "")]
        assert registry.get_sample_value("aiserve_inference_probe_failures_total") == failures
        assert registry.get_sample_value("aiserve_inference_health_check_passed") == 1  # the last one passed

        def unreadable() -> int:
            raise OSError("no such device")

        broken = InferenceHealth(HealthConfig(), engine.probe, unreadable, engine.step_errors(), report,
                                 CollectorRegistry())
        assert await broken.check() == Verdict(False, "free memory unreadable: no such device")


# --- the pure parts ---------------------------------------------------------------------------


def test_free_memory_is_mem_available_capped_by_the_cgroup_room(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:  8000000 kB\nMemFree:  100 kB\nMemAvailable:  4000000 kB\n")
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    assert host_free_bytes(meminfo, cgroup) == 4_000_000 * 1024  # no cgroup files
    (cgroup / "memory.max").write_text("max\n")
    (cgroup / "memory.current").write_text("123\n")
    assert host_free_bytes(meminfo, cgroup) == 4_000_000 * 1024  # no limit set
    (cgroup / "memory.max").write_text(f"{3 << 30}\n")
    (cgroup / "memory.current").write_text(f"{1 << 30}\n")
    assert host_free_bytes(meminfo, cgroup) == 2 << 30
    assert host_free_bytes(tmp_path / "absent", tmp_path / "absent") is None


def test_the_memory_verdict_names_the_floor() -> None:
    assert memory_verdict(100 << 20, 256 << 20) == Verdict(False, "free memory 100 MiB below the floor 256 MiB")
    assert memory_verdict(300 << 20, 256 << 20) == Verdict(True)
    assert memory_verdict(1, 0) == Verdict(True)  # 0: no floor
    assert memory_verdict(None, 256 << 20) == Verdict(True)  # unknown: nothing to hold against it


@pytest.mark.parametrize(("name", "value"), [
    ("health_probe_interval_s", 0.05), ("health_probe_interval_s", 3601.0),
    ("health_probe_timeout_s", 0.0), ("health_probe_timeout_s", 601.0),
    ("min_free_memory_bytes", -1), ("min_free_memory_bytes", (1 << 50) + 1),
])
def test_validate_rejects_a_bad_health_setting(name: str, value: object) -> None:
    with pytest.raises(ConfigError, match=rf"^{name}: must be"):
        config_with(InferenceConfig, **{name: value})


def test_the_health_defaults() -> None:
    config = config_with(InferenceConfig, fault_file="fault")
    assert config.health == HealthConfig(5.0, 30.0, 256 << 20, "fault")


# --- the service over real gRPC ---------------------------------------------------------------


@asynccontextmanager
async def serving(store: ModelStore, **settings: object) -> AsyncIterator[ServiceHandle]:
    """The inference service on a free port, warmed up, its health loop running."""
    config = config_with(InferenceConfig, port=0, metrics_port=0, dtype="float32", model_store=str(store.root),
                         max_num_seqs=2, kv_cache_bytes=64 << 20, max_seq_len=256, **settings)
    handle = await create_server(config)
    try:
        await handle.start()
        await handle.begin_serving()
        yield handle
    finally:
        await handle.stop(0)


class Watch:
    """grpc.health.v1 Watch of the service "": ``until`` reads changes until one matches."""

    def __init__(self, channel: aio.Channel) -> None:
        request = health_pb2.HealthCheckRequest(service="")
        self._call = health_pb2_grpc.HealthStub(channel).Watch(request, timeout=10 * TIMEOUT_S)

    async def until(self, status: int) -> None:
        async def read() -> None:
            async for reply in self._call:
                if reply.status == status:
                    return
            raise AssertionError("the Watch ended")

        await asyncio.wait_for(read(), TIMEOUT_S)


async def status_of(channel: aio.Channel) -> status_pb2.ServiceStatus:
    return await status_pb2_grpc.StatusStub(channel).GetStatus(status_pb2.StatusRequest(), timeout=TIMEOUT_S)


@contextmanager
def failing(what: object, name: str, message: str) -> Iterator[None]:
    """``what.name`` raises RuntimeError(message) while the block runs."""
    with pytest.MonkeyPatch.context() as patch:
        def boom(*args: object) -> object:
            raise RuntimeError(message)

        patch.setattr(what, name, boom)
        yield


async def generate(channel: aio.Channel, max_new_tokens: int = 2) -> list[inference_pb2.InferenceResponse]:
    decoding = inference_pb2.Decoding(max_new_tokens=max_new_tokens, ignore_eos=True)
    call = inference_pb2_grpc.InferenceStub(channel).Generate(
        inference_pb2.InferenceRequest(prompt_token_ids=PROMPT, decoding=decoding), timeout=TIMEOUT_S)
    return [m async for m in call]


async def test_a_fault_file_turns_it_not_serving_and_back(
        store: ModelStore, tmp_path: Path, two_torch_threads: None) -> None:
    fault = tmp_path / "fault"
    async with serving(store, health_probe_interval_s=0.2, fault_file=str(fault)) as handle, \
            aio.insecure_channel(f"127.0.0.1:{handle.port}") as channel:
        watch = Watch(channel)
        await watch.until(SERVING)
        failures = own_metric(handle, "aiserve_inference_probe_failures_total")
        assert failures == 0
        fault.touch()
        await watch.until(NOT_SERVING)
        report = await status_of(channel)
        assert report.state == status_pb2.SERVING_STATE_NOT_SERVING
        assert report.reason == f"fault injected: {fault} exists"
        assert (own_metric(handle, "aiserve_inference_probe_failures_total") or 0) >= 1
        fault.unlink()
        await watch.until(SERVING)
        report = await status_of(channel)
        assert (report.state, report.reason) == (status_pb2.SERVING_STATE_SERVING, "")
        assert (own_metric(handle, "aiserve_inference_probe_seconds") or 0) > 0
        assert (own_metric(handle, "aiserve_inference_free_memory_bytes") or 0) > 0


async def test_a_memory_floor_above_the_machine_gives_not_serving(
        store: ModelStore, two_torch_threads: None) -> None:
    async with serving(store, min_free_memory_bytes=1 << 50, health_probe_interval_s=3600) as handle, \
            aio.insecure_channel(f"127.0.0.1:{handle.port}") as channel:
        servicer = handle.servicer
        assert isinstance(servicer, InferenceServicer) and servicer.health is not None
        verdict = await servicer.health.check()  # the loop's first check gives the same
        assert not verdict.is_serving and verdict.reason.endswith("below the floor 1073741824 MiB")
        health = health_pb2_grpc.HealthStub(channel)
        reply = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=TIMEOUT_S)
        assert reply.status == NOT_SERVING
        report = await status_of(channel)
        assert report.reason.startswith("free memory ") and "below the floor 1073741824 MiB" in report.reason


async def test_a_failed_step_triggers_a_probe_at_once(store: ModelStore, two_torch_threads: None) -> None:
    """The interval is an hour: only a failed step can make the loop check again."""
    async with serving(store, health_probe_interval_s=3600) as handle, \
            aio.insecure_channel(f"127.0.0.1:{handle.port}") as channel:
        watch = Watch(channel)
        await watch.until(SERVING)  # the first check runs right after warm-up
        servicer = handle.servicer
        assert isinstance(servicer, InferenceServicer)
        engine = servicer.engine
        with failing(engine.model, "forward", "the device is gone"):  # the step and the probe fail
            with pytest.raises(aio.AioRpcError) as caught:
                await generate(channel)
            assert caught.value.code() == grpc.StatusCode.INTERNAL
            await watch.until(NOT_SERVING)
        assert (await status_of(channel)).reason == "probe failed: the device is gone"
        with failing(engine.runner, "execute", "a bug in one step"):  # the step fails, the probe passes
            with pytest.raises(aio.AioRpcError):
                await generate(channel)
            await watch.until(SERVING)
        assert engine.stats().num_step_errors == 2
        assert own_metric(handle, "aiserve_inference_step_errors_total") == 2
        assert own_metric(handle, "aiserve_inference_probe_failures_total") == 1


async def test_status_and_stats_carry_the_model_and_figures(
        store: ModelStore, manifest: Manifest, two_torch_threads: None) -> None:
    async with serving(store) as handle, aio.insecure_channel(f"127.0.0.1:{handle.port}") as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        stats = await stub.Stats(inference_pb2.InferenceStatsRequest(), timeout=TIMEOUT_S)
        assert stats.num_requests == 0  # the warm-up and the probes are not counted
        await generate(channel)
        await generate(channel)
        decoding = inference_pb2.Decoding(max_new_tokens=200, ignore_eos=True)
        call = stub.Generate(inference_pb2.InferenceRequest(prompt_token_ids=PROMPT, decoding=decoding),
                             timeout=TIMEOUT_S)
        try:
            await call.read()  # it runs now
            report = await status_of(channel)
            assert (report.service, report.model) == ("inference", str(manifest.ref))
            assert (report.running, report.queue_length) == (1, 0)
            assert 0 < report.kv_used_bytes < report.kv_total_bytes
            stats = await stub.Stats(inference_pb2.InferenceStatsRequest(), timeout=TIMEOUT_S)
            assert stats.num_requests == 3
        finally:
            call.cancel()
