"""Probes for engine tests that must not depend on the machine's speed: a request's events via
``BatchEngine.submit``, a gate that holds the worker inside a step, a log of what each step
computed, and waiting for the clock to pass a deadline."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Mapping

import pytest

from services.inference.batch_engine import BatchEngine
from services.inference.request import TokenEvent
from services.inference.runner import Picked, RowSampling
from services.inference.scheduler_output import SchedulerOutput
from services.inference.sequence import Seq

TIMEOUT_S = 60.0


class Events:
    """A ``deliver`` callback for ``BatchEngine.submit``: keeps every event; ``done`` resolves
    with the last one (finish_reason set) or the error. Make it on the test's event loop."""

    def __init__(self) -> None:
        self.items: list[TokenEvent | BaseException] = []
        self.done: asyncio.Future[TokenEvent | BaseException] = asyncio.get_running_loop().create_future()
        self._grew = asyncio.Event()

    def __call__(self, item: TokenEvent | BaseException) -> None:
        self.items.append(item)
        self._grew.set()
        is_last = isinstance(item, BaseException) or item.finish_reason is not None
        if is_last and not self.done.done():
            self.done.set_result(item)

    async def until(self, count: int) -> None:
        """Wait until ``count`` events have arrived (within TIMEOUT_S)."""
        async def wait() -> None:
            while len(self.items) < count:
                self._grew.clear()
                await self._grew.wait()

        await asyncio.wait_for(wait(), TIMEOUT_S)

    async def last(self) -> TokenEvent | BaseException:
        """The last event or the error (within TIMEOUT_S)."""
        return await asyncio.wait_for(asyncio.shield(self.done), TIMEOUT_S)


class StepGate:
    """Holds the engine's worker inside its next step (before the forward) until ``release``."""

    def __init__(self, engine: BatchEngine, monkeypatch: pytest.MonkeyPatch) -> None:
        self._entered, self._released = threading.Event(), threading.Event()
        execute = engine.runner.execute

        def held(output: SchedulerOutput, sampling: Mapping[Seq, RowSampling]) -> list[Picked]:
            self._entered.set()
            self._released.wait(TIMEOUT_S)
            return execute(output, sampling)

        monkeypatch.setattr(engine.runner, "execute", held)

    async def entered(self) -> None:
        """Wait until the worker is inside a step."""
        assert await asyncio.to_thread(self._entered.wait, TIMEOUT_S)

    def release(self) -> None:
        """Let that step and every later one run."""
        self._released.set()


class StepLog:
    """Records, for each step the worker executes, the prompts of the sequences it computes."""

    def __init__(self, engine: BatchEngine, monkeypatch: pytest.MonkeyPatch) -> None:
        self._lock = threading.Lock()
        self._steps: list[frozenset[tuple[int, ...]]] = []
        execute = engine.runner.execute

        def logged(output: SchedulerOutput, sampling: Mapping[Seq, RowSampling]) -> list[Picked]:
            with self._lock:
                self._steps.append(frozenset(tuple(c.seq.token_ids[: c.seq.num_prompt_tokens])
                                             for c in output.chunks))
            return execute(output, sampling)

        monkeypatch.setattr(engine.runner, "execute", logged)

    @property
    def count(self) -> int:
        """Steps that have entered execution so far."""
        with self._lock:
            return len(self._steps)

    def since(self, mark: int) -> list[frozenset[tuple[int, ...]]]:
        """The prompts computed by each step from number ``mark`` on."""
        with self._lock:
            return self._steps[mark:]


async def clock_past(instant: float) -> None:
    """Return once ``time.monotonic()`` is past ``instant``: what a deadline test waits for is
    the clock itself, whatever the machine's speed (the loop's timers run on the same clock)."""
    await asyncio.sleep(max(0.0, instant - time.monotonic()) + 0.01)
    assert time.monotonic() > instant
