"""Our CPU ops for the forward (``csrc/*.cpp``): how they are built, where they live, and when the
forward uses them instead of torch's.

- ``torch.ops.aiserve.decode_attention`` (``csrc/decode_attention.cpp``): the decode rows'
  attention. At 64 decoding sequences torch's CPU SDPA took ~22% of the step (0.8-0.9 ms a layer
  for 64 slots x 3 KV heads x 3 queries of 64 values, bf16): its flash kernel sets up a tiny
  problem per (slot, head). Ours reads each slot's own keys (no mask, no padding to the longest)
  in float32 arithmetic, ~3x faster with the same results within float rounding.
- ``torch.ops.aiserve.rms_norm`` (with the residual add before it) and ``rotate_`` (the rotary
  embedding, in place) (``csrc/fused_ops.cpp``): one pass per row instead of 5-8 torch ops,
  bit-identical in bf16.
- ``torch.ops.aiserve.decode_layers`` (``csrc/decode_layers.cpp``): a decode-only step's whole
  loop over layers in one call, the same ops in the same order without the Python between them
  (``LlamaModel.layers_in_cpp``); the Python loop's bits.
- ``torch.ops.aiserve.gemv`` (``csrc/gemv.cpp``): products of one to four rows on the weight in
  its loaded layout, each thread streaming one run of its rows with a prefetch ahead: a step of
  one sequence reads its weights ~1.4x faster than oneDNN's kernel did (``Linear.gemv``).
- ``torch.ops.aiserve.argmax_rows`` (``csrc/fused_ops.cpp``): greedy rows' ids (the sampler's
  ``_argmax``), the indices ``torch.max(x, -1)`` gives; 1.34 -> 0.50 ms on [64, 49152] bf16
  logits (2 cores).

They are C++ compiled against the installed torch with the system's C++ compiler (``g++`` or
``$CXX``) for AVX2 + FMA, which both CPU kinds we serve on have (an AVX-512 build of the attention
measured slower). Building is an install step: ``make`` runs ``python -m
services.inference.native_ops`` after installing the dependencies, the Dockerfile does the same.
The library goes into the virtual environment (``<sys.prefix>/lib/aiserve-kernels/``) under a
name hashed from the sources, the compiler flags and the torch version, so a changed source or a
new torch needs a new build and never loads a stale one. A service finds it there at start; where
it is missing (no compiler, not built) the forward keeps torch's ops and says so in its start log
and ``Info`` (docs/engine.md, "Our CPU ops"; decision 72).
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

SOURCES = tuple(sorted((Path(__file__).resolve().parent / "csrc").glob("*.cpp")))
HEADERS = tuple(sorted((Path(__file__).resolve().parent / "csrc").glob("*.h")))
FLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC", "-std=c++20")
NEEDS_CPU_FLAGS = frozenset({"avx2", "fma"})
ON, OFF = "on", "off"
"""Values of the ``native_ops`` setting besides "auto" (config.NATIVE_OPS_CHOICES): "auto" = ours
where they are built and the model runs on a CPU with AVX2 + FMA in bfloat16 or float32, else
torch's; "on" = ours or refuse to start; "off" = torch's."""


def library_path(sources: tuple[Path, ...] | None = None) -> Path:
    """Where the library built from ``sources`` (default ``SOURCES`` and ``HEADERS``), these flags
    and this torch lives."""
    digest = hashlib.sha256()
    for source in sources or SOURCES + HEADERS:
        digest.update(source.name.encode() + b"\0" + source.read_bytes())
    digest.update(" ".join(FLAGS).encode())
    digest.update(torch.__version__.encode())
    return Path(sys.prefix) / "lib" / "aiserve-kernels" / f"aiserve_ops-{digest.hexdigest()[:16]}.so"


def compiler() -> str | None:
    """The C++ compiler: ``$CXX``, else ``g++`` on the PATH (None when there is neither)."""
    return os.environ.get("CXX") or shutil.which("g++")


def build(path: Path | None = None) -> Path:
    """Compile the library into ``path`` (default ``library_path()``) unless it is there already.
    Written to a temporary file and renamed, so processes building at once never load half a file.
    Raises RuntimeError without a compiler or when the compiler fails (its output in the message)."""
    from torch.utils import cpp_extension  # noqa: PLC0415 (only the build needs it)

    path = path or library_path()
    if path.exists():
        return path
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("native_ops: no C++ compiler (set CXX or install g++)")
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as scratch:
        out = Path(scratch) / path.name
        command = [cxx, *FLAGS, *map(str, SOURCES), "-o", str(out),
                   f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
                   *[f"-I{p}" for p in cpp_extension.include_paths()],
                   *[f"-L{p}" for p in cpp_extension.library_paths()], "-lc10", "-ltorch_cpu"]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"native_ops: {cxx} exited with {done.returncode}:\n{done.stderr[-4000:]}")
        os.replace(out, path)
    return path


_loaded: list[Path] = []


def load() -> bool:
    """Load the built library into torch (``torch.ops.aiserve.*``) if it is built; False when it
    is not. Loading twice is a no-op."""
    if _loaded:
        return True
    path = library_path()
    if not path.exists():
        return False
    torch.ops.load_library(str(path))
    _loaded.append(path)
    return True


def loaded() -> bool:
    """Whether the library is loaded into this process (``torch.ops.aiserve.*`` exist)."""
    return bool(_loaded)


RUN_DTYPES = ("bfloat16", "float32")
"""The activation dtypes the ops are written for."""


def unsupported(device: torch.device, dtype: str) -> str | None:
    """Why the ops cannot run a model on ``device`` whose activations are ``dtype`` (a dtype
    name), or None when they can. The one check both ``choose`` and the model apply
    (services/inference/llama.py)."""
    if device.type != "cpu":
        return f"the model runs on {device.type}"
    if dtype not in RUN_DTYPES:
        return f"they run {' and '.join(RUN_DTYPES)}, not {dtype}"
    return None


def choose(setting: str, device: torch.device, dtype: str, cpu_flags: frozenset[str]) -> tuple[bool, str]:
    """Whether the forward uses our ops, and why (one line for the start log and ``Info``), for a
    model on ``device`` whose activations are ``dtype`` (a dtype name). Raises ConfigError when
    ``setting`` is "on" and they cannot run here."""
    if setting == OFF:
        return False, "off: native_ops=off set"
    reason = unsupported(device, dtype)
    if reason is None and not NEEDS_CPU_FLAGS <= cpu_flags:
        reason = f"this CPU lacks {' and '.join(sorted(NEEDS_CPU_FLAGS - cpu_flags))}"
    if reason is None and not load():
        reason = f"they are not built ({library_path().name}; python -m services.inference.native_ops)"
    if reason is None:
        return True, "on: built for avx2+fma, CPU has them"
    if setting == ON:
        raise ConfigError(f"native_ops: on asked for, but {reason}")
    return False, f"off: {reason}"


def main() -> int:
    """Build the library (the install step); prints where it is."""
    try:
        print(build())
    except RuntimeError as exc:
        print(exc, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
