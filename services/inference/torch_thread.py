"""Keep torch's parallel CPU work on one thread of the process.

torch's CPU kernels run their parallel regions on OpenMP (libgomp). Every thread that has run
one keeps its own pool of OpenMP workers for as long as it lives, and once the process holds
more such workers than there are cores, libgomp stops letting them spin between regions: each
region then waits on a futex wake-up. On the 2-core VM that made element-wise ops in the engine
thread 2-10x slower and a decode step of 64 about 40% slower than the same step on a thread
that was alone (docs/decisions.md, decision 30).

So the inference process runs torch on exactly one long-lived thread, the engine's worker:
the model is loaded on a short-lived thread that exits (taking its pool with it), and the
asyncio thread never runs a torch kernel. A new thread also starts with OpenMP's default
thread count, whatever ``torch.set_num_threads`` said elsewhere, so each torch thread adopts
the process setting first.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


def adopt_thread_count() -> None:
    """Apply the process's ``torch.set_num_threads`` to the calling thread's OpenMP team."""
    torch.set_num_threads(torch.get_num_threads())


def run_in_fresh_thread(fn: Callable[[], T], name: str = "torch-once") -> T:
    """Run ``fn`` on a new thread that exits when it returns; re-raise what it raised."""
    result: list[T] = []
    error: list[BaseException] = []

    def target() -> None:
        adopt_thread_count()
        try:
            result.append(fn())
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            error.append(exc)

    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]


async def in_fresh_thread(fn: Callable[[], T], name: str = "torch-once") -> T:
    """``run_in_fresh_thread`` without blocking the event loop (an executor thread only waits)."""
    return await asyncio.to_thread(run_in_fresh_thread, fn, name)
