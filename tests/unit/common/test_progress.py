"""Progress bars: drawn by tqdm on a terminal, one line per step anywhere else."""

from __future__ import annotations

import io

from tqdm import tqdm

from aiserve.common.progress import MAX_LINES, LineProgress, is_terminal, library_bars, progress


class Terminal(io.StringIO):
    """A stream that says it is a terminal."""

    def isatty(self) -> bool:
        return True


def test_a_terminal_gets_tqdm_anything_else_lines() -> None:
    assert is_terminal(Terminal()) and not is_terminal(io.StringIO())
    drawn = progress(total=3, file=Terminal())
    try:
        assert isinstance(drawn, tqdm)
    finally:
        drawn.close()
    assert isinstance(progress(total=3, file=io.StringIO()), LineProgress)


def test_lines_count_each_step_with_its_label_and_no_carriage_return() -> None:
    out = io.StringIO()
    with progress(total=3, desc="work", file=out) as bar:
        for label in ("a", "b", "c"):
            bar.set_postfix_str(label)
            bar.update(1)
    text = out.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    assert [line.split(" (")[0] for line in lines] == ["work: 1/3 a", "work: 2/3 b", "work: 3/3 c"]


def test_a_long_bar_writes_a_line_per_tenth_and_the_last() -> None:
    out = io.StringIO()
    items = list(progress(range(103), desc="Loading weights", file=out))
    assert items == list(range(103))
    counts = [line.split(": ")[1].split(" ")[0] for line in out.getvalue().splitlines()]
    assert counts == [f"{n}/103" for n in (*range(10, 101, 10), 103)]
    assert len(counts) == MAX_LINES + 1 and "\r" not in out.getvalue()


def test_closing_writes_a_count_no_line_has_shown() -> None:
    out = io.StringIO()
    bar = LineProgress(total=1000, desc="partial", file=out)
    bar.update(5)
    assert out.getvalue() == ""
    bar.close()
    bar.close()
    assert [line.split(" (")[0] for line in out.getvalue().splitlines()] == ["partial: 5/1000"]


def test_library_bars_become_lines_inside_and_are_restored_after() -> None:
    from transformers import modeling_gguf_pytorch_utils as gguf_loading
    from transformers.utils import logging as hf_logging

    out = io.StringIO()
    gguf_tqdm = gguf_loading.tqdm
    with library_bars(file=out):
        assert list(hf_logging.tqdm(range(4), desc="Loading weights")) == [0, 1, 2, 3]
        assert list(gguf_loading.tqdm(range(2), desc="Converting")) == [0, 1]
    assert gguf_loading.tqdm is gguf_tqdm
    lines = [line.split(" (")[0] for line in out.getvalue().splitlines()]
    assert lines == [*(f"Loading weights: {n}/4" for n in range(1, 5)), "Converting: 1/2", "Converting: 2/2"]
    assert "\r" not in out.getvalue()
