"""Sequences waiting for a KV slot: highest priority first, then by arrival.

A heap with lazy removal: an aborted or expired sequence stays in the heap, marked finished,
and is dropped when it reaches the top, so removal is O(1) and the count stays exact. Also
the batching window: when nothing runs, the first arrival waits ``batch_wait_ms`` for company
unless the waiting sequences already fill the batch. Pure Python (no torch, no grpc).
"""

from __future__ import annotations

import heapq
import itertools

from services.inference.sequence import Seq, SeqStatus


class WaitQueue:
    """The waiting sequences, by (-priority, arrival number)."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, Seq]] = []  # (-priority, arrival no., seq)
        self._count = 0  # live entries; aborted/expired ones are dropped lazily
        self._arrivals = itertools.count()

    def __len__(self) -> int:
        return self._count

    def add(self, seq: Seq, now: float) -> None:
        """Queue a new arrival: it gets its arrival time and number now."""
        seq.arrival = now
        seq.arrival_no = next(self._arrivals)
        self.push(seq)

    def push(self, seq: Seq) -> None:
        """Queue ``seq`` (new, or preempted: it keeps its arrival number) and mark it waiting."""
        seq.status = SeqStatus.WAITING
        heapq.heappush(self._heap, (-seq.priority, seq.arrival_no, seq))
        self._count += 1

    def peek(self) -> Seq | None:
        """The next sequence to admit, or None."""
        while self._heap and self._heap[0][2].status is not SeqStatus.WAITING:
            heapq.heappop(self._heap)  # aborted or expired while waiting
        return self._heap[0][2] if self._heap else None

    def pop(self) -> Seq:
        """Take the sequence ``peek`` returned."""
        if self.peek() is None:
            raise IndexError("pop from an empty wait queue")
        self._count -= 1
        return heapq.heappop(self._heap)[2]

    def discard(self, seq: Seq) -> None:
        """``seq`` leaves the queue (the caller marks it finished; its entry is skipped later)."""
        assert seq.status is SeqStatus.WAITING
        self._count -= 1

    def live(self) -> list[Seq]:
        """The waiting sequences, in no particular order."""
        return [seq for _, _, seq in self._heap if seq.status is SeqStatus.WAITING]

    def take_expired(self, now: float) -> list[Seq]:
        """Remove and return the waiting sequences whose deadline is at or before ``now``."""
        expired = [s for s in self.live() if s.deadline is not None and s.deadline <= now]
        self._count -= len(expired)
        return expired

    def gather_end(self, capacity: int, window_s: float) -> float:
        """When the batching window closes: ``window_s`` after the oldest arrival, or at once
        (-inf) when the waiting sequences fill ``capacity`` slots."""
        live = self.live()
        if len(live) >= capacity:
            return -float("inf")
        return min(s.arrival for s in live) + window_s

    def wake_at(self, capacity: int, window_s: float) -> float | None:
        """The earliest instant scheduling has work for an idle batch: the window's end or the
        nearest deadline; None when nothing waits."""
        live = self.live()
        if not live:
            return None
        return min([self.gather_end(capacity, window_s)] + [s.deadline for s in live if s.deadline is not None])
