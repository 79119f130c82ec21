"""What one scheduler step asks of the runner: the chunks to compute and the cache copies.

Pure Python (no torch, no grpc); the runner applies it, the scheduler accounts it afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.inference.prefix_index import BlockCopy
from services.inference.sequence import Seq
from services.inference.slot_table import SlotMove


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    """Work of one sequence in a step: tokens ``token_ids`` at positions ``start``.. in ``slot``."""

    seq: Seq
    slot: int
    start: int
    token_ids: tuple[int, ...]
    is_sampled: bool
    """The chunk reaches the end of the token list, so a new token is sampled after it."""
    num_drafts: int = 0
    """The last ``num_drafts`` ids are guesses past the token list, verified by this step."""

    @property
    def drafts(self) -> tuple[int, ...]:
        """The draft ids (the last ``num_drafts`` of ``token_ids``)."""
        return self.token_ids[len(self.token_ids) - self.num_drafts :]


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    """One step. The runner applies, in order: moves, prefix loads, the forward, prefix saves."""

    chunks: tuple[ScheduledChunk, ...] = ()
    moves: tuple[SlotMove, ...] = ()
    prefix_loads: tuple[BlockCopy, ...] = ()
    prefix_saves: tuple[BlockCopy, ...] = ()
    finished: tuple[Seq, ...] = ()
    """Sequences that ended outside a forward (deadline passed while waiting, aborted)."""

    @property
    def num_tokens(self) -> int:
        """Tokens the step computes (drafts included)."""
        return sum(len(c.token_ids) for c in self.chunks)
