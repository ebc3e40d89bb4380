"""What naming a dataset by its content costs: `dataset_sha256` (one streamed read of the bytes) beside the
planner's id scan (`scan_dataset` without it), on a JSONL of the seed's shape: 37K chats of ~9,500
characters (~2,400 tokens each, ~88M tokens in all). Also what a resume's re-tokenization of done rows
(`RowPlanner.plan` tokenizes each with `RowPlanner.outcome`) costs per row, on the tiny Llama's tokenizer. Prints a markdown table.

    .venv/bin/python -m benchmarks.dataset_hash_bench --out /tmp/hash-bench [--rows 37000 --tokenize-rows 500]
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from layertap.data.reader import iter_rows
from layertap.data.rows import ID_FIELDS
from layertap.data.scan import dataset_sha256, scan_dataset
from layertap.models.folder import ModelFolder
from layertap.pipeline.rows import RowPlanner
from layertap.pipeline.steps import Tokenize
from layertap.spec import ExtractionSpec
from layertap.tiny.build import build_tiny_model

WORDS = ["the", "model", "reads", "every", "token", "of", "a", "long", "conversation", "and", "drafter", "learns",
         "to", "guess", "what", "comes", "next", "from", "states", "captured", "at", "three", "layers"]  # fmt: skip


def write_chats(path: Path, rows: int, chars: int, seed: int = 0) -> None:
    """``rows`` user/assistant chats of about ``chars`` characters each."""
    rng = random.Random(seed)
    with path.open("w") as f:
        for i in range(rows):
            text = " ".join(rng.choices(WORDS, k=chars // 6))
            half = len(text) // 2
            messages = [{"role": "user", "content": text[:half]}, {"role": "assistant", "content": text[half:]}]
            f.write(json.dumps({"id": f"r{i}", "messages": messages}) + "\n")


def timed(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rows", type=int, default=37_000)
    ap.add_argument("--chars", type=int, default=9_500)
    ap.add_argument("--tokenize-rows", type=int, default=500)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    data = args.out / "chats.jsonl"
    write_chats(data, args.rows, args.chars)
    size = data.stat().st_size
    ids_s, _ = timed(lambda: sum(1 for _ in iter_rows(data, columns=ID_FIELDS)))
    hash_s, _ = timed(lambda: dataset_sha256(data))
    scan_s, _ = timed(lambda: scan_dataset(data))

    model = build_tiny_model("llama", args.out / "tiny-llama")
    spec = ExtractionSpec(model=model, data=data, layers=(1, 3, 5))
    planner, few = RowPlanner(spec, Tokenize(ModelFolder.read(model), spec, spec.max_length)), args.tokenize_rows
    rows = list(iter_rows(data, stop=few))
    tok_s, _ = timed(lambda: [planner.outcome(n, row) for n, row in rows])
    print(
        f"| dataset | scan ids (before) | sha256 of the bytes | scan_dataset (ids + sha256) | "
        f"re-tokenize a done row (resume) |\n|---|---|---|---|---|\n"
        f"| {args.rows:,} rows, {size / 1e6:,.0f} MB JSONL | {ids_s:.1f} s | {hash_s:.1f} s ({size / hash_s / 1e6:,.0f} MB/s)"
        f" | {scan_s:.1f} s | {tok_s / few * 1e3:.1f} ms/row ({tok_s / few * args.rows / 60:.1f} min for all rows) |"
    )


if __name__ == "__main__":
    main()
