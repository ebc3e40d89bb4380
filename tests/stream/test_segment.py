"""A producer's Mooncake segment is faulted in ahead of its puts (`layertap.stream.segment`), against a real
``mooncake_master``: its first pages are the process's before any put, more follow the puts by the lookahead, no more
than the objects held at once need however much is put, and a sample put into them reads back byte-equal."""

from __future__ import annotations

import ctypes
import os

import pytest
import torch

from harness.mooncake import MooncakeMaster
from layertap.store.index import SampleRecord
from layertap.stream import segment
from layertap.stream.mooncake import connect, disconnect, get_packed, put_packed, sample_manifest, settled

SEGMENT = 256 << 20


def faulted_in(prefault: segment.Prefault) -> int:
    """Bytes of the faulting threads' mappings in memory, counted page by page (mincore): the process's RSS is the
    kernel's approximate per-CPU sum, off by a few MB."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    page, total = os.sysconf("SC_PAGE_SIZE"), 0
    for at, length in prefault.chunks:
        pages = ctypes.create_string_buffer(length // page)
        assert libc.mincore(at, length, pages) == 0, ctypes.get_errno()
        total += pages.raw.count(1) * page
    return total


def resident() -> int:
    """This process's resident bytes."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) << 10 for line in status if line.startswith("VmRSS:"))


def sample(n: int, hidden: int = 256) -> tuple[dict, dict]:
    tensors = {"hidden_states": torch.randn(300, 4, hidden).to(torch.bfloat16), "token_ids": torch.arange(300),
               "loss_mask": torch.ones(300, dtype=torch.uint8)}  # fmt: skip
    return sample_manifest(f"seg-{n}", tensors, SampleRecord("s", n, 300, "", 0, "", "", ((0, 300),)), "t"), tensors


@pytest.mark.parametrize("prefault", [True, False])
def test_a_producers_segment_is_resident_before_its_first_put(mooncake_master: MooncakeMaster, prefault: bool) -> None:
    before = resident()
    store = connect(mooncake_master.address, segment_bytes=SEGMENT, pin=True, prefault=prefault)
    try:
        prefaulting = store._store.prefaulting
        assert prefaulting.wait(timeout=60)
        if prefault:
            assert faulted_in(prefaulting) >= SEGMENT  # every page of it (smaller than the lookahead), before any put
        else:
            assert resident() - before < SEGMENT // 2  # left to the puts: what the faulting in is measured against
        manifest, tensors = sample(0)
        put_packed(store, manifest, tensors)
        got = get_packed(store, manifest, timeout=10)
        assert all(torch.equal(got[name], tensors[name]) for name in tensors)
    finally:
        disconnect(store)


def test_the_faulted_in_pages_run_ahead_of_the_puts_not_over_the_whole_segment(
    mooncake_master: MooncakeMaster, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(segment, "LOOKAHEAD", 32 << 20)
    monkeypatch.setattr(segment, "CHUNK", 4 << 20)
    samples = [sample(n) for n in range(8)]  # 8 x 0.6 MB
    store = connect(mooncake_master.address, segment_bytes=SEGMENT, pin=True)
    prefaulting = store._store.prefaulting
    try:
        assert prefaulting.wait(timeout=60)
        assert 32 << 20 <= faulted_in(prefaulting) < 96 << 20  # the lookahead, not the segment's 256 MB
        for manifest, tensors in samples:
            put_packed(store, manifest, tensors)
        prefaulting.advance(64 << 20)  # as if 64 MB more were put
        assert prefaulting.wait(timeout=60)
        assert 96 << 20 <= faulted_in(prefaulting) < SEGMENT - (64 << 20)
    finally:
        disconnect(store)


def test_a_long_run_faults_in_what_its_objects_held_at_once_not_everything_it_put(
    mooncake_master: MooncakeMaster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As a consumer removes each object it acked, Mooncake puts the next at the lowest free offset: 300 MB put through
    a 256 MB segment, two 4.9 MB objects held at a time, fault in the lookahead and those two, not the segment."""
    monkeypatch.setattr(segment, "LOOKAHEAD", 32 << 20)
    monkeypatch.setattr(segment, "CHUNK", 4 << 20)
    manifest, tensors = sample(0, hidden=2048)
    size = manifest["metadata"]["total_aligned_bytes"]
    store = connect(mooncake_master.address, segment_bytes=SEGMENT, pin=True)
    prefaulting, held = store._store.prefaulting, []
    try:
        for n in range(-(-(300 << 20) // size)):
            handle = f"long-{n}"
            put_packed(store, {**manifest, "handle": handle}, tensors)
            held.append(handle)
            if len(held) == 2:
                gone = held.pop(0)
                assert store._store.remove(gone, force=True) == 0
                settled(store, [gone])
        assert prefaulting.wait(timeout=60)
        assert faulted_in(prefaulting) < (32 << 20) + 2 * size + (16 << 20)  # lookahead + 2 objects + chunk slack
        got = get_packed(store, {**manifest, "handle": held[-1]}, timeout=10)
        assert all(torch.equal(got[name], tensors[name]) for name in tensors)
    finally:
        disconnect(store)
