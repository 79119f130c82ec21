"""IncrementalDetokenizer: streamed deltas add up to the full decode, never a broken character."""

from __future__ import annotations

import random

import pytest

from aiserve.common.errors import InvalidArgument
from services.tokenizer.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer
from services.tokenizer.tokenizer import ModelTokenizer


def _stream(tokenizer: ModelTokenizer, ids: list[int], step: int,
            skip_special_tokens: bool = False) -> list[str]:
    detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens)
    deltas = [detokenizer.push(ids[i:i + step]) for i in range(0, len(ids), step)]
    return [*deltas, detokenizer.flush()]


@pytest.mark.parametrize("skip_special_tokens", [False, True])
def test_one_id_at_a_time_matches_decode(tokenizer: ModelTokenizer, corpus_text: str,
                                         skip_special_tokens: bool) -> None:
    ids = tokenizer.encode(corpus_text)
    deltas = _stream(tokenizer, ids, 1, skip_special_tokens)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens)
    assert len(deltas) == len(ids) + 1


@pytest.mark.parametrize("step", [2, 3, 7, 1000])
def test_several_ids_per_push_match_decode(tokenizer: ModelTokenizer, corpus_text: str,
                                           step: int) -> None:
    ids = tokenizer.encode(corpus_text)
    assert "".join(_stream(tokenizer, ids, step)) == tokenizer.decode(ids)


@pytest.mark.parametrize("step", [1, 2, 5])
def test_wide_text_never_yields_a_broken_character(tokenizer: ModelTokenizer, wide_text: str,
                                                   step: int) -> None:
    ids = tokenizer.encode(wide_text)
    deltas = _stream(tokenizer, ids, step)
    assert all(REPLACEMENT_CHAR not in delta for delta in deltas)
    assert "".join(deltas) == wide_text
    assert deltas[-1] == ""  # complete text: nothing is left for the flush


def test_complete_characters_before_a_partial_one_go_out_at_once(
        tokenizer: ModelTokenizer) -> None:
    ids = tokenizer.encode("ab 你")
    detokenizer = IncrementalDetokenizer(tokenizer)
    first = detokenizer.push(ids[:-1])  # "ab" and the first byte(s) of 你
    assert first and REPLACEMENT_CHAR not in first
    assert first + detokenizer.push(ids[-1:]) + detokenizer.flush() == "ab 你"


def test_flush_returns_an_incomplete_tail(tokenizer: ModelTokenizer) -> None:
    ids = tokenizer.encode("你")
    assert len(ids) > 1  # byte-level: 你 is several tokens
    detokenizer = IncrementalDetokenizer(tokenizer)
    assert detokenizer.push(ids[:1]) == ""
    assert detokenizer.flush() == tokenizer.decode(ids[:1]) == REPLACEMENT_CHAR


def test_special_tokens_skipped_or_kept(tokenizer: ModelTokenizer) -> None:
    ids = [1, *tokenizer.encode("assistant\nHi"), 2]
    assert "".join(_stream(tokenizer, ids, 1)) == "<|im_start|>assistant\nHi<|im_end|>"
    assert "".join(_stream(tokenizer, ids, 1, skip_special_tokens=True)) == "assistant\nHi"


def test_empty_push_and_bad_ids(tokenizer: ModelTokenizer) -> None:
    detokenizer = IncrementalDetokenizer(tokenizer)
    assert detokenizer.push([]) == ""
    assert detokenizer.push(tokenizer.encode("ok")) == "ok"
    with pytest.raises(InvalidArgument, match=r"token_ids\[1\]: 49152 is outside \[0, 49152\)"):
        detokenizer.push([5, 49152])
    assert detokenizer.num_ids == 1
    assert detokenizer.flush() == ""


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("step", [1, 3])
def test_random_ids_match_decode(tokenizer: ModelTokenizer, seed: int, step: int) -> None:
    """A model can emit any id sequence, broken UTF-8 included: deltas still add up exactly."""
    rng = random.Random(seed)
    byte_tokens = tokenizer.encode("你好🙂é")  # single-byte tokens make split characters likely
    ids = [rng.choice(byte_tokens) if rng.random() < 0.5 else rng.randrange(49152)
           for _ in range(300)]
    for skip in (False, True):
        assert "".join(_stream(tokenizer, ids, step, skip)) == tokenizer.decode(ids, skip)


def test_literal_replacement_character(tokenizer: ModelTokenizer) -> None:
    text = "a\ufffdb \ufffd"
    ids = tokenizer.encode(text)
    assert "".join(_stream(tokenizer, ids, 1)) == text
