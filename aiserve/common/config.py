"""Settings loading, the same for every service (docs/architecture.md, "Settings").

Order, later wins: the dataclass defaults, an optional TOML file (``--config`` or
``AISERVE_CONFIG``; a ``[<service>]`` table, or top-level keys), environment variables
``AISERVE_<SERVICE>_<SETTING>``, then command-line flags ``--<setting>`` (dashes or underscores).
Each service keeps one frozen dataclass; this module only fills it in.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tomllib
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


class ConfigError(ValueError):
    """A setting is malformed or out of range; the message names the setting and the limit."""


def _coerce(name: str, kind: Any, raw: Any) -> Any:
    """Turn a TOML/env/flag value into the field's declared type."""
    origin = typing.get_origin(kind)
    if origin is typing.Union or str(origin) == "<class 'types.UnionType'>":
        args = [a for a in typing.get_args(kind) if a is not type(None)]
        if raw is None or raw == "":
            return None
        kind = args[0]
    if kind is bool:
        if isinstance(raw, bool):
            return raw
        text = str(raw).strip().lower()
        if text in {"1", "true", "yes", "on"}:
            return True
        if text in {"0", "false", "no", "off"}:
            return False
        raise ConfigError(f"{name}: expected a boolean, got {raw!r}")
    if typing.get_origin(kind) is tuple:
        items = raw if isinstance(raw, list | tuple) else [s for s in str(raw).split(",") if s]
        return tuple(str(i) for i in items)
    try:
        return kind(raw)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{name}: expected {kind.__name__}, got {raw!r}") from exc


def _read_toml(path: Path, service: str) -> dict[str, Any]:
    data = tomllib.loads(path.read_text())
    section = data.get(service)
    return dict(section) if isinstance(section, dict) else {k: v for k, v in data.items() if not isinstance(v, dict)}


def settings_of(cls: type) -> dict[str, tuple[tuple[str, ...], Any]]:
    """Every setting of a settings dataclass: flat name -> (path of field names, declared type).

    A field whose type is itself a dataclass (a component's settings, e.g. the scheduler's) is
    flattened: its fields are settings of their own names, so ``AISERVE_INFERENCE_MAX_NUM_SEQS``
    reaches ``InferenceConfig.engine.scheduler.max_num_seqs``. A name may appear only once.
    """
    found: dict[str, tuple[tuple[str, ...], Any]] = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        inner = settings_of(kind) if isinstance(kind, type) and dataclasses.is_dataclass(kind) else {f.name: ((), kind)}
        for name, (path, leaf) in inner.items():
            if name in found:
                raise TypeError(f"{cls.__name__}: setting {name!r} is declared twice")
            found[name] = ((f.name, *path), leaf)
    return found


def _build(cls: type[T], values: Mapping[tuple[str, ...], Any]) -> T:
    """``cls`` with the given values (keyed by field path); components are built the same way."""
    direct = {path[0]: value for path, value in values.items() if len(path) == 1}
    nested: dict[str, dict[tuple[str, ...], Any]] = {}
    for path, value in values.items():
        if len(path) > 1:
            nested.setdefault(path[0], {})[path[1:]] = value
    hints = typing.get_type_hints(cls)
    for name, inner in nested.items():
        direct[name] = _build(hints[name], inner)
    return cls(**direct)


def config_with(cls: type[T], **values: Any) -> T:
    """``cls`` with settings given by their flat names (typed values), validated: the way tests
    and benchmarks build a service's settings, e.g. ``config_with(InferenceConfig, max_num_seqs=8)``."""
    settings = settings_of(cls)
    if unknown := sorted(set(values) - set(settings)):
        raise ConfigError(f"unknown setting(s) of {cls.__name__}: {', '.join(unknown)}")
    config = _build(cls, {settings[name][0]: value for name, value in values.items()})
    if (validate := getattr(config, "validate", None)) is not None:
        validate()
    return config


def load_config(
    cls: type[T],
    service: str,
    argv: Sequence[str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> T:
    """Build ``cls`` (a dataclass) for ``service`` from defaults, TOML, environment and flags."""
    environ = os.environ if environ is None else environ
    settings = settings_of(cls)
    parser = argparse.ArgumentParser(prog=f"aiserve-{service}", description=cls.__doc__)
    parser.add_argument("--config", type=Path, help="TOML settings file")
    for name, (_, kind) in settings.items():
        flag = "--" + name.replace("_", "-")
        parser.add_argument(flag, f"--{name}", dest=name, default=None, help=f"({kind})")
    args = parser.parse_args(list(argv) if argv is not None else [])

    values: dict[str, Any] = {}
    toml_path = args.config or (Path(environ["AISERVE_CONFIG"]) if environ.get("AISERVE_CONFIG") else None)
    if toml_path is not None:
        for key, raw in _read_toml(toml_path, service).items():
            if key not in settings:
                raise ConfigError(f"{toml_path}: unknown setting {service}.{key}")
            values[key] = raw
    prefix = f"AISERVE_{service.upper()}_"
    for name in settings:
        if (raw := environ.get(prefix + name.upper())) is not None:
            values[name] = raw
        if (flag_value := getattr(args, name)) is not None:
            values[name] = flag_value
    typed = {settings[name][0]: _coerce(name, settings[name][1], raw) for name, raw in values.items()}
    config = _build(cls, typed)
    if (validate := getattr(config, "validate", None)) is not None:
        validate()
    return config


def require(condition: bool, message: str) -> None:
    """Raise ConfigError(message) unless ``condition``; used by the ``validate()`` methods."""
    if not condition:
        raise ConfigError(message)


@dataclasses.dataclass(frozen=True)
class ServiceConfig:
    """Settings every service has. Each service subclasses this with its own fields."""

    host: str = "127.0.0.1"
    """Address to listen on. The gateway's compose service sets 0.0.0.0."""
    port: int = 0
    """gRPC port; 0 binds a free port (tests). Each service declares its own default."""
    metrics_port: int = 0
    """Prometheus HTTP port; 0 disables the metrics endpoint."""
    log_level: str = "info"
    """debug, info, warning or error."""
    grace_s: float = 10.0
    """Seconds in-flight RPCs get to finish after SIGTERM."""
    announce_fd: int = -1
    """A file descriptor the service writes its bound gRPC port to, one line, once it listens,
    then closes; -1 = none. The suite runner starts services on port 0 and learns their ports
    this way (no free-port guess that another process could take first)."""

    def validate(self) -> None:
        require(bool(self.host.strip()), "host: must not be empty")
        require(0 <= self.port <= 65535, f"port: must be 0..65535, got {self.port}")
        require(0 <= self.metrics_port <= 65535, f"metrics_port: must be 0..65535, got {self.metrics_port}")
        require(self.log_level in {"debug", "info", "warning", "error"},
                f"log_level: must be debug|info|warning|error, got {self.log_level!r}")
        require(0 <= self.grace_s <= 600, f"grace_s: must be 0..600 seconds, got {self.grace_s}")
        require(self.announce_fd >= -1, f"announce_fd: must be a file descriptor or -1, got {self.announce_fd}")
