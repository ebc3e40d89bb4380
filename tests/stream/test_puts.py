"""A producer's puts are memcpys into its own segment unless the user set ``MC_STORE_MEMCPY`` (Mooncake sends them to
itself over TCP where it finds an RDMA NIC), against a real ``mooncake_master``: either way a consumer's client reads
each sample back byte-equal (Mooncake's memcpy path corrupted data in 0.3.10)."""

from __future__ import annotations

import os

import pytest
import torch

from harness.mooncake import MooncakeMaster
from layertap.store.index import SampleRecord
from layertap.stream.mooncake import LOCAL_MEMCPY_ENV, connect, disconnect, get_packed, put_packed, sample_manifest


@pytest.mark.parametrize(("given", "used"), [(None, "1"), ("0", "0")])
def test_a_producers_puts_read_back_byte_equal_by_memcpy_or_over_tcp(
    mooncake_master: MooncakeMaster, monkeypatch: pytest.MonkeyPatch, given: str | None, used: str
) -> None:
    if given is None:
        monkeypatch.delenv(LOCAL_MEMCPY_ENV, raising=False)
    else:
        monkeypatch.setenv(LOCAL_MEMCPY_ENV, given)
    producer = connect(mooncake_master.address, segment_bytes=64 << 20, pin=True, prefault=False)
    consumer = connect(mooncake_master.address, segment_bytes=0)
    try:
        assert os.environ[LOCAL_MEMCPY_ENV] == used
        for n in range(3):
            tokens = 100 + 37 * n
            tensors = {"hidden_states": torch.randn(tokens, 4, 512).to(torch.bfloat16),
                       "token_ids": torch.randint(0, 1000, (tokens,)), "loss_mask": torch.ones(tokens, dtype=torch.uint8)}  # fmt: skip
            record = SampleRecord(f"s{n}", n, tokens, "", 0, "", "", ((0, tokens),))
            manifest = sample_manifest(f"puts-{given}-{n}", tensors, record, "t")
            put_packed(producer, manifest, tensors)
            got = get_packed(consumer, manifest, timeout=10)
            assert all(torch.equal(got[name], tensors[name]) for name in tensors)
    finally:
        disconnect(consumer)
        disconnect(producer)
