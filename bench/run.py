"""`make bench`: the engine benchmark (bench/engine_bench.py); the cache one is bench.cache_bench."""

from bench.engine_bench import main

if __name__ == "__main__":
    raise SystemExit(main())
