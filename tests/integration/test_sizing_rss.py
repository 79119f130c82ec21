"""``aiserve size``'s resident estimate (aiserve/sizing.py) against a real inference service.

The service is started alone with known settings (float32, a batch of ``max_num_seqs`` slots of
``max_seq_len`` tokens), warmed up as it always is before SERVING, and asked for its resident
memory (Stats.rss_bytes, /proc/self/statm); the estimate with the same settings must be within
15% of it, in float32 and in bfloat16 (on a CPU with bf16 instructions the service also keeps
oneDNN-packed copies of the weights and their kernels, which the estimate then counts), and in
bfloat16 capped to AVX2, where the service multiplies packed float32 copies of the weights.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from grpc import aio

from aiserve.common.cpu import read_cpu_flags
from aiserve.sizing import RUNTIME_BYTES, estimate, keeps_float32_copies, packs_weights, shape_of
from aiserve.store import ModelRef, ModelStore
from aiserve.v1 import inference_pb2, inference_pb2_grpc
from suite.runner import Suite
from tests.integration.conftest import config_for_tests

pytestmark = pytest.mark.integration

TOLERANCE = 0.15
RPC_S = 30.0
ROOT = Path(__file__).resolve().parents[2]


def off_by(estimated: int, measured: int) -> float:
    return abs(estimated - measured) / measured


def test_the_runtime_term_is_the_measured_baseline_of_the_service_process() -> None:
    """RUNTIME_BYTES against a process that imports what the inference service imports."""
    code = ("import os; import services.inference.server; "
            "print(int(open('/proc/self/statm').read().split()[1]) * os.sysconf('SC_PAGE_SIZE'))")
    env = {**os.environ, "GOMP_SPINCOUNT": "20000"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120, check=True).stdout
    measured = int(out.split()[-1])
    assert off_by(RUNTIME_BYTES, measured) <= TOLERANCE, f"runtime {measured / 2**20:.0f} MiB measured"


AVX2_CAP = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
"""The instruction-set cap that makes any AVX2 CPU an AVX2-only one to the service's kernels
(aiserve/common/cpu.py): a bfloat16 model then multiplies float32 copies of its weights."""


@pytest.mark.parametrize(("dtype", "max_num_seqs", "max_seq_len", "cap"),
                         [("float32", 1, 256, {}), ("float32", 16, 1024, {}), ("bfloat16", 4, 512, {}),
                          ("bfloat16", 16, 1024, {}), ("bfloat16", 16, 1024, AVX2_CAP)],
                         ids=["float32-1x256", "float32-16x1024", "bfloat16-4x512", "bfloat16-16x1024",
                              "bfloat16-16x1024-capped-to-avx2"])
async def test_the_estimate_is_within_15_percent_of_the_services_rss(
        tmp_path: Path, store: ModelStore, model_ref: ModelRef, dtype: str, max_num_seqs: int,
        max_seq_len: int, cap: dict[str, str]) -> None:
    if cap and "avx2" not in read_cpu_flags(environ={}):
        pytest.skip("the AVX2 cap needs a CPU with AVX2")
    config = config_for_tests(tmp_path / "home", store.root)
    config.extra_env.update({
        "AISERVE_INFERENCE_DTYPE": dtype,
        "AISERVE_INFERENCE_MAX_NUM_SEQS": str(max_num_seqs),
        "AISERVE_INFERENCE_MAX_SEQ_LEN": str(max_seq_len),
        **cap,
    })
    side = Suite(config)
    side.start_service("inference")
    try:
        await side.wait_serving(("inference",), timeout_s=300)
        async with aio.insecure_channel(config.address("inference")) as channel:
            stats = await inference_pb2_grpc.InferenceStub(channel).Stats(inference_pb2.InferenceStatsRequest(),
                                                                          timeout=RPC_S)
    finally:
        side.stop()
    # Packed, and with float32 copies, as the service does on this CPU under the service's cap (if any).
    flags = read_cpu_flags(environ={**os.environ, **cap})
    sized = estimate(shape_of(store.path(model_ref)), dtype, max_seq_len, max_num_seqs,
                     packed=packs_weights(dtype, flags), wide=keeps_float32_copies(dtype, flags))
    assert keeps_float32_copies(dtype, flags) or not cap  # capped, the service keeps float32 copies
    # The KV term is exact arithmetic: the service's cache is the estimate's slots + prefix store.
    assert off_by(sized.kv_cache, stats.kv_total_bytes) < 0.01
    assert off_by(sized.resident, stats.rss_bytes) <= TOLERANCE, (
        f"estimated {sized.resident / 2**20:.0f} MiB, measured {stats.rss_bytes / 2**20:.0f} MiB")
