"""A stream producer's put of one sample into Mooncake Store: hs-connectors' ``put_sample`` (each tensor copied into its
staging buffer, then ``put_from``) against layertap's ``put_packed`` (the tensors as the object's parts, one call),
each alone and beside a thread that holds the GIL as a capture's threads do.

Why: on one H100 (gpu_stream.md at b29c7d0) a producer's put took 28 ms a 39 MB sample, ``put_sample`` alone 8-9 ms;
a call that gives up the GIL waits up to the 5 ms switch interval to take it back, at each of its torch calls.

    .venv/bin/python -m benchmarks put [--tokens 700 --hidden 7168 --puts 30] --out benchmarks/results/put.md
"""

from __future__ import annotations

import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks import report
from harness.mooncake import MooncakeMaster
from layertap.store.index import SampleRecord
from layertap.stream.mooncake import connect, put_packed, sample_manifest


def per_put(put: Callable[[str], None], puts: int, busy: bool) -> float:
    """Seconds a put takes, alone or beside a thread that runs Python (holding the GIL) until the puts end."""
    stop, spinner = threading.Event(), None

    def spin() -> None:
        while not stop.is_set():
            pass

    if busy:
        spinner = threading.Thread(target=spin)
        spinner.start()
    t0 = time.perf_counter()
    for i in range(puts):
        put(f"bench-{busy}-{i}")
    seconds = (time.perf_counter() - t0) / puts
    stop.set()
    if spinner is not None:
        spinner.join()
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
    with tempfile.TemporaryDirectory() as work:
        master = MooncakeMaster.ephemeral(Path(work))
        store = connect(master.address, segment_bytes=1 << 30, pin=True)
        try:

            def put(how: Callable) -> Callable[[str], None]:
                def one(handle: str) -> None:
                    manifest = sample_manifest(handle, tensors, record, "bench")
                    how(manifest)
                    store._store.remove(handle)

                return one

            ways = {"hs-connectors put_sample": put(lambda m: store.put_sample(m, tensors)),
                    "layertap put_packed": put(lambda m: put_packed(store, m, tensors))}  # fmt: skip
            for way in ways.values():
                per_put(way, 3, busy=False)  # first-use costs
            rows = [[name, *(per_put(way, args.puts, busy) for busy in (False, True))] for name, way in ways.items()]
        finally:
            store._store.close()
            master.stop()
    nbytes = sum(t.nbytes for t in tensors.values())
    lines = [f"One sample of {args.tokens} tokens at hidden {args.hidden} ({nbytes / 1e6:.1f} MB), {args.puts} puts "
             "each way; ms a put (Mooncake over TCP, one master and producer on this machine).", "",
             *report.table_lines(("put", "alone ms", "beside a GIL-holding thread ms"),
                                 [(n, f"{a * 1e3:.1f}", f"{b * 1e3:.1f}") for n, a, b in rows])]  # fmt: skip
    report.write(args.out, report.result("put", "\n".join(lines), parameters=vars(args), rows=rows))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
