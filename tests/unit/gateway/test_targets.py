"""Backend targets: the three forms parsed and resolved; a bad one names its setting."""

from __future__ import annotations

import socket
from typing import Any

import pytest

from aiserve.common.config import ConfigError
from services.gateway.targets import Target, parse_target, resolve


async def test_host_port_is_one_replica() -> None:
    target = parse_target("inference_address", "inference:50053")
    assert target == Target("inference:50053", addresses=("inference:50053",))
    assert not target.is_dns
    assert await resolve(target) == ("inference:50053",)


async def test_an_ipv4_list_is_its_replicas_as_given() -> None:
    target = parse_target("inference_address", "ipv4:127.0.0.1:50053, 127.0.0.1:50063,127.0.0.1:50053")
    assert await resolve(target) == ("127.0.0.1:50053", "127.0.0.1:50063")  # a repeat counts once


async def test_a_dns_name_is_every_address_it_resolves_to_now() -> None:
    target = parse_target("inference_address", "dns:///inference.aiserve.svc:50053")
    assert (target.dns_host, target.port, target.is_dns) == ("inference.aiserve.svc", 50053, True)
    answers: list[list[tuple[Any, ...]]] = [
        [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.0.0.2", 50053)),
         (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.0.0.1", 50053)),
         (socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("fd00::1", 50053, 0, 0))],
        [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.0.0.3", 50053))],
    ]
    asked: list[tuple[str, int]] = []

    async def getaddrinfo(host: str, port: int, **kwargs: Any) -> list[tuple[Any, ...]]:
        asked.append((host, port))
        return answers.pop(0)

    assert await resolve(target, getaddrinfo) == ("10.0.0.1:50053", "10.0.0.2:50053", "[fd00::1]:50053")
    assert await resolve(target, getaddrinfo) == ("10.0.0.3:50053",)  # asked again: the answer changed
    assert asked == [("inference.aiserve.svc", 50053)] * 2


async def test_a_real_name_resolves_with_the_event_loops_getaddrinfo() -> None:
    addresses = await resolve(parse_target("cache_address", "dns:///localhost:50054"))
    assert "127.0.0.1:50054" in addresses


@pytest.mark.parametrize("text", [
    "nonsense", "localhost", "host:", ":50053", "host:0", "host:70000", "ipv4:", "ipv4:127.0.0.1:1,",
    "ipv4:127.0.0.1", "dns:///name", "dns://8.8.8.8/name:1", "unix:/tmp/sock", "ipv6:[::1]:1",
])
def test_a_bad_target_is_refused_naming_its_setting(text: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_target("inference_address", text)
    assert str(info.value).startswith("inference_address: ")
    assert "dns:///name:port" in str(info.value)  # and says what would do
