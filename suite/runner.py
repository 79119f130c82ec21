"""Run the suite's instances as child processes: what `make run` (``aiserve run``) and the
integration tests use.

Each instance (``suite.config``: one per service, or ``inference-0`` .. with replicas) is its own
process (``python -m services.<service>``) with its settings passed as environment variables,
its JSON log written to ``$AISERVE_HOME/logs/<instance>.log``. An instance configured with port
0 binds a free port and announces it (``suite.process``); ``start()`` starts the backends, learns
their ports, starts the gateway with their real addresses, and waits until every instance
reports SERVING over grpc.health.v1 (no sleeps, no polling). ``supervise()`` then restarts a
child that exits unasked (``suite.supervisor``); it runs only when called (``aiserve run`` and the
tests that want it run it as a task), so a suite a test drives by hand is left as it is.
``shutdown()`` (and ``stop()``, the same without an event loop) drains: the gateway first
(SIGTERM: it goes NOT_SERVING and lets its streams finish), then the backends; they return each
child's exit code. On start it makes sure the development tenant's API key
(``$AISERVE_HOME/dev.key``) and the admin key (``$AISERVE_HOME/admin.key``) exist.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Awaitable, Coroutine, Iterable
from pathlib import Path
from typing import IO, TextIO

from aiserve.common.paths import DEV_KEY_FILE, LOGS_DIR
from aiserve.common.server import wait_for_serving
from services.gateway.admin_key import ensure_admin_key
from services.gateway.tenants import ensure_dev_key
from suite.config import BACKENDS, SERVICE_CONFIGS, SERVICES, SuiteConfig, service_of
from suite.process import read_announced_ports, spawn_service, wait_exit
from suite.supervisor import Supervisor
from suite.version_instances import stop_all_versions

__all__ = ["BACKENDS", "SERVICES", "SERVICE_CONFIGS", "Suite", "SuiteConfig", "free_ports"]

STOP_TIMEOUT_S = 30.0
"""How long a child may take to exit after SIGTERM before it is killed (above every grace_s)."""


def free_ports(n: int) -> list[int]:
    """``n`` ports free now (bound together, so distinct; released for the suite to bind)."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


