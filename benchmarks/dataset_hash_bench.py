"""What naming a dataset by its content costs: `dataset_sha256` (one streamed read of the bytes) beside the
planner's id scan (`scan_dataset` without it), on a JSONL of the seed's shape: 37K chats of ~9,500
characters (~2,400 tokens each, ~88M tokens in all). Also what a resume's re-tokenization of done rows
(`RowPlanner.plan` tokenizes each with `RowPlanner.outcome`) costs per row, on the tiny Llama's tokenizer. Prints the
table (and writes the result to ``--out`` when given).

    .venv/bin/python -m benchmarks dataset_hash --work /tmp/hash-bench [--rows 37000 --tokenize-rows 500]
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

from benchmarks import report
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


def main(argv: list[str] | None = None) -> None:
    ap = report.parser(__doc__)
    ap.add_argument("--work", type=Path, required=True, help="a folder for the data and the tiny model")
    ap.add_argument("--out", type=Path, help="where to write the result (NAME.json and NAME.md)")
    ap.add_argument("--rows", type=int, default=37_000)
    ap.add_argument("--chars", type=int, default=9_500)
    ap.add_argument("--tokenize-rows", type=int, default=500)
    args = ap.parse_args(argv)
    if args.smoke:
        args.rows, args.chars, args.tokenize_rows = 200, 600, 10
    args.work.mkdir(parents=True, exist_ok=True)
    data = args.work / "chats.jsonl"
    write_chats(data, args.rows, args.chars)
    size = data.stat().st_size
    ids_s, _ = timed(lambda: sum(1 for _ in iter_rows(data, columns=ID_FIELDS)))
    hash_s, _ = timed(lambda: dataset_sha256(data))
    scan_s, _ = timed(lambda: scan_dataset(data))

    model = build_tiny_model("llama", args.work / "tiny-llama")
    spec = ExtractionSpec(model=model, data=data, layers=(1, 3, 5))
    planner, few = RowPlanner(spec, Tokenize(ModelFolder.read(model), spec, spec.max_length)), args.tokenize_rows
    rows = list(iter_rows(data, stop=few))
    tok_s, _ = timed(lambda: [planner.outcome(n, row) for n, row in rows])
    head = ["dataset", "scan ids (before)", "sha256 of the bytes", "scan_dataset (ids + sha256)",
            "re-tokenize a done row (resume)"]  # fmt: skip
    row = [f"{args.rows:,} rows, {size / 1e6:,.0f} MB JSONL", f"{ids_s:.1f} s",
           f"{hash_s:.1f} s ({size / hash_s / 1e6:,.0f} MB/s)", f"{scan_s:.1f} s",
           f"{tok_s / few * 1e3:.1f} ms/row ({tok_s / few * args.rows / 60:.1f} min for all rows)"]  # fmt: skip
    metrics = {"bytes": size, "ids_s": ids_s, "sha256_s": hash_s, "scan_s": scan_s, "tokenize_s_per_row": tok_s / few}
    measured = report.result("dataset_hash", "\n".join(report.table_lines(head, [row])) + "\n", parameters=vars(args),
                             metrics=metrics)  # fmt: skip
    print(report.write(args.out, measured) if args.out else report.render(measured))
