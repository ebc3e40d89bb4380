"""A consumer without pinned memory reads samples into buffers it reads into again (`ReadBuffers`) only once nothing
holds a view of one: a sample a trainer keeps is never overwritten by a later read, a buffer a DataLoader worker's
pickling moved to shared memory is never read into again, and against a real ``mooncake_master`` every sample read
through kept buffers is byte-equal to what was put while the samples a trainer holds stay as they were."""

from __future__ import annotations

import io
from multiprocessing.reduction import ForkingPickler

import torch
import torch.multiprocessing  # registers torch's reductions with ForkingPickler, as a DataLoader does)

from harness.mooncake import MooncakeMaster
from layertap.store.index import SampleRecord
from layertap.stream import mooncake
from layertap.stream.mooncake import ReadBuffers, connect, disconnect, get_packed, put_packed, sample_manifest


def test_a_buffer_is_read_into_again_only_once_no_view_of_it_is_held() -> None:
    buffers = ReadBuffers(keep=2)
    first = buffers.take(1000)
    at = first.data_ptr()
    kept = first[10:20].view(torch.int16)[1:]  # a view of a view, as a trainer's slicing makes
    del first
    second = buffers.take(1000)
    assert second.data_ptr() != at  # the first is still held through ``kept``
    del second
    assert buffers.take(1000).data_ptr() != at  # the second is free again; the first still is not
    del kept
    assert {buffers.take(1000).data_ptr() for _ in range(3)} <= {at, buffers.buffers[1].data_ptr()}


def test_a_buffer_moved_to_shared_memory_is_never_read_into_again() -> None:
    buffers = ReadBuffers(keep=2)
    sample = buffers.take(1000)
    ForkingPickler(io.BytesIO()).dump(sample[:100])  # what a DataLoader worker does to the item it hands over
    shared = sample.data_ptr()
    assert sample.untyped_storage().is_shared()
    del sample
    assert buffers.take(1000).data_ptr() != shared
    assert all(not b.untyped_storage().is_shared() for b in buffers.buffers)


def test_a_longer_sample_replaces_a_free_buffer_too_small_for_it() -> None:
    buffers = ReadBuffers(keep=2)
    held = buffers.take(1000)
    buffers.take(1000)  # a second kept buffer, free again at once
    longer = buffers.take(mooncake._BUFFER_ROUND + 1)
    assert longer.numel() == mooncake._BUFFER_ROUND + 1
    assert [b.numel() for b in buffers.buffers] == [mooncake._BUFFER_ROUND, 2 * mooncake._BUFFER_ROUND]
    assert buffers.buffers[0].data_ptr() == held.data_ptr()


def test_samples_read_through_kept_buffers_are_what_was_put_and_held_ones_stay_so(
    mooncake_master: MooncakeMaster,
) -> None:
    producer = connect(mooncake_master.address, segment_bytes=64 << 20, pin=True)
    consumer = connect(mooncake_master.address, segment_bytes=0)
    try:
        put = []
        for n in range(8):
            tensors = {"hidden_states": torch.randn(300, 4, 256).to(torch.bfloat16), "token_ids": torch.arange(300) + n,
                       "loss_mask": (torch.arange(300) % (n + 2) == 0).to(torch.uint8)}  # fmt: skip
            manifest = sample_manifest(f"rb-{n}", tensors, SampleRecord("s", n, 300, "", 0, "", "", ((0, 300),)), "t")
            put_packed(producer, manifest, tensors)
            put.append((manifest, tensors))
        buffers, held, places = ReadBuffers(keep=4), [], set()
        for n, (manifest, tensors) in enumerate(put):
            got = get_packed(consumer, manifest, timeout=10, buffers=buffers)
            assert all(torch.equal(got[name], tensors[name]) for name in tensors), n
            place = got["hidden_states"].untyped_storage().data_ptr()
            assert place in {b.data_ptr() for b in buffers.buffers}, n  # a kept buffer: 3 held leave one free
            places.add(place)
            if n % 3 == 0:  # a trainer keeping some samples (a shuffle buffer) while it reads on
                held.append((got, tensors))
            del got
        for got, tensors in held:  # none was read over by a later sample
            assert all(torch.equal(got[name], tensors[name]) for name in tensors)
        assert len(places) == 4  # 8 samples through 4 buffers
    finally:
        disconnect(consumer)
        disconnect(producer)
