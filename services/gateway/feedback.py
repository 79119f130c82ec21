"""Feedback on answers (docs/gateway.md, "Feedback"): ratings by request id, and two passive signals.

* ``rating``: the tenant says an answer was good (1) or bad (-1), with an optional comment.
  Only the tenant's own requests can be rated; any other id is NOT_FOUND, so a tenant cannot
  even learn that another tenant's request id exists.
* ``abandoned``: the client cancelled a stream before its last message.
* ``repeat``: the same tenant asked a near-identical question again within a few minutes
  (recorded on the earlier request: its answer probably did not help).

Rows go to the ledger's database through its writer. No grpc, no pb.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections import defaultdict, deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from aiserve.common.errors import InvalidArgument, NotFound
from services.gateway.ledger import Ledger, UsageRow

_INSERT = ("INSERT INTO feedback (request_id, tenant, kind, rating, comment, related_request_id, created_at_ms) "
           "VALUES (?, ?, ?, ?, ?, ?, ?)")
_WORD_RE = re.compile(r"\w+")
MAX_RECENT = 64
"""Questions remembered per tenant for the repeat signal."""


@dataclass(frozen=True, slots=True)
class _Asked:
    at: float
    request_id: str
    shingles: frozenset[str]


def shingles(text: str) -> frozenset[str]:
    """Character 3-grams of the text, lower-cased, punctuation and spacing ignored."""
    norm = " ".join(_WORD_RE.findall(text.lower()))
    return frozenset(norm[i:i + 3] for i in range(max(len(norm) - 2, 1)))


class RepeatDetector:
    """Remembers each tenant's recent questions (as 3-gram sets only, never the text)."""

    def __init__(self, window_s: float, threshold: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s, self.threshold, self._clock = window_s, threshold, clock
        self._recent: dict[str, deque[_Asked]] = defaultdict(lambda: deque(maxlen=MAX_RECENT))

    def observe(self, tenant: str, request_id: str, question: str) -> str | None:
        """Remember this question; return the id of an earlier near-identical one, if any."""
        now, grams = self._clock(), shingles(question)
        recent = self._recent[tenant]
        while recent and now - recent[0].at > self.window_s:
            recent.popleft()
        earlier = next((a for a in reversed(recent) if a.request_id != request_id
                        and len(grams & a.shingles) / max(len(grams | a.shingles), 1) >= self.threshold), None)
        recent.append(_Asked(now, request_id, grams))
        return None if earlier is None else earlier.request_id


CountFeedback = Callable[[str], None]
"""Told the kind of every feedback row written: good, bad, abandoned or repeat (the metrics)."""

RATING_KINDS = {1: "good", -1: "bad"}


class Feedback:
    """Writes ratings and passive signals next to the usage rows they are about."""

    def __init__(self, ledger: Ledger, max_comment_chars: int, count: CountFeedback = lambda _: None) -> None:
        self.ledger = ledger
        self.max_comment_chars = max_comment_chars
        self._count = count

    async def rate(self, tenant: str, request_id: str, rating: int, comment: str) -> UsageRow:
        """Record a rating of one of ``tenant``'s requests; return that request's usage row."""
        if not 1 <= len(request_id) <= 128:
            raise InvalidArgument(f"request_id: must be 1..128 characters, got {len(request_id)}")
        if rating not in (-1, 1):
            raise InvalidArgument(f"rating: must be -1 (bad) or 1 (good), got {rating}")
        if len(comment) > self.max_comment_chars:
            raise InvalidArgument(f"comment: at most {self.max_comment_chars} characters, got {len(comment)}")
        row = await asyncio.to_thread(self.ledger.find, tenant, request_id)
        if row is None:
            raise NotFound(f"request_id: no request {request_id!r} of this tenant")
        await asyncio.wrap_future(self._write(tenant, request_id, "rating", rating, comment, ""))
        self._count(RATING_KINDS[rating])
        return row

    def abandoned(self, tenant: str, request_id: str) -> None:
        self._write(tenant, request_id, "abandoned", 0, "", "")
        self._count("abandoned")

    def repeated(self, tenant: str, earlier_request_id: str, request_id: str) -> None:
        self._write(tenant, earlier_request_id, "repeat", 0, "", request_id)
        self._count("repeat")

    def _write(self, tenant: str, request_id: str, kind: str, rating: int, comment: str,
               related: str) -> Future[None]:
        return self.ledger.write(_INSERT, (request_id, tenant, kind, rating, comment, related, int(time.time() * 1000)))
