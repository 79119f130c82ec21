"""Model routes with versions in the real gateway, over real gRPC, in front of fake tokenizer
and inference replicas of two versions (fake@1, fake@2): pinned and weighted requests, the
exact version named in usage, ledger and metrics, stickiness, the Admin routes rpcs with their
refusals, a dropped version's streams, and the routes surviving a restart."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc import aio

from aiserve.common.server import ServiceHandle, wait_for_serving
from aiserve.v1 import admin_pb2, admin_pb2_grpc, common_pb2, gateway_pb2, gateway_pb2_grpc, status_pb2
from services.gateway.admin_key import ensure_admin_key
from services.gateway.backends import Backends
from services.gateway.config import GatewayConfig
from services.gateway.route_store import RouteStore
from services.gateway.route_table import Role
from services.gateway.routing import Routes
from services.gateway.server import GatewayServicer, create_server
from tests.unit.gateway.pipeline_fakes import FakeObserver
from tests.unit.gateway.server_fakes import MODEL, FakeInference, FakeTokenizer, Seen, fake_server
from tests.unit.gateway.test_fleet import HANG, TIMEOUT_S, gateway_config, request
from tests.unit.gateway.test_server import tenant_keys

CANARY = "fake@2"


@dataclass
class Versions:
    """A gateway whose settings' route is fake@1, and the replicas of fake@1 and fake@2."""

    gateway: ServiceHandle
    backends: list[ServiceHandle]
    seen: dict[str, Seen]
    keys: dict[str, str]
    admin_key: str
    config: GatewayConfig

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.gateway.port}"

    @property
    def routes(self) -> Routes:
        assert isinstance(self.gateway.servicer, GatewayServicer)
        router = self.gateway.servicer.pipeline.backends.router
        assert isinstance(router, Routes)
        return router

    def target(self, service: str, model: str) -> str:
        index = {"tokenizer": 0, "inference": 1}[service] + 2 * (model == CANARY)
        return f"127.0.0.1:{self.backends[index].port}"

    async def serving(self, model: str) -> None:
        """Wait (on the watches) until ``model``'s tokenizer and inference replicas serve."""
        backends = self.routes.backends_of(model)
        for pool in backends.pools():
            await pool.wait_for(lambda p=pool: bool(p.replicas.usable()), TIMEOUT_S)  # type: ignore[misc]


async def start(tmp_path: Path, stickiness: str = "tenant", observer: FakeObserver | None = None) -> Versions:
    seen = {MODEL: Seen(), CANARY: Seen()}
    backends = [fake_server("tokenizer", FakeTokenizer(MODEL)), fake_server("inference", FakeInference(seen[MODEL])),
                fake_server("tokenizer", FakeTokenizer(CANARY)),
                fake_server("inference", FakeInference(seen[CANARY], model=CANARY))]
    config = dataclasses.replace(gateway_config(tmp_path, backends[0], [backends[1]]), route_stickiness=stickiness,
                                 prices=(f"{MODEL}=10/20/1000", f"{CANARY}=10/20/1000"))
    keys = tenant_keys(tmp_path / "keys.sqlite3")
    gateway = await create_server(config, observer)
    for handle in (*backends, gateway):
        await handle.start()
        await handle.begin_serving()
    versions = Versions(gateway, backends, seen, keys, ensure_admin_key(tmp_path / "admin.key"), config)
    await wait_for_serving(versions.address, TIMEOUT_S)
    return versions


async def stop(versions: Versions) -> None:
    for handle in (versions.gateway, *versions.backends):
        await handle.stop(0)


@pytest.fixture
async def versions(tmp_path: Path) -> AsyncIterator[Versions]:
    started = await start(tmp_path)
    try:
        yield started
    finally:
        await stop(started)


async def admin(versions: Versions, rpc: str, message: object, key: str | None = None) -> object:
    async with aio.insecure_channel(versions.address) as channel:
        call = getattr(admin_pb2_grpc.AdminStub(channel), rpc)
        return await call(message, metadata=(("authorization", f"Bearer {key or versions.admin_key}"),),
                          timeout=TIMEOUT_S)


async def refused(versions: Versions, rpc: str, message: object, key: str | None = None) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        await admin(versions, rpc, message, key)
    return info.value


async def add_canary(versions: Versions, weight: int = 0) -> admin_pb2.Route:
    route = await admin(versions, "AddVersion", admin_pb2.AddVersionRequest(
        model=CANARY, tokenizer_target=versions.target("tokenizer", CANARY),
        inference_target=versions.target("inference", CANARY), weight=weight))
    await versions.serving(CANARY)
    assert isinstance(route, admin_pb2.Route)
    return route


