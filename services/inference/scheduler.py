"""The continuous-batching scheduler: which sequences run this step and how many tokens each.

Pure Python (no torch, no grpc), so it is unit-tested with synthetic requests. One progress
model: a sequence's ``num_computed_tokens`` catches up with its token list (prompt, then the
generated ids) under a per-step token budget, so prefill, chunked prefill, prefix-cache hits and
resumption after preemption need no special phase. A step is schedule -> execute -> update.

KV memory is a fixed number of slots (one sequence each, ``slot_len`` tokens long). The running
batch always holds slots ``[0, n)``: when a sequence leaves, the one in the last slot moves into
the hole (one copy per finish, emitted as a ``SlotMove``), so decode attention reads one view.
Prompt prefixes are kept in a block store (``PrefixIndex``) and copied into a new sequence's
slot at admission instead of being recomputed.
"""

from __future__ import annotations

import enum
import heapq
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from aiserve.common.errors import ResourceExhausted
from aiserve.common.finish import FinishReason
from services.inference.engine_config import SchedulerConfig
from services.inference.prefix_index import BlockCopy, PrefixIndex
from services.inference.speculative import NgramDrafter


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False, slots=True)
class Seq:
    """One request inside the scheduler: its token list and how far its K/V is computed."""

    token_ids: list[int]
    """Prompt, then the generated ids (appended by ``update``)."""
    num_prompt_tokens: int
    max_new_tokens: int
    priority: int = 0
    deadline: float | None = None
    """A clock instant; passed while waiting -> finished as expired, never run."""
    stop_token_ids: frozenset[int] = frozenset()
    arrival: float = 0.0
    status: SeqStatus = SeqStatus.WAITING
    num_computed_tokens: int = 0
    slot: int | None = None
    finish_reason: FinishReason | None = None
    is_expired: bool = False
    """Finished because its deadline passed while it waited (``finish_reason`` CANCELLED)."""
    first_scheduled: float | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0
    """Prompt tokens taken from the prefix store at the last admission."""
    drafter: NgramDrafter | None = None
    """Proposes draft tokens (speculative decoding); set only for greedy sequences."""
    arrival_no: int = field(default=-1, repr=False)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED


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
        return self.token_ids[len(self.token_ids) - self.num_drafts :]


@dataclass(frozen=True, slots=True)
class SlotMove:
    """Copy the first ``num_tokens`` positions of slot ``src`` into slot ``dst``."""

    src: int
    dst: int
    num_tokens: int


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
        return sum(len(c.token_ids) for c in self.chunks)


