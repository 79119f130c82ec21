"""Constrained decoding: JSON and JSON-Schema grammars as per-step token masks (xgrammar).

A constrained request carries a ``JsonConstraint``. ``Grammars`` compiles it into an xgrammar
``CompiledGrammar`` on a thread of its own (never the engine's worker, never the event loop),
caches it by the constraint's text, and the engine queues the request once its grammar is ready.
Each constrained sequence then holds a ``RowGrammar``: its matcher, which the runner asks for the
next token mask of the sequence's rows (only constrained rows get one; applied to the logits
before sampling) and advances with the tokens the step made. Drafts of a constrained sequence
(speculative decoding) are cut to the longest prefix its grammar accepts before they are
computed, and each verified position is masked with the grammar's state after the drafts
before it, so a draft the grammar refuses is never accepted (docs/engine.md).

xgrammar was measured against llguidance on this model's vocabulary: 1.2-2.7 us against
12-17 us p50 per mask (bench/grammar_libs.py, docs/decisions.md).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from aiserve.common.errors import InvalidArgument
from aiserve.model_facts import decoder_kinds

if TYPE_CHECKING:
    import xgrammar

ANY_OBJECT = '{"type":"object"}'
"""The schema of ``json_object``: any JSON object (OpenAI's JSON mode), not any JSON value."""
MAX_WHITESPACE = 16
"""The most whitespace characters the grammar allows between two JSON elements: enough for
indented output several levels deep, and a small model can no longer fill its answer with
newlines where the grammar allowed any whitespace (seen on 2 of 32 schemas before the limit)."""
CACHE_SIZE = 256
"""Compiled grammars kept, most recently used first (a compiled JSON schema is tens of KB)."""


@dataclass(frozen=True, slots=True)
class JsonConstraint:
    """The output must be JSON that validates against ``schema`` (its JSON text); the empty
    schema means any JSON object."""

    schema: str = ""

    @property
    def text(self) -> str:
        """The schema the grammar is compiled from (also its cache key)."""
        return self.schema or ANY_OBJECT


def mask_width(vocab_size: int) -> int:
    """int32 words of one row's token bitmask (one bit per id)."""
    return (vocab_size + 31) // 32


class RowGrammar:
    """One constrained sequence's grammar state: an xgrammar matcher advanced by its tokens.

    Used on the engine's worker thread only (the scheduler trims drafts under the engine lock,
    the runner masks and advances during the step)."""

    __slots__ = ("_matcher",)

    def __init__(self, compiled: xgrammar.CompiledGrammar, max_rollback: int) -> None:
        import xgrammar  # noqa: PLC0415 - native; loaded by constrained requests only

        self._matcher = xgrammar.GrammarMatcher(compiled, max_rollback_tokens=max_rollback)

    def valid_prefix(self, drafts: Sequence[int]) -> int:
        """How many of ``drafts`` (in order) the grammar accepts from its current state; the
        state is unchanged afterwards."""
        accepted = 0
        for token in drafts:
            if not self._matcher.accept_token(token):
                break
            accepted += 1
        if accepted:
            self._matcher.rollback(accepted)
        return accepted

    def fill(self, bitmask: torch.Tensor, first_row: int, drafts: Sequence[int]) -> None:
        """Write the masks of one sampled chunk: row ``first_row`` for the token after the
        sequence, then one row per draft, each under the state after the drafts before it
        (``drafts`` were checked by ``valid_prefix``; the state is unchanged afterwards)."""
        self._matcher.fill_next_token_bitmask(bitmask, first_row)
        for i, token in enumerate(drafts):
            if not self._matcher.accept_token(token):
                raise RuntimeError(f"draft {token} was not checked against the grammar")
            self._matcher.fill_next_token_bitmask(bitmask, first_row + i + 1)
        if drafts:
            self._matcher.rollback(len(drafts))

    def advance(self, token_ids: Sequence[int]) -> None:
        """Accept the tokens the step made (each was sampled under this grammar's mask)."""
        for token in token_ids:
            if self._matcher.is_terminated():
                return  # the sequence ended on a stop id; anything after it is dropped anyway
            if not self._matcher.accept_token(token):
                raise RuntimeError(f"token {token} was sampled outside its grammar's mask")


def apply_masks(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set the logits of ``rows`` to -inf wherever their mask forbids the id (in place)."""
    import xgrammar  # noqa: PLC0415

    xgrammar.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[1], indices=rows)


def new_bitmask(num_rows: int, vocab_size: int) -> torch.Tensor:
    """An all-allowed bitmask of ``num_rows`` rows (int32 words)."""
    return torch.full((num_rows, mask_width(vocab_size)), -1, dtype=torch.int32)


class Grammars:
    """Compiles constraints for one model's vocabulary, off the engine's thread, with a cache.

    The tokenizer's vocabulary is read (from the model folder's ``tokenizer.json``) on the
    compile thread the first time a constrained request arrives, so a service that never sees
    one pays nothing at start."""

    def __init__(self, tokenizer_file: Path, vocab_size: int, stop_ids: frozenset[int]) -> None:
        self.tokenizer_file, self.vocab_size, self.stop_ids = tokenizer_file, vocab_size, stop_ids
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
        self._compiler: xgrammar.GrammarCompiler | None = None
        self._cache: OrderedDict[str, Future[xgrammar.CompiledGrammar]] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, constraint: JsonConstraint) -> Future[xgrammar.CompiledGrammar]:
        """The compiled grammar of ``constraint``, as a future (done at once when cached).
        It fails with InvalidArgument when the schema cannot be enforced (kept like a success,
        so a bad schema sent again costs no second compile)."""
        key = constraint.text
        with self._lock:
            future = self._cache.get(key)
            if future is not None:  # a refusal is cached too: the same schema fails the same way
                self._cache.move_to_end(key)
                return future
            future = self._executor.submit(self._compile, key)
            self._cache[key] = future
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
            return future

    def close(self) -> None:
        """Stop the compile thread (pending compiles still finish)."""
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _compile(self, schema: str) -> xgrammar.CompiledGrammar:
        compiler = self._compiler or self._new_compiler()
        try:
            return compiler.compile_json_schema(schema, max_whitespace_cnt=MAX_WHITESPACE)
        except (RuntimeError, ValueError) as exc:
            reason = str(exc).rsplit(": ", 1)[-1] if ": " in str(exc) else str(exc)
            raise InvalidArgument(f"decoding.json_schema: not supported by the grammar compiler: {reason}") from None

    def _new_compiler(self) -> xgrammar.GrammarCompiler:
        import xgrammar  # noqa: PLC0415

        self._compiler = xgrammar.GrammarCompiler(self._tokenizer_info(xgrammar), max_threads=1)
        return self._compiler

    def _tokenizer_info(self, xgrammar: Any) -> xgrammar.TokenizerInfo:
        """The vocabulary as xgrammar reads it: byte-level BPE pieces by id, from tokenizer.json."""
        from tokenizers import Tokenizer  # noqa: PLC0415

        tok = Tokenizer.from_file(str(self.tokenizer_file))
        pieces = [""] * self.vocab_size
        for piece, index in tok.get_vocab(with_added_tokens=True).items():
            if index < self.vocab_size:
                pieces[index] = piece
        vocab_type = _vocab_type(xgrammar, decoder_kinds(tok.to_str()))
        return xgrammar.TokenizerInfo(pieces, vocab_type, vocab_size=self.vocab_size,
                                      stop_token_ids=sorted(self.stop_ids), add_prefix_space=False)


def _vocab_type(xgrammar: Any, kinds: frozenset[str]) -> Any:
    """BYTE_LEVEL for a GPT-2 style byte-level BPE (the pieces are bytes mapped to printable
    characters), BYTE_FALLBACK for sentencepiece-style byte tokens, RAW otherwise."""
    if "ByteLevel" in kinds:
        return xgrammar.VocabType.BYTE_LEVEL
    if "ByteFallback" in kinds:
        return xgrammar.VocabType.BYTE_FALLBACK
    return xgrammar.VocabType.RAW
