"""Priority, deadlines and cancellation against the real inference engine."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
from grpc import aio

from aiserve.v1 import gateway_pb2, gateway_pb2_grpc
from suite.runner import Suite
from tests.integration.conftest import (
    TEST_TORCH_THREADS,
    auth,
    create_tenant,
    eventually,
    ledger_rows,
    log_records,
    new_request_id,
)
from tests.integration.test_e2e import TIMEOUT_S, chat_request

GENERATION_METHODS = {"/aiserve.v1.Inference/Generate", "/aiserve.v1.Inference/GenerateMux:stream"}


def inference_calls(suite: Suite, request_id: str) -> list[dict[str, object]]:
    """The inference service's log lines of this request id's finished generations: a Generate
    call's, or its stream's on the gateway's shared GenerateMux call."""
    return [
        r
        for r in log_records(suite, "inference")
        if r.get("request_id") == request_id and r.get("method") in GENERATION_METHODS
    ]


FREE_QUEUE = 6
"""Free requests sent at once. For a queue to form, this must exceed the number of sequences
the engine runs at once: the small_batch_suite fixture's max_num_seqs (2)."""


async def test_a_paid_request_behind_a_queue_of_free_ones_is_admitted_before_all_of_them(
    small_batch_suite: Suite,
) -> None:
    suite = small_batch_suite
    _, free_key = create_tenant(suite.config.home, "queue-free", "free")
    _, paid_key = create_tenant(suite.config.home, "queue-paid", "paid")
    first_token: list[str] = []  # stream names, in the order their first token arrived
    queue_formed = asyncio.Event()

    async def run(name: str, key: str, text: str, max_new_tokens: int) -> None:
        request = chat_request(text, max_new_tokens=max_new_tokens, cache=gateway_pb2.CACHE_POLICY_BYPASS)
        async with aio.insecure_channel(suite.config.address("gateway")) as channel:
            call = gateway_pb2_grpc.GatewayStub(channel).Generate(request, metadata=auth(key), timeout=TIMEOUT_S)
            num_tokens = 0
            async for message in call:
                if message.token_ids and num_tokens == 0:
                    first_token.append(name)
                num_tokens += len(message.token_ids)
                if num_tokens >= 3:  # a free request is deep into its generation: the rest wait
                    queue_formed.set()

    frees = [
        asyncio.create_task(run(f"free{i}", free_key, f"Write a long story about a dragon named Rex {i}.", 24))
        for i in range(FREE_QUEUE)
    ]
    await asyncio.wait_for(queue_formed.wait(), TIMEOUT_S)
    running = set(first_token)  # these had a place in the batch before the paid request came
    await run("paid", paid_key, "Say yes.", 4)
    await asyncio.gather(*frees)
    waiting = [name for name in first_token if name.startswith("free") and name not in running]
    assert waiting, f"all {FREE_QUEUE} free requests ran at once: raise FREE_QUEUE above the batch size"
    assert first_token.index("paid") < min(first_token.index(name) for name in waiting), first_token


def inference_environ(suite: Suite) -> dict[str, str]:
    """The environment the suite's inference process runs with (Linux: /proc/<pid>/environ)."""
    raw = Path(f"/proc/{suite.processes['inference'].pid}/environ").read_bytes()
    return dict(entry.split("=", 1) for entry in raw.decode().split("\0") if "=" in entry)


def test_the_test_suites_run_inference_on_one_torch_thread(suite: Suite, small_batch_suite: Suite) -> None:
    # A torch thread per core spins at every barrier on a shared machine: a decode step of the
    # queue test then took ~1 s, and its 6 x 24 tokens overran the 120 s deadline.
    for running in (suite, small_batch_suite):
        assert inference_environ(running)["AISERVE_INFERENCE_TORCH_THREADS"] == str(TEST_TORCH_THREADS)


async def test_client_cancel_stops_the_generation(suite: Suite) -> None:
    tenant, key = create_tenant(suite.config.home, "cancel", "paid")
    rid = new_request_id()
    request = chat_request("Write a very long essay about rivers.", max_new_tokens=400)
    request.cache = gateway_pb2.CACHE_POLICY_BYPASS
    async with aio.insecure_channel(suite.config.address("gateway")) as channel:
        call = gateway_pb2_grpc.GatewayStub(channel).Generate(
            request, metadata=(*auth(key), ("x-request-id", rid)), timeout=TIMEOUT_S
        )
        num_tokens = 0
        async for message in call:
            num_tokens += len(message.token_ids)
            if num_tokens >= 3:
                break
        call.cancel()

    # The gateway cancelled its inference call: the engine dropped the sequence long before 400 tokens.
    await eventually(lambda: bool(inference_calls(suite, rid)), what="the inference call's end")
    [ended] = inference_calls(suite, rid)
    assert ended["code"] == "CANCELLED"
    await eventually(lambda: any(r.request_id == rid for r in ledger_rows(suite.config.home, tenant)), what="row")
    [row] = [r for r in ledger_rows(suite.config.home, tenant) if r.request_id == rid]
    assert row.status == "CANCELLED" and 3 <= row.completion_tokens < 400 and row.cost_micros > 0


DEADLINE_S = 2.0
"""The client's deadline in the deadline test: 400 tokens take far longer on a CPU."""
ENDED_WITHIN_S = 60.0
"""Bound on when a call with a DEADLINE_S deadline must end, in the client and in the inference
service: generous for a loaded 2-core machine, and ten times below the inference call's own
default deadline (600 s), which is what a gateway that did not pass the client's on would give."""


async def test_the_clients_deadline_is_the_inference_deadline(suite: Suite) -> None:
    tenant, key = create_tenant(suite.config.home, "deadline", "paid")
    rid = new_request_id()
    request = chat_request("Write a very long essay about mountains.", max_new_tokens=400)
    request.cache = gateway_pb2.CACHE_POLICY_BYPASS
    started = time.monotonic()
    async with aio.insecure_channel(suite.config.address("gateway")) as channel:
        try:
            await gateway_pb2_grpc.GatewayStub(channel).Complete(
                request, metadata=(*auth(key), ("x-request-id", rid)), timeout=DEADLINE_S
            )
            raise AssertionError(f"400 tokens in {DEADLINE_S} s: make the request longer")
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED  # type: ignore[attr-defined]
    assert time.monotonic() - started < ENDED_WITHIN_S

    await eventually(lambda: bool(inference_calls(suite, rid)), what="the inference call's end")
    [ended] = inference_calls(suite, rid)
    assert ended["code"] in {"CANCELLED", "DEADLINE_EXCEEDED"}
    # It ended at the client's deadline, not at the inference call's default one.
    assert float(str(ended["latency_ms"])) < ENDED_WITHIN_S * 1000
    await eventually(lambda: any(r.request_id == rid for r in ledger_rows(suite.config.home, tenant)), what="row")
    [row] = [r for r in ledger_rows(suite.config.home, tenant) if r.request_id == rid]
    assert row.status == "DEADLINE_EXCEEDED"
