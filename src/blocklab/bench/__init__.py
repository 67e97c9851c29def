"""Benchmark suite: `python -m blocklab.bench [NAME ...] [--size tiny | --quick] [--out PATH]`."""
from blocklab.bench.suites import BENCHMARKS

__all__ = ["BENCHMARKS"]
