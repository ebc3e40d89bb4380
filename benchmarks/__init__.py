"""Benchmarks: ``python -m benchmarks NAME [--smoke]`` from the repository root (``benchmarks/__main__.py``; on the
device through ``benchmarks/gpu/on_device.sh``). What they stand up comes from ``harness`` (as the tests' does), what
they share beside it from ``benchmarks.common``, and each writes one result through ``benchmarks.report``."""
