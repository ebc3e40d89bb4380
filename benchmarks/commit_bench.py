"""How fast the store commits captured samples, by commit threads (no model: a FakeEngine hands out
pre-built captures, standing in for a GPU server). Prints a markdown table; ratios within one run.

    .venv/bin/python benchmarks/commit_bench.py --out /tmp/bench-store [--hidden 4096 --tokens 2300]
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from layertap.engines.base import Engine
from layertap.models.tiny import build_tiny_model
from layertap.pipeline import run_shard
from layertap.sample import CapturedSample, TokenizedSample
from layertap.spec import ExtractionSpec, resolve_capture
from layertap.store.manifest import Manifest
from layertap.store.store import OutputStore


class FakeEngine(Engine):
    """Returns the same pre-built states for every sample: measures the store, not a model."""

    def __init__(self, hidden: int, layers: int) -> None:
        self.spec = resolve_capture(
            list(range(1, layers + 1)), convention="capture", num_layers=layers + 2, final="post"
        )
        self.hidden = hidden
        self._states: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def capture(self, samples: Iterable[TokenizedSample]) -> Iterator[CapturedSample]:
        for s in samples:
            if s.num_tokens not in self._states:
                aux = torch.randn(s.num_tokens, len(self.spec.layers), self.hidden).to(torch.bfloat16)
                self._states[s.num_tokens] = (aux, torch.randn(s.num_tokens, self.hidden).to(torch.bfloat16))
            aux, post = self._states[s.num_tokens]
            yield CapturedSample(sample=s, aux=aux, final_post=post, final_pre=None)

    def describe(self) -> dict:
        return {"name": "fake"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("/tmp/layertap-commit-bench"))
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=2300)
    ap.add_argument("--samples", type=int, default=40)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    data = args.out / "data.jsonl"
    data.write_text(
        "".join(json.dumps({"id": f"s{i}", "input_ids": [5] * args.tokens}) + "\n" for i in range(args.samples))
    )
    engine = FakeEngine(args.hidden, 3)
    model = args.out / "model"  # only its tokenizer is used (rows are pretokenized)
    if not (model / "config.json").exists():
        build_tiny_model("llama", model)
    spec = ExtractionSpec(model=model, data=data, layers=engine.spec.layers)
    rows = []
    for threads in (1, 2, 4, 8):
        root = args.out / f"store-{threads}"
        shutil.rmtree(root, ignore_errors=True)
        manifest = Manifest(
            format="specforge", model_path="fake", model_config_sha256="-", model_revision=None, tokenizer_sha256="-",
            chat_template_sha256=None, compute_dtype="bfloat16", store_dtype="bfloat16", hidden_size=args.hidden,
            num_layers=5, layer_ids_given=list(engine.spec.layers), layer_convention="capture",
            capture_indices=list(engine.spec.layers), final_post_norm=True, final_pre_norm=False, max_length=None,
            overlong="truncate", dataset_path=str(data), dataset_rows=args.samples, engine={"name": "fake"},
        )  # fmt: skip
        store = OutputStore.create_or_resume(root, manifest)
        t0 = time.perf_counter()
        report = run_shard(spec, store, engine, commit_threads=threads)
        dt = time.perf_counter() - t0
        nbytes = sum(r.nbytes for r in store.records().values())
        assert len(report.computed) == args.samples
        rows.append((threads, report.tokens / dt, nbytes / dt))
        shutil.rmtree(root)
    print(f"{args.samples} samples x {args.tokens} tokens, hidden {args.hidden}, 3 aux + final, bf16, specforge\n")
    print("| commit threads | tokens/s | bytes/s | vs 1 thread |\n|---|---|---|---|")
    for threads, tok, byt in rows:
        print(f"| {threads} | {tok:,.0f} | {byt / 1e6:,.0f} MB/s | {tok / rows[0][1]:.2f}x |")


if __name__ == "__main__":
    main()
