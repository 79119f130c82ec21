"""How a step's room for draft tokens is computed (no torch; drafting itself: test_speculative.py)."""

from __future__ import annotations

from services.inference.draft_planning import draft_room, max_logit_rows
from services.inference.engine_config import SchedulerConfig


def test_drafts_fill_a_step_up_to_the_speculative_cap() -> None:
    config = SchedulerConfig(max_num_batched_tokens=512, speculative_max_step_tokens=32)
    assert draft_room(config, 10) == 22
    assert draft_room(config, 32) == 0
    assert draft_room(config, 100) == 0  # a large step pays for every draft row: none


def test_drafts_never_pass_the_token_budget() -> None:
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, speculative_max_step_tokens=32)
    assert draft_room(config, 10) == 6


def test_no_room_when_drafting_is_off() -> None:
    assert draft_room(SchedulerConfig(num_speculative_tokens=0), 1) == 0


def test_a_step_asks_for_one_logits_row_per_sequence_or_per_drafting_token() -> None:
    config = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=512, speculative_max_step_tokens=32)
    assert max_logit_rows(config, 64) == 64
    assert max_logit_rows(config, 8) == 32  # a drafting step of 32 tokens wants 32 rows
    assert max_logit_rows(SchedulerConfig(max_num_seqs=8, num_speculative_tokens=0), 8) == 8
    small = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, speculative_max_step_tokens=32)
    assert max_logit_rows(small, 4) == 16  # never more rows than the step has tokens
