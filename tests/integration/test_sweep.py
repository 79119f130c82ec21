"""``aiserve sweep`` against the real suite: a seeded sweep run twice gives the same outputs, and
its page shows every one of them in a real browser.

Kept small (2 prompts x 2 sampled grid points, 12 tokens): each sweep is 4 Complete calls."""

from __future__ import annotations

import json
from pathlib import Path

from suite.cli import build_parser
from suite.runner import Suite
from suite.sweep import SweepResults
from tests.integration.conftest import dev_key
from tests.unit.suite.test_sweep_page import assert_every_cell_is_in_the_dom, browser_dom

PROMPTS = [{"id": "poem", "kind": "creative", "text": "Write a poem about rain."},
           {"id": "wall", "kind": "chinese", "text": "请介绍长城。"}]
GRID = "temperature=0.7,1.0 top_p=1.0"


def sweep(suite: Suite, prompts: Path, out: Path, seed: int) -> SweepResults:
    """One run of the command as a user types it; its results file, read back."""
    args = build_parser().parse_args([
        "sweep", "--prompts", str(prompts), "--grid", GRID, "--seed", str(seed), "--max-new-tokens", "12",
        "--concurrency", "2", "--timeout", "120", "--address", suite.config.address("gateway"),
        "--key", dev_key(suite), "--out", str(out)])
    assert args.func(args) == 0
    return SweepResults.from_json((out / "sweep.json").read_text(encoding="utf-8"))


def texts(results: SweepResults) -> dict[tuple[str, str], str]:
    return {(c.prompt_id, c.point): c.text for c in results.cells}


def test_a_seeded_sweep_is_reproducible_and_its_page_shows_every_output(suite: Suite, tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(PROMPTS, ensure_ascii=False), encoding="utf-8")
    first = sweep(suite, prompts, tmp_path / "first", seed=1234)
    again = sweep(suite, prompts, tmp_path / "again", seed=1234)
    assert len(first.cells) == 4 and all(c.text and c.num_tokens > 0 and not c.error for c in first.cells)
    assert texts(again) == texts(first)
    other = sweep(suite, prompts, tmp_path / "other", seed=99)
    assert texts(other) != texts(first)  # the seed is what made them equal, not greedy decoding
    page = (tmp_path / "first" / "sweep.html").read_text(encoding="utf-8")
    assert_every_cell_is_in_the_dom(first, browser_dom(page, tmp_path))
