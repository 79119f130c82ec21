"""A fake inference replica in a process of its own, for a test to SIGKILL: it serves
``FakeInference`` on a free port, reports SERVING and prints ``port=N`` as a line of its own
(among its log lines).

Run as ``python -m tests.unit.gateway.fake_replica``; it serves until it is killed.
"""

from __future__ import annotations

import asyncio

from tests.unit.gateway.server_fakes import FakeInference, Seen, fake_server


async def serve() -> None:
    handle = fake_server("inference", FakeInference(Seen()))
    await handle.start()
    await handle.begin_serving()
    print(f"port={handle.port}", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(serve())
