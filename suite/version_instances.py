"""A model version's own tokenizer and inference processes, started beside a running suite.

A rollout never touches the running version: the new version gets processes of its own, from
its own verified folder in the model store, on ports they choose (port 0, announced), with logs
``logs/tokenizer@NAME@VERSION.log`` and ``logs/inference@NAME@VERSION.log``. Their pids and
addresses are kept in ``$AISERVE_HOME/versions.json`` so that a later command (``aiserve
rollout``, or the runner's stop) can find and stop them: they outlive the command that started
them, as a rollout outlives one terminal session.
"""

from __future__ import annotations

import asyncio
import json
import os
import select
import signal
import subprocess
from collections.abc import Collection, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from aiserve.common.paths import HOME_ENV, MODEL_STORE_ENV
from aiserve.common.server import wait_for_serving
from suite.process import read_announced_port, spawn_service, wait_exit

VERSIONS_FILE = "versions.json"
SERVICES = ("tokenizer", "inference")
STOP_TIMEOUT_S = 30.0
"""How long a version's process may drain after SIGTERM before it is killed."""


@dataclass(frozen=True)
class VersionProcess:
    """One process of a version: which service, its pid and the address it serves on."""

    service: str
    pid: int
    address: str


def versions_path(home: Path) -> Path:
    return home / VERSIONS_FILE


def read_versions(home: Path) -> dict[str, list[VersionProcess]]:
    """The recorded processes by name@version ({} when none were started)."""
    try:
        data = json.loads(versions_path(home).read_text())
    except FileNotFoundError:
        return {}
    return {model: [VersionProcess(**p) for p in processes] for model, processes in data.items()}


def _write_versions(home: Path, versions: Mapping[str, list[VersionProcess]]) -> None:
    path = versions_path(home)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({m: [asdict(p) for p in ps] for m, ps in versions.items()}, indent=1))
    tmp.replace(path)  # atomic: a reader never sees half a file


def version_env(base: Mapping[str, str], home: Path, store_root: Path, service: str, model: str,
                torch_threads: int, settings: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a version's ``service`` process: ``model`` from ``store_root``, a port
    of its own choosing, no metrics port (the running suite's are taken). The service's own
    settings in ``base`` are the running version's and are left out; ``settings`` (the
    version's own, ``AISERVE_<SERVICE>_*``) win over everything."""
    prefix = f"AISERVE_{service.upper()}_"
    env = {key: value for key, value in base.items() if not key.startswith(prefix)}
    env.update({HOME_ENV: str(home), MODEL_STORE_ENV: str(store_root), "PYTHONUNBUFFERED": "1",
                "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                prefix + "MODEL": model, prefix + "PORT": "0", prefix + "METRICS_PORT": "0"})
    if service == "inference":
        env[prefix + "TORCH_THREADS"] = str(torch_threads)
    else:
        env["OMP_NUM_THREADS"] = "1"
    env.update({key: value for key, value in (settings or {}).items() if key.startswith(prefix)})
    return env


@dataclass
class _Child:
    """A version's process while it starts."""

    service: str
    process: subprocess.Popen[bytes]
    announce_fd: int
    log_path: Path


async def start_version(home: Path, store_root: Path, model: str, timeout_s: float,
                        torch_threads: int = 1, settings: Mapping[str, str] | None = None) -> dict[str, str]:
    """Start ``model``'s tokenizer and inference, wait until both are SERVING, record them;
    return their addresses by service. On any failure the started processes are killed and
    the error names the one that failed, with the end of its log."""
    logs = home / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    children: list[_Child] = []
    try:
        for service in SERVICES:
            log_path = logs / f"{service}@{model}.log"
            with log_path.open("ab") as log:  # the child keeps its own descriptor
                env = version_env(os.environ, home, store_root, service, model, torch_threads, settings)
                process, announce_fd = spawn_service(service, env, log)
            children.append(_Child(service, process, announce_fd, log_path))
        addresses = {child.service: await _bound(child, model, timeout_s) for child in children}
        for child in children:
            await _serving(child, model, addresses[child.service], timeout_s)
    except BaseException:
        for child in children:
            if child.process.poll() is None:
                child.process.kill()
                child.process.wait()
        raise
    versions = read_versions(home)
    versions[model] = [VersionProcess(c.service, c.process.pid, addresses[c.service]) for c in children]
    _write_versions(home, versions)
    return addresses


async def _bound(child: _Child, model: str, timeout_s: float) -> str:
    """The address ``child`` announced; its exit before that is an error with its log's end."""
    port = await asyncio.wait_for(read_announced_port(child.announce_fd), timeout_s)
    if port is None:
        code = await wait_exit(child.process)
        raise RuntimeError(f"{child.service} of {model} exited with code {code}:\n{_tail(child.log_path)}")
    return f"127.0.0.1:{port}"


async def _serving(child: _Child, model: str, address: str, timeout_s: float) -> None:
    """Until ``address`` is SERVING; fail at once, with its log's end, if the process exits."""
    watch = asyncio.ensure_future(wait_for_serving(address, timeout_s))
    exited = asyncio.ensure_future(wait_exit(child.process))
    done, pending = await asyncio.wait({watch, exited}, return_when=asyncio.FIRST_COMPLETED)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    if watch not in done:
        raise RuntimeError(f"{child.service} of {model} exited with code {exited.result()}:\n"
                           f"{_tail(child.log_path)}")
    watch.result()


def stop_version(home: Path, model: str, timeout_s: float = STOP_TIMEOUT_S) -> int:
    """SIGTERM every recorded process of ``model`` (they drain), wait up to ``timeout_s`` for
    each to exit (then SIGKILL it), and forget them; how many were running."""
    versions = read_versions(home)
    stopped = sum(_stop(process.pid, timeout_s) for process in versions.pop(model, []))
    _write_versions(home, versions)
    return stopped


def stop_unrouted(home: Path, routed: Collection[str], timeout_s: float = STOP_TIMEOUT_S) -> list[str]:
    """Stop the recorded versions that are on no route any more (removed, or retired after a
    promote); the models stopped."""
    gone = [model for model in read_versions(home) if model not in routed]
    for model in gone:
        stop_version(home, model, timeout_s)
    return gone


def stop_all_versions(home: Path, timeout_s: float = STOP_TIMEOUT_S) -> int:
    """``stop_version`` for every recorded version (the runner's stop calls it)."""
    return sum(stop_version(home, model, timeout_s) for model in read_versions(home))


def _stop(pid: int, timeout_s: float) -> bool:
    """SIGTERM ``pid`` and wait on its pidfd for the exit (no polling); SIGKILL after
    ``timeout_s``. False when it was not running."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return False
    try:
        signal.pidfd_send_signal(pidfd, signal.SIGTERM)  # the pidfd: never a recycled pid
        if not select.select([pidfd], [], [], timeout_s)[0]:
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            select.select([pidfd], [], [], timeout_s)
    except ProcessLookupError:
        pass  # it exited meanwhile
    finally:
        os.close(pidfd)
    try:
        os.waitpid(pid, os.WNOHANG)  # reap it where it is our own child
    except ChildProcessError:
        pass
    return True


def _tail(path: Path, chars: int = 2000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""
