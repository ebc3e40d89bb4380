"""How fast the store commits captured samples, by commit path and threads (no model: a FakeEngine
hands out pre-built captures, standing in for a GPU server). Prints a markdown table; ratios within one run.

Two commit paths: "write" (the engine hands tensors; the store validates, serialises, hashes, fsyncs)
and "rename" (the engine hands a file the SGLang plugin already wrote in the store's format, as with
``--dump-layout specforge``; the store validates it, hashes it and renames it into place). The
prepared files are written before the timed run: on a server that is the plugin's writer thread.

    .venv/bin/python benchmarks/commit_bench.py --out /tmp/bench-store [--hidden 4096 --tokens 2300]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from layertap.engines.base import Engine
from layertap.pipeline import run_shard
from layertap.sample import CapturedSample, SampleFile, TokenizedSample
from layertap.spec import ExtractionSpec, resolve_capture
from layertap.store.manifest import Manifest
from layertap.store.store import OutputStore
from layertap.tiny.build import build_tiny_model
from sglang_patch.contract import SPECFORGE
from sglang_patch.sample_files import specforge_tensors, unpack_sample, write_sample


class FakeEngine(Engine):
    """Returns the same pre-built states for every sample: measures the store, not a model."""

    def __init__(self, hidden: int, layers: int, prepared: Path | None = None) -> None:
        """With `prepared`, each sample comes as a specforge file written there first (see `prepare`)."""
        self.spec = resolve_capture(
            list(range(1, layers + 1)), convention="capture", num_layers=layers + 2, final="post"
        )
        self.hidden = hidden
        self.prepared = prepared
        self._states: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def states(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        if num_tokens not in self._states:
            aux = torch.randn(num_tokens, len(self.spec.layers), self.hidden).to(torch.bfloat16)
            self._states[num_tokens] = (aux, torch.randn(num_tokens, self.hidden).to(torch.bfloat16))
        return self._states[num_tokens]

    def prepare(self, samples: Iterable[TokenizedSample]) -> None:
        """Write each sample's specforge file into `prepared`, as the plugin's writer thread would."""
        assert self.prepared is not None
        self.prepared.mkdir(parents=True, exist_ok=True)
        for s in samples:
            aux, post = self.states(s.num_tokens)
            with (self.prepared / f"{s.sample_id}.ckpt").open("wb") as f:
                write_sample(SPECFORGE, specforge_tensors(s.input_ids, s.loss_mask, aux, post), f)
                f.flush()
                os.fsync(f.fileno())

    def capture(self, samples: Iterable[TokenizedSample]) -> Iterator[CapturedSample]:
        for s in samples:
            if self.prepared is None:
                aux, post = self.states(s.num_tokens)
                yield CapturedSample(sample=s, aux=aux, final_post=post, final_pre=None)
                continue
            path = self.prepared / f"{s.sample_id}.ckpt"
            views = unpack_sample(SPECFORGE, torch.load(path, mmap=True, weights_only=True), len(self.spec.layers))
            yield CapturedSample(s, views["aux"], views["final_post"], None, source=SampleFile(path, SPECFORGE))

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
    layers = 3
    model = args.out / "model"  # only its tokenizer is used (rows are pretokenized)
    if not (model / "config.json").exists():
        build_tiny_model("llama", model)
    samples = [
        TokenizedSample(f"s{i}", i, torch.full((args.tokens,), 5), torch.ones(args.tokens, dtype=torch.uint8))
        for i in range(args.samples)
    ]
    rows = []
    for path in ("write", "rename"):
        for threads in (1, 2, 4, 8):
            root = args.out / f"store-{path}-{threads}"
            shutil.rmtree(root, ignore_errors=True)
            engine = FakeEngine(
                args.hidden, layers, prepared=root.with_name(root.name + "-dumps") if path == "rename" else None
            )
            if engine.prepared is not None:
                engine.prepare(samples)
            spec = ExtractionSpec(model=model, data=data, layers=engine.spec.layers)
            manifest = Manifest(
                format="specforge", model_path="fake", model_config_sha256="-", model_revision=None,
                tokenizer_sha256="-", chat_template_sha256=None, compute_dtype="bfloat16", store_dtype="bfloat16",
                hidden_size=args.hidden, num_layers=5, layer_ids_given=list(engine.spec.layers),
                layer_convention="capture", capture_indices=list(engine.spec.layers), final_post_norm=True,
                final_pre_norm=False, max_length=None, overlong="truncate", dataset_path=str(data),
                dataset_rows=args.samples, engine={"name": "fake"},
            )  # fmt: skip
            store = OutputStore.create_or_resume(root, manifest)
            t0 = time.perf_counter()
            report = run_shard(spec, store, engine, commit_threads=threads)
            dt = time.perf_counter() - t0
            nbytes = sum(r.nbytes for r in store.records().values())
            assert len(report.computed) == args.samples and report.failed == 0, report
            rows.append((path, threads, report.tokens / dt, nbytes / dt))
            shutil.rmtree(root)
            if engine.prepared is not None:
                shutil.rmtree(engine.prepared)
    print(f"{args.samples} samples x {args.tokens} tokens, hidden {args.hidden}, 3 aux + final, bf16, specforge\n")
    print("| commit path | commit threads | tokens/s | bytes/s | vs write, 1 thread |\n|---|---|---|---|---|")
    for path, threads, tok, byt in rows:
        print(f"| {path} | {threads} | {tok:,.0f} | {byt / 1e6:,.0f} MB/s | {tok / rows[0][2]:.2f}x |")


if __name__ == "__main__":
    main()
