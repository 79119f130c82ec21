"""The helpers that keep torch work on threads that exit (services/inference/torch_thread.py)."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from services.inference.torch_thread import in_fresh_thread, run_in_fresh_thread


def test_runs_on_another_thread_that_exits() -> None:
    seen: list[threading.Thread] = []

    def work() -> int:
        seen.append(threading.current_thread())
        return int(torch.ones(3).sum())

    assert run_in_fresh_thread(work, name="probe") == 3
    assert seen[0] is not threading.main_thread() and seen[0].name == "probe"
    assert not seen[0].is_alive()


def test_errors_reach_the_caller() -> None:
    def fail() -> None:
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        run_in_fresh_thread(fail)


def test_async_variant_keeps_the_loop_running() -> None:
    async def main() -> tuple[bool, int]:
        gate = threading.Event()
        ticks = 0

        def work() -> bool:
            return gate.wait(timeout=10)  # True only if the loop ran tick() meanwhile

        async def tick() -> None:
            nonlocal ticks
            ticks += 1
            gate.set()

        released, _ = await asyncio.wait_for(asyncio.gather(in_fresh_thread(work), tick()), timeout=30)
        return released, ticks

    assert asyncio.run(main()) == (True, 1)