async def complete(versions: Versions, model: str = "", session: str = "",
                   tenant: str = "payer") -> gateway_pb2.CompleteResponse:
    metadata = [("authorization", f"Bearer {versions.keys[tenant]}")]
    if session:
        metadata.append(("x-aiserve-session", session))
    async with aio.insecure_channel(versions.address) as channel:
        reply = await gateway_pb2_grpc.GatewayStub(channel).Complete(
            _request(model), metadata=metadata, timeout=TIMEOUT_S)
    assert reply.finish_reason == common_pb2.FINISH_REASON_LENGTH
    return reply  # type: ignore[no-any-return]


def _request(model: str, words: int = 3) -> gateway_pb2.GenerateRequest:
    message = request(words=words)
    message.model = model
    return message


def counts(versions: Versions) -> dict[str, int]:
    return {model: len(seen.request_ids) for model, seen in versions.seen.items()}


# --- requests ---------------------------------------------------------------------------------

async def test_a_pinned_version_answers_and_is_named_in_usage_ledger_and_metrics(versions: Versions) -> None:
    await add_canary(versions)
    assert (await complete(versions, CANARY)).usage.model == CANARY
    assert (await complete(versions)).usage.model == MODEL  # weight 0: no unpinned traffic
    assert (await complete(versions, "fake")).usage.model == MODEL
    assert counts(versions) == {MODEL: 2, CANARY: 1}
    assert isinstance(versions.gateway.servicer, GatewayServicer)
    ledger = versions.gateway.servicer.accounting.ledger
    await ledger.flush()
    assert sorted(m for (m,) in ledger.query("SELECT model FROM usage", ())) == [MODEL, MODEL, CANARY]
    labels = {"model": CANARY, "finish_reason": "length", "cache_hit": "false"}
    assert versions.gateway.registry.get_sample_value("aiserve_gateway_requests_total", labels) == 1.0
    with pytest.raises(grpc.RpcError) as info:
        await complete(versions, "fake@9")
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert info.value.details() == f"model: 'fake@9' is not served; available: {MODEL}, {CANARY}"


async def test_tenant_stickiness_keeps_each_tenant_on_one_version(versions: Versions) -> None:
    await add_canary(versions)
    await admin(versions, "SetWeights", admin_pb2.SetWeightsRequest(name="fake", weights={MODEL: 50, CANARY: 50}))
    models = {tenant: {(await complete(versions, tenant=tenant)).usage.model for _ in range(5)}
              for tenant in ("payer", "freebie")}
    assert all(len(found) == 1 for found in models.values())  # 5 requests each, one version each


async def test_session_stickiness_splits_sessions_and_keeps_each_on_its_version(tmp_path: Path) -> None:
    versions = await start(tmp_path, stickiness="session")
    try:
        await add_canary(versions)
        await admin(versions, "SetWeights", admin_pb2.SetWeightsRequest(name="fake", weights={MODEL: 1, CANARY: 1}))
        first = {s: (await complete(versions, session=f"s-{s}")).usage.model for s in range(16)}
        assert set(first.values()) == {MODEL, CANARY}  # 16 sessions at 50/50 (by their hash: fixed)
        again = {s: (await complete(versions, session=f"s-{s}")).usage.model for s in range(16)}
        assert again == first
    finally:
        await stop(versions)


async def test_a_dropped_version_finishes_its_streams_there_then_closes(versions: Versions) -> None:
    await add_canary(versions)
    async with aio.insecure_channel(versions.address) as channel:
        call = gateway_pb2_grpc.GatewayStub(channel).Generate(
            _request(CANARY, words=HANG), metadata=(("authorization", f"Bearer {versions.keys['payer']}"),),
            timeout=TIMEOUT_S)
        assert list((await call.read()).token_ids) == [10]  # running on fake@2, then hanging
        route = await admin(versions, "RemoveVersion", admin_pb2.RemoveVersionRequest(model=CANARY))
        assert isinstance(route, admin_pb2.Route) and [v.model for v in route.versions] == [MODEL]
        assert CANARY in [b.model for b in versions.routes.all_backends()]  # its stream holds it
        with pytest.raises(grpc.RpcError) as info:
            await complete(versions, CANARY)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND  # no new request
        call.cancel()
    await versions.routes.wait_for(lambda: CANARY not in [b.model for b in versions.routes.all_backends()],
                                   TIMEOUT_S)  # its stream ended: its replicas close


# --- the Admin rpcs ---------------------------------------------------------------------------

