"""The sampling sweep's data: the grid, the prompts, the figures of one output, the results file.

``aiserve sweep`` (suite/sweep_run.py) sends every prompt at every point of a grid of sampling
parameters to a running suite and keeps, per output, its text, its length in tokens and three
figures of its variety, so that a judge can compare the outputs side by side
(suite/sweep_page.py) and the presets in docs/gateway.md can point at a measured run:

- distinct-n: distinct n-grams / n-grams of the output's tokens (Li et al. 2016); 1.0 when
  nothing repeats, lower when the output loops;
- rep-3: the share of the output's 3-grams that repeat an earlier one, i.e. 1 - distinct-3
  (Welleck et al. 2019's seq-rep-n with n = 3): the loop detector.

The figures are over token ids, not words, so that a Chinese answer (no spaces) is measured
like an English one. No grpc here: this module is the data and its arithmetic.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Hashable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

DEFAULT_GRID = "temperature=0,0.3,0.7,1.0 top_p=0.9,1.0 repetition_penalty=1.0,1.1"
DEFAULT_PROMPTS = Path(__file__).parent / "data" / "sweep_prompts.json"

# The gateway's limits of each sweepable field (services/gateway/validation.py), checked here so
# that a bad grid fails before any call: (low, high, low end open).
GRID_LIMITS: dict[str, tuple[float, float, bool]] = {
    "temperature": (0.0, 2.0, False),
    "top_p": (0.0, 1.0, True),
    "repetition_penalty": (0.5, 2.0, False),
    "top_k": (0.0, 1_000_000.0, False),
}


class GridError(ValueError):
    """A grid that cannot be swept; the message names the key at fault."""


@dataclass(frozen=True, slots=True)
class GridPoint:
    """One combination of sampling parameters, in the grid's key order."""

    values: tuple[tuple[str, float], ...]

    @property
    def label(self) -> str:
        """``temperature=0.7 top_p=0.9 ...``: the point as the grid wrote it."""
        return " ".join(f"{key}={value:g}" for key, value in self.values)

    def as_dict(self) -> dict[str, float]:
        return dict(self.values)


def _parse_value(key: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise GridError(f"grid: {key}: {text!r} is not a number") from None
    low, high, low_open = GRID_LIMITS[key]
    if (value <= low if low_open else value < low) or value > high or value != value:
        raise GridError(f"grid: {key}: {text} is outside {'(' if low_open else '['}{low:g}, {high:g}]")
    if key == "top_k" and value != int(value):
        raise GridError(f"grid: top_k: {text} is not a whole number")
    return value


def parse_grid(text: str) -> list[GridPoint]:
    """``"temperature=0,0.7 top_p=0.9,1.0"`` -> the cartesian product of the values, in order.

    GridError naming the key for an unknown or repeated key, a key without values, a value
    that is not a number or is outside the gateway's limit for that field."""
    axes: dict[str, list[float]] = {}
    for term in text.split():
        key, sep, values = term.partition("=")
        if not sep:
            raise GridError(f"grid: {term!r} is not key=v1,v2,...")
        if key not in GRID_LIMITS:
            raise GridError(f"grid: unknown key {key!r}; known: {', '.join(GRID_LIMITS)}")
        if key in axes:
            raise GridError(f"grid: {key} is given twice")
        if not values or "" in values.split(","):
            raise GridError(f"grid: {key} has an empty value")
        axes[key] = [_parse_value(key, v) for v in values.split(",")]
    if not axes:
        raise GridError("grid: empty; give at least one key=v1,v2,...")
    return [GridPoint(tuple(zip(axes, combo, strict=True))) for combo in itertools.product(*axes.values())]


@dataclass(frozen=True, slots=True)
class Prompt:
    """One prompt of the sweep: an id for the page, what kind of answer it wants, its text."""

    id: str
    kind: str
    text: str


def load_prompts(path: Path) -> list[Prompt]:
    """Prompts from a JSON list of ``{"id", "kind", "text"}``, or a text file (one per line)."""
    raw = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        prompts = [Prompt(str(p["id"]), str(p.get("kind", "")), str(p["text"])) for p in json.loads(raw)]
    else:
        lines = [line.strip() for line in raw.splitlines() if line.strip()]
        prompts = [Prompt(f"p{i + 1}", "", line) for i, line in enumerate(lines)]
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    if len({p.id for p in prompts}) != len(prompts):
        raise ValueError(f"{path}: prompt ids must be unique")
    return prompts


def distinct_n(tokens: Sequence[Hashable], n: int) -> float:
    """Distinct n-grams / n-grams of ``tokens``; 0.0 when it has fewer than n tokens."""
    grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 0.0


def repetition(tokens: Sequence[Hashable], n: int = 3) -> float:
    """Share of the n-grams of ``tokens`` that repeat an earlier one (1 - distinct-n); 0.0 when
    it has fewer than n tokens."""
    return 1.0 - distinct_n(tokens, n) if len(tokens) >= n else 0.0


@dataclass(frozen=True, slots=True)
class Cell:
    """One output: a prompt at a grid point, with its figures (or the error that replaced it)."""

    prompt_id: str
    point: str
    text: str
    num_tokens: int
    distinct_1: float
    distinct_2: float
    rep_3: float
    finish_reason: str
    error: str = ""

    @classmethod
    def of(cls, prompt_id: str, point: GridPoint, text: str, token_ids: Sequence[int], finish_reason: str) -> Cell:
        """A cell with its figures computed from the output's token ids."""
        return cls(prompt_id, point.label, text, len(token_ids), round(distinct_n(token_ids, 1), 4),
                   round(distinct_n(token_ids, 2), 4), round(repetition(token_ids, 3), 4), finish_reason)


@dataclass(frozen=True, slots=True)
class SweepResults:
    """A whole sweep: how it was run, its prompts, its grid points and one cell per pair."""

    seed: int
    max_new_tokens: int
    grid: str
    prompts: list[Prompt]
    points: list[str]
    cells: list[Cell]
    model: str = ""
    meta: dict[str, str] = field(default_factory=dict)

    def cell(self, prompt_id: str, point: str) -> Cell | None:
        return next((c for c in self.cells if c.prompt_id == prompt_id and c.point == point), None)

    def to_json(self) -> str:
        return json.dumps(asdict(self), ensure_ascii=False, indent=1) + "\n"

    @classmethod
    def from_json(cls, text: str) -> SweepResults:
        raw = json.loads(text)
        return cls(seed=int(raw["seed"]), max_new_tokens=int(raw["max_new_tokens"]), grid=str(raw["grid"]),
                   prompts=[Prompt(**p) for p in raw["prompts"]], points=[str(p) for p in raw["points"]],
                   cells=[Cell(**c) for c in raw["cells"]], model=str(raw.get("model", "")),
                   meta={str(k): str(v) for k, v in raw.get("meta", {}).items()})
