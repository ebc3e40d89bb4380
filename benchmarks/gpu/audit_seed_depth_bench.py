"""`layertap audit` of a seed-depth INT4 store on one GPU: verdict, peak memory, read rate, time per 1,000 tokens.

The folder is the seed's model at 1/48 of its experts, with weights: `layertap tiny-model --arch kimi-k2.5
--shape seed-depth --quantize int4` (61 layers, hidden 7168, MLA, first layer dense, 8 routed experts top-8 + 1
shared, routed experts pack-quantized INT4, the rest bf16; random weights, built here). Its store holds chats of the
seed's lengths (up to 4,096 tokens) captured at 3, 31, 59 + final by the HF engine on the GPU (bf16, the folder's
dtype). The audit then runs on the same GPU with the folder's pages evicted from the page cache first (a cold read),
and the shards are read once more, raw, for the disk's own rate. The notes project the real Kimi-K2.5 (384 experts,
554 GB) from what was measured: its work per token is this folder's (top-8 routing at the same widths).

    On the device: docs/performance.md ("Benchmarks on the device") has its recipe.
    CPU first: .venv/bin/python -m benchmarks audit_seed_depth --smoke --out /tmp/seed.md
"""

from __future__ import annotations

import argparse
import os
import random
import resource
import time
from pathlib import Path

from benchmarks import report
from benchmarks.common import Stages, chat_rows, log, write_jsonl
from benchmarks.report import git_commit
from harness.processes import run_layertap

KIMI_K25_BYTES = 554e9  # the released folder (kimi_k25_int4_layout.md)
KIMI_K25_EXPERTS, SEED_EXPERTS = 384, 8
GB = 1e9


