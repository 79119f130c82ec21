"""The local suite's shape: which instances run, on which ports, with which settings.

An *instance* is one child process of the suite. Each service runs as one instance named after
it, except inference with ``inference_replicas`` N > 1: then ``inference-0`` .. ``inference-{N-1}``,
each on its own port and metrics port (the service's port + 10 * i; port 0 stays 0, each binds
its own and announces it), with the cores split between them (docs/decisions.md, decision 46).
The gateway gets every replica's address in one target (``ipv4:127.0.0.1:p0,127.0.0.1:p1``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from aiserve.common.config import ServiceConfig
from aiserve.common.paths import ADMIN_KEY_FILE, HOME_ENV, MODEL_STORE_ENV, MODELS_DIR, aiserve_home
from services.cache.config import CacheConfig
from services.gateway.config import GatewayConfig
from services.inference.config import InferenceConfig
from services.tokenizer.config import TokenizerConfig

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
REPLICA_PORT_STEP = 10
"""Replica i of a service listens on the service's port + 10 * i (50053, 50063, ...)."""
REPLICAS_ENV = "AISERVE_INFERENCE_REPLICAS"
HTTP_PORT_ENV = "AISERVE_GATEWAY_HTTP_PORT"


def service_of(instance: str) -> str:
    """The service an instance runs: ``inference-1`` -> ``inference``, ``gateway`` -> ``gateway``."""
    service, dash, index = instance.rpartition("-")
    return service if dash and index.isdigit() else instance


def replica_port(base: int, index: int) -> int:
    """The port of replica ``index`` of a service on ``base``; 0 (bind a free one) stays 0."""
    return base + REPLICA_PORT_STEP * index if base else 0


