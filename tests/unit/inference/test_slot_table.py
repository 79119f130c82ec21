"""The slot table: the running batch stays in slots [0, n), holes are filled by moves (no torch)."""

from __future__ import annotations

from services.inference.sequence import Seq, SeqStatus
from services.inference.slot_table import SlotMove, SlotTable


def running(table: SlotTable, count: int) -> list[Seq]:
    seqs = [Seq([1, 2, 3], 3, 4) for _ in range(count)]
    for i, s in enumerate(seqs):
        table.add(s)
        s.num_computed_tokens = 10 + i
    return seqs


def test_sequences_take_the_slots_in_order_until_full() -> None:
    table = SlotTable(capacity=3)
    a, b, c = running(table, 3)
    assert [s.slot for s in (a, b, c)] == [0, 1, 2] and a.status is SeqStatus.RUNNING
    assert table.is_full and len(table) == 3 and list(table.seqs) == [a, b, c]


def test_the_last_sequence_fills_a_hole_with_one_move() -> None:
    table = SlotTable(capacity=4)
    a, b, c = running(table, 3)
    table.remove(a)
    assert a.slot is None and c.slot == 0 and list(table.seqs) == [c, b]
    assert table.take_moves() == (SlotMove(src=2, dst=0, num_tokens=12),)
    assert table.take_moves() == () and not table.has_moves  # each move is handed out once


def test_the_last_slot_leaving_moves_nothing() -> None:
    table = SlotTable(capacity=4)
    a, b = running(table, 2)
    table.remove(b)
    assert not table.has_moves and list(table.seqs) == [a]


def test_an_empty_batch_drops_pending_moves() -> None:
    table = SlotTable(capacity=4)
    a, b = running(table, 2)
    table.remove(a)  # b moves to slot 0 ...
    table.remove(b)  # ... but then leaves too: no K/V is left to keep
    assert not table.has_moves and len(table) == 0
