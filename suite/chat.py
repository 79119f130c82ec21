"""A small gRPC client of the gateway: ``aiserve chat`` streams an answer and reports usage."""

from __future__ import annotations

import sys
import time
import uuid
from pathlib import Path

import grpc
from grpc import aio

from aiserve.common.context import AUTHORIZATION_KEY, REQUEST_ID_KEY
from aiserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc


def read_key(path: Path) -> str:
    """The API key in a key file (``$AISERVE_HOME/dev.key``); "" when there is none."""
    return path.read_text().strip() if path.is_file() else ""


async def chat(address: str, prompt: str, max_new_tokens: int, raw: bool, timeout_s: float, key: str) -> int:
    """Stream the answer to stdout; print request id, token counts and timings to stderr."""
    request = gateway_pb2.GenerateRequest(sampling=common_pb2.SamplingParams(max_new_tokens=max_new_tokens))
    if raw:
        request.prompt = prompt
    else:
        request.chat.messages.add(role="user", content=prompt)
    request_id = uuid.uuid4().hex
    started = time.perf_counter()
    first_ms = 0.0
    async with aio.insecure_channel(address) as channel:
        call = gateway_pb2_grpc.GatewayStub(channel).Generate(
            request, timeout=timeout_s, metadata=((REQUEST_ID_KEY, request_id), (AUTHORIZATION_KEY, f"Bearer {key}"))
        )
        try:
            async for message in call:
                if message.text_delta:
                    first_ms = first_ms or (time.perf_counter() - started) * 1000
                    sys.stdout.write(message.text_delta)
                    sys.stdout.flush()
                if message.HasField("usage"):
                    usage = message.usage
                    total_s = time.perf_counter() - started
                    reason = common_pb2.FinishReason.Name(message.finish_reason)
                    print(
                        f"\n\n[request {message.request_id}] {reason}; prompt {usage.prompt_tokens} tokens, "
                        f"completion {usage.completion_tokens} tokens; first text {first_ms:.0f} ms, "
                        f"total {total_s * 1000:.0f} ms "
                        f"({usage.completion_tokens / max(total_s, 1e-9):.1f} tok/s); "
                        f"cache hit {usage.cache_hit}; cost {usage.cost_micros} micros",
                        file=sys.stderr,
                    )
        except grpc.RpcError as exc:
            print(f"\nerror [{request_id}]: {exc.code().name}: {exc.details()}", file=sys.stderr)  # type: ignore[attr-defined]
            return 1
    return 0
