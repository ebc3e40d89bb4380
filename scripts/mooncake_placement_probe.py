"""Can a capture server write a sample straight into a stream producer's Mooncake segment? A probe of Mooncake's own
API, on the CPU (docs/streaming.md, "Not yet"): nothing in layertap uses this yet.

    .venv/bin/python scripts/mooncake_placement_probe.py [--objects 20 --mib 37]

A producer mounts its segment from a tmpfs file (`mount_segment`), reserves each object without copying anything
(`batch_put_session_start` / `batch_put_session_end`) and reads where it landed (`get_replica_desc`: an address in
its shared mapping of the file). A separate process, standing in for the server, writes the object's bytes into the
file at that offset; a consumer then gets the object over TCP and compares. Prints, per object, its offset in the
file, the reservation's milliseconds (the RPCs a placed sample would add) and whether the consumer read the bytes
the writer wrote.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mooncake.store import MooncakeDistributedStore, ReplicateConfig

from harness.mooncake import MooncakeMaster

WRITER = "import os, sys; fd = os.open(sys.argv[1], os.O_WRONLY); os.pwrite(fd, os.urandom(int(sys.argv[3])), int(sys.argv[2]))"


def client(master: MooncakeMaster) -> MooncakeDistributedStore:
    store = MooncakeDistributedStore()
    status = store.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", master.address)  # as `connect` does
    if status != 0:
        raise SystemExit(f"Mooncake setup failed ({status})")
    return store


def mapping_start(path: Path) -> int:
    """Where this process mapped ``path`` (the segment's file), from /proc/self/maps."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        if line.endswith(str(path)):
            return int(line.split("-")[0], 16)
    raise SystemExit(f"{path} is not mapped here: mount_segment did not map the file")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--objects", type=int, default=20)
    ap.add_argument("--mib", type=int, default=37, help="an object's size (a 4-layer Kimi-K2 sample: ~37 MB)")
    args = ap.parse_args()
    size = args.mib << 20
    with tempfile.TemporaryDirectory() as work, tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
        master = MooncakeMaster.ephemeral(Path(work))
        try:
            producer, consumer = client(master), client(master)
            segment = Path(shm) / "segment"
            os.truncate(os.open(segment, os.O_RDWR | os.O_CREAT, 0o600), 4 * size)
            if producer.mount_segment(str(segment), 4 * size, 0, "tcp", "")["ret"] != 0:
                raise SystemExit("mount_segment refused the file")
            base = mapping_start(segment)
            config = ReplicateConfig()
            config.with_hard_pin, config.preferred_segment = True, producer.get_hostname()
            landing = ctypes.create_string_buffer(size)
            consumer.register_buffer(ctypes.addressof(landing), size)
            ms, equal = [], 0
            print("| object | offset in the file | reserve ms | consumer read the writer's bytes |\n|---|---|---|---|")
            for i in range(args.objects):
                key, t0 = f"probe-{i}", time.perf_counter()
                if producer.batch_put_session_start([key], [size], config) != [0]:
                    raise SystemExit(f"reserving {key} failed")
                producer.batch_put_session_end([key])
                [replica] = producer.get_replica_desc(key)
                offset = replica.get_memory_descriptor().buffer_descriptor.buffer_address - base
                ms.append(1e3 * (time.perf_counter() - t0))
                subprocess.run([sys.executable, "-c", WRITER, str(segment), str(offset), str(size)], check=True)
                with open(segment, "rb") as f:
                    f.seek(offset)
                    written = f.read(size)
                got = consumer.get_into(key, ctypes.addressof(landing), size)
                same = got == size and landing.raw == written
                equal += same
                print(f"| {key} | {offset:,} | {ms[-1]:.2f} | {same} |")
                if i >= 2:  # three held at once (the segment holds four), as a producer's bound keeps several
                    producer.remove(f"probe-{i - 2}", True)  # hard-pinned: removed only when forced
            print(f"\n{equal} of {args.objects} read back as written; reserve median {statistics.median(ms):.2f} ms")
        finally:
            master.stop()


if __name__ == "__main__":
    main()
