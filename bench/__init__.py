"""Benchmarks (docs/architecture.md, "Benchmarks"): each writes JSON and a PNG under bench/results/."""
