"""One request as the scheduler sees it: its token list and how far its K/V is computed.

Pure Python (no torch, no grpc). The scheduler owns every ``Seq``: the wait queue and the slot
table hold them, a step's chunks point at them, and the engine keys its per-request records by
them (identity, not value: ``eq=False``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from aiserve.common.finish import FinishReason
from services.inference.speculative import NgramDrafter

if TYPE_CHECKING:
    from services.inference.grammar import RowGrammar


class SeqStatus(enum.Enum):
    """Where a sequence is: in the wait queue, in a KV slot, or done."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False, slots=True)
class Seq:
    """One request inside the scheduler: its token list and how far its K/V is computed."""

    token_ids: list[int]
    """Prompt, then the generated ids (appended by ``Scheduler.update``)."""
    num_prompt_tokens: int
    max_new_tokens: int
    priority: int = 0
    deadline: float | None = None
    """A clock instant; passed while waiting -> finished as expired, never run."""
    stop_token_ids: frozenset[int] = frozenset()
    arrival: float = 0.0
    """The clock instant ``Scheduler.add`` queued it (seconds)."""
    status: SeqStatus = SeqStatus.WAITING
    num_computed_tokens: int = 0
    slot: int | None = None
    finish_reason: FinishReason | None = None
    is_expired: bool = False
    """Finished because its deadline passed while it waited (``finish_reason`` CANCELLED)."""
    first_scheduled: float | None = None
    """The clock instant its first chunk was scheduled (seconds); None while it never ran."""
    drafter: NgramDrafter | None = None
    """Proposes draft tokens (speculative decoding); set only for greedy sequences."""
    grammar: RowGrammar | None = None
    """Constrained decoding: the grammar its tokens must follow (masks, draft checks)."""
    arrival_no: int = field(default=-1, repr=False)
    """Order of arrival: breaks priority ties in the queue, picks the newest to preempt."""

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens so far."""
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Generated tokens so far."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        """It ended (stop, length, cancelled, expired or error) and holds no slot."""
        return self.status is SeqStatus.FINISHED
