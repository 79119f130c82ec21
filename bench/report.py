"""bench/results/report.md: one page gathering every benchmark's figures, with the machine named.

Each section reads its JSON from bench/results/; a section whose JSON is absent (that benchmark did
not run) says "not measured in this run" instead of failing, so benchmarks added later (the
quantization one, the HTTP one, the KV-cache one) appear as soon as they write their file. The
README's tables are taken from this page.
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Any

from aiserve.common.cpu import isa_caps, read_cpu_flags

RESULTS = Path(__file__).resolve().parent / "results"

# (title, JSON file, PNG beside it) in the order the page shows them.
SECTIONS: tuple[tuple[str, str, str], ...] = (
    ("Engine", "engine.json", "engine.png"),
    ("Semantic cache", "cache.json", "cache.png"),
    ("Weight quantization", "quant.json", "quant.png"),
    ("KV cache", "kv_cache.json", "kv_cache.png"),
    ("Replicas (fleet)", "fleet.json", "fleet.png"),
    ("Cold start", "cold_start.json", "cold_start.png"),
    ("HTTP", "http.json", "http.png"),
    ("Structured output and log-probabilities", "constrained.json", "constrained.png"),
    ("`make bench`: its own duration", "bench_duration.json", "bench_duration.png"),
)

NOT_MEASURED = "not measured in this run"


def machine() -> dict[str, str]:
    """CPU model and flags, cores and torch version of the machine the figures come from, and
    the instruction-set caps in force with the flags the kernels may use under them
    (``aiserve.common.cpu``), where there are caps."""
    model, flags = platform.processor() or "unknown", ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model in ("unknown", "", platform.machine()):
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = value.strip()
    except OSError:
        pass
    wanted = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_bf16", "amx_int8", "fma")
    try:
        import torch
        torch_version = torch.__version__
    except ImportError:
        torch_version = "absent"
    described = {
        "cpu": model,
        "flags": " ".join(f for f in wanted if f in flags.split()) or "none of interest",
        "cores": str(os.cpu_count() or 0),
        "torch": torch_version,
        "python": platform.python_version(),
    }
    if caps := isa_caps():
        usable = read_cpu_flags()
        described |= {"isa_caps": " ".join(caps),
                      "usable_flags": " ".join(f for f in wanted if f in usable) or "none of interest"}
    return described


def _rows(data: Any, prefix: str = "") -> list[tuple[str, str]]:
    """Numbers, strings and booleans of a JSON document as (dotted key, value) rows; lists are
    summarised by their length."""
    if isinstance(data, dict):
        rows: list[tuple[str, str]] = []
        for key, value in data.items():
            rows += _rows(value, f"{prefix}.{key}" if prefix else str(key))
        return rows
    if isinstance(data, list):
        return [(prefix, f"{len(data)} entries")]
    if isinstance(data, float):
        return [(prefix, f"{data:.4g}")]
    return [(prefix, str(data))]


def render(results: Path = RESULTS, host: dict[str, str] | None = None) -> str:
    """The report's Markdown for the JSON files under `results`."""
    host = host if host is not None else machine()
    lines = ["# aiserve benchmark report", "", "## Machine", ""]
    lines += [f"- {key}: {value}" for key, value in host.items()]
    for title, name, png in SECTIONS:
        lines += ["", f"## {title}", ""]
        path = results / name
        if not path.exists():
            lines.append(f"{NOT_MEASURED} (no bench/results/{name}).")
            continue
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            lines.append(f"{NOT_MEASURED} (bench/results/{name} unreadable: {exc}).")
            continue
        lines += ["| figure | value |", "|---|---|"]
        lines += [f"| {key} | {value} |" for key, value in _rows(data)]
        if (results / png).exists():
            lines += ["", f"![{title}]({png})"]
    return "\n".join(lines) + "\n"


def write(results: Path = RESULTS) -> Path:
    """Writes results/report.md and returns its path."""
    results.mkdir(parents=True, exist_ok=True)
    out = results / "report.md"
    out.write_text(render(results))
    return out


def main() -> int:
    print(f"wrote {write()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
