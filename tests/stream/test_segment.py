"""A producer's Mooncake segment is faulted in at connect (`layertap.stream.segment`), against a real
``mooncake_master``: its pages are the process's before any put, and a sample put into them reads back byte-equal."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from harness.mooncake import MooncakeMaster
from layertap.store.index import SampleRecord
from layertap.stream.mooncake import connect, disconnect, get_packed, put_packed, sample_manifest

SEGMENT = 256 << 20


def resident() -> int:
    """This process's resident bytes."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) << 10 for line in status if line.startswith("VmRSS:"))


def faulting_in() -> bool:
    return any(t.name.startswith("segment-prefault") for t in threading.enumerate())


@pytest.mark.parametrize("prefault", [True, False])
def test_a_producers_segment_is_resident_before_its_first_put(mooncake_master: MooncakeMaster, prefault: bool) -> None:
    before = resident()
    store = connect(mooncake_master.address, segment_bytes=SEGMENT, pin=True, prefault=prefault)
    try:
        deadline = time.monotonic() + 60
        while faulting_in() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not faulting_in()
        grown = resident() - before
        if prefault:
            assert grown >= SEGMENT  # every page of it, before any put
        else:
            assert grown < SEGMENT // 2  # left to the puts: what the prefault is measured against
        tensors = {"hidden_states": torch.randn(300, 4, 256).to(torch.bfloat16), "token_ids": torch.arange(300),
                   "loss_mask": torch.ones(300, dtype=torch.uint8)}  # fmt: skip
        manifest = sample_manifest("seg-0", tensors, SampleRecord("s", 0, 300, "", 0, "", "", ((0, 300),)), "test")
        put_packed(store, manifest, tensors)
        got = get_packed(store, manifest, timeout=10)
        assert all(torch.equal(got[name], tensors[name]) for name in tensors)
    finally:
        disconnect(store)
