"""The capture plugin's writers and the worker's commit of their dumps, by thread count, with no SGLang.

Three tables, every figure measured in this run on this machine:

1. Per-thread costs of the choices made (one Llama-width sample in memory): checksums, finiteness
   checks, torch.save with and without its zip CRC-32, safetensors built in memory vs streamed.
2. The plugin's `DumpWriter` (specforge dumps: serialise, sha256 while writing, fsync, rename) by
   writer threads, on tmpfs and on the local disk: the server side of capture.
3. The worker's commit of those dumps (`OutputStore.commit` through `run_shard`: read the dump,
   check ids, shapes, dtypes, loss mask, finiteness, the writer's sha256, rename into the store,
   append the index record) by commit threads, on tmpfs: the client side.

    .venv/bin/python benchmarks/writer_bench.py [--tokens 2000 --hidden 4096 --samples 16]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import time
import zlib
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch
from safetensors.torch import save as safetensors_bytes
from torch.utils.serialization import config as serialization_config

from layertap.engines.base import Engine
from layertap.models.tiny import build_tiny_model
from layertap.pipeline import run_shard
from layertap.sample import CapturedSample, SampleFile, TokenizedSample
from layertap.spec import ExtractionSpec, resolve_capture
from layertap.store.manifest import Manifest
from layertap.store.store import OutputStore
from sglang_patch.contract import AUX, FINAL_TENSORS, INPUT_IDS, SPECFORGE, dump_dir, format_rid, read_dump
from sglang_patch.sample_files import mask_runs, unpack_sample, write_safetensors
from sglang_patch.writer import DumpJob, DumpWriter, HostBudget

LAYERS = (1, 2, 3)


def best_rate(nbytes: int, fn: Callable[[], object], repeat: int = 3) -> float:
    """Bytes/s of the fastest of `repeat` calls."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best


def micro(states: torch.Tensor, folder: Path) -> list[str]:
    """Table 1: one thread, one sample's states [T, 4, H] bf16."""
    torch.set_num_threads(1)
    raw = states.view(torch.uint8).numpy().data
    n = states.nbytes
    path = folder / "micro.bin"

    def save(crc: bool) -> None:
        serialization_config.save.compute_crc32 = crc
        with path.open("wb") as f:
            torch.save({"s": states}, f)

    def stream() -> None:
        with path.open("wb") as f:
            write_safetensors({"s": states}, f)

    def built() -> None:
        with path.open("wb") as f:
            f.write(safetensors_bytes({"s": states}))

    rows = [
        ("checksum", "sha256 (hashlib)", best_rate(n, lambda: hashlib.sha256(raw).digest())),
        ("checksum", "blake2b (hashlib)", best_rate(n, lambda: hashlib.blake2b(raw).digest())),
        ("checksum", "crc32 (zlib)", best_rate(n, lambda: zlib.crc32(raw))),
        ("finite", "isfinite(t).all()", best_rate(n, lambda: bool(torch.isfinite(states).all()))),
        ("finite", "isfinite(t.abs().amax())", best_rate(n, lambda: bool(torch.isfinite(states.abs().amax())))),
        ("finite", "aminmax(t), both finite (used)", best_rate(n, lambda: [bool(x.isfinite()) for x in torch.aminmax(states)])),
        ("write to tmpfs", "torch.save, zip CRC-32 on (used)", best_rate(n, lambda: save(True))),
        ("write to tmpfs", "torch.save, zip CRC-32 off", best_rate(n, lambda: save(False))),
        ("write to tmpfs", "safetensors save() bytes, then write", best_rate(n, built)),
        ("write to tmpfs", "safetensors streamed from tensor memory (used)", best_rate(n, stream)),
    ]  # fmt: skip
    serialization_config.save.compute_crc32 = True
    path.unlink()
    torch.set_num_threads(os.cpu_count() or 1)
    return ["| step | method | GB/s (one thread) |", "|---|---|---|"] + [
        f"| {step} | {method} | {rate / 1e9:.2f} |" for step, method, rate in rows
    ]


def captured_states(tokens: int, hidden: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        INPUT_IDS: torch.full((tokens,), 5, dtype=torch.int64),
        AUX: torch.randn(tokens, len(LAYERS), hidden, generator=g).to(torch.bfloat16),
        FINAL_TENSORS["post"]: torch.randn(tokens, hidden, generator=g).to(torch.bfloat16),
    }


def write_dumps(root: Path, states: dict[str, torch.Tensor], rids: list[str], threads: int) -> float:
    """Seconds for a `threads`-thread DumpWriter to write one specforge dump per rid (as the plugin does,
    the buffers already on the host)."""
    shutil.rmtree(root, ignore_errors=True)
    budget = HostBudget(1 << 40)
    t0 = time.perf_counter()
    writer = DumpWriter(root, layers=LAYERS, finals=("post",), budget=budget, threads=threads, layout=SPECFORGE)
    for rid in rids:
        writer.submit(DumpJob(rid, tensors=states, loss_mask_runs=[[0, states[INPUT_IDS].shape[0]]]))
    writer.close()
    return time.perf_counter() - t0


