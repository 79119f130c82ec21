"""The shipped evaluation data (aiserve/eval_data/) and the scorer of its tasks: pure Python.

A task is one user message with the answers it accepts; ``score`` says whether a model's answer
matches one of them, by the task's ``match``:

- ``contains``: one expected text is in the answer, case ignored;
- ``contains_case``: the same, case kept (e.g. "write it in capitals");
- ``number``: one expected number appears in the answer as a whole number (so "42" is not
  found in "142" or "4.2").
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

EVAL_DATA = Path(__file__).resolve().parent / "eval_data"
TEXT_FILE = EVAL_DATA / "pride_and_prejudice_ch1.txt"
TASKS_FILE = EVAL_DATA / "tasks.json"
MATCHES = ("contains", "contains_case", "number")


@dataclass(frozen=True, slots=True)
class Task:
    """One prompt and the answers it accepts."""

    id: str
    category: str
    prompt: str
    expected: tuple[str, ...]
    match: str


def load_tasks(path: Path = TASKS_FILE) -> list[Task]:
    """The tasks of ``path``; ValueError naming a task whose ``match`` is unknown."""
    tasks = [Task(t["id"], t["category"], t["prompt"], tuple(t["expected"]), t["match"])
             for t in json.loads(path.read_text(encoding="utf-8"))["tasks"]]
    if bad := [t.id for t in tasks if t.match not in MATCHES or not t.expected]:
        raise ValueError(f"{path}: tasks {bad} need a match among {MATCHES} and expected answers")
    return tasks


def load_text(path: Path = TEXT_FILE) -> str:
    """The perplexity text."""
    return path.read_text(encoding="utf-8")


def _numbers(text: str) -> set[str]:
    """Whole numbers in ``text`` (thousands commas dropped): "1,250 and 3.5" -> {"1250", "3.5"}."""
    return {m.replace(",", "") for m in re.findall(r"(?<![\d.])\d[\d,]*(?:\.\d+)?(?![\d])", text)}


def score(task: Task, answer: str) -> bool:
    """Whether ``answer`` is correct for ``task``."""
    if task.match == "number":
        return bool(_numbers(answer) & {e.replace(",", "") for e in task.expected})
    if task.match == "contains_case":
        return any(e in answer for e in task.expected)
    return any(e.casefold() in answer.casefold() for e in task.expected)
