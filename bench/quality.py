"""The benchmarks' quality figures: ``aiserve eval``'s report (suite/evaluate.py) of a candidate
against its reference, on every core this process may use (nothing else runs while a benchmark
evaluates, and the figures do not depend on the thread count), with each reference run once per
process: the quantization bench's two schemes and the KV cache bench's int8 cache are all
measured against the same base version, whose run took ~17 s of every evaluation on one thread."""

from __future__ import annotations

import os
from typing import Any

from aiserve.store import ModelRef, ModelStore
from suite.evaluate import ReferenceRuns, evaluate

REFERENCES: ReferenceRuns = {}


def evaluate_version(store: ModelStore, ref: ModelRef, kv_dtype: str = "auto") -> dict[str, Any]:
    """``ref`` against its default reference (a quantized version's base; with ``kv_dtype``
    int8, its own version on the model's dtype), with the default bounds."""
    return evaluate(store, ref, None, None, threads=len(os.sched_getaffinity(0)), kv_dtype=kv_dtype,
                    references=REFERENCES)
