"""A change signal: whoever changes something calls ``notify``; whoever waits for a condition
on it re-checks after each change (no polling). The replica pools and the routes use it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


class Changes:
    """Notifies ``on_change`` and wakes every ``wait_for`` after each change."""

    def __init__(self, on_change: Callable[[], None] = lambda: None) -> None:
        self._event = asyncio.Event()
        self._on_change = on_change

    def notify(self) -> None:
        self._event.set()
        self._on_change()

    async def wait_for(self, condition: Callable[[], bool], timeout_s: float) -> None:
        """Return once ``condition()`` holds, checked after each change (TimeoutError after
        ``timeout_s``)."""
        async with asyncio.timeout(timeout_s):
            while True:
                self._event.clear()
                if condition():
                    return
                await self._event.wait()
