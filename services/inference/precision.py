"""Which precision the inference service runs in: chosen by the machine unless a setting says.

``choose_precision`` is the one place the choice is made: a pure function of the device, the
CPU's flags and the two settings (``dtype``, ``matmul_dtype``: a dtype name or "auto").
``aiserve.common.cpu`` reads the flags and names the kind of CPU, apart, so tests inject them. "auto"
follows ``POLICY``, a table by kind of machine (docs/engine.md, "Precision chosen by the
machine"; decision 51); an explicit setting always wins. Pure Python: no torch.
"""

from __future__ import annotations

from collections.abc import Set
from dataclasses import dataclass

from aiserve.common.cpu import CPU_KINDS, machine_kind

AUTO = "auto"
DTYPES = ("bfloat16", "float32", "float16")
"""The dtype names a setting may give besides "auto" (model.TORCH_DTYPES maps them to torch)."""
_SIXTEEN_BIT = ("bfloat16", "float16")

@dataclass(frozen=True, slots=True)
class Rule:
    """What "auto" means on one kind of machine."""

    weights: str
    """dtype of the weights, the activations and the KV cache."""
    wide_matmul: bool
    """16-bit models run their larger products on float32 copies of the weights."""
    why: str
    """The reason, for the start-up log and Info."""
    draft_step_tokens: int = 8
    """``speculative_max_step_tokens`` of "auto": how full a step drafts may make it. 32 where a
    32-row step costs about what one row costs (the weights' read bounds it); 8 where the
    products are compute-bound by 16 rows (drafts at 16 concurrent streams cost 8% of the
    throughput on the avx512_bf16 EPYC)."""


_EMULATED = "no bf16 instructions: bf16 products are emulated (4-6x slower at 64 rows), so float32 copies"
POLICY: dict[str, Rule] = {
    "cuda": Rule("bfloat16", False, "bf16 tensor cores; half the bytes of float32 read per token", 32),
    "amx": Rule("bfloat16", False, "bf16 tile instructions: oneDNN-packed bf16 products, half the bytes read", 32),
    "avx512_bf16": Rule("bfloat16", False, "bf16 dot-product instructions: oneDNN-packed bf16 products"),
    "avx512": Rule("bfloat16", True, _EMULATED),
    "avx2": Rule("bfloat16", True, _EMULATED),
    "other": Rule("bfloat16", True, _EMULATED),
}
"""The policy of "auto", by machine kind (one row each; measurements refine it)."""


@dataclass(frozen=True, slots=True)
class Precision:
    """The dtypes the service runs in, the machine they were chosen for, and why."""

    weights: str
    """dtype name of the weights and activations ("bfloat16", "float32", "float16")."""
    matmul: str
    """dtype name of the larger matrix products (float32: copies of 16-bit weights)."""
    kv: str
    """dtype name of the KV cache: the activations' (the forward writes them into it)."""
    cpu: str
    """Kind of machine: "cuda", or the CPU's: "amx", "avx512_bf16", "avx512", "avx2", "other"."""
    cpu_flags: tuple[str, ...]
    """The flags of ``aiserve.common.cpu.CPU_KINDS`` this CPU has (none on CUDA: the choice rests on none)."""
    reason: str
    """One line: why these dtypes."""
    native_ops: str = "off"
    """Whether the forward runs our CPU ops ("on") or torch's ("off"): ``native_ops.py``."""
    native_ops_reason: str = ""
    """One line: why."""
    draft_step_tokens: int = 8
    """What "auto" (-1) means for ``speculative_max_step_tokens`` on this machine (``Rule``)."""


def choose_precision(device: str, cpu_flags: Set[str], dtype: str, matmul_dtype: str) -> Precision:
    """The precision to run in on ``device`` with these CPU flags, given the settings ``dtype``
    and ``matmul_dtype`` (each a dtype name, which wins, or "auto": ``POLICY``'s row)."""
    kind = machine_kind(device, cpu_flags)
    rule = POLICY[kind]
    weights = rule.weights if dtype == AUTO else dtype
    if matmul_dtype != AUTO:
        matmul = matmul_dtype
    elif rule.wide_matmul and weights in _SIXTEEN_BIT:
        matmul = "float32"
    else:
        matmul = weights
    explicit = [f"{name}={value}" for name, value in (("dtype", dtype), ("matmul_dtype", matmul_dtype))
                if value != AUTO]
    reason = f"{kind}: {rule.why}" + (f" ({', '.join(explicit)} set)" if explicit else "")
    flags = () if kind == "cuda" else tuple(flag for _, flag in CPU_KINDS if flag in cpu_flags)
    return Precision(weights, matmul, weights, kind, flags, reason, draft_step_tokens=rule.draft_step_tokens)
