"""The route and the generations over several inference replicas (docs/decisions.md, 44 and 45).

The ``Router`` and ``Generations`` of ``services/gateway/interfaces.py``. A generation picks its
inference replica (round-robin over the SERVING ones whose pairing with the tokenizer holds)
when it starts, and stays on it: its events come over that replica's own shared call. If the
replica fails it with UNAVAILABLE before its first event, nothing reached the client yet, so it
is started once more on another SERVING replica; after the first event it fails with
UNAVAILABLE naming the replica and the request id.
"""

from __future__ import annotations

import time
from collections.abc import Collection

from aiserve.common.errors import FailedPrecondition, Unavailable
from services.gateway.domain import GenerationEvent, GenerationRequest, RouteInfo
from services.gateway.generate_call_client import CallGeneration
from services.gateway.generate_mux_client import MuxGeneration
from services.gateway.pool import ReplicaPool
from services.gateway.replica import Replica
from services.gateway.replica_clients import InferenceClients
from services.gateway.replicas import State

InferenceReplica = Replica[InferenceClients]


class FleetRouter:
    """The checked route: a SERVING inference replica whose pairing with the tokenizer holds."""

    def __init__(self, pool: ReplicaPool[InferenceClients], mismatch_retry_s: float) -> None:
        self.pool = pool
        self._mismatch_retry_s = mismatch_retry_s

    async def route(self, model: str) -> RouteInfo:
        """The route for ``model`` ('' = default): NOT_FOUND / FAILED_PRECONDITION / UNAVAILABLE."""
        return (await self.checked_replica(model, advance=False))[1]  # the generation's pick takes the turn

    def forget_route(self) -> None:
        """Nothing to forget here: each replica's pairing is checked again when it turns SERVING
        anew (its watch sees every restart) and after ``fingerprint_ttl_s``."""

    async def checked_replica(self, model: str, exclude: Collection[str] = (),
                              advance: bool = True) -> tuple[InferenceReplica, RouteInfo]:
        """The next usable replica whose pairing holds, and the route it serves; a replica that
        fails the check is refused ("tokenizer mismatch: ...") and the next one is tried."""
        tried = set(exclude)
        failed: FailedPrecondition | Unavailable | None = None
        while True:
            try:
                replica = await self.pool.pick_ready(tried, advance)
            except Unavailable:
                if failed is not None:
                    raise failed from None
                self._raise_if_all_refused()
                raise
            try:
                return replica, await replica.clients.check(model)
            except FailedPrecondition as exc:
                replica.mark_mismatch(f"tokenizer mismatch: {exc.message}", self._mismatch_retry_s)
                failed = exc
            except Unavailable as exc:
                failed = exc
            tried.add(replica.address)

    def _raise_if_all_refused(self) -> None:
        """Every SERVING replica failed the pairing check: that is a deployment's mistake
        (FAILED_PRECONDITION), not an outage."""
        serving = [r for r in self.pool.replicas if r.state is State.SERVING]
        if serving and all(r.reason for r in serving):
            raise FailedPrecondition(f"inference: every SERVING replica is refused "
                                     f"({'; '.join(f'{r.address}: {r.reason}' for r in serving)})")


class FleetGenerations:
    """Starts ``FleetGeneration``s over the inference replicas."""

    def __init__(self, router: FleetRouter) -> None:
        self.router = router

    def open(self, request: GenerationRequest, timeout_s: float) -> FleetGeneration:
        """``request``, started on its replica when it is first read."""
        return FleetGeneration(self.router, request, time.monotonic() + timeout_s)

    async def close(self) -> None:
        """The replicas own their calls (``Backends.close`` closes them)."""


class FleetGeneration:
    """One generation on one replica; started on another replica once if the first fails with
    UNAVAILABLE before any event."""

    def __init__(self, router: FleetRouter, request: GenerationRequest, deadline: float) -> None:
        self._router, self._request, self._deadline = router, request, deadline
        self._replica: InferenceReplica | None = None
        self._current: MuxGeneration | CallGeneration | None = None
        self._has_event = self._has_retried = False

    @property
    def address(self) -> str:
        """The replica it runs on ("" before it started)."""
        return self._replica.address if self._replica is not None else ""

    async def read(self, timeout_s: float) -> GenerationEvent:
        """The next event; the generation's error, UNAVAILABLE naming its replica and request id."""
        if self._current is None:
            await self._start(())
        assert self._current is not None
        try:
            event = await self._current.read(timeout_s)
        except Unavailable as exc:
            if self._has_event or self._has_retried:
                raise self._went_away(exc) from None
            event = await self._retry(exc, timeout_s)
        self._has_event = True
        return event

    async def _retry(self, first: Unavailable, timeout_s: float) -> GenerationEvent:
        """Nothing reached the client yet: start it on another replica, once."""
        self._has_retried = True
        failed = self.address
        error = self._went_away(first)
        self._close_current()
        try:
            await self._start((failed,))
        except Unavailable:
            raise error from None
        assert self._current is not None
        try:
            return await self._current.read(timeout_s)
        except Unavailable as exc:
            raise self._went_away(exc) from None

    async def _start(self, exclude: Collection[str]) -> None:
        replica, _ = await self._router.checked_replica(self._request.model, exclude)
        self._replica = replica
        remaining = max(self._deadline - time.monotonic(), 0.001)
        self._current = replica.clients.generations.open(self._request, remaining)

    def _went_away(self, exc: Unavailable) -> Unavailable:
        return Unavailable(f"inference replica {self.address} went away "
                           f"(request_id={self._request.request_id}): {exc.message}")

    def _close_current(self) -> None:
        if (current := self._current) is not None:
            self._current = None
            current.close()

    def close(self) -> None:
        """Always called: cancels the generation on its replica unless it ended."""
        self._close_current()
