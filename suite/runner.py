"""Run the four services as child processes: what `make run` (``aiserve run``) and the
integration tests use.

Each service is its own process (``python -m services.<name>``) with its settings passed as
environment variables, its JSON log written to ``$AISERVE_HOME/logs/<name>.log``. A service
configured with port 0 binds a free port and announces it (``suite.process``); ``start()``
starts tokenizer, inference and cache, learns their ports, starts the gateway with their real
addresses, and waits until every service reports SERVING over grpc.health.v1 (no sleeps, no
polling). ``stop()`` sends SIGTERM, waits for a graceful exit, and kills what is left. On start
it makes sure the development tenant exists and its API key is in ``$AISERVE_HOME/dev.key``.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
from collections.abc import Awaitable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from aiserve.common.config import ServiceConfig
from aiserve.common.paths import DEV_KEY_FILE, HOME_ENV, LOGS_DIR, MODEL_STORE_ENV, MODELS_DIR, aiserve_home
from aiserve.common.server import wait_for_serving
from services.cache.config import CacheConfig
from services.gateway.config import GatewayConfig
from services.gateway.tenants import ensure_dev_key
from services.inference.config import InferenceConfig
from services.tokenizer.config import TokenizerConfig
from suite.process import read_announced_port, spawn_service, wait_exit

SERVICE_CONFIGS: dict[str, type[ServiceConfig]] = {
    "tokenizer": TokenizerConfig,
    "inference": InferenceConfig,
    "cache": CacheConfig,
    "gateway": GatewayConfig,
}
SERVICES = tuple(SERVICE_CONFIGS)
"""In start order: the gateway needs the others' addresses."""
BACKENDS = SERVICES[:-1]
DEFAULT_PORTS = {name: cls().port for name, cls in SERVICE_CONFIGS.items()}
"""Each service's own default gRPC port (its config class declares it)."""
DEFAULT_METRICS_PORTS = {name: cls().metrics_port for name, cls in SERVICE_CONFIGS.items()}


@dataclass
class SuiteConfig:
    """Where the suite keeps its state and which ports its services use."""

    home: Path
    ports: dict[str, int] = field(default_factory=lambda: dict(DEFAULT_PORTS))
    """gRPC port of each service; 0 = the service binds a free one, and the suite writes the
    port it bound here once the service announces it."""
    metrics_ports: dict[str, int] = field(default_factory=lambda: dict(DEFAULT_METRICS_PORTS))
    inference_threads: int = 0
    """torch threads of the inference service; 0 = all cores (the other services get one)."""
    extra_env: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> SuiteConfig:
        """Honour AISERVE_HOME and AISERVE_<SERVICE>_PORT / _METRICS_PORT like the services do."""
        config = cls(home=aiserve_home(environ).resolve())
        for name in SERVICES:
            if port := environ.get(f"AISERVE_{name.upper()}_PORT"):
                config.ports[name] = int(port)
            if port := environ.get(f"AISERVE_{name.upper()}_METRICS_PORT"):
                config.metrics_ports[name] = int(port)
        return config

    @classmethod
    def for_tests(cls, home: Path) -> SuiteConfig:
        """Every service on a port of its own choosing, no metrics endpoints."""
        return cls(home=home, ports=dict.fromkeys(SERVICES, 0), metrics_ports=dict.fromkeys(SERVICES, 0))

    def address(self, name: str) -> str:
        """``127.0.0.1:<port>`` of a service; for port 0, the port it announced."""
        if not self.ports[name]:
            raise LookupError(f"{name} has not announced the port it bound yet (start it first)")
        return f"127.0.0.1:{self.ports[name]}"

    def env_for(self, name: str, base: Mapping[str, str]) -> dict[str, str]:
        """The environment of service ``name``: ``base``, the extra settings, home and ports."""
        env = {**base, **self.extra_env}
        env.setdefault("HF_HUB_OFFLINE", "1")
        env.setdefault("TRANSFORMERS_OFFLINE", "1")
        env[HOME_ENV] = str(self.home)
        env.setdefault(MODEL_STORE_ENV, str(self.home / MODELS_DIR))
        env["PYTHONUNBUFFERED"] = "1"
        prefix = f"AISERVE_{name.upper()}_"
        env[prefix + "PORT"] = str(self.ports[name])
        env[prefix + "METRICS_PORT"] = str(self.metrics_ports[name])
        if name == "inference":
            threads = self.inference_threads or os.cpu_count() or 1
            env.setdefault(prefix + "TORCH_THREADS", str(threads))
        else:
            # Four services share the cores; the model's matrix products get them.
            env["OMP_NUM_THREADS"] = "1"
        if name == "gateway":
            for backend in BACKENDS:
                env[f"{prefix}{backend.upper()}_ADDRESS"] = self.address(backend)
        return env