async def test_the_observer_sees_each_finished_request_and_gives_the_figures(tmp_path: Path) -> None:
    observer = FakeObserver()
    versions = await start(tmp_path, observer=observer)
    try:
        await add_canary(versions)
        for model in (CANARY, CANARY, MODEL):
            await complete(versions, model)
        assert [(o.model, o.is_error, o.cache_hit) for o in observer.outcomes] == [
            (CANARY, False, False), (CANARY, False, False), (MODEL, False, False)]
        listed = await admin(versions, "ListRoutes", admin_pb2.ListRoutesRequest())
        assert isinstance(listed, admin_pb2.RouteList)
        assert [(v.model, v.figures.requests) for v in listed.routes[0].versions] == [(MODEL, 1), (CANARY, 2)]
    finally:
        await stop(versions)


async def test_list_add_and_set_weights_with_their_refusals(versions: Versions) -> None:
    listed = await admin(versions, "ListRoutes", admin_pb2.ListRoutesRequest())
    assert isinstance(listed, admin_pb2.RouteList)
    [route] = listed.routes
    assert (route.name, route.stickiness) == ("fake", admin_pb2.STICKINESS_TENANT)
    [stable] = route.versions
    assert (stable.model, stable.weight, stable.role, stable.state) == (
        MODEL, 100, admin_pb2.VERSION_ROLE_STABLE, status_pb2.SERVING_STATE_SERVING)
    assert (stable.tokenizer_target, stable.inference_target) == (versions.config.tokenizer_address,
                                                                  versions.config.inference_address)
    assert stable.figures.requests == 0  # no observer plugged in: zeros
    route = await add_canary(versions, weight=0)
    assert [(v.model, v.weight, v.role) for v in route.versions] == [
        (MODEL, 100, admin_pb2.VERSION_ROLE_STABLE), (CANARY, 0, admin_pb2.VERSION_ROLE_CANARY)]
    again = admin_pb2.AddVersionRequest(model=CANARY, tokenizer_target="t:1", inference_target="i:1")
    assert (await refused(versions, "AddVersion", again)).code() == grpc.StatusCode.ALREADY_EXISTS
    for bad in (admin_pb2.AddVersionRequest(model="noversion", tokenizer_target="t:1", inference_target="i:1"),
                admin_pb2.AddVersionRequest(model="fake@3", tokenizer_target="nonsense", inference_target="i:1")):
        assert (await refused(versions, "AddVersion", bad)).code() == grpc.StatusCode.INVALID_ARGUMENT
    route = await admin(versions, "SetWeights", admin_pb2.SetWeightsRequest(name="fake", weights={CANARY: 30}))
    assert isinstance(route, admin_pb2.Route) and [v.weight for v in route.versions] == [100, 30]
    for bad, code in ((admin_pb2.SetWeightsRequest(name="nope", weights={MODEL: 1}), grpc.StatusCode.NOT_FOUND),
                      (admin_pb2.SetWeightsRequest(name="fake", weights={"fake@9": 1}), grpc.StatusCode.NOT_FOUND),
                      (admin_pb2.SetWeightsRequest(name="fake", weights={MODEL: 0, CANARY: 0}),
                       grpc.StatusCode.INVALID_ARGUMENT)):
        assert (await refused(versions, "SetWeights", bad)).code() == code


async def test_promote_rollback_and_remove(versions: Versions) -> None:
    await add_canary(versions, weight=10)
    route = await admin(versions, "Rollback", admin_pb2.RollbackRequest(name="fake", reason="too slow"))
    assert isinstance(route, admin_pb2.Route)
    assert [(v.weight, v.rolled_back_reason) for v in route.versions] == [(100, ""), (0, "too slow")]
    route = await admin(versions, "Promote", admin_pb2.PromoteRequest(model=CANARY, retire_after_s=120))
    assert isinstance(route, admin_pb2.Route)
    former, new = route.versions
    assert (new.model, new.weight, new.role) == (CANARY, 100, admin_pb2.VERSION_ROLE_STABLE)
    assert (former.model, former.weight, former.role) == (MODEL, 0, admin_pb2.VERSION_ROLE_RETIRING)
    assert former.retire_at_unix_s > 0
    assert (await complete(versions)).usage.model == CANARY  # the default route's new stable version
    error = await refused(versions, "RemoveVersion", admin_pb2.RemoveVersionRequest(model=CANARY))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    route = await admin(versions, "RemoveVersion", admin_pb2.RemoveVersionRequest(model=MODEL))
    assert isinstance(route, admin_pb2.Route) and [v.model for v in route.versions] == [CANARY]


