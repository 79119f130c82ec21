"""Our decode-attention kernel for the CPU (``csrc/decode_attention.cpp``): how it is built, where
it lives, and when the forward uses it instead of ``scaled_dot_product_attention``.

At 64 decoding sequences, torch's CPU SDPA over the step's decode rows took ~22% of the step
(0.8-0.9 ms a layer for 64 slots x 3 KV heads x 3 queries of 64 values, bf16): its flash kernel
sets up a tiny problem per (slot, head). The kernel reads each slot's own keys (no mask, no
padding to the longest) in float32 arithmetic, 3x faster at the same results within bf16
rounding (docs/engine.md, "Decode attention"; decision 72).

It is C++ compiled against the installed torch with the system's C++ compiler (``g++`` or
``$CXX``), for AVX2 + FMA, which both CPU kinds we serve on have (an AVX-512 build measured
slower). Building is an install step: ``make`` runs ``python -m services.inference.decode_attention``
after installing the dependencies, the Dockerfile does the same. The library goes into the
virtual environment (``<sys.prefix>/lib/aiserve-kernels/``) under a name hashed from the source,
the compiler flags and the torch version, so a changed source or a new torch needs a new build
and never loads a stale one. A service finds it there at start; where it is missing (no
compiler, not built) the forward keeps SDPA and says so in its start log and ``Info``.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from aiserve.common.config import ConfigError

SOURCE = Path(__file__).resolve().parent / "csrc" / "decode_attention.cpp"
FLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC", "-std=c++20")
NEEDS_CPU_FLAGS = frozenset({"avx2", "fma"})
KERNEL, SDPA = "kernel", "sdpa"
"""Values of the ``decode_attention`` setting besides "auto" (config.ATTENTION_CHOICES): "auto" =
the kernel where it is built and the model runs on a CPU with AVX2 + FMA, else SDPA; "kernel" =
the kernel or refuse to start; "sdpa" = torch's."""


def library_path() -> Path:
    """Where the built kernel for this source, these flags and this torch lives."""
    digest = hashlib.sha256(SOURCE.read_bytes())
    digest.update(" ".join(FLAGS).encode())
    digest.update(torch.__version__.encode())
    return Path(sys.prefix) / "lib" / "aiserve-kernels" / f"decode_attention-{digest.hexdigest()[:16]}.so"


def compiler() -> str | None:
    """The C++ compiler: ``$CXX``, else ``g++`` on the PATH (None when there is neither)."""
    return os.environ.get("CXX") or shutil.which("g++")


def build(path: Path | None = None) -> Path:
    """Compile the kernel into ``path`` (default ``library_path()``) unless it is there already.
    Written to a temporary file and renamed, so processes building at once never load half a file.
    Raises RuntimeError without a compiler or when the compiler fails (its output in the message)."""
    from torch.utils import cpp_extension  # noqa: PLC0415 (only the build needs it)

    path = path or library_path()
    if path.exists():
        return path
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("decode_attention: no C++ compiler (set CXX or install g++)")
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as scratch:
        out = Path(scratch) / path.name
        command = [cxx, *FLAGS, str(SOURCE), "-o", str(out),
                   f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
                   *[f"-I{p}" for p in cpp_extension.include_paths()],
                   *[f"-L{p}" for p in cpp_extension.library_paths()], "-lc10", "-ltorch_cpu"]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"decode_attention: {cxx} exited with {done.returncode}:\n{done.stderr[-4000:]}")
        os.replace(out, path)
    return path


_loaded: list[Path] = []


def load() -> bool:
    """Load the built kernel into torch (``torch.ops.aiserve.decode_attention``) if it is built;
    False when it is not. Loading twice is a no-op."""
    if _loaded:
        return True
    path = library_path()
    if not path.exists():
        return False
    torch.ops.load_library(str(path))
    _loaded.append(path)
    return True


def choose(setting: str, device: torch.device, cpu_flags: frozenset[str]) -> tuple[bool, str]:
    """Whether the forward uses the kernel, and why (one line for the start log and ``Info``).
    Raises ConfigError when ``setting`` is "kernel" and the kernel cannot run here."""
    if setting == SDPA:
        return False, "sdpa: decode_attention=sdpa set"
    if device.type != "cpu":
        reason = f"the model runs on {device.type}"
    elif not NEEDS_CPU_FLAGS <= cpu_flags:
        reason = f"this CPU lacks {' and '.join(sorted(NEEDS_CPU_FLAGS - cpu_flags))}"
    elif not load():
        reason = f"the kernel is not built ({library_path().name}; python -m services.inference.decode_attention)"
    else:
        return True, "kernel: built for avx2+fma, CPU has them"
    if setting == KERNEL:
        raise ConfigError(f"decode_attention: kernel asked for, but {reason}")
    return False, f"sdpa: {reason}"


def main() -> int:
    """Build the kernel (the install step); prints where it is."""
    try:
        print(build())
    except RuntimeError as exc:
        print(exc, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