class Scheduler:
    """Owns the waiting queue, the running batch, its KV slots and the prefix index.

    Single-threaded: the engine calls it under its lock, never while a step executes
    (``abort`` between steps; ``add`` at any time).
    """

    def __init__(
        self,
        config: SchedulerConfig,
        num_slots: int,
        slot_len: int,
        prefix: PrefixIndex | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        config.validate()
        self.config = config
        self.slot_len = slot_len
        self.capacity = min(num_slots, config.max_num_seqs)
        self.prefix = prefix
        self._clock = clock
        self._waiting: list[tuple[int, int, Seq]] = []  # heap of (-priority, arrival no., seq)
        self._num_waiting = 0  # live entries; aborted/expired ones are dropped lazily
        self._arrivals = itertools.count()
        self._slots: list[Seq] = []  # the running batch; index == slot
        self._moves: list[SlotMove] = []
        self._finished: list[Seq] = []
        self.num_preemptions = 0
        self.num_draft_tokens = 0  # drafts computed
        self.num_accepted_tokens = 0  # drafts the model confirmed (tokens gained)

    @property
    def num_waiting(self) -> int:
        return self._num_waiting

    @property
    def num_running(self) -> int:
        return len(self._slots)

    @property
    def running(self) -> Sequence[Seq]:
        return self._slots

    def has_work(self) -> bool:
        return bool(self._slots or self._num_waiting or self._finished or self._moves)

    def add(self, seq: Seq) -> None:
        """Queue ``seq``. ResourceExhausted when the queue is full; ValueError if it cannot fit
        one slot (the engine validates that first, with the limit named)."""
        if self._num_waiting >= self.config.max_queue:
            raise ResourceExhausted(f"inference queue is full (max_queue {self.config.max_queue})")
        if seq.num_prompt_tokens + seq.max_new_tokens > self.slot_len or not seq.token_ids:
            raise ValueError(f"sequence needs {seq.num_prompt_tokens}+{seq.max_new_tokens} "
                             f"tokens; a slot holds {self.slot_len}")
        seq.arrival = self._clock()
        seq.arrival_no = next(self._arrivals)
        self._push(seq)

    def abort(self, seq: Seq) -> bool:
        """Finish ``seq`` as "cancelled" and free its slot now; False if it had finished."""
        if seq.is_finished:
            return False
        self._remove(seq)
        self._finish(seq, FinishReason.CANCELLED, report=True)
        return True

    def schedule(self) -> SchedulerOutput:
        """Pick this step's work: expire, admit (maybe preempt), then spend the token budget."""
        now = self._clock()
        self._expire(now)
        if self._is_gathering(now):
            return self._output((), (), ())
        loads = self._admit()
        chunks, saves = self._assign_budget(now)
        return self._output(chunks, loads, saves)

    def update(self, output: SchedulerOutput, sampled: Sequence[Sequence[int]]) -> list[tuple[Seq, int]]:
        """Account a finished step. ``sampled`` holds, per sampled chunk in order, the ids the
        step made for it: one, plus one per draft the model confirmed (``speculative.accept``).

        Returns each sequence that grew and by how many ids (a stop id or max_new_tokens cuts
        the rest); those that finished have left the batch.
        """
        picks = iter(sampled)
        made = [(c, tuple(next(picks)) if c.is_sampled else ()) for c in output.chunks]
        for chunk, ids in made:  # first all progress, so slot moves copy every new K/V
            if chunk.seq.status is SeqStatus.RUNNING:  # a confirmed draft's K/V is computed
                chunk.seq.num_computed_tokens += len(chunk.token_ids) - chunk.num_drafts + max(len(ids) - 1, 0)
        grown: list[tuple[Seq, int]] = []
        for chunk, ids in made:
            seq = chunk.seq
            if not ids or seq.status is not SeqStatus.RUNNING:
                continue
            self.num_draft_tokens += chunk.num_drafts
            self.num_accepted_tokens += len(ids) - 1
            count = 0
            for token in ids:
                seq.token_ids.append(token)
                count += 1
                if token in seq.stop_token_ids:
                    self._remove(seq)
                    self._finish(seq, FinishReason.STOP, report=False)
                    break
                if seq.num_output_tokens >= seq.max_new_tokens:
                    self._remove(seq)
                    self._finish(seq, FinishReason.LENGTH, report=False)
                    break
            grown.append((seq, count))
        if self.prefix is not None:
            self.prefix.commit()
        return grown

    def fail(self, output: SchedulerOutput, everything: bool = False) -> list[Seq]:
        """A step raised: finish its sequences (or, with ``everything``, every running one, as
        when the cache itself may be inconsistent) with "error" and free their slots."""
        if self.prefix is not None:
            self.prefix.clear() if everything else self.prefix.rollback()
        victims = list(self._slots) if everything else [c.seq for c in output.chunks]
        failed = []
        for seq in victims:
            if seq.status is SeqStatus.RUNNING:
                self._remove(seq)
                self._finish(seq, FinishReason.ERROR, report=False)
                failed.append(seq)
        return failed

    def wait_s(self) -> float | None:
        """How long the engine may sleep before ``schedule`` has work; None = until an event."""
        if self._slots or self._finished or self._moves:
            return 0.0
        live = [seq for _, _, seq in self._waiting if seq.status is SeqStatus.WAITING]
        if not live:
            return None
        now = self._clock()
        until = [self._gather_end(live)] + [s.deadline for s in live if s.deadline is not None]
        return max(0.0, min(until) - now)

    # --- internals ---------------------------------------------------------------------------

    def _output(self, chunks: Sequence[ScheduledChunk], loads: Sequence[BlockCopy],
                saves: Sequence[BlockCopy]) -> SchedulerOutput:
        output = SchedulerOutput(tuple(chunks), tuple(self._moves), tuple(loads), tuple(saves),
                                 tuple(self._finished))
        self._moves.clear()
        self._finished.clear()
        return output

    def _push(self, seq: Seq) -> None:
        seq.status = SeqStatus.WAITING
        heapq.heappush(self._waiting, (-seq.priority, seq.arrival_no, seq))
        self._num_waiting += 1

    def _peek(self) -> Seq | None:
        while self._waiting and self._waiting[0][2].status is not SeqStatus.WAITING:
            heapq.heappop(self._waiting)  # aborted or expired while waiting
        return self._waiting[0][2] if self._waiting else None

    def _gather_end(self, live: Sequence[Seq]) -> float:
        if len(live) >= self.capacity:
            return -float("inf")
        return min(s.arrival for s in live) + self.config.batch_wait_ms / 1000

    def _is_gathering(self, now: float) -> bool:
        """Idle and the batching window is still open: wait for more arrivals."""
        if self._slots or not self._num_waiting or self.config.batch_wait_ms <= 0:
            return False
        live = [seq for _, _, seq in self._waiting if seq.status is SeqStatus.WAITING]
        return self._gather_end(live) > now

    def _expire(self, now: float) -> None:
        for _, _, seq in self._waiting:
            if seq.status is SeqStatus.WAITING and seq.deadline is not None and seq.deadline <= now:
                self._num_waiting -= 1
                seq.is_expired = True
                self._finish(seq, FinishReason.CANCELLED, report=True)

    def _admit(self) -> list[BlockCopy]:
        """Move waiting sequences into free slots in priority order; return prefix loads."""
        admitted: list[tuple[Seq, tuple[int, ...]]] = []
        while (seq := self._peek()) is not None:
            if len(self._slots) >= self.capacity and not self._preempt_for(seq):
                break
            heapq.heappop(self._waiting)
            self._num_waiting -= 1
            seq.status, seq.slot = SeqStatus.RUNNING, len(self._slots)
            self._slots.append(seq)
            hits: tuple[int, ...] = ()
            if self.prefix is not None:  # keep >= 1 token to compute: it yields the logits
                hits = self.prefix.match(seq.token_ids, seq.num_tokens - 1)
            seq.num_computed_tokens = seq.num_cached_tokens = len(hits) * self._block_size
            admitted.append((seq, hits))
        # Slots are final only now: a later preemption in this loop may have moved a sequence.
        return [BlockCopy(s.slot, tuple(enumerate(h))) for s, h in admitted
                if h and s.slot is not None]

    def _preempt_for(self, seq: Seq) -> bool:
        """Evict the lowest-priority (then newest) running sequence if ``seq`` outranks it."""
        if not self.config.enable_preemption or not self._slots:
            return False
        victim = min(self._slots, key=lambda s: (s.priority, -s.arrival_no))
        if victim.priority >= seq.priority:
            return False
        self._remove(victim)
        victim.num_computed_tokens = 0  # recompute on return (no swap space on CPU)
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self._push(victim)
        return True

    def _assign_budget(self, now: float) -> tuple[list[ScheduledChunk], list[BlockCopy]]:
        """Decodes first (they never stall), then prefill chunks by priority and arrival."""
        budget = self.config.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        saves: list[BlockCopy] = []
        order = sorted(self._slots, key=lambda s: (s.num_tokens - s.num_computed_tokens > 1,
                                                   -s.priority, s.arrival_no))
        for seq in order:
            start = seq.num_computed_tokens
            n = min(seq.num_tokens - start, budget)
            if n <= 0 or seq.slot is None:
                break
            budget -= n
            end = start + n
            chunks.append(ScheduledChunk(seq, seq.slot, start, tuple(seq.token_ids[start:end]),
                                         end == seq.num_tokens))
            if seq.first_scheduled is None:
                seq.first_scheduled = now
            if self.prefix is not None and start < seq.num_prompt_tokens <= end:
                pairs = self.prefix.insert(seq.token_ids[: seq.num_prompt_tokens])
                if pairs:  # the prompt's K/V is complete after this step: keep its blocks
                    saves.append(BlockCopy(seq.slot, pairs))
        if self.config.num_speculative_tokens:
            used = self.config.max_num_batched_tokens - budget
            self._add_drafts(chunks, min(budget, self.config.speculative_max_step_tokens - used))
        return chunks, saves

    def _add_drafts(self, chunks: list[ScheduledChunk], room: int) -> None:
        """Give decoding sequences with a drafter up to ``num_speculative_tokens`` drafts each,
        in the chunks' order, within ``room`` tokens. Drafts never pass max_new_tokens."""
        for i, chunk in enumerate(chunks):
            if room <= 0:
                return
            seq = chunk.seq
            if seq.drafter is None or not chunk.is_sampled or len(chunk.token_ids) != 1:
                continue
            limit = min(self.config.num_speculative_tokens, room,
                        seq.max_new_tokens - seq.num_output_tokens - 1)
            drafts = seq.drafter.propose(seq.token_ids, limit)
            if drafts:
                chunks[i] = ScheduledChunk(seq, chunk.slot, chunk.start, chunk.token_ids + drafts, True,
                                           len(drafts))
                room -= len(drafts)

    @property
    def _block_size(self) -> int:
        return self.prefix.block_size if self.prefix is not None else 1

    def _remove(self, seq: Seq) -> None:
        """Take ``seq`` out of the queue or the batch; the last slot's sequence fills its hole."""
        if seq.status is SeqStatus.WAITING:
            self._num_waiting -= 1  # its heap entry is skipped later
        elif seq.status is SeqStatus.RUNNING and seq.slot is not None:
            hole, last = seq.slot, self._slots.pop()
            if last is not seq:
                self._slots[hole] = last
                self._moves.append(SlotMove(len(self._slots), hole, last.num_computed_tokens))
                last.slot = hole
            seq.slot = None
            if not self._slots:
                self._moves.clear()  # nothing left whose K/V must be kept

    def _finish(self, seq: Seq, reason: FinishReason, report: bool) -> None:
        seq.status, seq.finish_reason = SeqStatus.FINISHED, reason
        if report:
            self._finished.append(seq)