async def test_every_routes_rpc_denies_a_tenant_key(versions: Versions) -> None:
    metadata = (("authorization", f"Bearer {versions.keys['payer']}"),)
    async with aio.insecure_channel(versions.address) as channel:
        stub = admin_pb2_grpc.AdminStub(channel)
        calls = [stub.ListRoutes(admin_pb2.ListRoutesRequest(), metadata=metadata, timeout=TIMEOUT_S),
                 stub.AddVersion(admin_pb2.AddVersionRequest(), metadata=metadata, timeout=TIMEOUT_S),
                 stub.SetWeights(admin_pb2.SetWeightsRequest(), metadata=metadata, timeout=TIMEOUT_S),
                 stub.Promote(admin_pb2.PromoteRequest(), metadata=metadata, timeout=TIMEOUT_S),
                 stub.Rollback(admin_pb2.RollbackRequest(), metadata=metadata, timeout=TIMEOUT_S),
                 stub.RemoveVersion(admin_pb2.RemoveVersionRequest(), metadata=metadata, timeout=TIMEOUT_S)]
        for call in calls:
            with pytest.raises(grpc.RpcError) as info:
                await call
            assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED


async def test_a_restarted_gateway_serves_the_routes_it_had(versions: Versions) -> None:
    await add_canary(versions)
    await admin(versions, "SetWeights", admin_pb2.SetWeightsRequest(name="fake", weights={CANARY: 40}))
    before = await admin(versions, "ListRoutes", admin_pb2.ListRoutesRequest())
    await versions.gateway.stop(0)
    versions.gateway = await create_server(versions.config)
    await versions.gateway.start()
    await versions.gateway.begin_serving()
    await wait_for_serving(versions.address, TIMEOUT_S)
    await versions.serving(CANARY)
    after = await admin(versions, "ListRoutes", admin_pb2.ListRoutesRequest())
    assert isinstance(before, admin_pb2.RouteList) and isinstance(after, admin_pb2.RouteList)
    assert [(v.model, v.weight, v.role) for v in after.routes[0].versions] == [(MODEL, 100, 1), (CANARY, 40, 2)]
    assert after == before
    assert (await complete(versions, CANARY)).usage.model == CANARY


# --- retirement and the routes file, with an injected clock -----------------------------------

class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


async def test_a_former_stable_version_retires_when_due_and_the_file_says_so(tmp_path: Path) -> None:
    config = GatewayConfig(default_model=MODEL, cache_address="", tokenizer_address="127.0.0.1:1",
                           inference_address="127.0.0.1:2", retire_after_s=300.0)
    store, clock = RouteStore(tmp_path / "routes.sqlite3"), Clock()
    backends = Backends(config, store=store, clock=clock)
    try:
        routes = backends.routes
        routes.add_version(CANARY, "127.0.0.1:3", "127.0.0.1:4", 0)
        routes.promote(CANARY, 0.0)  # 0: the setting's 300 s
        assert [(v.model, v.role, v.retire_at) for v in store.load()[0].versions] == [
            (MODEL, Role.RETIRING, 1_300.0), (CANARY, Role.STABLE, 0.0)]
        clock.now = 1_299.9
        assert routes.retire_due() == []
        clock.now = 1_300.0
        assert [v.model for v in routes.retire_due()] == [MODEL]
        assert [v.model for v in store.load()[0].versions] == [CANARY]
        assert [b.model for b in routes.all_backends()] == [CANARY]  # nothing in flight: closed at once
        assert [pool.route for pool in backends.pools()] == [CANARY, CANARY]
    finally:
        await backends.close()
    again = Backends(config, store=store, clock=clock)  # a new route table from the same file
    try:
        assert [(v.model, v.role) for v in again.routes.table.route("fake").versions] == [(CANARY, Role.STABLE)]
        assert again.routes.table.default_name == "fake"
    finally:
        await again.close()


async def test_with_several_routes_the_health_reason_names_each_stable_version(tmp_path: Path) -> None:
    config = GatewayConfig(default_model=MODEL, cache_address="", tokenizer_address="127.0.0.1:1",
                           inference_address="127.0.0.1:2")
    backends = Backends(config)
    try:
        assert backends.health() == (False, "tokenizer: no replica SERVING (127.0.0.1:1: connecting); "
                                            "inference: no replica SERVING (127.0.0.1:2: connecting)")
        backends.routes.add_version("other@1", "127.0.0.1:3", "127.0.0.1:4", 0)
        serving, reason = backends.health()
        assert not serving and reason.startswith(f"{MODEL}: tokenizer: no replica SERVING")
        assert "other@1: inference: no replica SERVING (127.0.0.1:4: connecting)" in reason
    finally:
        await backends.close()
