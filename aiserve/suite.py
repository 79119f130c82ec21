"""Run the four services as child processes: what `make run` (``aiserve run``) and the
integration tests use.

Each service is its own process (``python -m services.<name>``) with its settings passed as
environment variables, its JSON log written to ``$AISERVE_HOME/logs/<name>.log``. ``start()``
waits until every service reports SERVING over grpc.health.v1 (no sleeps); ``stop()`` sends
SIGTERM, waits for a graceful exit, and kills what is left. On start it makes sure the
development tenant exists and its API key is in ``$AISERVE_HOME/dev.key`` (DESIGN.md §3).
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from aiserve.common.paths import DEV_KEY_FILE, HOME_ENV, LOGS_DIR, MODEL_STORE_ENV, MODELS_DIR, aiserve_home
from aiserve.common.server import wait_for_serving
from services.gateway.tenants import ensure_dev_key

SERVICES = ("tokenizer", "inference", "cache", "gateway")
DEFAULT_PORTS = {"gateway": 50051, "tokenizer": 50052, "inference": 50053, "cache": 50054}
DEFAULT_METRICS_PORTS = {"gateway": 9101, "tokenizer": 9102, "inference": 9103, "cache": 9104}


def free_port() -> int:
    """A TCP port nobody listens on right now (bind to 0, read it back, release it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class SuiteConfig:
    """Where the suite keeps its state and which ports its services use."""

    home: Path
    ports: dict[str, int] = field(default_factory=lambda: dict(DEFAULT_PORTS))
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
        return cls(
            home=home,
            ports={name: free_port() for name in SERVICES},
            metrics_ports={name: 0 for name in SERVICES},
        )

    def address(self, name: str) -> str:
        return f"127.0.0.1:{self.ports[name]}"

    def env_for(self, name: str, base: Mapping[str, str]) -> dict[str, str]:
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
            for backend in ("tokenizer", "inference", "cache"):
                env[f"{prefix}{backend.upper()}_ADDRESS"] = self.address(backend)
        return env


class Suite:
    """The four services as child processes."""

    def __init__(self, config: SuiteConfig) -> None:
        self.config = config
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self._logs: list[IO[bytes]] = []

    @property
    def log_dir(self) -> Path:
        return self.config.home / LOGS_DIR

    def log_path(self, name: str) -> Path:
        return self.log_dir / f"{name}.log"

    def start_service(self, name: str) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = self.log_path(name).open("ab")
        self._logs.append(log)
        self.processes[name] = subprocess.Popen(
            [sys.executable, "-m", f"services.{name}"],
            env=self.config.env_for(name, os.environ),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # Ctrl-C reaches the supervisor, which stops children in order
        )

    async def wait_serving(self, names: tuple[str, ...] = SERVICES, timeout_s: float = 300) -> None:
        """Wait until each named service is SERVING; fail fast if one of them exits."""

        async def one(name: str) -> None:
            watch = asyncio.create_task(wait_for_serving(self.config.address(name), timeout_s))
            while not watch.done():
                done, _ = await asyncio.wait({watch}, timeout=0.5)
                process = self.processes[name]
                if not done and process.poll() is not None:
                    watch.cancel()
                    tail = self.log_path(name).read_text(errors="replace")[-2000:]
                    raise RuntimeError(f"{name} exited with code {process.returncode}:\n{tail}")
            watch.result()

        await asyncio.gather(*(one(name) for name in names))

    @property
    def dev_key_path(self) -> Path:
        return self.config.home / DEV_KEY_FILE

    async def start(self, timeout_s: float = 300) -> None:
        """Create the development tenant's key (first start only), then start the four services."""
        self.config.home.mkdir(parents=True, exist_ok=True)
        ensure_dev_key(self.config.home)
        for name in SERVICES:
            self.start_service(name)
        try:
            await self.wait_serving(SERVICES, timeout_s)
        except BaseException:
            self.stop()
            raise

    def stop_service(self, name: str, timeout_s: float = 30) -> int | None:
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
