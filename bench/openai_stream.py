"""A streaming chat completion against an OpenAI-compatible HTTP server, timed like a gRPC stream.

Plain asyncio over one HTTP/1.1 connection per request (what an OpenAI SDK client does per
stream), so the peer bench's client costs the same few microseconds per message on either side
and needs no HTTP library in aiserve's environment.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from bench.measure import Timing


async def _chunks(reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
    """The body of a chunked transfer-encoded response, chunk by chunk."""
    while True:
        size = int((await reader.readline()).strip() or b"0", 16)
        if size == 0:
            return
        yield await reader.readexactly(size)
        await reader.readexactly(2)  # the CRLF after each chunk


async def _events(reader: asyncio.StreamReader) -> AsyncIterator[dict[str, Any]]:
    """The JSON payloads of a server-sent event stream, until ``[DONE]``."""
    buffer = b""
    async for chunk in _chunks(reader):
        buffer += chunk
        while b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            for line in event.splitlines():
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    return
                yield json.loads(data)


async def chat_stream(host: str, port: int, model: str, text: str, max_tokens: int,
                      timeout_s: float, key: str = "", params: dict[str, Any] | None = None,
                      headers: dict[str, str] | None = None) -> tuple[Timing, str]:
    """POST /v1/chat/completions (stream, greedy unless ``params`` say otherwise) with ``text`` as
    one user message, with the API key ``key`` if any and ``headers``; the stream's timing
    (tokens counted from the final usage, as the server counted them) and the answer."""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
                       "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True},
                       **(params or {})}).encode()
    given = {**({"Authorization": f"Bearer {key}"} if key else {}), **(headers or {})}
    lines = b"".join(b"%s: %s\r\n" % (name.encode(), value.encode()) for name, value in given.items())
    started = time.perf_counter()
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout_s)
    try:
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n%s"
                     b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (host.encode(), lines, len(body), body))
        await writer.drain()
        return await asyncio.wait_for(_read(reader, started), timeout_s)
    finally:
        writer.close()


async def _read(reader: asyncio.StreamReader, started: float) -> tuple[Timing, str]:
    status = await reader.readline()
    if b" 200 " not in status:
        raise RuntimeError(f"peer answered {status.decode().strip()}: {(await reader.read(2000)).decode()}")
    while (await reader.readline()).strip():  # headers
        pass
    timing, last, usage = Timing(), started, 0
    parts: list[str] = []
    async for event in _events(reader):
        if event.get("usage"):
            usage = int(event["usage"]["completion_tokens"])
        delta = "".join(c["delta"].get("content") or "" for c in event.get("choices", []))
        if not delta:
            continue
        now = time.perf_counter()
        if not parts:
            timing.ttft_ms = (now - started) * 1000
        else:
            timing.gaps_ms.append((now - last) * 1000)
        last = now
        parts.append(delta)
    timing.tokens = usage or len(parts)
    timing.total_ms = (time.perf_counter() - started) * 1000
    timing.decode_ms = (last - started) * 1000 - timing.ttft_ms if parts else 0.0
    return timing, "".join(parts)
