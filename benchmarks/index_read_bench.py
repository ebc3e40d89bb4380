"""How long a shard's start spends reading the store's index: the first read in a process (every line
parsed) vs a repeat read (only lines appended since). Prints a markdown table; ratios within one run.

    .venv/bin/python benchmarks/index_read_bench.py [--records 37000 --appended 100]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from layertap.store.index import INDEX_DIR, SampleRecord, load_index_candidates


def record(i: int) -> str:
    return SampleRecord(
        sample_id=f"conv-{i}", index=i, num_tokens=2000, file=f"rows_0-2000/data_{i}.ckpt", nbytes=131_072_000,
        sha256="a" * 64, ids_sha256="b" * 64, mask_runs=((10, 200), (300, 900), (1000, 1500)),
    ).to_json()  # fmt: skip


def timed(root: Path) -> float:
    t0 = time.perf_counter()
    load_index_candidates(root)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--records", type=int, default=37_000)
    ap.add_argument("--appended", type=int, default=100, help="records another shard commits between reads")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        log = root / INDEX_DIR / "worker.jsonl"
        log.parent.mkdir()
        log.write_text("".join(record(i) + "\n" for i in range(args.records)))
        first = timed(root)
        repeat = statistics.median(timed(root) for _ in range(args.repeats))
        after = []
        for r in range(args.repeats):
            with log.open("a") as f:
                base = args.records + r * args.appended
                f.write("".join(record(base + i) + "\n" for i in range(args.appended)))
            after.append(timed(root))
    print(f"index of {args.records} records, one log; median of {args.repeats}\n")
    print("| read | seconds | vs first |\n|---|---|---|")
    for name, t in (("first in the process", first), ("repeat, nothing new", repeat),
                    (f"repeat, {args.appended} records appended", statistics.median(after))):  # fmt: skip
        print(f"| {name} | {t:.3f} | {t / first:.2f} |")


if __name__ == "__main__":
    main()
