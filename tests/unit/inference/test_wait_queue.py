"""The wait queue: priority order, lazy removal, expiry and the batching window (no torch)."""

from __future__ import annotations

import pytest

from services.inference.sequence import Seq, SeqStatus
from services.inference.wait_queue import WaitQueue


def seq(priority: int = 0, deadline: float | None = None) -> Seq:
    return Seq([1, 2], 2, 4, priority, deadline)


def test_pops_by_priority_then_arrival() -> None:
    queue = WaitQueue()
    low, high, mid, high2 = seq(0), seq(5), seq(2), seq(5)
    for now, s in enumerate((low, high, mid, high2)):
        queue.add(s, float(now))
    assert [queue.pop() for _ in range(4)] == [high, high2, mid, low]
    assert len(queue) == 0 and queue.peek() is None
    with pytest.raises(IndexError):
        queue.pop()


def test_a_requeued_sequence_keeps_its_place_by_arrival() -> None:
    queue = WaitQueue()
    first, second = seq(), seq()
    queue.add(first, 1.0)
    queue.add(second, 2.0)
    assert queue.pop() is first
    first.status = SeqStatus.RUNNING
    queue.push(first)  # preempted: back in the queue, ahead of the later arrival
    assert first.status is SeqStatus.WAITING and first.arrival == 1.0
    assert queue.pop() is first


def test_removed_sequences_leave_the_count_at_once_and_the_heap_lazily() -> None:
    queue = WaitQueue()
    a, b = seq(5), seq(0)
    queue.add(a, 1.0)
    queue.add(b, 2.0)
    queue.discard(a)
    a.status = SeqStatus.FINISHED  # what the scheduler does with a discarded sequence
    assert len(queue) == 1 and queue.live() == [b]
    assert queue.peek() is b and queue.pop() is b


def test_take_expired_removes_sequences_whose_deadline_passed() -> None:
    queue = WaitQueue()
    early, late, none = seq(deadline=10.0), seq(deadline=20.0), seq()
    for s in (early, late, none):
        queue.add(s, 0.0)
    assert queue.take_expired(9.9) == []
    assert queue.take_expired(10.0) == [early] and len(queue) == 2


def test_the_batching_window_closes_after_the_oldest_arrival_or_when_full() -> None:
    queue = WaitQueue()
    queue.add(seq(), 100.0)
    queue.add(seq(), 100.004)
    assert queue.gather_end(capacity=4, window_s=0.010) == pytest.approx(100.010)
    assert queue.gather_end(capacity=2, window_s=0.010) == -float("inf")  # the batch is full


def test_wake_at_is_the_window_end_or_an_earlier_deadline() -> None:
    queue = WaitQueue()
    assert queue.wake_at(4, 0.010) is None
    queue.add(seq(), 100.0)
    assert queue.wake_at(4, 0.010) == pytest.approx(100.010)
    queue.add(seq(deadline=100.002), 100.001)
    assert queue.wake_at(4, 0.010) == pytest.approx(100.002)
