"""The supervisor: while the suite runs, a child that exits without being asked is started
again, after a backoff (``RestartPolicy``), on the port it had; one that keeps failing to start
makes it give up and stop the suite (docs/decisions.md, decision 47; docs/operations.md).

One guard per instance waits for its child's exit (an event, ``suite.process.wait_exit``). An
exit the suite asked for (``Suite.stop_service``, ``stop``, ``shutdown``: they take the child out
of ``Suite.processes`` before they signal it, or mark the suite closing) is not restarted. Each
restart is one line on the runner's output and one JSON record in ``logs/supervisor.log``.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
from datetime import UTC, datetime
from typing import TYPE_CHECKING, TextIO

from suite.process import wait_exit
from suite.restart_policy import RestartPolicy

if TYPE_CHECKING:
    from suite.runner import Suite

START_TIMEOUT_S = 300.0
"""How long a restarted child may take to report SERVING before it counts as a failed start."""
LOG_FILE = "supervisor.log"


class GaveUp(RuntimeError):
    """An instance failed to start ``max_start_failures`` times in a row; the suite was stopped."""

    def __init__(self, name: str, exit_code: int | None, failures: int, tail: str) -> None:
        super().__init__(f"{name} failed to start {failures} times in a row (last exit code {exit_code}); "
                         f"gave up and stopped the suite. The end of its log:\n{tail}")
        self.name = name


class Supervisor:
    """Restarts the children of one running ``Suite``; ``run()`` until the suite stops."""

    def __init__(self, suite: Suite, out: TextIO, restarts: dict[str, int]) -> None:
        self.suite = suite
        self.out = out
        self.restarts = restarts
        """Restarts begun, by instance (the suite's own count, kept across supervisors)."""
        self.served: dict[str, int] = {}
        """The number of the latest restart that reported SERVING, by instance."""
        self._progress = asyncio.Condition()
        self._started = {name: asyncio.Event() for name in suite.config.instance_names}

    def started(self, name: str) -> None:
        """``Suite.start_service`` started ``name``: its guard watches the new child."""
        if (event := self._started.get(name)) is not None:
            event.set()

    def wake(self) -> None:
        """The suite is closing: every guard idle for want of a child ends."""
        for event in self._started.values():
            event.set()

    async def run(self) -> None:
        """Guard every instance until the suite closes; on give-up stop the suite and raise GaveUp."""
        guards = [asyncio.create_task(self._guard(name), name=f"guard-{name}")
                  for name in self.suite.config.instance_names]
        try:
            done, _ = await asyncio.wait(guards, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            for guard in guards:
                guard.cancel()
            await asyncio.gather(*guards, return_exceptions=True)
        for task in done:
            if not task.cancelled() and (error := task.exception()) is not None:
                await self.suite.shutdown()
                raise error

    async def wait_restarted(self, name: str, count: int, timeout_s: float) -> None:
        """Until restart number ``count`` of ``name`` (or a later one) has reported SERVING."""
        async with self._progress:
            await asyncio.wait_for(self._progress.wait_for(lambda: self.served.get(name, 0) >= count), timeout_s)

    async def _guard(self, name: str) -> None:
        policy = RestartPolicy(self.suite.config.restart_backoff_s, self.suite.config.restart_max_backoff_s,
                               self.suite.config.max_start_failures)
        serving = True  # a child started by someone else was waited for by them
        while not self.suite.closing:
            process = self.suite.processes.get(name)
            if process is None:  # stopped on purpose: wait until it is started again
                self._started[name].clear()
                await self._started[name].wait()
                serving = True
                continue
            code = await wait_exit(process)
            if not self._unasked(name, process):
                continue
            delay = policy.after_exit(serving)
            if delay is None:
                self._record("gave_up", name, exit_code=code, start_failures=policy.start_failures)
                raise GaveUp(name, code, policy.start_failures, self.suite.log_tail(name))
            self._record("restart", name, exit_code=code, restart=self.restarts.get(name, 0) + 1, backoff_s=delay)
            await asyncio.sleep(delay)  # the backoff itself, not a wait for something to happen
            if self._unasked(name, process):
                serving = await self._restart(name)
                if serving:
                    policy.serving()

    def _unasked(self, name: str, process: subprocess.Popen[bytes]) -> bool:
        """Whether ``process`` is still ``name``'s child, and the suite is not closing."""
        return not self.suite.closing and self.suite.processes.get(name) is process

    async def _restart(self, name: str) -> bool:
        """Start ``name`` again; whether it reported SERVING (else it failed to start)."""
        number = self.restarts[name] = self.restarts.get(name, 0) + 1
        self.suite.start_service(name)
        try:
            await self.suite.wait_serving((name,), START_TIMEOUT_S)
        except RuntimeError:  # it exited before SERVING (or was stopped meanwhile)
            return False
        except TimeoutError:
            if (process := self.suite.processes.get(name)) is not None:
                process.kill()  # its exit is the failed start the guard sees next
            return False
        async with self._progress:
            self.served[name] = number
            self._progress.notify_all()
        self._record("serving", name, restart=number)
        return True

    def _record(self, event: str, name: str, **fields: object) -> None:
        """One line on the runner's output and one JSON record in logs/supervisor.log."""
        words = {"restart": "exited with code {exit_code} unasked; restart {restart} in {backoff_s:.1f}s",
                 "serving": "is SERVING again (restart {restart})",
                 "gave_up": "exited with code {exit_code}; {start_failures} failed starts in a row: giving up"}
        print(f"aiserve: {name} {words[event].format(**fields)}", file=self.out, flush=True)
        record = {"time": datetime.now(UTC).isoformat(), "event": event, "instance": name, **fields}
        self.suite.log_dir.mkdir(parents=True, exist_ok=True)
        with (self.suite.log_dir / LOG_FILE).open("a") as log:
            log.write(json.dumps(record) + "\n")
