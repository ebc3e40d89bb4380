"""A stream producer's put of one sample into Mooncake Store (layertap's ``put_packed``) by where it lands: pages of
the segment used before (each object removed after its put, so the next reuses its place), fresh pages (none removed:
each put lands where nothing was), fresh places of a segment the producer faulted in before its puts (and how long
that took), and used pages sent over TCP (Mooncake's own pick on a host with an RDMA NIC, not memcpy). Then a
consumer's unpinned read of one sample (`get_packed`) into fresh memory and into a kept buffer (`ReadBuffers`).
Why: on one H100 (gpu_stream.md at 89724c9) a producer's put took 24-30 ms a 37 MB sample in the run, 4-7 ms alone.

    .venv/bin/python -m benchmarks put [--tokens 700 --hidden 7168 --puts 30] --out benchmarks/results/put.md
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import torch
from hs_connectors.mooncake_store import MooncakeHiddenStatesStore

from benchmarks import report
from harness.mooncake import MooncakeMaster
from layertap.store.index import SampleRecord
from layertap.stream import mooncake
from layertap.stream.mooncake import ReadBuffers, connect, disconnect, get_packed, put_packed, sample_manifest


def per_put(store: MooncakeHiddenStatesStore, put: Callable[[str], None], puts: int, *, remove: bool) -> float:
    """Seconds a put takes; with ``remove`` each object goes before the next put, else all of them after the last."""
    handles = [f"bench-{remove}-{i}" for i in range(puts)]
    t0 = time.perf_counter()
    for handle in handles:
        put(handle)
        if remove:
            store._store.remove(handle, True)
    seconds = (time.perf_counter() - t0) / puts
    for handle in handles if not remove else ():
        store._store.remove(handle, True)
    return seconds


def main(argv: list[str] | None = None) -> None:
    ap = report.parser(__doc__)
    ap.add_argument("--tokens", type=int, default=700)
    ap.add_argument("--hidden", type=int, default=7168, help="Kimi-K2's width: 4 states a token (3 aux + final)")
    ap.add_argument("--puts", type=int, default=30)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    if args.smoke:
        args.tokens, args.hidden, args.puts = 64, 256, 4
    tensors = {"hidden_states": torch.randn(args.tokens, 4, args.hidden).to(torch.bfloat16),
               "token_ids": torch.arange(args.tokens), "loss_mask": torch.ones(args.tokens, dtype=torch.uint8)}  # fmt: skip
    record = SampleRecord("s", 0, args.tokens, "", 0, "", "", ((0, args.tokens),))
    segment = 2 * args.puts * sum(t.nbytes for t in tensors.values()) + (64 << 20)  # fresh places for both arms
    with tempfile.TemporaryDirectory() as work:
        master = MooncakeMaster.ephemeral(Path(work))
        try:
            stores = [connect(master.address, segment_bytes=0)]  # a consumer, first: Mooncake logs its own pick
            stores += [connect(master.address, segment_bytes=segment, pin=True, prefault=p) for p in (False, True)]
            with mock.patch.dict(os.environ, {mooncake.LOCAL_MEMCPY_ENV: "0"}):  # TCP: Mooncake's pick with RDMA
                stores.append(connect(master.address, segment_bytes=segment // args.puts, pin=True, prefault=False))
            t0 = time.perf_counter()
            stores[2]._store.prefaulting.advance(segment)  # all of it, before its puts
            stores[2]._store.prefaulting.wait(timeout=600)
            fill = time.perf_counter() - t0

            def put(store: MooncakeHiddenStatesStore) -> Callable[[str], None]:
                return lambda handle: put_packed(store, sample_manifest(handle, tensors, record, "bench"), tensors)

            per_put(stores[1], put(stores[1]), 3, remove=True)  # first-use costs
            rows = [("a put: pages used before", per_put(stores[1], put(stores[1]), args.puts, remove=True)),
                    ("a put: fresh pages", per_put(stores[1], put(stores[1]), args.puts, remove=False)),
                    ("a put: a faulted-in segment", per_put(stores[2], put(stores[2]), args.puts, remove=False)),
                    ("a put: pages used before, sent over TCP", per_put(stores[3], put(stores[3]), args.puts, remove=True))]  # fmt: skip
            manifest = sample_manifest("read", tensors, record, "bench")
            put_packed(stores[1], manifest, tensors)
            for where, buffers in (("a read: fresh memory", None), ("a read: a kept buffer", ReadBuffers())):
                t0 = time.perf_counter()
                for _ in range(args.puts):  # each sample's views dropped before the next read, as a trainer's are
                    get_packed(stores[0], manifest, timeout=10, buffers=buffers)
                rows.append((where, (time.perf_counter() - t0) / args.puts))
        finally:
            for store in stores:
                disconnect(store)
            master.stop()
    nbytes = sum(t.nbytes for t in tensors.values())
    lines = [
        f"One sample of {args.tokens} tokens at hidden {args.hidden} ({nbytes / 1e6:.1f} MB), {args.puts} puts or "
        "reads each way (Mooncake over TCP, one master, producer and consumer on this machine); the faulted-in segment "
        f"({segment / 2**30:.2f} GiB) took {fill:.2f} s to fault in. A put is a memcpy into the producer's own segment "
        f"({mooncake.LOCAL_MEMCPY_ENV}=1, as layertap's producer asks), but in the row sent over TCP: what Mooncake "
        "picks by itself on a host with an RDMA NIC.",
        "",
        *report.table_lines(("it lands in", "ms"), [(n, f"{t * 1e3:.1f}") for n, t in rows]),
    ]
    report.write(args.out, report.result("put", "\n".join(lines), parameters=vars(args), rows=rows))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
