"""What every service exposes besides its API (health, reflection), and the chat CLI."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from suite.runner import SERVICES, Suite

ROOT = Path(__file__).resolve().parents[2]

API = {
    "gateway": "aiserve.v1.Gateway",
    "tokenizer": "aiserve.v1.Tokenizer",
    "inference": "aiserve.v1.Inference",
    "cache": "aiserve.v1.Cache",
}


async def test_every_service_serves_health_and_reflection(suite: Suite) -> None:
    for name in SERVICES:
        async with aio.insecure_channel(suite.config.address(name)) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            for service in ("", API[name]):
                reply = await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING, (name, service)
    for name in SERVICES:
        # The reflection client is synchronous.
        import grpc

        with grpc.insecure_channel(suite.config.address(name)) as channel:
            services = set(ProtoReflectionDescriptorDatabase(channel).get_services())
        assert {API[name], "grpc.health.v1.Health"} <= services, (name, services)


def test_chat_cli_streams_and_reports_request_id_tokens_and_timings(suite: Suite) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "suite",
            "chat",
            "What is the capital of France?",
            "--max-new-tokens",
            "24",
            "--address",
            suite.config.address("gateway"),
        ],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "AISERVE_HOME": str(suite.config.home)},  # reads its dev.key
    )
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    assert "[request " in result.stderr and "completion" in result.stderr and " ms" in result.stderr
