"""What kind of CPU this is, from its flags: the one reading of /proc/cpuinfo that the services'
choices of precision rest on (the inference service's weights and products, the cache's
embedding model). Pure Python: no torch."""

from __future__ import annotations

from collections.abc import Set
from pathlib import Path

CPU_KINDS: tuple[tuple[str, str], ...] = (
    ("amx", "amx_bf16"),  # Intel Xeon from Sapphire Rapids: bf16 tile products
    ("avx512_bf16", "avx512_bf16"),  # bf16 dot products: Cooper Lake, AMD Zen 4 and later
    ("avx512", "avx512f"),
    ("avx2", "avx2"),
)
"""CPU kinds by the flag that makes each, most capable first: a CPU is the first it has the flag
of ("other" when none)."""


def machine_kind(device: str, cpu_flags: Set[str]) -> str:
    """"cuda" for a CUDA device, else the first of ``CPU_KINDS`` whose flag the CPU has, or "other"."""
    if device.startswith("cuda"):
        return "cuda"
    return next((kind for kind, flag in CPU_KINDS if flag in cpu_flags), "other")


def read_cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The CPU's flags from the first "flags" line of ``cpuinfo`` (empty where there is none,
    as on ARM, or the file cannot be read)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name.strip() == "flags":
            return frozenset(value.split())
    return frozenset()
