from __future__ import annotations

from pathlib import Path

import pytest

from aiserve.common.errors import InvalidArgument, NotFound
from services.gateway.feedback import Feedback, RepeatDetector
from services.gateway.ledger import Ledger
from tests.unit.gateway.test_ledger import row


def test_near_identical_question_within_the_window_is_a_repeat() -> None:
    now = [0.0]
    detector = RepeatDetector(window_s=300, threshold=0.85, clock=lambda: now[0])
    assert detector.observe("acme", "r1", "What is the capital of France?") is None
    now[0] = 60
    assert detector.observe("acme", "r2", "what is the capital of france") == "r1"
    assert detector.observe("other", "r3", "What is the capital of France?") is None  # another tenant
    assert detector.observe("acme", "r4", "How tall is the Eiffel tower?") is None
    now[0] = 1000  # outside the window of r1 and r2
    assert detector.observe("acme", "r5", "What is the capital of France?") is None


async def test_only_the_tenants_own_requests_can_be_rated(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path / "ledger.sqlite3")
    feedback = Feedback(ledger, max_comment_chars=10)
    try:
        await ledger.record(row("mine", tenant="acme"))
        await ledger.record(row("theirs", tenant="other"))
        assert (await feedback.rate("acme", "mine", -1, "wrong")).request_id == "mine"
        with pytest.raises(NotFound) as other:
            await feedback.rate("acme", "theirs", 1, "")
        with pytest.raises(NotFound) as missing:
            await feedback.rate("acme", "never", 1, "")
        # The same answer whether the id belongs to another tenant or to nobody.
        assert other.value.message.replace("theirs", "X") == missing.value.message.replace("never", "X")
        for bad in ((0, ""), (2, ""), (1, "x" * 11)):
            with pytest.raises(InvalidArgument):
                await feedback.rate("acme", "mine", *bad)
        feedback.abandoned("acme", "mine")
    finally:
        ledger.close()
    rows = Ledger(tmp_path / "ledger.sqlite3")
    try:
        kinds = rows.query("SELECT kind, rating, comment FROM feedback WHERE tenant = 'acme' ORDER BY id", ())
        assert kinds == [("rating", -1, "wrong"), ("abandoned", 0, "")]
    finally:
        rows.close()


async def test_each_feedback_row_is_counted_by_its_kind(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path / "ledger.sqlite3")
    kinds: list[str] = []
    feedback = Feedback(ledger, max_comment_chars=10, count=kinds.append)
    try:
        await ledger.record(row("mine", tenant="acme"))
        await feedback.rate("acme", "mine", 1, "")
        await feedback.rate("acme", "mine", -1, "")
        with pytest.raises(NotFound):  # refused: not counted
            await feedback.rate("acme", "never", 1, "")
        feedback.abandoned("acme", "mine")
        feedback.repeated("acme", "mine", "later")
    finally:
        ledger.close()
    assert kinds == ["good", "bad", "abandoned", "repeat"]
