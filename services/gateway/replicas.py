"""The replicas of one backend service and which one serves the next request (pure logic).

Each replica's health comes from its own watch (``replica.py``); a ``ReplicaSet`` only reads
what the watches recorded and picks round-robin over the replicas that can serve now. No grpc:
unit-tested with plain objects.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Iterator
from typing import Generic, Protocol, TypeVar

from aiserve.common.errors import Unavailable


class State(enum.Enum):
    """What a replica's health watch says now."""

    SERVING = "serving"
    NOT_SERVING = "not_serving"
    UNREACHABLE = "unreachable"


class Member(Protocol):
    """What a ReplicaSet reads of a replica."""

    @property
    def address(self) -> str: ...

    @property
    def is_usable(self) -> bool:
        """SERVING, and nothing else rules it out (a failed pairing check)."""
        ...

    @property
    def reason(self) -> str:
        """Why it is not usable ("" when it is)."""
        ...


M = TypeVar("M", bound=Member)


class ReplicaSet(Generic[M]):
    """The replicas of ``service`` (by address, in the order they came) and a round-robin pick."""

    def __init__(self, service: str) -> None:
        self.service = service
        self._members: dict[str, M] = {}
        self._turn = 0

    def __iter__(self) -> Iterator[M]:
        return iter(list(self._members.values()))

    def __len__(self) -> int:
        return len(self._members)

    def addresses(self) -> tuple[str, ...]:
        return tuple(self._members)

    def add(self, member: M) -> None:
        self._members[member.address] = member

    def remove(self, address: str) -> M | None:
        """Forget the replica at ``address`` (it is returned for closing)."""
        return self._members.pop(address, None)

    def usable(self, exclude: Collection[str] = ()) -> list[M]:
        """The replicas a request may go to now, except those at ``exclude``."""
        return [m for m in self._members.values() if m.is_usable and m.address not in exclude]

    def pick(self, exclude: Collection[str] = (), advance: bool = True) -> M:
        """The next usable replica, round-robin; Unavailable naming each replica's reason when
        there is none. ``advance`` False: the same one again next time (a look, not a use)."""
        candidates = self.usable(exclude)
        if not candidates:
            raise Unavailable(f"{self.service} unavailable: {self.why_none(exclude)}")
        member = candidates[self._turn % len(candidates)]
        self._turn += advance
        return member

    def why_none(self, exclude: Collection[str] = ()) -> str:
        """"no replica SERVING (address: reason; ...)", as the health reason and errors say it."""
        reasons = [f"{m.address}: {'just failed' if m.address in exclude and m.is_usable else m.reason}"
                   for m in self._members.values()]
        return f"no replica SERVING ({'; '.join(reasons) or 'no replica known'})"
