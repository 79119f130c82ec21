"""What kind of CPU this is, from its flags: the one reading of /proc/cpuinfo that the services'
choices of precision rest on (the inference service's weights and products, the cache's
embedding model). Pure Python: no torch.

The flags are the ones the kernels may use: where the environment caps the instruction set
torch's kernels run (``ONEDNN_MAX_CPU_ISA`` for oneDNN, which runs the bf16 and packed products;
``ATEN_CPU_CAPABILITY`` for ATen's vectorised ops), the flags above the cap are dropped, so the
choices follow what the products will really run on (docs/engine.md, "Capping the instruction
set"; decision 81). An AVX-512 machine capped to AVX2 chooses as an AVX2-only one does."""

from __future__ import annotations

import os
from collections.abc import Mapping, Set
from pathlib import Path

CPU_KINDS: tuple[tuple[str, str], ...] = (
    ("amx", "amx_bf16"),  # Intel Xeon from Sapphire Rapids: bf16 tile products
    ("avx512_bf16", "avx512_bf16"),  # bf16 dot products: Cooper Lake, AMD Zen 4 and later
    ("avx512", "avx512f"),
    ("avx2", "avx2"),
)
"""CPU kinds by the flag that makes each, most capable first: a CPU is the first it has the flag
of ("other" when none)."""

BF16_KINDS = ("amx", "avx512_bf16")
"""The kinds with bf16 dot-product instructions; elsewhere bf16 products are emulated."""

ISA_CAP_VARIABLES = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")
"""The environment variables that cap the instruction set torch's CPU kernels use
(``DNNL_MAX_CPU_ISA``: oneDNN's older name for the first)."""

_AVX512_UP = ("avx512", "amx")
_BF16_UP = ("avx512_bf16", "avx512_fp16", "amx")
_ONEDNN_CAPS = {
    "SSE41": ("avx", "fma", "amx"), "AVX": ("avx2", "avx512", "fma", "amx"),
    "AVX2": _AVX512_UP, "AVX2_VNNI": _AVX512_UP, "AVX2_VNNI_2": _AVX512_UP,
    "AVX512_CORE": _BF16_UP, "AVX512_CORE_VNNI": _BF16_UP,
    "AVX512_CORE_BF16": ("amx",), "AVX512_CORE_FP16": ("amx",),
}
_CAPS: dict[str, dict[str, tuple[str, ...]]] = {
    # value -> prefixes of the flags it leaves unusable; values as oneDNN and ATen spell them
    # (oneDNN: docs "CPU Dispatcher Control"; ATen: "default", "avx2", "avx512").
    "ONEDNN_MAX_CPU_ISA": _ONEDNN_CAPS, "DNNL_MAX_CPU_ISA": _ONEDNN_CAPS,
    "ATEN_CPU_CAPABILITY": {"default": ("avx2", "avx512", "amx"), "avx2": _AVX512_UP},
}


def machine_kind(device: str, cpu_flags: Set[str]) -> str:
    """"cuda" for a CUDA device, else the first of ``CPU_KINDS`` whose flag the CPU has, or "other"."""
    if device.startswith("cuda"):
        return "cuda"
    return next((kind for kind, flag in CPU_KINDS if flag in cpu_flags), "other")


def isa_caps(environ: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """The caps in force, as "NAME=value" (empty where none): the ``ISA_CAP_VARIABLES`` set to a
    value that hides some flag (``ALL``, ``avx512`` and unknown values cap nothing here)."""
    env = os.environ if environ is None else environ
    return tuple(f"{name}={env[name]}" for name in ISA_CAP_VARIABLES if _hidden_prefixes(name, env.get(name, "")))


def caps_note(environ: Mapping[str, str] | None = None) -> str:
    """" (instruction set capped: NAME=value, ...)" where ``isa_caps`` finds caps, else "": what
    the start logs and ``Info`` append to the reason for a choice resting on the flags."""
    caps = isa_caps(environ)
    return f" (instruction set capped: {', '.join(caps)})" if caps else ""


def _hidden_prefixes(name: str, value: str) -> tuple[str, ...]:
    """The prefixes of the flags that ``name`` set to ``value`` leaves unusable."""
    return _CAPS[name].get(value.lower() if name == "ATEN_CPU_CAPABILITY" else value.upper(), ())


def read_cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo"), environ: Mapping[str, str] | None = None) -> frozenset[str]:
    """The CPU's flags from the first "flags" line of ``cpuinfo`` (empty where there is none,
    as on ARM, or the file cannot be read), less those an ISA cap in ``environ`` (default: this
    process's environment) leaves unusable."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name.strip() == "flags":
            env = os.environ if environ is None else environ
            hidden = tuple(p for var in ISA_CAP_VARIABLES for p in _hidden_prefixes(var, env.get(var, "")))
            return frozenset(flag for flag in value.split() if not flag.startswith(hidden))
    return frozenset()
