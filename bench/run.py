"""`make bench`: the engine benchmark (bench/engine_bench.py), then the fleet one
(bench/fleet_bench.py: one vs two inference replicas, SIGKILL of a replica under load), then the
cold start (bench/cold_start.py), then the HTTP door against gRPC (bench/http_bench.py); the
cache one is bench.cache_bench."""

from bench import cold_start, engine_bench, fleet_bench, http_bench


def main() -> int:
    return engine_bench.main() or fleet_bench.main([]) or cold_start.main([]) or http_bench.main([])


if __name__ == "__main__":
    raise SystemExit(main())
