"""The sweep's grid, figures and results file (suite/sweep.py), the figures worked by hand."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from suite.cli import build_parser
from suite.sweep import (
    DEFAULT_GRID,
    DEFAULT_PROMPTS,
    Cell,
    GridError,
    GridPoint,
    SweepResults,
    distinct_n,
    load_prompts,
    parse_grid,
    repetition,
)


def test_the_default_grid_is_the_cartesian_product_in_key_order() -> None:
    points = parse_grid(DEFAULT_GRID)
    assert len(points) == 4 * 2 * 2
    assert points[0].as_dict() == {"temperature": 0.0, "top_p": 0.9, "repetition_penalty": 1.0}
    assert points[1].label == "temperature=0 top_p=0.9 repetition_penalty=1.1"
    assert points[-1].label == "temperature=1 top_p=1 repetition_penalty=1.1"
    assert len({p.label for p in points}) == len(points)


@pytest.mark.parametrize(("grid", "names"), [
    ("temp=0,1", "unknown key 'temp'"),
    ("temperature=0,1 temperature=0.5", "temperature is given twice"),
    ("temperature=", "temperature has an empty value"),
    ("top_p=0.9,,1.0", "top_p has an empty value"),
    ("top_p=0.9,abc", "top_p: 'abc' is not a number"),
    ("top_p=0", r"top_p: 0 is outside \(0, 1\]"),
    ("temperature=2.5", r"temperature: 2.5 is outside \[0, 2\]"),
    ("repetition_penalty=0.1", "repetition_penalty: 0.1 is outside"),
    ("top_k=2.5", "top_k: 2.5 is not a whole number"),
    ("temperature", "'temperature' is not key=v1,v2"),
    ("  ", "grid: empty"),
])
def test_a_bad_grid_names_the_key_at_fault(grid: str, names: str) -> None:
    with pytest.raises(GridError, match=names):
        parse_grid(grid)


def test_the_sweep_command_refuses_a_bad_grid_before_any_call(capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser().parse_args(["sweep", "--grid", "top_p=1.5", "--key", "k", "--address", "127.0.0.1:1"])
    assert args.func(args) == 2
    assert "top_p: 1.5 is outside (0, 1]" in capsys.readouterr().err


def test_distinct_n_by_hand() -> None:
    words = "the cat sat on the cat".split()
    assert distinct_n(words, 1) == pytest.approx(4 / 6)  # the, cat, sat, on
    assert distinct_n(words, 2) == pytest.approx(4 / 5)  # "the cat" twice among 5 bigrams
    assert distinct_n(words, 3) == 1.0
    assert distinct_n(list("长城长城"), 1) == 0.5  # characters work like words
    assert distinct_n(["a"], 2) == 0.0  # no bigram at all


def test_repetition_is_the_share_of_3_grams_seen_before() -> None:
    looping = "a b c a b c a b c".split()  # 7 trigrams: abc bca cab abc bca cab abc
    assert repetition(looping) == pytest.approx(4 / 7)
    assert distinct_n(looping, 1) == pytest.approx(3 / 9)
    assert distinct_n(looping, 2) == pytest.approx(3 / 8)
    assert repetition("the cat sat on the cat".split()) == 0.0
    assert repetition(["a", "b"]) == 0.0  # too short to repeat a 3-gram


def test_a_cell_measures_its_token_ids() -> None:
    point = GridPoint((("temperature", 0.7),))
    cell = Cell.of("p", point, "text", [5, 6, 7, 5, 6, 7, 5, 6, 7], "length")
    assert (cell.point, cell.num_tokens, cell.distinct_1, cell.distinct_2, cell.rep_3) == (
        "temperature=0.7", 9, round(3 / 9, 4), round(3 / 8, 4), round(4 / 7, 4))


def test_the_shipped_prompts_cover_factual_creative_and_chinese() -> None:
    prompts = load_prompts(DEFAULT_PROMPTS)
    assert {"factual", "creative", "chinese"} <= {p.kind for p in prompts}
    assert any("长城" in p.text for p in prompts)


def test_a_text_prompts_file_is_one_prompt_a_line(tmp_path: Path) -> None:
    path = tmp_path / "prompts.txt"
    path.write_text("first\n\nsecond\n", encoding="utf-8")
    assert [(p.id, p.text) for p in load_prompts(path)] == [("p1", "first"), ("p2", "second")]


def test_results_survive_their_json_file(tmp_path: Path) -> None:
    prompts = load_prompts(DEFAULT_PROMPTS)[:2]
    points = parse_grid("temperature=0,0.7")
    cells = [Cell.of(p.id, g, f"{p.id} {g.label} 长城 <b>", [1, 2, 3], "stop") for p in prompts for g in points]
    results = SweepResults(seed=7, max_new_tokens=8, grid="temperature=0,0.7", prompts=prompts,
                           points=[g.label for g in points], cells=cells, meta={"seconds": "3"})
    assert SweepResults.from_json(results.to_json()) == results
    assert "长城" in results.to_json()  # readable, not \\u-escaped


def test_render_only_rewrites_the_page_from_a_json_file(tmp_path: Path) -> None:
    results = SweepResults(seed=1, max_new_tokens=4, grid="temperature=0", prompts=load_prompts(DEFAULT_PROMPTS)[:1],
                           points=["temperature=0"], cells=[])
    (tmp_path / "in.json").write_text(results.to_json(), encoding="utf-8")
    args = argparse.Namespace(render=str(tmp_path / "in.json"), out=str(tmp_path / "out"))
    assert build_parser().parse_args(["sweep"]).func(args) == 0
    assert "missing from the results" in (tmp_path / "out" / "sweep.html").read_text(encoding="utf-8")
