"""A dump's writer stats (`sglang_patch.contract.DumpMeta.writer`) reach the worker's writer series."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY

from worker.metrics import WorkerMetrics


def value(name: str, **labels: str) -> float | None:
    return REGISTRY.get_sample_value(name, {"worker": "writer-stats", **labels})


def test_a_gpu_servers_dump_stats_fill_every_writer_series() -> None:
    metrics = WorkerMetrics("writer-stats")
    gpu_dump = {"wait_s": 0.25, "queued": 3, "pinned_bytes": 1 << 30, "pinned_cap_bytes": 4 << 30, "threads": 4,
                "pinned_held_bytes": 6 << 30, "pinned_alloc_s": 1.5, "ready_s": 0.01, "write_s": 0.2}  # fmt: skip
    metrics.observe_writer(gpu_dump)
    metrics.observe_writer({**gpu_dump, "wait_s": 0.5, "write_s": 0.3, "pinned_held_bytes": 5 << 30})
    assert value("layertap_writer_wait_seconds_total") == pytest.approx(0.75)
    assert value("layertap_writer_busy_seconds_total", phase="write") == pytest.approx(0.5)
    assert value("layertap_writer_busy_seconds_total", phase="copy_wait") == pytest.approx(0.02)
    assert value("layertap_writer_threads") == 4 and value("layertap_writer_queued_dumps") == 3
    assert value("layertap_writer_pinned_held_bytes") == 5 << 30  # the last dump's view
    # A CPU server's dump has no allocator stats: the gauge keeps its last GPU value, nothing fails.
    metrics.observe_writer({"wait_s": 0.0, "threads": 4})
    assert value("layertap_writer_pinned_held_bytes") == 5 << 30
