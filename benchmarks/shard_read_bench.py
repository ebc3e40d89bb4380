"""How long a worker spends reading its shards' rows from a JSONL dataset: every shard reading the
file from the top (what a fresh process does) vs seeking from the row checkpoints the reader learns.
Prints a markdown table; compare the two columns as a ratio within one run.

    .venv/bin/python benchmarks/shard_read_bench.py [--rows 10000 --row-bytes 20000 --shard-size 200]
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

from layertap.data import reader
from layertap.data.reader import iter_rows


def write_dataset(path: Path, rows: int, row_bytes: int) -> None:
    rng = random.Random(0)
    with path.open("w") as f:
        for i in range(rows):
            text = "".join(rng.choice("abcdefgh ") for _ in range(row_bytes))
            f.write(json.dumps({"id": f"r{i}", "messages": [{"role": "user", "content": text}]}) + "\n")


def read_all_shards(path: Path, rows: int, shard_size: int, *, checkpoints: bool) -> float:
    """Seconds to read every shard's rows in order, as one worker process running them all would."""
    reader._jsonl_checkpoints.clear()
    t0 = time.perf_counter()
    for start in range(0, rows, shard_size):
        if not checkpoints:
            reader._jsonl_checkpoints.clear()
        count = sum(1 for _ in iter_rows(path, start=start, stop=start + shard_size))
        assert count == min(shard_size, rows - start)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=10_000)
    ap.add_argument("--row-bytes", type=int, default=20_000)
    ap.add_argument("--shard-size", type=int, default=200)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "data.jsonl"
        write_dataset(path, args.rows, args.row_bytes)
        size = path.stat().st_size
        read_all_shards(path, args.rows, args.shard_size, checkpoints=True)  # warm the page cache
        top = read_all_shards(path, args.rows, args.shard_size, checkpoints=False)
        seek = read_all_shards(path, args.rows, args.shard_size, checkpoints=True)
    shards = -(-args.rows // args.shard_size)
    print(f"{args.rows} rows, {size / 1e6:,.0f} MB JSONL (page cache warm), {shards} shards of {args.shard_size}\n")
    print("| every shard reads from the top | seek from checkpoints | ratio |\n|---|---|---|")
    print(f"| {top:.2f} s | {seek:.2f} s | {top / seek:.1f}x |")


if __name__ == "__main__":
    main()
