"""The exact tier: an answer for the same namespace and the same rendered prompt.

An exact hit needs no embedding and has similarity 1.0; it is looked up before the semantic
tier. The key is sha256 of (namespace, prompt) (record_schema.py), unique in the record, so
storing the same prompt again replaces the answer.
"""

from __future__ import annotations

from services.cache.entry import CacheEntry, CacheScope, require_scope_and_prompt
from services.cache.record import CacheRecord
from services.cache.record_schema import entry_key


class ExactTier:
    """Answers by exact (namespace, prompt) match from a CacheRecord."""

    def __init__(self, record: CacheRecord) -> None:
        self._record = record

    def lookup(self, scope: CacheScope, prompt: str) -> CacheEntry | None:
        """The live entry for ``scope`` and ``prompt`` (its last use set to now), or None.
        Raises InvalidArgument for an empty model or prompt."""
        require_scope_and_prompt(scope, prompt)
        return self._record.get(entry_key(self._record.namespace(scope), prompt))
