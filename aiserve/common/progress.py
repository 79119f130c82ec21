"""Progress bars a person can read wherever the output goes.

On a terminal a bar is tqdm's, redrawn in place. Anywhere else (a log file, a pipe, CI) a bar is
a ``LineProgress``: one finished line per step and no carriage returns, so ``make run > run.log``
stays readable. ``library_bars`` routes the bars transformers draws while a model loads or a
GGUF file converts through the same rule; ``quiet_library_bars`` turns them off in a service,
whose log is JSON lines and which logs its own load events.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from types import TracebackType
from typing import IO, Any

from tqdm import tqdm

MAX_LINES = 10
"""A bar of more steps than this writes a line per further tenth of its total, not per step."""


def is_terminal(stream: IO[str] | None) -> bool:
    """Whether ``stream`` (default: stderr, where bars go) is an interactive terminal."""
    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


class LineProgress:
    """A progress bar for a stream that is not a terminal: one line per step, never a ``\\r``.

    It takes tqdm's arguments (those it does not use are ignored) and offers the part of
    tqdm's interface that this project and the libraries it routes use: iteration, ``update``,
    ``set_postfix_str``, ``set_description``, ``close`` and use as a context manager. A line
    reads ``<desc>: <n>/<total> <postfix> (<seconds>s)``.
    """

    def __init__(self, iterable: Iterable[Any] | None = None, desc: str | None = None,
                 total: float | None = None, file: IO[str] | None = None, unit: str = "it",
                 **_tqdm_options: Any) -> None:
        if total is None and iterable is not None and hasattr(iterable, "__len__"):
            total = len(iterable)  # type: ignore[arg-type]
        self.iterable = iterable
        self.total = int(total) if total is not None else None
        self.desc = desc or ""
        self.unit = unit
        self.file = sys.stderr if file is None else file
        self.n = 0
        self.postfix = ""
        self._written_n = 0
        self._started = time.monotonic()
        self._closed = False

    def __iter__(self) -> Iterator[Any]:
        for item in self.iterable or ():
            yield item
            self.update(1)
        self.close()

    def __enter__(self) -> LineProgress:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def update(self, n: float = 1) -> None:
        """Count ``n`` more done; write a line when that completes a step."""
        self.n += int(n)
        if self._is_step():
            self._write()

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        """Text after the count on the following lines (e.g. the name of the step done)."""
        self.postfix = s

    def set_description(self, desc: str | None = None, refresh: bool = True) -> None:
        """Text before the count on the following lines."""
        self.desc = desc or ""

    def refresh(self) -> None:
        """Nothing to redraw: lines are final."""

    def close(self) -> None:
        """Write the last count if no line has shown it yet."""
        if not self._closed and self.n > self._written_n:
            self._write()
        self._closed = True

    def _is_step(self) -> bool:
        if self.total is None or self.total <= MAX_LINES:
            return True
        tenth = max(self.total // MAX_LINES, 1)
        return self.n >= self.total or self.n // tenth > self._written_n // tenth

    def _write(self) -> None:
        count = f"{self.n}/{self.total}" if self.total is not None else f"{self.n} {self.unit}"
        postfix = f" {self.postfix}" if self.postfix else ""
        elapsed = time.monotonic() - self._started
        self.file.write(f"{self.desc + ': ' if self.desc else ''}{count}{postfix} ({elapsed:.1f}s)\n")
        self.file.flush()
        self._written_n = self.n


def progress(iterable: Iterable[Any] | None = None, *, file: IO[str] | None = None,
             **options: Any) -> tqdm[Any] | LineProgress:
    """A bar over ``iterable`` (or updated by hand): tqdm's on a terminal, lines elsewhere."""
    if is_terminal(file):
        return tqdm(iterable, file=file, **options)
    return LineProgress(iterable, file=file, **options)


@contextmanager
def library_bars(file: IO[str] | None = None) -> Iterator[None]:
    """While inside: the bars transformers draws (loading weights, converting a GGUF file)
    follow ``progress``. On a terminal nothing changes; elsewhere they write lines to ``file``."""
    if is_terminal(file):
        yield
        return
    from transformers import modeling_gguf_pytorch_utils as gguf_loading
    from transformers.utils import logging as hf_logging

    def as_lines(factory: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if factory is hf_logging.EmptyTqdm:  # bars turned off: keep them off
            return factory(*args, **kwargs)
        return LineProgress(*args, **{"file": file, **kwargs})

    previous_hook = hf_logging.set_tqdm_hook(as_lines)
    # The GGUF reader calls tqdm directly rather than through transformers' hook.
    gguf_tqdm = gguf_loading.tqdm
    gguf_loading.tqdm = lambda *args, **kwargs: LineProgress(*args, **{"file": file, **kwargs})  # type: ignore[assignment]
    try:
        yield
    finally:
        hf_logging.set_tqdm_hook(previous_hook)
        gguf_loading.tqdm = gguf_tqdm


def quiet_library_bars(stream: IO[str] | None = None) -> None:
    """Turn off Hugging Face libraries' bars when ``stream`` (default stderr) is not a terminal.

    Called before a service loads anything: the libraries read the setting when first imported.
    """
    if is_terminal(stream):
        return
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if "huggingface_hub" in sys.modules:  # already imported: tell it directly
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
