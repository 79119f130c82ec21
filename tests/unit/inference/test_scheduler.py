"""The scheduler with synthetic requests: no model, no torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from aiserve.common.errors import ResourceExhausted
from services.inference.engine_config import SchedulerConfig
from services.inference.prefix_index import PrefixIndex
from services.inference.scheduler import Scheduler
from services.inference.scheduler_output import SchedulerOutput
from services.inference.sequence import Seq, SeqStatus
from services.inference.slot_table import SlotMove

TOKEN = 7  # what the fake model always samples
STOP = 99


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_scheduler(num_slots: int = 4, slot_len: int = 256, prefix: PrefixIndex | None = None,
                   clock: Clock | None = None, **settings: object) -> Scheduler:
    config = SchedulerConfig(**{"batch_wait_ms": 0.0, **settings})  # type: ignore[arg-type]
    return Scheduler(config, num_slots, slot_len, prefix, clock or Clock())


def seq(prompt_len: int = 4, max_new: int = 4, priority: int = 0, deadline: float | None = None,
        first: int = 1) -> Seq:
    return Seq(list(range(first, first + prompt_len)), prompt_len, max_new, priority, deadline,
               frozenset({STOP}))


def has_work(s: Scheduler) -> bool:
    return bool(s.num_running or s.num_waiting)


def step(s: Scheduler, token: int = TOKEN) -> SchedulerOutput:
    out = s.schedule()
    s.update(out, [(token,)] * sum(c.is_sampled for c in out.chunks))
    return out


def test_waiting_queue_is_ordered_by_priority_then_arrival() -> None:
    s = make_scheduler(num_slots=1, enable_preemption=False)
    low, high, mid, high2 = seq(priority=0), seq(priority=5), seq(priority=2), seq(priority=5)
    for x in (low, high, mid, high2):
        s.add(x)
    order = []
    while has_work(s):
        out = step(s, STOP)  # every sequence stops after its first token
        order += [c.seq for c in out.chunks]
    assert order == [high, high2, mid, low]


def test_new_request_joins_the_running_batch_at_the_next_step() -> None:
    s = make_scheduler()
    a = seq()
    s.add(a)
    step(s)  # a's prefill
    b = seq(prompt_len=3)
    s.add(b)
    out = step(s)
    assert {c.seq for c in out.chunks} == {a, b}
    assert [len(c.token_ids) for c in out.chunks] == [1, 3]  # a decodes, b prefills


def test_finished_sequence_leaves_at_once_and_the_last_slot_fills_the_hole() -> None:
    s = make_scheduler()
    a, b, c = seq(), seq(), seq()
    for x in (a, b, c):
        s.add(x)
    step(s)
    out = s.schedule()
    s.update(out, [(STOP,) if ch.seq is a else (TOKEN,) for ch in out.chunks])
    assert a.is_finished and a.finish_reason == "stop" and a.slot is None
    assert s.num_running == 2 and (c.slot, b.slot) == (0, 1)  # c filled the hole
    out = s.schedule()
    assert a not in {ch.seq for ch in out.chunks}
    assert out.moves == (SlotMove(src=2, dst=0, num_tokens=c.num_computed_tokens),)


def test_length_finish_after_max_new_tokens() -> None:
    s = make_scheduler()
    a = seq(max_new=3)
    s.add(a)
    steps = 0
    while has_work(s):
        step(s)
        steps += 1
    assert a.finish_reason == "length" and a.num_output_tokens == 3 and steps == 3


def test_long_prompt_is_prefilled_in_chunks_without_stalling_decodes() -> None:
    s = make_scheduler(max_num_seqs=4, max_num_batched_tokens=16)
    a = seq(max_new=50)
    s.add(a)
    step(s)
    long = seq(prompt_len=40, first=100)
    s.add(long)
    chunks = []
    while long.num_output_tokens == 0:
        out = step(s)
        assert out.num_tokens <= 16
        assert any(c.seq is a and len(c.token_ids) == 1 for c in out.chunks)  # a decodes every step
        chunks += [len(c.token_ids) for c in out.chunks if c.seq is long]
    assert chunks == [15, 15, 10] and long.num_computed_tokens == 40


def test_queue_limit_raises_resource_exhausted() -> None:
    s = make_scheduler(max_queue=2)
    s.add(seq())
    s.add(seq())
    with pytest.raises(ResourceExhausted, match="max_queue 2"):
        s.add(seq())


def test_deadline_passing_in_the_queue_finishes_the_request_unrun() -> None:
    clock = Clock()
    s = make_scheduler(num_slots=1, clock=clock, enable_preemption=False)
    running, late = seq(max_new=10), seq(deadline=clock.now + 0.5)
    s.add(running)
    s.add(late)
    step(s)
    clock.now += 1.0
    out = step(s)
    assert late.is_finished and late.is_expired and late.finish_reason == "cancelled" and out.finished == (late,)
    assert late.num_computed_tokens == 0 and late.first_scheduled is None
    assert s.num_waiting == 0


def test_full_capacity_makes_requests_wait_then_admits_them() -> None:
    s = make_scheduler(num_slots=2)
    a, b, c = seq(max_new=2), seq(max_new=2), seq(max_new=2)
    for x in (a, b, c):
        s.add(x)
    step(s)
    assert s.num_running == 2 and c.status is SeqStatus.WAITING
    step(s)  # a and b finish (length)
    out = step(s)
    assert [ch.seq for ch in out.chunks] == [c]


def test_higher_priority_preempts_the_lowest_and_the_victim_resumes_later() -> None:
    s = make_scheduler(num_slots=2)
    low, mid = seq(priority=0, max_new=3), seq(priority=1, max_new=3)
    s.add(low)
    s.add(mid)
    step(s)
    urgent = seq(priority=9, max_new=1)
    s.add(urgent)
    out = step(s)
    assert low.status is SeqStatus.WAITING and low.num_computed_tokens == 0
    assert s.num_preemptions == 1 and low.token_ids[-1] == TOKEN  # its output is kept
    assert urgent in {c.seq for c in out.chunks}
    while has_work(s):
        step(s)
    assert low.finish_reason == "length" and low.num_output_tokens == 3


def test_abort_frees_the_slot_at_once() -> None:
    s = make_scheduler(num_slots=2)
    a, b, waiting = seq(), seq(), seq()
    for x in (a, b, waiting):
        s.add(x)
    step(s)
    assert s.abort(a) and a.finish_reason == "cancelled" and s.num_running == 1
    assert s.abort(waiting) and s.num_waiting == 0
    assert not s.abort(a)
    out = s.schedule()
    assert set(out.finished) == {a, waiting}
    assert out.moves == (SlotMove(1, 0, b.num_computed_tokens),)
    assert [c.seq for c in out.chunks] == [b]


def test_failed_step_frees_its_sequences() -> None:
    s = make_scheduler()
    a, b = seq(), seq()
    s.add(a)
    s.add(b)
    out = s.schedule()
    assert set(s.fail(out)) == {a, b}
    assert a.finish_reason == "error" and s.num_running == 0 and not has_work(s)


def test_shared_prefix_is_computed_once_and_loaded_later() -> None:
    prefix = PrefixIndex(num_blocks=8, block_size=4)
    s = make_scheduler(prefix=prefix)
    first = Seq(list(range(10)) + [50, 51], 12, 2)
    s.add(first)
    out = s.schedule()
    assert out.prefix_saves[0].blocks == ((0, 0), (1, 1), (2, 2))  # 3 full blocks of 12 tokens
    second = Seq(list(range(10)) + [60, 61, 62], 13, 2)
    s.add(second)
    assert prefix.match(second.token_ids, 12) == ()  # pending until the step commits
    s.update(out, [(TOKEN,)])
    out = s.schedule()
    load = next(c for c in out.prefix_loads if c.slot == second.slot)
    assert load.blocks == ((0, 0), (1, 1))  # tokens 0..7 shared; block 2 differs
    assert second.num_computed_tokens == 8
    chunk = next(c for c in out.chunks if c.seq is second)
    assert chunk.start == 8 and len(chunk.token_ids) == 5
    assert prefix.num_hits == 1 and prefix.num_hit_tokens == 8


def test_requests_arriving_together_reuse_the_prefix_the_first_computed() -> None:
    """Three prompts with a shared 8-token prefix arrive at once; the budget fits one prompt a
    step. All three take slots in the first step, but the prefix is matched when a sequence
    first gets tokens, so the second and third load what the first stored."""
    prefix = PrefixIndex(num_blocks=8, block_size=4)
    s = make_scheduler(prefix=prefix, max_num_seqs=4, max_num_batched_tokens=10, num_speculative_tokens=0)
    seqs = [Seq([*range(8), 100 + i, 200 + i], 10, 4) for i in range(3)]
    for sq in seqs:
        s.add(sq)
    first = step(s)
    assert [c.seq for c in first.chunks] == [seqs[0]] and first.prefix_loads == ()
    second = step(s)
    assert [c.blocks for c in second.prefix_loads] == [((0, 0), (1, 1))] * 2
    chunk = next(c for c in second.chunks if c.seq is seqs[1])
    assert (chunk.start, len(chunk.token_ids)) == (8, 2)  # 2 of 10 tokens computed, not 10
    third = next(c for c in second.chunks if c.seq is seqs[2])  # the budget had room: it hits too
    assert third.start == 8
    assert prefix.num_hits == 2 and prefix.num_hit_tokens == 16


def test_a_fully_stored_prompt_still_computes_its_last_token() -> None:
    """Its logits come from the forward, so the prefix load stops a block short of the end."""
    prefix = PrefixIndex(num_blocks=4, block_size=4)
    s = make_scheduler(prefix=prefix)
    s.add(Seq(list(range(8)), 8, 2))
    step(s)  # the prompt's two blocks are stored and committed
    again = Seq(list(range(8)), 8, 2)
    s.add(again)
    out = s.schedule()
    assert [c.blocks for c in out.prefix_loads] == [((0, 0),)]
    chunk = next(c for c in out.chunks if c.seq is again)
    assert (chunk.start, chunk.token_ids) == (4, (4, 5, 6, 7))


def test_batching_window_waits_for_company_unless_full() -> None:
    clock = Clock()
    s = make_scheduler(num_slots=2, clock=clock, batch_wait_ms=10.0)
    s.add(seq())
    assert s.schedule().chunks == () and s.wait_s() == pytest.approx(0.010)
    s.add(seq())  # the batch is full: fire now
    assert s.wait_s() == 0.0 and len(s.schedule().chunks) == 2


def test_batching_window_fires_when_it_passes() -> None:
    clock = Clock()
    s = make_scheduler(num_slots=4, clock=clock, batch_wait_ms=10.0)
    s.add(seq())
    assert s.schedule().chunks == ()
    clock.now += 0.011
    assert len(s.schedule().chunks) == 1


PURE_MODULES = ("scheduler", "scheduler_output", "sequence", "wait_queue", "slot_table", "draft_planning",
                "prefix_index", "speculative", "engine_config")


def test_the_scheduler_and_its_parts_import_no_torch_and_no_grpc() -> None:
    root = Path(__file__).resolve().parents[3]
    imports = "; ".join(f"import services.inference.{name}" for name in PURE_MODULES)
    code = f"import sys; {imports}; print(sorted({{'torch', 'grpc'}} & set(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                            check=True, timeout=60)
    assert result.stdout.strip() == "[]"