@dataclass
class SuiteConfig:
    """Where the suite keeps its state, which instances it runs and on which ports."""

    home: Path
    ports: dict[str, int] = field(default_factory=lambda: dict(DEFAULT_PORTS))
    """gRPC port of each instance; 0 = the instance binds a free one, and the suite writes the
    port it bound here once it announces it. Given per service, inference's entry becomes one
    per replica (``inference-i``: the port + 10 * i)."""
    metrics_ports: dict[str, int] = field(default_factory=lambda: dict(DEFAULT_METRICS_PORTS))
    """Metrics port of each instance, spread over the replicas like ``ports``."""
    http_port: int = GatewayConfig().http_port
    """The gateway's OpenAI-compatible HTTP port; 0 = off; -1 = a free one, which the suite
    writes here once the gateway announces it (so that a restarted gateway binds it again)."""
    inference_threads: int = 0
    """torch threads of each inference instance; 0 = the cores split evenly between the
    replicas (at least one each). The other services get one thread."""
    inference_replicas: int = 1
    """Inference instances; 1 = one instance named ``inference`` (as before replicas existed)."""
    extra_env: dict[str, str] = field(default_factory=dict)
    """Settings for every instance (``AISERVE_<SERVICE>_<SETTING>``)."""
    instance_env: dict[str, dict[str, str]] = field(default_factory=dict)
    """Settings for one instance only, by instance name (they win over ``extra_env``)."""
    restart_backoff_s: float = 1.0
    """The supervisor's first delay before restarting a child that exited unasked; it doubles
    with each restart in a row (docs/decisions.md, decision 47)."""
    restart_max_backoff_s: float = 30.0
    """The supervisor's longest delay between restarts."""
    max_start_failures: int = 5
    """Restarts in a row that exit before SERVING after which the supervisor gives up."""

    def __post_init__(self) -> None:
        if self.inference_replicas < 1:
            raise ValueError(f"inference_replicas: must be at least 1, got {self.inference_replicas}")
        for ports in (self.ports, self.metrics_ports):
            if self.inference_replicas > 1 and "inference" in ports:
                base = ports.pop("inference")
                for index, name in enumerate(self.inference_names):
                    ports.setdefault(name, replica_port(base, index))

    @classmethod
    def from_env(cls, environ: Mapping[str, str], inference_replicas: int | None = None) -> SuiteConfig:
        """Honour AISERVE_HOME, AISERVE_INFERENCE_REPLICAS and AISERVE_<SERVICE>_PORT /
        _METRICS_PORT like the services do; ``inference_replicas`` (a flag) wins over the variable."""
        ports, metrics_ports = dict(DEFAULT_PORTS), dict(DEFAULT_METRICS_PORTS)
        for name in SERVICES:
            if port := environ.get(f"AISERVE_{name.upper()}_PORT"):
                ports[name] = int(port)
            if port := environ.get(f"AISERVE_{name.upper()}_METRICS_PORT"):
                metrics_ports[name] = int(port)
        if inference_replicas is None:
            inference_replicas = int(environ.get(REPLICAS_ENV) or 1)
        http_port = int(environ.get(HTTP_PORT_ENV) or GatewayConfig().http_port)
        return cls(home=aiserve_home(environ).resolve(), ports=ports, metrics_ports=metrics_ports,
                   http_port=http_port, inference_replicas=inference_replicas)

    @classmethod
    def for_tests(cls, home: Path, inference_replicas: int = 1) -> SuiteConfig:
        """Every instance on a port of its own choosing, no metrics endpoints."""
        return cls(home=home, ports=dict.fromkeys(SERVICES, 0), metrics_ports=dict.fromkeys(SERVICES, 0),
                   http_port=-1, inference_replicas=inference_replicas)

    @property
    def inference_names(self) -> tuple[str, ...]:
        """The inference instances: ``("inference",)``, or ``inference-0`` .. with replicas."""
        if self.inference_replicas == 1:
            return ("inference",)
        return tuple(f"inference-{index}" for index in range(self.inference_replicas))

    @property
    def backend_names(self) -> tuple[str, ...]:
        """Every instance but the gateway, in start order."""
        return ("tokenizer", *self.inference_names, "cache")

    @property
    def instance_names(self) -> tuple[str, ...]:
        """Every instance, in start order (the gateway last)."""
        return (*self.backend_names, "gateway")

    @property
    def admin_key_path(self) -> Path:
        """The admin key the suite writes and its gateway reads (``$AISERVE_HOME/admin.key``)."""
        return self.home / ADMIN_KEY_FILE

    def address(self, name: str) -> str:
        """``127.0.0.1:<port>`` of an instance; for port 0, the port it announced."""
        if not self.ports[name]:
            raise LookupError(f"{name} has not announced the port it bound yet (start it first)")
        return f"127.0.0.1:{self.ports[name]}"

    def inference_target(self) -> str:
        """The gateway's inference address: one ``host:port``, or every replica as one gRPC
        target (``ipv4:127.0.0.1:p0,127.0.0.1:p1``)."""
        addresses = [self.address(name) for name in self.inference_names]
        return addresses[0] if len(addresses) == 1 else "ipv4:" + ",".join(addresses)

    def torch_threads(self) -> int:
        """torch threads of one inference instance."""
        return self.inference_threads or max(1, (os.cpu_count() or 1) // self.inference_replicas)

    def env_for(self, name: str, base: Mapping[str, str]) -> dict[str, str]:
        """The environment of instance ``name``: ``base``, the extra settings (its own last),
        home and ports."""
        service = service_of(name)
        env = {**base, **self.extra_env, **self.instance_env.get(name, {})}
        env.setdefault("HF_HUB_OFFLINE", "1")
        env.setdefault("TRANSFORMERS_OFFLINE", "1")
        env[HOME_ENV] = str(self.home)
        env.setdefault(MODEL_STORE_ENV, str(self.home / MODELS_DIR))
        env["PYTHONUNBUFFERED"] = "1"
        prefix = f"AISERVE_{service.upper()}_"
        env[prefix + "PORT"] = str(self.ports[name])
        env[prefix + "METRICS_PORT"] = str(self.metrics_ports[name])
        if service == "inference":
            env.setdefault(prefix + "TORCH_THREADS", str(self.torch_threads()))
        else:
            # The other services share the cores; the model's matrix products get them.
            env["OMP_NUM_THREADS"] = "1"
        if service == "gateway":
            env[prefix + "TOKENIZER_ADDRESS"] = self.address("tokenizer")
            env[prefix + "INFERENCE_ADDRESS"] = self.inference_target()
            env[prefix + "CACHE_ADDRESS"] = self.address("cache")
            env[prefix + "ADMIN_KEY_PATH"] = str(self.admin_key_path)
            env[HTTP_PORT_ENV] = str(self.http_port)
        return env

    def http_address(self) -> str:
        """``http://127.0.0.1:<port>`` of the gateway's HTTP API ("" when it is off)."""
        if self.http_port < 0:
            raise LookupError("the gateway has not announced its HTTP port yet (start it first)")
        return f"http://127.0.0.1:{self.http_port}" if self.http_port else ""