class DumpEngine(Engine):
    """Hands out the plugin's dumps as the SGLang engine does once a reply came: read the dump (its
    tensors memory-mapped), take the file and the writer's sha256 as the sample's source."""

    def __init__(self, root: Path, rids: dict[str, str]) -> None:
        self.spec = resolve_capture(list(LAYERS), convention="capture", num_layers=len(LAYERS) + 2, final="post")
        self.root, self.rids = root, rids

    def capture(self, samples: Iterable[TokenizedSample]) -> Iterator[CapturedSample]:
        for s in samples:
            dump = read_dump(dump_dir(self.root, self.rids[s.sample_id]))
            views = unpack_sample(SPECFORGE, dump.tensors, len(LAYERS))
            source = SampleFile(dump.path / dump.meta.file, SPECFORGE, dump.meta.file_sha256)
            yield CapturedSample(s, views[AUX], views[FINAL_TENSORS["post"]], None, source=source)

    def describe(self) -> dict:
        return {"name": "plugin dumps"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tmpfs", type=Path, default=Path("/dev/shm/layertap-writer-bench"))
    ap.add_argument("--disk", type=Path, default=Path("/tmp/layertap-writer-bench"))
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--threads", default="1,2,4,8")
    args = ap.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    for folder in (args.tmpfs, args.disk):
        folder.mkdir(parents=True, exist_ok=True)
    states = captured_states(args.tokens, args.hidden, 0)
    stacked = torch.cat([states[AUX], states[FINAL_TENSORS["post"]].unsqueeze(1)], dim=1)
    mb = stacked.nbytes / 1e6
    out = [f"{args.samples} samples x {args.tokens} tokens, hidden {args.hidden}, 3 aux + final, bf16 specforge "
           f"(~{mb:.0f} MB per sample); {os.cpu_count()} cores.", "", "### 1. Per-thread costs", "",
           *micro(stacked, args.tmpfs), "", "### 2. Plugin writers (DumpWriter, specforge dumps)", "",
           "| volume | writer threads | GB/s | vs 1 thread |", "|---|---|---|---|"]  # fmt: skip
    rids = [format_rid("bench", f"s{i}", 0) for i in range(args.samples)]
    total = args.samples * stacked.nbytes
    for volume, folder in (("tmpfs", args.tmpfs), ("disk", args.disk)):
        base = None
        for n in threads:
            rate = total / write_dumps(folder / "dumps", states, rids, n)
            base = base or rate
            out.append(f"| {volume} | {n} | {rate / 1e9:.2f} | {rate / base:.2f}x |")
            print(out[-1], flush=True)
    out += ["", "### 3. Worker commit of those dumps (tmpfs; dumps and store on one filesystem)", "",
            "| commit threads | GB/s | tokens/s | vs 1 thread |", "|---|---|---|---|"]  # fmt: skip
    data = args.tmpfs / "data.jsonl"
    data.write_text(
        "".join(json.dumps({"id": f"s{i}", "input_ids": [5] * args.tokens}) + "\n" for i in range(args.samples))
    )
    model = args.disk / "model"  # only its tokenizer is used (rows are pretokenized)
    if not (model / "config.json").exists():
        build_tiny_model("llama", model)
    mask = mask_runs(torch.ones(args.tokens, dtype=torch.uint8))
    assert mask == ((0, args.tokens),)
    base = None
    for n in threads:
        write_dumps(args.tmpfs / "dumps", states, rids, 4)
        root = args.tmpfs / "store"
        shutil.rmtree(root, ignore_errors=True)
        engine = DumpEngine(args.tmpfs / "dumps", {f"s{i}": rid for i, rid in enumerate(rids)})
        spec = ExtractionSpec(model=model, data=data, layers=LAYERS)
        manifest = Manifest(
            format="specforge", model_path="bench", model_config_sha256="-", model_revision=None,
            tokenizer_sha256="-", chat_template_sha256=None, compute_dtype="bfloat16", store_dtype="bfloat16",
            hidden_size=args.hidden, num_layers=5, layer_ids_given=list(LAYERS), layer_convention="capture",
            capture_indices=list(LAYERS), final_post_norm=True, final_pre_norm=False, max_length=None,
            overlong="truncate", dataset_path=str(data), dataset_rows=args.samples, engine={"name": "bench"},
        )  # fmt: skip
        store = OutputStore.create_or_resume(root, manifest)
        t0 = time.perf_counter()
        report = run_shard(spec, store, engine, commit_threads=n, check_level="quick")
        dt = time.perf_counter() - t0
        assert len(report.computed) == args.samples and report.failed == 0, report
        nbytes = sum(r.nbytes for r in store.records().values())
        base = base or nbytes / dt
        out.append(f"| {n} | {nbytes / dt / 1e9:.2f} | {report.tokens / dt:,.0f} | {nbytes / dt / base:.2f}x |")
        print(out[-1], flush=True)
        store.close()
        shutil.rmtree(root)
    for folder in (args.tmpfs, args.disk):
        shutil.rmtree(folder, ignore_errors=True)
    print("\n".join(out))


if __name__ == "__main__":
    main()