def shards(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors"))


def evict(folder: Path) -> None:
    """Drop the folder's pages from the page cache (its files are ours: no privilege needed)."""
    for path in shards(folder):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def raw_read_rate(folder: Path) -> float:
    """Bytes per second reading every shard once, cold, in 64 MiB reads."""
    evict(folder)
    buf, total = bytearray(64 * 1024**2), 0
    started = time.perf_counter()
    for path in shards(folder):
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                total += n
    return total / (time.perf_counter() - started)


def build(args: argparse.Namespace) -> None:
    from layertap.models.folder import ModelFolder
    from layertap.tiny import build_tiny_model

    started = time.perf_counter()
    shape = {"shape": "tiny", "num_hidden_layers": 8} if args.smoke else {"shape": "seed-depth"}
    folder = build_tiny_model("kimi-k2.5", args.work / "folder", quantize="int4", **shape)
    rows = chat_rows(args.chats, random.Random(61), max_words=60 if args.smoke else 400)
    write_jsonl(args.work / "chats.jsonl", rows)
    size = sum(p.stat().st_size for p in shards(args.work / "folder"))
    layers = ModelFolder.read(folder).num_layers
    Stages(args.work).save("build", {"seconds": time.perf_counter() - started, "folder_bytes": size, "layers": layers})
    log(f"folder built: {size / GB:.1f} GB in {time.perf_counter() - started:.0f} s")


def extract(args: argparse.Namespace) -> None:
    layers = "1,3,5" if args.smoke else "3,31,59"
    device = "cpu" if args.smoke else "cuda"
    started = time.perf_counter()
    run = run_layertap("extract", "--model", args.work / "folder", "--data", args.work / "chats.jsonl", "--layers",
                       layers, "--format", "speculators", "--engine", "hf", "--device", device, "--trust-remote-code",
                       "--max-length", "4096", "--batch-tokens", "16384", "--out", args.work / "store")  # fmt: skip
    print(run.stdout[-2000:], run.stderr[-4000:])
    if run.returncode:
        raise SystemExit(f"extract failed ({run.returncode})")
    Stages(args.work).save("extract", {"seconds": time.perf_counter() - started})
    log(f"store written in {time.perf_counter() - started:.0f} s")


def audit(args: argparse.Namespace) -> dict:
    import torch

    from layertap.audit import audit_store
    from layertap.store.store import OutputStore

    folder, store = args.work / "folder", args.work / "store"
    evict(folder)
    report = audit_store(store, samples=args.samples, seed=0, device="cpu" if args.smoke else "cuda:0",
                         trust_remote_code=True, say=log)  # fmt: skip
    log(report.summary())
    host_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    raw = raw_read_rate(folder)
    lengths = sorted(r.num_tokens for r in OutputStore.open_existing(store).records().values())
    result = {
        "report": report.to_dict(), "markdown": report.markdown(), "host_peak": host_peak, "raw_read_rate": raw,
        "lengths": lengths, "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
    }  # fmt: skip
    Stages(args.work).save("audit", result)
    return result


def markdown(args: argparse.Namespace) -> str:
    """The table and its projection, from the stages' facts (``WORK/STAGE.json``)."""
    results = Stages(args.work)
    a, rep = results["audit"], results["audit"]["report"]
    seconds, tokens = rep["seconds"], rep["tokens"]
    folder_bytes = results["build"]["folder_bytes"]
    reading = rep["reading"]
    read_rate = a["raw_read_rate"]
    gpu_peak = rep["peak_device_bytes"] or 0
    lengths = a["lengths"]
    # Kimi-K2.5: the same per-token work (top-8 at the same widths), 48x the experts: 554 GB to read, each layer
    # held twice as stored on the host (the one computed, the one read ahead), the router's scores 48x wider.
    layer_bytes = folder_bytes / results["build"]["layers"]
    kimi_layer = KIMI_K25_BYTES / 61
    read_s = KIMI_K25_BYTES / read_rate
    lines = [
        f"# `layertap audit` at the seed's depth with weights ({'CPU smoke' if args.smoke else a['gpu']})", "",
        f"Written by `benchmarks/gpu/audit_seed_depth_bench.py` at commit {args.commit} "
        f"({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}). Folder: `layertap tiny-model --arch kimi-k2.5 "
        f"--shape seed-depth --quantize int4` ({folder_bytes / GB:.1f} GB: 61 layers, hidden 7168, MLA, first layer "
        "dense, 8 routed experts top-8 + 1 shared, routed experts INT4 pack-quantized, the rest bf16, random weights). "
        f"Store: {len(lengths)} chats (tokens per sample: min {lengths[0]}, median {lengths[len(lengths) // 2]}, max "
        f"{lengths[-1]}) captured at 3, 31, 59 + final by the HF engine (bf16) on the same GPU in "
        f"{results['extract']['seconds']:.0f} s. The audit ran on one GPU after the folder's pages were evicted "
        "from the page cache.", "",
        "| measure | value |", "|---|---|",
        f"| verdict | {'PASS' if rep['passed'] else 'FAIL'} |",
        f"| samples, tokens audited | {len(rep['samples'])} of {rep['samples_total']}, {tokens:,} |",
        f"| what the audit said before it started | {rep['memory']} |",
        f"| peak GPU memory (torch, max allocated) | {gpu_peak / 1024**3:.1f} GiB |",
        f"| peak host memory (process max RSS) | {a['host_peak'] / 1024**3:.1f} GiB |",
        f"| reading the folder | {reading} |",
        f"| the disk, raw (every shard cold, 64 MiB reads) | {read_rate / GB:.2f} GB/s |",
        f"| audit time | {seconds:.0f} s |",
        f"| time per 1,000 tokens | {1000 * seconds / max(tokens, 1):.2f} s |",
        "",
        "## Projection for the real Kimi-K2.5 (384 routed experts, 554 GB) on one GPU", "",
        f"- Reading: 554 GB at this disk's raw {read_rate / GB:.2f} GB/s is {read_s / 60:.0f} min, the floor of its "
        f"time (this folder: {folder_bytes / GB:.1f} GB).",
        f"- Computing: the work per token is this folder's (8 routed experts of 2048 per token + 1 shared, the same "
        f"attention), so ~{1000 * seconds / max(tokens, 1):.2f} s per 1,000 audited tokens as measured, plus "
        f"{KIMI_K25_EXPERTS // SEED_EXPERTS}x as many (smaller) expert calls per layer. With the read overlapped, "
        f"{tokens:,} tokens would take about max({read_s / 60:.0f} min, {seconds / 60:.0f} min) plus that overhead.",
        f"- GPU: as measured ({gpu_peak / 1024**3:.1f} GiB for {tokens:,} tokens) plus the router's 384 scores per "
        "token instead of 8; experts are dequantized one at a time, so their count does not enter.",
        f"- Host: two layers as stored, {2 * kimi_layer / GB:.1f} GB (here {2 * layer_bytes / GB:.1f} GB), plus the "
        "audited samples' stored states: well within an 8-GPU node's host memory.",
        "", "## The audit's report", "", a["markdown"].replace("# Audit of", "### Audit of", 1).replace("\n## ", "\n#### "),
    ]  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = report.parser(__doc__)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--work", type=Path, default=Path("/tmp/layertap-seed-audit"))
    ap.add_argument("--stage", default="build,extract,audit")
    ap.add_argument("--chats", type=int, default=110)
    ap.add_argument("--samples", type=int, default=100)
    ap.add_argument("--commit", default="")
    args = ap.parse_args(argv)
    if args.smoke:
        args.chats, args.samples = 8, 6
    args.commit = args.commit or git_commit()
    args.work.mkdir(parents=True, exist_ok=True)
    stages = args.stage.split(",")
    for stage, step in (("build", build), ("extract", extract), ("audit", audit)):
        if stage in stages:
            step(args)
    if "audit" in stages:
        done = Stages(args.work)
        result = report.result("audit_seed_depth", markdown(args), parameters=vars(args),
                               rows=[{"stage": stage, **done[stage]} for stage in ("build", "extract", "audit")])  # fmt: skip
        print(report.write(args.out, result) if args.out else report.render(result))
