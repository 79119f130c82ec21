"""The continuous-batching scheduler: which sequences run this step and how many tokens each.

Pure Python (no torch, no grpc), so it is unit-tested with synthetic requests. One progress
model: a sequence's ``num_computed_tokens`` catches up with its token list (prompt, then the
generated ids) under a per-step token budget, so prefill, chunked prefill, prefix-cache hits and
resumption after preemption need no special phase. A step is schedule -> execute -> update.

The parts: ``wait_queue.WaitQueue`` (priority order, batching window), ``slot_table.SlotTable``
(the running batch in KV slots ``[0, n)``), ``prefix_index.PrefixIndex`` (prompt prefixes whose
K/V is stored, copied into a sequence's slot when it first gets tokens to compute instead of
being recomputed) and
``draft_planning`` (draft tokens for greedy decodes). This class admits, preempts, spends the
token budget and accounts each step's results.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from aiserve.common.errors import ResourceExhausted
from aiserve.common.finish import FinishReason
from services.inference.draft_planning import add_drafts, draft_room
from services.inference.engine_config import SchedulerConfig
from services.inference.prefix_index import BlockCopy, PrefixIndex
from services.inference.scheduler_output import ScheduledChunk, SchedulerOutput
from services.inference.sequence import Seq, SeqStatus
from services.inference.slot_table import SlotTable
from services.inference.wait_queue import WaitQueue


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
        self.prefix = prefix
        self._clock = clock
        self._queue = WaitQueue()
        self._slots = SlotTable(min(num_slots, config.max_num_seqs))
        self._finished: list[Seq] = []  # ended outside a forward, reported by the next output
        self.num_preemptions = 0
        self.num_draft_tokens = 0  # drafts computed
        self.num_accepted_tokens = 0  # drafts the model confirmed (tokens gained)

    @property
    def capacity(self) -> int:
        """Sequences the running batch holds at most: min(KV slots, max_num_seqs)."""
        return self._slots.capacity

    @property
    def num_waiting(self) -> int:
        """Sequences in the wait queue."""
        return len(self._queue)

    @property
    def num_running(self) -> int:
        """Sequences in the running batch (each holds a KV slot)."""
        return len(self._slots)

    def add(self, seq: Seq) -> None:
        """Queue ``seq``. ResourceExhausted when the queue is full; ValueError if it cannot fit
        one slot (the engine validates that first, with the limit named)."""
        if len(self._queue) >= self.config.max_queue:
            raise ResourceExhausted(f"inference queue is full (max_queue {self.config.max_queue})")
        if seq.num_prompt_tokens + seq.max_new_tokens > self.slot_len or not seq.token_ids:
            raise ValueError(f"sequence needs {seq.num_prompt_tokens}+{seq.max_new_tokens} "
                             f"tokens; a slot holds {self.slot_len}")
        self._queue.add(seq, self._clock())

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
        for seq in self._queue.take_expired(now):
            seq.is_expired = True
            self._finish(seq, FinishReason.CANCELLED, report=True)
        if self._is_gathering(now):
            return self._output((), (), ())
        self._admit()
        return self._output(*self._assign_budget(now))

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
            if ids and chunk.seq.status is SeqStatus.RUNNING:
                self.num_draft_tokens += chunk.num_drafts
                self.num_accepted_tokens += len(ids) - 1
                grown.append((chunk.seq, self._append(chunk.seq, ids)))
        if self.prefix is not None:
            self.prefix.commit()
        return grown

    def fail(self, output: SchedulerOutput, everything: bool = False) -> list[Seq]:
        """A step raised: finish its sequences (or, with ``everything``, every running one, as
        when the cache itself may be inconsistent) with "error" and free their slots."""
        if self.prefix is not None:
            self.prefix.clear() if everything else self.prefix.rollback()
        victims = list(self._slots.seqs) if everything else [c.seq for c in output.chunks]
        failed = []
        for seq in victims:
            if seq.status is SeqStatus.RUNNING:
                self._remove(seq)
                self._finish(seq, FinishReason.ERROR, report=False)
                failed.append(seq)
        return failed

    def wait_s(self) -> float | None:
        """How long the engine may sleep before ``schedule`` has work; None = until an event."""
        if len(self._slots) or self._finished or self._slots.has_moves:
            return 0.0
        wake_at = self._queue.wake_at(self.capacity, self.config.batch_wait_ms / 1000)
        return None if wake_at is None else max(0.0, wake_at - self._clock())

    # --- internals ---------------------------------------------------------------------------

    def _output(self, chunks: Sequence[ScheduledChunk], loads: Sequence[BlockCopy],
                saves: Sequence[BlockCopy]) -> SchedulerOutput:
        output = SchedulerOutput(tuple(chunks), self._slots.take_moves(), tuple(loads), tuple(saves),
                                 tuple(self._finished))
        self._finished.clear()
        return output

    def _is_gathering(self, now: float) -> bool:
        """Idle and the batching window is still open: wait for more arrivals."""
        if len(self._slots) or not len(self._queue) or self.config.batch_wait_ms <= 0:
            return False
        return self._queue.gather_end(self.capacity, self.config.batch_wait_ms / 1000) > now

    def _admit(self) -> None:
        """Move waiting sequences into free slots in priority order (their prefix is matched
        when they first get tokens to compute: ``_assign_budget``)."""
        while (seq := self._queue.peek()) is not None:
            if self._slots.is_full and not self._preempt_for(seq):
                break
            self._slots.add(self._queue.pop())

    def _preempt_for(self, seq: Seq) -> bool:
        """Evict the lowest-priority (then newest) running sequence if ``seq`` outranks it."""
        if not self.config.enable_preemption or not len(self._slots):
            return False
        victim = min(self._slots.seqs, key=lambda s: (s.priority, -s.arrival_no))
        if victim.priority >= seq.priority:
            return False
        self._slots.remove(victim)
        victim.num_computed_tokens = 0  # recompute on return (no swap space on CPU)
        self.num_preemptions += 1
        self._queue.push(victim)
        return True

    def _assign_budget(self, now: float) -> tuple[list[ScheduledChunk], list[BlockCopy], list[BlockCopy]]:
        """Decodes first (they never stall), then prefill chunks by priority and arrival; returns
        the chunks, the prefix loads and the prefix saves."""
        budget = self.config.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        loads: list[BlockCopy] = []
        saves: list[BlockCopy] = []
        order = sorted(self._slots.seqs, key=lambda s: (s.num_tokens - s.num_computed_tokens > 1,
                                                        -s.priority, s.arrival_no))
        for seq in order:
            if budget <= 0 or seq.slot is None:
                break
            if seq.num_computed_tokens == 0 and (hits := self._match_prefix(seq)):
                loads.append(BlockCopy(seq.slot, tuple(enumerate(hits))))
            start = seq.num_computed_tokens
            n = min(seq.num_tokens - start, budget)
            if n <= 0:
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
        used = self.config.max_num_batched_tokens - budget
        add_drafts(chunks, self.config.num_speculative_tokens, draft_room(self.config, used))
        return chunks, loads, saves

    def _match_prefix(self, seq: Seq) -> tuple[int, ...]:
        """Stored blocks of ``seq``'s longest stored prefix (its K/V is loaded into the slot
        before this step's forward), counted as computed. Matched when the sequence first gets
        tokens, not when it takes a slot: requests that arrive together then reuse the prefix
        that the first of them computed a step earlier (a shared system prompt)."""
        if self.prefix is None:
            return ()
        hits = self.prefix.match(seq.token_ids, seq.num_tokens - 1)  # keep >= 1 token: it yields the logits
        seq.num_computed_tokens = len(hits) * self.prefix.block_size
        return hits

    def _append(self, seq: Seq, ids: Sequence[int]) -> int:
        """Append a step's ids to ``seq`` up to a stop id or max_new_tokens (which finish it);
        returns how many were appended."""
        for count, token in enumerate(ids, start=1):
            seq.token_ids.append(token)
            if token in seq.stop_token_ids:
                self._remove(seq)
                self._finish(seq, FinishReason.STOP, report=False)
                return count
            if seq.num_output_tokens >= seq.max_new_tokens:
                self._remove(seq)
                self._finish(seq, FinishReason.LENGTH, report=False)
                return count
        return len(ids)

    def _remove(self, seq: Seq) -> None:
        """Take ``seq`` out of the queue or the batch."""
        if seq.status is SeqStatus.WAITING:
            self._queue.discard(seq)
        elif seq.status is SeqStatus.RUNNING and seq.slot is not None:
            self._slots.remove(seq)

    def _finish(self, seq: Seq, reason: FinishReason, report: bool) -> None:
        seq.status, seq.finish_reason = SeqStatus.FINISHED, reason
        if report:
            self._finished.append(seq)
