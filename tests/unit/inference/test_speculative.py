"""Speculative decoding without a model: the n-gram drafter, the acceptance rule, and how the
scheduler spends and accounts drafts."""

from __future__ import annotations

import pytest

from services.inference.engine_config import SchedulerConfig
from services.inference.scheduler import Scheduler
from services.inference.sequence import Seq
from services.inference.slot_table import SlotMove
from services.inference.speculative import NgramDrafter, accept

STOP = 99


def test_drafter_proposes_what_followed_the_latest_earlier_match() -> None:
    d = NgramDrafter(min_ngram=2, max_ngram=3)
    #         the 2-gram (5, 6) occurs at 0 (then 7, 8) and at 4 (then 9, 1); the latest wins
    tokens = [5, 6, 7, 8, 5, 6, 9, 1, 2, 5, 6]
    assert d.propose(tokens, 2) == (9, 1)
    assert d.propose(tokens, 1) == (9,)
    assert d.propose(tokens, 0) == ()


def test_drafter_prefers_the_longest_ngram() -> None:
    d = NgramDrafter(min_ngram=2, max_ngram=3)
    # (3, 4) last occurs before 8, but (2, 3, 4) only before 7
    assert d.propose([2, 3, 4, 7, 0, 3, 4, 8, 0, 2, 3, 4], 1) == (7,)


def test_drafter_never_matches_the_suffix_itself_and_stops_at_the_end() -> None:
    d = NgramDrafter(min_ngram=2, max_ngram=2)
    assert d.propose([1, 2, 3, 4], 3) == ()  # (3, 4) only occurs as the suffix
    assert d.propose([1, 2, 1, 2], 3) == (1, 2)  # the match's continuation is the suffix: 2 left


def test_incremental_index_proposes_like_a_fresh_one() -> None:
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3, 3, 8, 3, 2, 7, 9, 5]
    grown = NgramDrafter(1, 3)
    for end in range(1, len(tokens) + 1):
        assert grown.propose(tokens[:end], 3) == NgramDrafter(1, 3).propose(tokens[:end], 3), end


def test_ngram_sizes_are_checked() -> None:
    with pytest.raises(ValueError, match="min_ngram"):
        NgramDrafter(min_ngram=0)
    with pytest.raises(ValueError, match="min_ngram"):
        NgramDrafter(min_ngram=3, max_ngram=2)


def test_accept_keeps_the_drafts_the_model_agrees_with() -> None:
    assert accept((4, 5, 6), (4, 5, 6, 7)) == 3
    assert accept((4, 5, 6), (4, 0, 6, 7)) == 1  # everything after the first miss is dropped
    assert accept((4,), (3, 4)) == 0
    assert accept((), (3,)) == 0


def repeating(max_new: int = 20) -> Seq:
    """A greedy sequence whose prompt repeats, so the drafter always has a guess."""
    prompt = [1, 2, 3, 4] * 3
    s = Seq(list(prompt), len(prompt), max_new, stop_token_ids=frozenset({STOP}))
    s.drafter = NgramDrafter()
    return s


def scheduler(**settings: object) -> Scheduler:
    config = SchedulerConfig(**{"batch_wait_ms": 0.0, "num_speculative_tokens": 2, **settings})  # type: ignore[arg-type]
    return Scheduler(config, num_slots=4, slot_len=64)


def prefilled(s: Scheduler, *seqs: Seq) -> None:
    for seq in seqs:
        s.add(seq)
    out = s.schedule()
    assert all(c.num_drafts == 0 for c in out.chunks)  # a prompt chunk gets no drafts
    s.update(out, [(1,)] * len(out.chunks))  # each prompt is followed by 1: "... 3, 4, 1"


def test_a_decode_chunk_carries_drafts_and_confirmed_ones_count_as_computed() -> None:
    s = scheduler()
    seq = repeating()
    prefilled(s, seq)
    out = s.schedule()
    (chunk,) = out.chunks
    assert chunk.token_ids == (1, 2, 3) and chunk.num_drafts == 2 and chunk.start == 12
    grown = s.update(out, [(2, 3, 4)])  # both drafts confirmed, plus the model's own next token
    assert grown == [(seq, 3)] and seq.token_ids[-4:] == [1, 2, 3, 4]
    assert seq.num_computed_tokens == 15 == seq.num_tokens - 1  # 1, 2, 3 computed; 4 is next
    assert (s.num_draft_tokens, s.num_accepted_tokens) == (2, 2)
    out = s.schedule()
    assert out.chunks[0].start == 15 and out.chunks[0].token_ids[0] == 4
    s.update(out, [(9,)])  # every draft rejected: one token, the drafts' K/V is not kept
    assert seq.num_computed_tokens == 16 and seq.token_ids[-1] == 9
    assert (s.num_draft_tokens, s.num_accepted_tokens) == (4, 2)


def test_drafts_stay_within_max_new_tokens_and_the_step_cap() -> None:
    s = scheduler(speculative_max_step_tokens=4)
    a, b, c = repeating(max_new=2), repeating(), repeating()
    prefilled(s, a, b, c)
    out = s.schedule()
    # a has one token left to make: no drafts; b's one draft fills the cap of 4; c gets none
    assert [ch.num_drafts for ch in out.chunks] == [0, 1, 0]
    assert out.num_tokens == 4


def test_no_drafts_without_a_drafter_or_when_disabled() -> None:
    s = scheduler()
    plain = repeating()
    plain.drafter = None
    prefilled(s, plain)
    assert s.schedule().chunks[0].num_drafts == 0
    off = scheduler(num_speculative_tokens=0)
    prefilled(off, repeating())
    assert off.schedule().chunks[0].num_drafts == 0


def test_a_stop_token_among_the_confirmed_ids_ends_the_sequence_there() -> None:
    s = scheduler()
    a, b = repeating(), repeating()
    prefilled(s, a, b)
    out = s.schedule()
    assert [c.num_drafts for c in out.chunks] == [2, 2]
    grown = s.update(out, [(2, STOP, 4), (2, 3, 4)])
    assert grown == [(a, 2), (b, 3)]
    assert a.is_finished and a.finish_reason == "stop" and a.token_ids[-2:] == [2, STOP]
    # b moved into a's slot with its confirmed drafts' K/V: 12 prompt + 1, 2, 3
    assert s.schedule().moves == (SlotMove(src=1, dst=0, num_tokens=15),)


def test_max_new_tokens_cuts_confirmed_ids() -> None:
    s = scheduler()
    seq = repeating(max_new=3)
    prefilled(s, seq)
    out = s.schedule()
    assert out.chunks[0].num_drafts == 1  # two tokens left to make: the next one and one draft
    assert s.update(out, [(2, 3)]) == [(seq, 2)]
    assert seq.finish_reason == "length" and seq.num_output_tokens == 3
