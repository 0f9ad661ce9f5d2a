"""Benchmarks: each prints ratios measured in one run (see docs/benchmarks.md)."""
