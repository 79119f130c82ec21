"""What SERVING means for the inference service, and the loop that keeps it true.

The service is SERVING while its last health check passed: no injected fault, the engine's
probe (one token through the real model between two steps, health_probe.py) answered within
``health_probe_timeout_s``, and free memory is at least ``min_free_memory_bytes``. The loop
(``InferenceHealth.run``, the server's ``health_loop``) checks at once after warm-up, then
every ``health_probe_interval_s`` and right after any failed engine step. Free memory is read
here from /proc and the cgroup (no torch, no grpc); the device's comes in as a callable.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import Counter, Gauge
from prometheus_client.registry import CollectorRegistry

from aiserve.common.config import require
from aiserve.common.logging import get_logger

log = get_logger("inference_health")

MIB = 1 << 20
MEMINFO = Path("/proc/meminfo")
CGROUP = Path("/sys/fs/cgroup")


@dataclass(frozen=True, slots=True)
class HealthConfig:
    """How the inference service checks itself (services/inference/health.py)."""

    health_probe_interval_s: float = 5.0
    """Seconds between two health checks (a failed engine step checks at once). 0.1..3600."""
    health_probe_timeout_s: float = 30.0
    """A probe that has not answered after this many seconds fails (NOT_SERVING). 0.1..600.
    The wait includes the engine step in flight: on a 2-core VM loaded three times over, the
    first step of 32 new float32 sequences kept a probe waiting past 10 s, so a shorter default
    turned a slow but working replica NOT_SERVING (docs/decisions.md, decision 43)."""
    min_free_memory_bytes: int = 256 * MIB
    """Below this much free memory the service is NOT_SERVING; 0 = no floor. Free memory is
    MemAvailable, capped by the cgroup v2 limit's room (memory.max - memory.current) where one
    is set, and by the device's free memory on CUDA. 0..1 PiB."""
    fault_file: str = ""
    """A TEST setting: while this path exists every health check fails ("fault injected: <path>
    exists"), so tests and drills can take a replica out without breaking it. "" = none."""

    def validate(self) -> None:
        """Raise ConfigError naming the first setting out of range and its limit."""
        require(0.1 <= self.health_probe_interval_s <= 3600,
                f"health_probe_interval_s: must be 0.1..3600 s, got {self.health_probe_interval_s}")
        require(0.1 <= self.health_probe_timeout_s <= 600,
                f"health_probe_timeout_s: must be 0.1..600 s, got {self.health_probe_timeout_s}")
        require(0 <= self.min_free_memory_bytes <= 1 << 50,
                f"min_free_memory_bytes: must be 0..{1 << 50} (0 = no floor), got {self.min_free_memory_bytes}")


def host_free_bytes(meminfo: Path = MEMINFO, cgroup: Path = CGROUP) -> int | None:
    """Memory this process could still get: MemAvailable, or the room left under a cgroup v2
    limit where that is less; None where neither can be read (not Linux)."""
    found = [x for x in (_mem_available(meminfo), _cgroup_room(cgroup)) if x is not None]
    return min(found) if found else None


def _mem_available(meminfo: Path) -> int | None:
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_room(cgroup: Path) -> int | None:
    try:
        limit = (cgroup / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return max(0, int(limit) - int((cgroup / "memory.current").read_text()))
    except (OSError, ValueError):
        return None


def free_memory_bytes(device_free: Callable[[], int | None]) -> int | None:
    """The least of the host's free memory and the device's (``device_free``: None on a CPU)."""
    found = [x for x in (host_free_bytes(), device_free()) if x is not None]
    return min(found) if found else None


@dataclass(frozen=True, slots=True)
class Verdict:
    """One health check's outcome: SERVING or not, and why not."""

    is_serving: bool
    reason: str = ""


def fault_verdict(fault_file: str) -> Verdict:
    """NOT_SERVING while the test setting ``fault_file`` names a path that exists."""
    if fault_file and Path(fault_file).exists():
        return Verdict(False, f"fault injected: {fault_file} exists")
    return Verdict(True)


def memory_verdict(free: int | None, floor: int) -> Verdict:
    """NOT_SERVING when ``free`` is known and below ``floor`` (0 = no floor)."""
    if floor and free is not None and free < floor:
        return Verdict(False, f"free memory {free // MIB} MiB below the floor {floor // MIB} MiB")
    return Verdict(True)


class HealthMetrics:
    """The health loop's metrics on its server's registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        p = "aiserve_inference_"
        self.failures = Counter(p + "probe_failures", "Health checks that failed (probe, memory floor "
                                "or injected fault)", registry=registry)
        self.probe_seconds = Gauge(p + "probe_seconds", "Seconds the last engine probe took",
                                   registry=registry)
        self.free_memory = Gauge(p + "free_memory_bytes", "Free memory at the last health check",
                                 registry=registry)
        self.passed = Gauge(p + "health_check_passed", "1 if the last health check passed, 0 if it failed",
                            registry=registry)
        self.checked_at = Gauge(p + "health_check_timestamp_seconds", "Unix time the last health check ended",
                                registry=registry)


class InferenceHealth:
    """The inference service's health loop: checks, then reports through ``report``."""

    def __init__(self, config: HealthConfig, probe: Callable[[float], Awaitable[float]],
                 free_memory: Callable[[], int | None], step_errors: asyncio.Event,
                 report: Callable[[bool, str], Awaitable[None]], registry: CollectorRegistry) -> None:
        self.config = config
        self._probe, self._free_memory, self._step_errors = probe, free_memory, step_errors
        self._report = report
        self.metrics = HealthMetrics(registry)

    async def run(self) -> None:
        """Check now, then every interval or right after a failed step, until cancelled."""
        while True:
            self._step_errors.clear()  # an error during the check below wakes the next one
            await self.check()
            try:
                await asyncio.wait_for(self._step_errors.wait(), self.config.health_probe_interval_s)
            except TimeoutError:
                pass

    async def check(self) -> Verdict:
        """One health check, reported (and logged and counted when it fails)."""
        verdict = await self._verdict()
        self.metrics.passed.set(1 if verdict.is_serving else 0)
        self.metrics.checked_at.set_to_current_time()
        if not verdict.is_serving:
            self.metrics.failures.inc()
            log.warning("probe_failed", reason=verdict.reason)
        await self._report(verdict.is_serving, verdict.reason)
        return verdict

    async def _verdict(self) -> Verdict:
        if not (fault := fault_verdict(self.config.fault_file)).is_serving:
            return fault
        probed = await self._run_probe()
        try:
            free = self._free_memory()
        except Exception as exc:  # noqa: BLE001 - e.g. a CUDA error: the device is not usable
            return Verdict(False, f"free memory unreadable: {exc}")
        if free is not None:
            self.metrics.free_memory.set(free)
        return probed if not probed.is_serving else memory_verdict(free, self.config.min_free_memory_bytes)

    async def _run_probe(self) -> Verdict:
        timeout_s = self.config.health_probe_timeout_s
        started = time.perf_counter()
        try:
            self.metrics.probe_seconds.set(await self._probe(timeout_s))
        except TimeoutError:
            self.metrics.probe_seconds.set(time.perf_counter() - started)
            return Verdict(False, f"probe timed out after {timeout_s:g}s")
        except Exception as exc:  # noqa: BLE001 - any failure of the probe is the verdict
            self.metrics.probe_seconds.set(time.perf_counter() - started)
            return Verdict(False, f"probe failed: {exc or type(exc).__name__}")
        return Verdict(True)