class Suite:
    """The four services as child processes."""

    def __init__(self, config: SuiteConfig) -> None:
        self.config = config
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self._announcements: dict[str, int] = {}  # name -> read end of its port pipe, until read
        self._logs: list[IO[bytes]] = []

    @property
    def log_dir(self) -> Path:
        return self.config.home / LOGS_DIR

    def log_path(self, name: str) -> Path:
        return self.log_dir / f"{name}.log"

    @property
    def dev_key_path(self) -> Path:
        return self.config.home / DEV_KEY_FILE

    def start_service(self, name: str) -> None:
        """Start one service (not waiting for it). Started again, it binds the port it bound
        before, so that the gateway's address of it stays right."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = self.log_path(name).open("ab")
        self._logs.append(log)
        self.processes[name], self._announcements[name] = spawn_service(
            name, self.config.env_for(name, os.environ), log)

    async def wait_bound(self, names: tuple[str, ...], timeout_s: float = 300) -> None:
        """Wait until each named service has announced the port it bound (and record it)."""
        await _all(self._bound(name, timeout_s) for name in names if name in self._announcements)

    async def _bound(self, name: str, timeout_s: float) -> None:
        port = await asyncio.wait_for(read_announced_port(self._announcements.pop(name)), timeout_s)
        if port is None:
            await wait_exit(self.processes[name])
            raise self._exited(name)
        self.config.ports[name] = port

    async def wait_serving(self, names: tuple[str, ...] = SERVICES, timeout_s: float = 300) -> None:
        """Wait until each named service is SERVING; fail fast if one of them exits."""
        await self.wait_bound(names, timeout_s)
        await _all(self._serving(name, timeout_s) for name in names)

    async def _serving(self, name: str, timeout_s: float) -> None:
        watch = asyncio.ensure_future(wait_for_serving(self.config.address(name), timeout_s))
        exited = asyncio.ensure_future(wait_exit(self.processes[name]))
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
            raise self._exited(name)
        watch.result()  # TimeoutError when it never reported SERVING

    def _exited(self, name: str) -> RuntimeError:
        process = self.processes[name]
        tail = self.log_path(name).read_text(errors="replace")[-2000:]
        return RuntimeError(f"{name} exited with code {process.returncode}:\n{tail}")

    async def start(self, timeout_s: float = 300) -> None:
        """Create the development tenant's key (first start only), start tokenizer, inference and
        cache, then the gateway with their addresses (at once where their ports are fixed, once
        they announced them where they bind port 0); return when all four are SERVING."""
        self.config.home.mkdir(parents=True, exist_ok=True)
        ensure_dev_key(self.config.home)
        deadline = asyncio.get_running_loop().time() + timeout_s
        try:
            for name in BACKENDS:
                self.start_service(name)
            # The gateway needs the backends' addresses: wait only for those bound to port 0.
            await self.wait_bound(tuple(name for name in BACKENDS if not self.config.ports[name]), timeout_s)
            self.start_service("gateway")
            await self.wait_serving(SERVICES, max(deadline - asyncio.get_running_loop().time(), 1.0))
        except BaseException:
            self.stop()
            raise

    def stop_service(self, name: str, timeout_s: float = 30) -> int | None:
        """SIGTERM one service and wait up to ``timeout_s`` for it to exit, then kill it."""
        if (read_fd := self._announcements.pop(name, None)) is not None:
            os.close(read_fd)
        process = self.processes.pop(name, None)
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

    def stop(self) -> None:
        """Gateway first (stop taking requests), then the backends."""
        for name in reversed(SERVICES):
            self.stop_service(name)
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
