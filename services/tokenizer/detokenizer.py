"""Incremental (streaming) detokenization: token ids in, text deltas out, no broken characters.

The technique of vLLM and TGI: keep two offsets into the ids seen so far. ``prefix_offset`` starts
a short window of already-emitted ids that is decoded again as context (tokenizers such as
SentencePiece decode a token differently at the start of a text), ``read_offset`` ends what
has been emitted. Each push decodes ``ids[prefix_offset:read_offset]`` and
``ids[prefix_offset:]``; the difference is the new text. While the new text ends with U+FFFD
(a byte-level token that stops inside a UTF-8 character) its tail is held back; the complete
characters before it go out at once, counted in ``_num_partial_chars`` until the window moves.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.tokenizer.tokenizer import ModelTokenizer

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas for one generation.

    Concatenating every ``push`` result and the final ``flush`` equals
    ``tokenizer.decode(all_ids, skip_special_tokens)`` exactly. No delta ends inside a
    UTF-8 character. One instance per stream; not thread-safe.
    """

    def __init__(self, tokenizer: ModelTokenizer, skip_special_tokens: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0  # start of the context window (already emitted)
        self._read_offset = 0  # ids before this are emitted in full
        self._num_partial_chars = 0  # chars past the window's prefix text already emitted

    @property
    def num_ids(self) -> int:
        return len(self._ids)

    def _window_texts(self) -> tuple[str, str]:
        decode = self._tokenizer.decode_unchecked
        window = self._ids[self._prefix_offset:]
        prefix_text = decode(window[: self._read_offset - self._prefix_offset],
                             self._skip_special_tokens)
        return prefix_text, decode(window, self._skip_special_tokens)

    def push(self, ids: Sequence[int]) -> str:
        """Add generated ids; return the text they complete (may be ""). Bad ids raise
        InvalidArgument and leave the state unchanged."""
        self._tokenizer.check_ids(ids)
        if not ids:
            return ""
        self._ids.extend(ids)
        prefix_text, new_text = self._window_texts()
        start = len(prefix_text) + self._num_partial_chars
        if new_text.endswith(REPLACEMENT_CHAR) or len(new_text) <= len(prefix_text):
            # Incomplete character at the end (or nothing new yet): send only what is final.
            delta = new_text.rstrip(REPLACEMENT_CHAR)[start:]
            self._num_partial_chars += len(delta)
            return delta
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._num_partial_chars = 0
        return new_text[start:]

    def flush(self) -> str:
        """The text still held back (e.g. a trailing incomplete character, as U+FFFD); call
        once when the stream ends."""
        prefix_text, new_text = self._window_texts()
        delta = new_text[len(prefix_text) + self._num_partial_chars:]
        self._prefix_offset = self._read_offset = len(self._ids)
        self._num_partial_chars = 0
        return delta
