"""A producer beside its capture server mounts its Mooncake segment from a file in the server's dump root, reserves
each sample's object there and the server writes the sample into it (`MooncakeSink.place`, a real ``mooncake_master``
and Redis, the bytes written by another process as the server's writer writes them): the consumer reads them
byte-equal, nothing copied by the producer; a reservation given back frees its place in the bound and its object; the
file goes with the producer, and one a killed producer left goes when the next one mounts."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import torch

from harness.mooncake import MooncakeMaster
from harness.processes import REPO_ROOT
from harness.services import RedisServer
from layertap.store.index import SampleRecord
from layertap.stream.mooncake import connect, disconnect, get_packed, objects_present
from layertap.stream.sink import MooncakeSink
from sglang_patch.contract import SEGMENT_PREFIX

WRITE = "import sys, torch; from sglang_patch.contract import Placement; from sglang_patch.segments import Segments; " \
        "Segments().write(Placement.from_param(torch.load(sys.argv[1])), torch.load(sys.argv[2]))"  # fmt: skip


def sample(tokens: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"hidden_states": torch.randn(tokens, 3, 64, generator=g).to(torch.bfloat16),
            "token_ids": torch.randint(0, 1000, (tokens,), generator=g),
            "loss_mask": (torch.rand(tokens, generator=g) > 0.5).to(torch.uint8)}  # fmt: skip


def test_a_sample_the_server_writes_into_its_placement_reaches_a_consumer_byte_equal(
    mooncake_master: MooncakeMaster, redis_server: RedisServer, tmp_path: Path
) -> None:
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    dead = _dead_pid()
    stale = dumps / f"{SEGMENT_PREFIX}{socket.gethostname()}-{dead}-0000"  # a killed producer's
    stale.write_bytes(b"x")
    sink = MooncakeSink(redis_server.url, "placed", master=mooncake_master.address, segment_bytes=64 << 20,
                        max_unacked=2, segment_dir=dumps)  # fmt: skip
    reader = connect(mooncake_master.address, segment_bytes=0)
    try:
        assert not stale.exists() and sink.segment_file is not None and sink.segment_file.parent == dumps
        assert sink.segment_file.stat().st_size == 64 << 20
        for n, tokens in enumerate((40, 73)):
            tensors = sample(tokens, n)
            shapes = {name: (tuple(t.shape), t.dtype) for name, t in tensors.items()}
            place = sink.place(f"s{n}", n, shapes)
            assert place is not None and sink.place(f"s{n}", n, shapes) is place  # each attempt: the same object
            torch.save(place.param(), tmp_path / "place.pt")
            torch.save(tensors, tmp_path / "tensors.pt")
            subprocess.run([sys.executable, "-c", WRITE, str(tmp_path / "place.pt"), str(tmp_path / "tensors.pt")],
                           check=True, cwd=REPO_ROOT)  # fmt: skip
            staged = sink.staged(SampleRecord(f"s{n}", n, tokens, "", 0, "", "", ((0, tokens),)), tensors)
            sink.announce(staged)
            got = get_packed(reader, staged.manifest, timeout=10)
            assert all(torch.equal(got[name], tensors[name]) for name in tensors)
        assert sink.put_count == 2 and sink.putting == 0 and len(sink.unacked) == 2
        assert sink.redis.hget(sink.keys.stream_run(sink.name), "placed") == b"2"  # the stream's record says so

        sink.max_unacked = 3
        spare = sink.place("s2", 2, {"token_ids": ((5,), torch.int64)})
        assert spare is not None and sink.putting == 1 and objects_present(reader, [spare.key]) == [True]
        sink.cancel("s2")  # its capture came back unplaced: its server wrote a dump of its own
        assert sink.putting == 0 and objects_present(reader, [spare.key]) == [False] and not sink.placed
        late = sink.place("s3", 3, {"token_ids": ((5,), torch.int64)})
        sink.cancel("s3", fenced=True)  # failed for good: its server may still write there, so the object stays
        assert late is not None and sink.putting == 0 and objects_present(reader, [late.key]) == [True]
        assert sink.fenced == 1  # so its client is not kept for a later producer: the segment goes, the object with it
        segment = sink.segment_file
    finally:
        disconnect(reader)
        sink.close()
    assert not segment.exists()


def _dead_pid() -> int:
    """A pid no process has now (one that just exited)."""
    child = subprocess.Popen(["true"])
    child.wait()
    try:
        os.kill(child.pid, 0)
    except ProcessLookupError:
        return child.pid
    raise AssertionError("the pid of an exited child is taken")
