"""A fake backend on a free port, called the way the gateway calls its backends."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from grpc import aio

from aiserve.common.interceptors import downstream_channel


@asynccontextmanager
async def fake_backend(add: Callable[[Any, aio.Server], None], servicer: object) -> AsyncIterator[aio.Channel]:
    """Serve ``servicer`` (``add`` registers it) over a real socket; yield a channel to it that
    forwards the request context, as the gateway's channels do."""
    server = aio.server()
    add(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = downstream_channel(f"127.0.0.1:{port}")
    try:
        yield channel
    finally:
        await channel.close()
        await server.stop(None)
