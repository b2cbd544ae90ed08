"""Benchmark harness: prompt sets (``bench.datasets``) and the side-by-side mode runner."""
