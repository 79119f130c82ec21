"""The CPU's flags as the kernels may use them: an instruction-set cap in the environment
(``ONEDNN_MAX_CPU_ISA``, ``ATEN_CPU_CAPABILITY``) drops the flags above it, so the machine's
choices follow the cap (cpuinfo and environment injected)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from aiserve.common.cpu import caps_note, isa_caps, machine_kind, read_cpu_flags
from services.cache.precision import choose_dtype
from services.inference import native_ops
from services.inference.config import InferenceConfig
from services.inference.engine_build import machine_precision
from services.inference.precision import choose_precision

AMX_XEON = "fpu sse4_2 avx avx2 fma f16c avx512f avx512bw avx512_bf16 avx512_fp16 avx512_vnni amx_bf16 amx_tile"
ZEN4_EPYC = "fpu sse4_2 avx avx2 fma avx512f avx512bw avx512_bf16 avx512_vnni sha_ni"


def cpuinfo(tmp_path: Path, flags: str) -> Path:
    path = tmp_path / "cpuinfo"
    path.write_text(f"processor\t: 0\nmodel name\t: test\nflags\t\t: {flags}\n")
    return path


@pytest.mark.parametrize(("flags", "environ", "kind", "kept", "dropped"), [
    # capped to AVX2: an AVX-512 machine is an AVX2 one (bf16 products emulated: float32 copies)
    (ZEN4_EPYC, {"ONEDNN_MAX_CPU_ISA": "AVX2"}, "avx2", {"avx2", "fma", "sha_ni"}, {"avx512f", "avx512_bf16"}),
    (ZEN4_EPYC, {"ONEDNN_MAX_CPU_ISA": "avx2"}, "avx2", {"avx2"}, {"avx512f"}),  # oneDNN takes any case
    (ZEN4_EPYC, {"DNNL_MAX_CPU_ISA": "AVX2_VNNI"}, "avx2", {"avx2"}, {"avx512_vnni"}),
    (AMX_XEON, {"ATEN_CPU_CAPABILITY": "avx2"}, "avx2", {"avx2", "f16c"}, {"amx_bf16", "amx_tile", "avx512_fp16"}),
    # capped below bf16: AVX-512 without bf16 instructions
    (AMX_XEON, {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI"}, "avx512", {"avx512f", "avx512_vnni"},
     {"avx512_bf16", "avx512_fp16", "amx_bf16"}),
    # capped below AMX: the bf16 dot products stay
    (AMX_XEON, {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}, "avx512_bf16", {"avx512_bf16"}, {"amx_bf16"}),
    # no vector instructions at all
    (ZEN4_EPYC, {"ATEN_CPU_CAPABILITY": "default"}, "other", {"sse4_2", "avx"}, {"avx2", "avx512f"}),
    # the lower of two caps wins
    (AMX_XEON, {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16", "ATEN_CPU_CAPABILITY": "avx2"}, "avx2", {"avx2"},
     {"avx512f", "amx_bf16"}),
])
def test_a_cap_drops_the_flags_above_it(tmp_path: Path, flags: str, environ: dict[str, str], kind: str,
                                        kept: set[str], dropped: set[str]) -> None:
    read = read_cpu_flags(cpuinfo(tmp_path, flags), environ)
    assert kept <= read and not dropped & read
    assert machine_kind("cpu", read) == kind
    assert isa_caps(environ) and all(f"{name}={value}" in caps_note(environ) for name, value in environ.items())


@pytest.mark.parametrize("environ", [{}, {"ONEDNN_MAX_CPU_ISA": "ALL"}, {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_AMX"},
                                     {"ATEN_CPU_CAPABILITY": "avx512"}, {"ONEDNN_MAX_CPU_ISA": "no-such-isa"}])
def test_no_cap_or_one_above_the_cpu_leaves_every_flag(tmp_path: Path, environ: dict[str, str]) -> None:
    assert read_cpu_flags(cpuinfo(tmp_path, AMX_XEON), environ) == frozenset(AMX_XEON.split())
    assert isa_caps(environ) == () and caps_note(environ) == ""


def test_capped_to_avx2_the_choices_are_an_avx2_machines(tmp_path: Path) -> None:
    """What a capped AVX-512 bf16 machine chooses: float32 products for the model, a float32
    embedding, and our AVX2 ops still on."""
    flags = read_cpu_flags(cpuinfo(tmp_path, ZEN4_EPYC), {"ONEDNN_MAX_CPU_ISA": "AVX2"})
    p = choose_precision("cpu", flags, "auto", "auto")
    assert (p.cpu, p.matmul, p.cpu_flags) == ("avx2", "float32", ("avx2",))
    assert choose_dtype("cpu", flags, "auto")[0] == "float32"
    assert native_ops.choose("auto", torch.device("cpu"), p.weights, flags)[0] is native_ops.library_path().exists()
    no_vectors = read_cpu_flags(cpuinfo(tmp_path, ZEN4_EPYC), {"ATEN_CPU_CAPABILITY": "default"})
    assert native_ops.choose("auto", torch.device("cpu"), p.weights, no_vectors)[0] is False


def test_the_service_reads_the_cap_from_its_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """The inference service's choice on this machine, capped to AVX2 by its environment: no
    AVX-512 flag in what it reports, and the reason names the cap."""
    if "avx2" not in read_cpu_flags():
        pytest.skip("this CPU has no AVX2: an AVX2 cap hides nothing on it")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    p = machine_precision(InferenceConfig())
    assert p.cpu == "avx2" and p.matmul == "float32" and not any(f.startswith("avx512") for f in p.cpu_flags)
    assert p.reason.endswith("(instruction set capped: ONEDNN_MAX_CPU_ISA=AVX2)")
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    assert "capped" not in machine_precision(InferenceConfig()).reason
