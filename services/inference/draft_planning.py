"""Which decode chunks of a step carry draft tokens (speculative decoding), and how many.

The drafts themselves come from each sequence's ``speculative.NgramDrafter``; this module only
spends the step's room on them. Pure Python (no torch, no grpc).
"""

from __future__ import annotations

from services.inference.engine_config import DRAFT_STEP_TOKENS, SchedulerConfig
from services.inference.scheduler_output import ScheduledChunk


def step_limit(config: SchedulerConfig) -> int:
    """``speculative_max_step_tokens``, with -1 (not resolved for a machine) as ``DRAFT_STEP_TOKENS``."""
    limit = config.speculative_max_step_tokens
    return DRAFT_STEP_TOKENS if limit < 0 else limit


def draft_room(config: SchedulerConfig, num_tokens: int) -> int:
    """Draft tokens a step of ``num_tokens`` may add: what is left of the token budget, and
    only up to ``speculative_max_step_tokens`` in the step (0 when drafting is off)."""
    if not config.num_speculative_tokens:
        return 0
    left = config.max_num_batched_tokens - num_tokens
    return max(0, min(left, step_limit(config) - num_tokens))


def max_logit_rows(config: SchedulerConfig, num_slots: int) -> int:
    """The most logits rows one step asks for: one per sequence (at most ``num_slots``), and in a
    step that drafts, one per token of it (at most ``speculative_max_step_tokens``)."""
    drafting = step_limit(config) if config.num_speculative_tokens else 0
    return min(config.max_num_batched_tokens, max(num_slots, drafting))


def add_drafts(chunks: list[ScheduledChunk], max_drafts: int, room: int) -> None:
    """Give decoding sequences with a drafter up to ``max_drafts`` drafts each, in the chunks'
    order, within ``room`` tokens, by replacing their chunks in place. Drafts never pass a
    sequence's max_new_tokens (its next token is not a draft); a constrained sequence's drafts
    stop before the first its grammar refuses."""
    for i, chunk in enumerate(chunks):
        if room <= 0:
            return
        seq = chunk.seq
        if seq.drafter is None or not chunk.is_sampled or len(chunk.token_ids) != 1:
            continue
        limit = min(max_drafts, room, seq.max_new_tokens - seq.num_output_tokens - 1)
        drafts = seq.drafter.propose(seq.token_ids, limit)
        if drafts and seq.grammar is not None:  # a draft its grammar refuses could never be accepted
            drafts = drafts[: seq.grammar.valid_prefix(drafts)]
        if drafts:
            chunks[i] = ScheduledChunk(seq, chunk.slot, chunk.start, chunk.token_ids + drafts, True, len(drafts))
            room -= len(drafts)
