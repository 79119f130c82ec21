"""Backend addresses as gRPC target strings that may name several replicas.

A setting such as ``inference_address`` is one of:

- ``host:port``: one replica;
- ``ipv4:127.0.0.1:50053,127.0.0.1:50063``: these replicas, as given;
- ``dns:///inference.aiserve.svc:50053``: every address the name resolves to, asked again every
  ``resolve_interval_s`` (replicas come and go as the answer changes; a headless Kubernetes
  service is such a name).

The gateway balances over the replicas itself (docs/decisions.md, decision 44), so it needs the
addresses, not a channel that hides them. Pure: no grpc; resolving uses the event loop's
``getaddrinfo``.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiserve.common.config import ConfigError

IPV4 = "ipv4:"
DNS = "dns:///"
FORMS = "a target is host:port, ipv4:host:port,host:port or dns:///name:port"

GetAddrInfo = Callable[..., Awaitable[list[tuple[Any, ...]]]]
"""``loop.getaddrinfo``'s signature (tests give their own)."""


@dataclass(frozen=True)
class Target:
    """A parsed target: fixed ``addresses``, or a ``dns_host`` and ``port`` to resolve."""

    text: str
    addresses: tuple[str, ...] = ()
    dns_host: str = ""
    port: int = 0

    @property
    def is_dns(self) -> bool:
        """Whether the replicas are whatever ``dns_host`` resolves to now."""
        return bool(self.dns_host)


def _host_port(setting: str, text: str, item: str) -> tuple[str, int]:
    host, sep, port = item.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        where = "" if item == text else f" in {text!r}"
        raise ConfigError(f"{setting}: must be host:port, got {item!r}{where} ({FORMS})")
    return host, int(port)


def parse_target(setting: str, text: str) -> Target:
    """``text`` as a Target; ConfigError naming ``setting`` when it is none of the forms."""
    if text.startswith(DNS):
        host, port = _host_port(setting, text, text.removeprefix(DNS))
        return Target(text, dns_host=host, port=port)
    if text.startswith(IPV4):
        items = [item.strip() for item in text.removeprefix(IPV4).split(",")]
        if not items or not all(items):
            raise ConfigError(f"{setting}: {text!r} lists an empty address ({FORMS})")
        for item in items:
            _host_port(setting, text, item)
        return Target(text, addresses=tuple(dict.fromkeys(items)))
    if "://" in text or (text.split(":", 1)[0] in {"dns", "ipv6", "unix"}):
        raise ConfigError(f"{setting}: unsupported target {text!r} ({FORMS})")
    _host_port(setting, text, text)
    return Target(text, addresses=(text,))


def _address(family: int, ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if family == socket.AF_INET6 else f"{ip}:{port}"


async def resolve(target: Target, getaddrinfo: GetAddrInfo | None = None) -> tuple[str, ...]:
    """The replica addresses ``target`` names now, sorted (a DNS name is asked now; OSError
    when it does not resolve)."""
    if not target.is_dns:
        return target.addresses
    lookup = getaddrinfo or asyncio.get_running_loop().getaddrinfo
    answers = await lookup(target.dns_host, target.port, type=socket.SOCK_STREAM)
    return tuple(sorted({_address(family, sockaddr[0], target.port) for family, _, _, _, sockaddr in answers}))
