"""Which index record describes a sample's file when two writers committed it (a frozen worker whose
lease was taken over keeps going): the one whose bytes are on disk, whatever order the logs are in."""

from __future__ import annotations

from pathlib import Path

import torch

from layertap.sample import CapturedSample
from layertap.store.store import OutputStore
from layertap.verify import verify_store
from tests.core.store.test_adopt import H, K, T, _sample, _store


def _capture(seed: int) -> CapturedSample:
    g = torch.Generator().manual_seed(seed)
    return CapturedSample(_sample(), torch.randn(T, K, H, generator=g), torch.randn(T, H, generator=g), None)


def test_the_record_matching_the_file_wins_over_log_order(tmp_path: Path) -> None:
    first = _store(tmp_path / "out", "specforge")
    # Two workers: "b" commits first, "a" (the frozen one, back to life) commits the same sample after.
    worker_b = OutputStore(first.root, first.manifest, writer_id="b")
    worker_a = OutputStore(first.root, first.manifest, writer_id="a")
    early = worker_b.commit(_capture(1))
    late = worker_a.commit(_capture(2))
    assert early.sha256 != late.sha256  # different bytes (batching changes low bits on a GPU)
    for store in (worker_a, worker_b, first):
        store.close()
    # Log order (a.jsonl before b.jsonl) would pick b's record; the file holds a's bytes.
    records = OutputStore.open_existing(tmp_path / "out").records()
    assert records["s0"].sha256 == late.sha256
    assert verify_store(tmp_path / "out").ok
