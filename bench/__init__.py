"""Benchmarks (DESIGN.md §7): each writes JSON and a PNG under bench/results/."""