class Suite:
    """The suite's instances as child processes."""

    def __init__(self, config: SuiteConfig) -> None:
        self.config = config
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self.closing = False
        """Set by ``stop``/``shutdown``: from then on no child is restarted."""
        self._announcements: dict[str, int] = {}  # name -> read end of its port pipe, until read
        self._logs: list[IO[bytes]] = []
        self._supervisor: Supervisor | None = None
        self._restarts: dict[str, int] = {}

    @property
    def log_dir(self) -> Path:
        return self.config.home / LOGS_DIR

    def log_path(self, name: str) -> Path:
        return self.log_dir / f"{name}.log"

    def log_tail(self, name: str, chars: int = 2000) -> str:
        """The end of an instance's log (what it said before it exited)."""
        try:
            return self.log_path(name).read_text(errors="replace")[-chars:]
        except FileNotFoundError:
            return ""

    @property
    def dev_key_path(self) -> Path:
        return self.config.home / DEV_KEY_FILE

    @property
    def admin_key_path(self) -> Path:
        return self.config.admin_key_path

    @property
    def inference_names(self) -> tuple[str, ...]:
        """The inference instances (``inference``, or ``inference-0`` .. with replicas)."""
        return self.config.inference_names

    def start_service(self, name: str) -> None:
        """Start one instance (not waiting for it). Started again, it binds the port it bound
        before, so that the gateway's address of it stays right."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = self.log_path(name).open("ab")
        self._logs.append(log)
        self.processes[name], self._announcements[name] = spawn_service(
            service_of(name), self.config.env_for(name, os.environ), log)
        if self._supervisor is not None:
            self._supervisor.started(name)

    async def wait_bound(self, names: tuple[str, ...], timeout_s: float = 300) -> None:
        """Wait until each named instance has announced the port it bound (and record it)."""
        await _all(self._bound(name, timeout_s) for name in names if name in self._announcements)

    async def _bound(self, name: str, timeout_s: float) -> None:
        process = self.processes[name]
        ports = await asyncio.wait_for(read_announced_ports(self._announcements.pop(name)), timeout_s)
        if not ports:
            await wait_exit(process)
            raise self._exited(name, process)
        self.config.ports[name] = ports[0]
        if name == "gateway" and self.config.http_port and len(ports) > 1:
            self.config.http_port = ports[1]

    async def wait_serving(self, names: tuple[str, ...] | None = None, timeout_s: float = 300) -> None:
        """Wait until each named instance (default: all) is SERVING; fail fast if one exits."""
        names = self.config.instance_names if names is None else names
        await self.wait_bound(names, timeout_s)
        await _all(self._serving(name, timeout_s) for name in names)

    async def _serving(self, name: str, timeout_s: float) -> None:
        process = self.processes[name]
        watch = asyncio.ensure_future(wait_for_serving(self.config.address(name), timeout_s))
        exited = asyncio.ensure_future(wait_exit(process))
        try:
            done, pending = await asyncio.wait({watch, exited}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            watch.cancel()
            exited.cancel()
            raise
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)  # let them finish cancelling
        if watch not in done:
            raise self._exited(name, process)
        watch.result()  # TimeoutError when it never reported SERVING

    def _exited(self, name: str, process: subprocess.Popen[bytes]) -> RuntimeError:
        return RuntimeError(f"{name} exited with code {process.returncode}:\n{self.log_tail(name)}")

    async def start(self, timeout_s: float = 300) -> None:
        """Create the development tenant's key and the admin key (first start only), start the
        backends, then the gateway with their addresses (at once where their ports are fixed,
        once they announced them where they bind port 0); return when all are SERVING."""
        self.closing = False
        self.config.home.mkdir(parents=True, exist_ok=True)
        ensure_dev_key(self.config.home)
        ensure_admin_key(self.admin_key_path)
        deadline = asyncio.get_running_loop().time() + timeout_s
        try:
            backends = self.config.backend_names
            for name in backends:
                self.start_service(name)
            # The gateway needs the backends' addresses: wait only for those bound to port 0.
            await self.wait_bound(tuple(name for name in backends if not self.config.ports[name]), timeout_s)
            self.start_service("gateway")
            await self.wait_serving(None, max(deadline - asyncio.get_running_loop().time(), 1.0))
        except BaseException:
            self.stop()
            raise

    def supervise(self, out: TextIO | None = None) -> Coroutine[None, None, None]:
        """Restart any child that exits unasked, until the suite stops; raise ``GaveUp`` (after
        stopping the suite) when one fails to start ``max_start_failures`` times in a row.
        Restarts are reported on ``out`` (default stderr) and in ``logs/supervisor.log``.

        The supervisor exists once this returns (run the coroutine as a task), so that
        ``wait_restarted`` works at once."""
        if self._supervisor is not None:
            raise RuntimeError("the suite is already supervised")
        self._supervisor = supervisor = Supervisor(self, out or sys.stderr, self._restarts)

        async def run() -> None:
            try:
                await supervisor.run()
            finally:
                self._supervisor = None

        return run()

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to an instance, as a crash would (the supervisor restarts it)."""
        self.processes[name].send_signal(sig)

    def restart_count(self, name: str) -> int:
        """How many times the supervisor has begun to restart ``name``."""
        return self._restarts.get(name, 0)

    async def wait_restarted(self, name: str, count: int, timeout_s: float) -> None:
        """Wait until the ``count``-th restart of ``name`` (or a later one) is SERVING."""
        if self._supervisor is None:
            raise RuntimeError("the suite is not supervised: run supervise() first")
        await self._supervisor.wait_restarted(name, count, timeout_s)

    def _begin_closing(self) -> None:
        self.closing = True
        if self._supervisor is not None:
            self._supervisor.wake()

    def _take(self, name: str) -> subprocess.Popen[bytes] | None:
        """Take an instance out of the suite before stopping it (so nothing restarts it)."""
        if (read_fd := self._announcements.pop(name, None)) is not None:
            os.close(read_fd)
        return self.processes.pop(name, None)

    def stop_service(self, name: str, timeout_s: float = STOP_TIMEOUT_S) -> int | None:
        """SIGTERM one instance and wait up to ``timeout_s`` for it to exit, then kill it; its
        exit code (None when it was not running)."""
        process = self._take(name)
        if process is None:
            return None
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        return process.returncode

    async def shutdown_service(self, name: str, timeout_s: float = STOP_TIMEOUT_S) -> int | None:
        """``stop_service`` on the event loop: the loop keeps running while the child drains."""
        process = self._take(name)
        if process is None:
            return None
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                return await asyncio.wait_for(wait_exit(process), timeout_s)
            except TimeoutError:
                process.kill()
        return await wait_exit(process)

    def _stop_order(self) -> list[str]:
        """The gateway first (stop taking requests), then the backends."""
        return sorted(self.processes, key=lambda name: name != "gateway")

    async def shutdown(self, timeout_s: float = STOP_TIMEOUT_S) -> dict[str, int | None]:
        """Drain and stop the suite: the gateway first (its streams finish within its grace
        period), then the backends at once, with the processes of any version a rollout started
        (suite/version_instances.py); every child's exit code by instance."""
        self._begin_closing()
        codes: dict[str, int | None] = {}
        if "gateway" in self.processes:
            codes["gateway"] = await self.shutdown_service("gateway", timeout_s)
        backends = list(self.processes)
        versions = asyncio.ensure_future(asyncio.to_thread(stop_all_versions, self.config.home, timeout_s))
        results = await asyncio.gather(*(self.shutdown_service(name, timeout_s) for name in backends))
        await versions
        codes.update(zip(backends, results, strict=True))
        self._close_logs()
        return codes

    def stop(self) -> dict[str, int | None]:
        """``shutdown`` for callers without a running event loop (fixtures); the gateway first."""
        self._begin_closing()
        codes = {name: self.stop_service(name) for name in self._stop_order()}
        stop_all_versions(self.config.home)  # versions a rollout started beside the suite
        self._close_logs()
        return codes

    def _close_logs(self) -> None:
        for log in self._logs:
            log.close()
        self._logs.clear()


async def _all(waits: Iterable[Awaitable[None]]) -> None:
    """Await all of ``waits`` at once; the first failure cancels the rest and is raised."""
    tasks = [asyncio.ensure_future(wait) for wait in waits]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        raise
