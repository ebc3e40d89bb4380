"""Benchmarks: run each as a module from the repository root (``python -m benchmarks.NAME``, ``benchmarks.gpu.NAME``
on the device through ``benchmarks/gpu/on_device.sh``); what they share is ``benchmarks.harness``."""
