"""The running batch in KV slots ``[0, n)``: sequence ``i`` of the table holds slot ``i``.

When a sequence leaves, the one in the last slot moves into the hole: one copy per finish
(a ``SlotMove`` the runner applies before the next forward), so decode attention always reads
one contiguous view of the cache. Pure Python (no torch, no grpc).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from services.inference.sequence import Seq, SeqStatus


@dataclass(frozen=True, slots=True)
class SlotMove:
    """Copy the first ``num_tokens`` positions of slot ``src`` into slot ``dst``."""

    src: int
    dst: int
    num_tokens: int


class SlotTable:
    """Which sequence holds which KV slot, and the moves that keep the slots contiguous."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._seqs: list[Seq] = []  # index == slot
        self._moves: list[SlotMove] = []

    def __len__(self) -> int:
        return len(self._seqs)

    @property
    def seqs(self) -> Sequence[Seq]:
        """The running sequences, by slot."""
        return self._seqs

    @property
    def is_full(self) -> bool:
        """Every slot is taken."""
        return len(self._seqs) >= self.capacity

    @property
    def has_moves(self) -> bool:
        """Moves wait to be applied by the next step."""
        return bool(self._moves)

    def add(self, seq: Seq) -> None:
        """Put ``seq`` into the first free slot (the end of the table) and mark it running."""
        seq.status, seq.slot = SeqStatus.RUNNING, len(self._seqs)
        self._seqs.append(seq)

    def remove(self, seq: Seq) -> None:
        """Free ``seq``'s slot; the sequence in the last slot fills the hole (a ``SlotMove``)."""
        assert seq.slot is not None
        hole, last = seq.slot, self._seqs.pop()
        if last is not seq:
            self._seqs[hole] = last
            self._moves.append(SlotMove(len(self._seqs), hole, last.num_computed_tokens))
            last.slot = hole
        seq.slot = None
        if not self._seqs:
            self._moves.clear()  # nothing left whose K/V must be kept

    def take_moves(self) -> tuple[SlotMove, ...]:
        """The moves since the last call, in order (the runner applies them in this order)."""
        moves = tuple(self._moves)
        self._moves.clear()
        return moves
