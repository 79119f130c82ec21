"""`make bench`: the engine benchmark (bench/engine_bench.py), then the fleet one
(bench/fleet_bench.py: one vs two inference replicas, SIGKILL of a replica under load), then the
cold start (bench/cold_start.py), then the HTTP door against gRPC (bench/http_bench.py), then
constrained decoding and log-probabilities against free text (bench/constrained_bench.py), then
weight quantization (bench/quant_bench.py), the int8 KV cache (bench/kv_bench.py) and the
semantic cache (bench/cache_bench.py). Ends with bench/results/report.md (bench/report.py): whatever
JSON the benchmarks left, the machine named."""

from bench import (
    cache_bench,
    cold_start,
    constrained_bench,
    engine_bench,
    fleet_bench,
    http_bench,
    kv_bench,
    quant_bench,
    report,
)


def main() -> int:
    rc = (engine_bench.main() or fleet_bench.main([]) or cold_start.main([]) or http_bench.main([])
          or constrained_bench.main([]) or quant_bench.main([]) or kv_bench.main([]) or cache_bench.main([]))
    report.main()
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
