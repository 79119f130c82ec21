"""The engine benchmark's report: the ratios against the baselines, and the plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def add_ratios(a: dict[str, Any], b: dict[str, Any], c: dict[str, Any]) -> None:
    """Each part's ratios against its baselines (and the gateway's cost), in place."""
    a["ratio_gateway_vs_hf_static"] = a["gateway"]["tokens_per_s"] / a["hf_static"]["tokens_per_s"]
    a["ratio_gateway_vs_hf_sequential"] = a["gateway"]["tokens_per_s"] / a["hf_sequential"]["tokens_per_s"]
    a["ratio_direct_vs_hf_static"] = a["direct"]["tokens_per_s"] / a["hf_static"]["tokens_per_s"]
    a["ratio_direct_vs_hf_sequential"] = a["direct"]["tokens_per_s"] / a["hf_sequential"]["tokens_per_s"]
    a["gateway_cost"] = 1 - a["gateway"]["tokens_per_s"] / a["direct"]["tokens_per_s"]
    b["ratio_gateway_vs_hf"] = b["gateway"]["tokens_per_s"] / b["hf"]["tokens_per_s"]
    b["ratio_direct_vs_hf"] = b["direct"]["tokens_per_s"] / b["hf"]["tokens_per_s"]
    c["ratio_gateway_vs_hf_static"] = c["gateway"]["tokens_per_s"] / c["hf_static"]["tokens_per_s"]
    off = c["no_speculation"]
    off["ratio_gateway_vs_hf_static"] = off["gateway"]["tokens_per_s"] / c["hf_static"]["tokens_per_s"]


def plot(report: dict[str, Any], path: Path) -> None:
    """Throughput of (a) and (c) against their baselines, and the sweep's curve with its knee."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    a = report["a_64_concurrent"]
    names = ["HF sequential", "HF static 64", "engine direct", "engine via gateway"]
    values = [a["hf_sequential"]["tokens_per_s"], a["hf_static"]["tokens_per_s"], a["direct"]["tokens_per_s"],
              a["gateway"]["tokens_per_s"]]
    axes[0].bar(names, values, color=["grey", "grey", "tab:blue", "tab:orange"])
    axes[0].set(title=f"(a) 64 concurrent x 64 tokens, HF in {report['hf_dtype']}", ylabel="useful tokens/s")
    axes[0].tick_params(axis="x", rotation=20)
    c = report["c_mixed"]
    off = c["no_speculation"]
    labels = ["HF static", "via gateway", "via gateway,\nno spec."]
    axes[1].bar(labels, [c["hf_static"]["tokens_per_s"], c["gateway"]["tokens_per_s"], off["gateway"]["tokens_per_s"]],
                color=["grey", "tab:orange", "navajowhite"])
    axes[1].set(title=f"(c) mixed, concurrency {c['concurrency']}", ylabel="useful tokens/s")
    pts = report["d_sweep"]["points"]
    sizes = [p["max_num_seqs"] for p in pts]
    axes[2].plot(sizes, [p["tokens_per_s"] for p in pts], "o-", label="tokens/s")
    axes[2].set(title="(d) batch-size sweep", xlabel="max_num_seqs", ylabel="tokens/s", xscale="log", xticks=sizes)
    axes[2].set_xticklabels([str(s) for s in sizes])
    twin = axes[2].twinx()
    twin.plot(sizes, [p["time_per_token"]["p50_ms"] for p in pts], "s--", color="tab:red", label="p50 ms per token")
    twin.plot(sizes, [p["time_per_token"]["p99_ms"] for p in pts], "^:", color="tab:red", label="p99 ms per token")
    twin.set_ylabel("ms")
    axes[2].axvline(report["d_sweep"]["knee"], color="k", linestyle=":", label="knee")
    axes[2].legend(loc="upper left")
    twin.legend(loc="lower right")
    fig.suptitle(f"{report['machine']['cpu']}, {report['machine']['cores']} cores, torch {report['machine']['torch']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
