"""The shipped evaluation data loads, and the scorer matches answers as each task says."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from aiserve.eval_tasks import Task, load_tasks, load_text, score


def test_the_shipped_data_has_ten_tasks_per_kind_and_a_text() -> None:
    tasks = load_tasks()
    assert Counter(t.category for t in tasks) == {"facts": 10, "arithmetic": 10, "instructions": 10, "chinese": 10}
    assert len({t.id for t in tasks}) == len(tasks)
    assert load_text().startswith("It is a truth universally acknowledged") and len(load_text()) > 4000


def test_numbers_match_whole_numbers_only() -> None:
    task = Task("m", "arithmetic", "17+25?", ("42",), "number")
    assert score(task, "17 + 25 = 42.") and score(task, "It is 42")
    assert not score(task, "142") and not score(task, "4.2") and not score(task, "420")
    assert score(Task("t", "arithmetic", "1000+250?", ("1250",), "number"), "That makes 1,250.")


def test_contains_ignores_case_unless_told_not_to() -> None:
    assert score(Task("f", "facts", "Capital?", ("Paris",), "contains"), "the capital is PARIS")
    capitals = Task("i", "instructions", "Capitals please", ("CAT",), "contains_case")
    assert score(capitals, "CAT") and not score(capitals, "cat")
    assert score(Task("z", "chinese", "首都？", ("北京",), "contains"), "中国的首都是北京。")


def test_an_unknown_match_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "tasks.json"
    path.write_text('{"tasks": [{"id": "x", "category": "c", "prompt": "p", "expected": ["a"], "match": "regex"}]}')
    with pytest.raises(ValueError, match=r"tasks \['x'\] need a match"):
        load_tasks(path)
