"""The capture plugin's writers and the worker's commit of their dumps, by thread count, with no SGLang.

Five tables, every figure measured in this run on this machine:

1. Per-thread costs of the choices made (one Llama-width sample in memory): checksums, finiteness
   checks, torch.save with and without its zip CRC-32, safetensors built in memory vs streamed.
2. The plugin's `DumpWriter` (specforge dumps: serialise, write, fsync, rename) by
   writer threads, on tmpfs and on the local disk: the server side of capture.
3. The worker's commit of those dumps (`OutputStore.commit` through `Run.rows`: read the dump,
   check ids, shapes, dtypes, loss mask, finiteness, rename into the store, hash the file, append
   the index record) by commit threads, on tmpfs: the client side.
4. One writer beside a busy Python loop, as the writers run beside SGLang's scheduler loop: the
   loop in a thread (sharing the writer's GIL) or in a process (sharing only the cores), for the
   way the plugin writes now and the way it wrote before (torch.save through a Python file object
   that hashed the bytes on their way): how much each slows the other.
5. The speculators layout's writers, by writer threads on tmpfs: the file's ``hidden_states`` [T, k+1, H]
   stacked by the writer on the host (how it wrote before: one more full copy of each sample) against
   staged already stacked by the hook on the device (how it writes now).

    .venv/bin/python -m benchmarks writer [--tokens 2000 --hidden 4096 --samples 16] [--out benchmarks/results/NAME]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import os
import shutil
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save as safetensors_bytes
from torch.utils.serialization import config as serialization_config

from benchmarks import report
from benchmarks.common import write_jsonl
from layertap.engines.base import Engine
from layertap.engines.sglang import captured_from_dump
from layertap.pipeline import Run
from layertap.sample import CapturedSample, TokenizedSample
from layertap.settings import RunSettings
from layertap.spec import ExtractionSpec, resolve_capture
from layertap.tiny.build import build_tiny_model
from sglang_patch.contract import (
    AUX,
    FINAL_TENSORS,
    INPUT_IDS,
    SPECFORGE,
    SPECULATORS,
    dump_dir,
    format_rid,
    read_dump,
)
from sglang_patch.sample_files import (
    mask_runs,
    specforge_tensors,
    speculators_tensors,
    stack_aux_final,
    write_safetensors,
)
from sglang_patch.writer import DumpJob, DumpWriter, HostBudget, write_tensors_file

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
    return report.table_lines(["step", "method", "GB/s (one thread)"], [(s, m, f"{r / 1e9:.2f}") for s, m, r in rows])


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


def spin(stop: Any, counter: Any) -> None:
    """A pure-Python loop standing for SGLang's scheduler loop (it holds the GIL but to wait)."""
    while not stop.is_set():
        for _ in range(1000):
            pass
        counter[0] += 1


def run_loop(kind: str, seconds: float | None, work: Callable[[], object] | None = None) -> tuple[float, float]:
    """Run `spin` in a thread or a process while `work()` runs (or for `seconds`); returns (the loop's
    iterations/s, work's seconds)."""
    ctx = multiprocessing.get_context("fork")
    stop, counter = ctx.Event(), ctx.Array("q", 1, lock=False)
    cls = threading.Thread if kind == "thread" else ctx.Process
    loop = cls(target=spin, args=(stop, counter))
    loop.start()
    time.sleep(0.2)  # the loop is running (a forked process takes a moment)
    start_count, t0 = counter[0], time.perf_counter()
    if work is None:
        time.sleep(seconds or 0.0)
    else:
        work()
    dt = time.perf_counter() - t0
    rate = (counter[0] - start_count) / dt
    stop.set()
    loop.join()
    return rate, dt


def save_hashing(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """How the plugin wrote before: torch.save into a Python file object that hashed every chunk."""
    digest = hashlib.sha256()
    with path.open("wb") as raw:

        class Hashing:
            def write(self, data: memoryview) -> int:
                digest.update(data)
                return raw.write(data)

            def flush(self) -> None:
                raw.flush()

        torch.save(tensors, Hashing())
        raw.flush()
        os.fsync(raw.fileno())


def beside_loop(states: dict[str, torch.Tensor], folder: Path, dumps: int) -> list[str]:
    """Table 4: one writer thread writing `dumps` specforge files, beside nothing, a busy thread or a
    busy process; the writer's rate, and the loop's rate against the loop alone."""
    tensors = specforge_tensors(states[INPUT_IDS], torch.ones_like(states[INPUT_IDS]), states[AUX],
                                states[FINAL_TENSORS["post"]])  # fmt: skip
    nbytes = sum(t.nbytes for t in tensors.values()) * dumps
    methods = {"before: torch.save to a hashing Python file": save_hashing,
               "now: torch.save to a path, no hash": lambda p, t: write_tensors_file(p, SPECFORGE, t)}  # fmt: skip
    rows = ["| writer | loop in | writer GB/s | loop's rate vs alone |", "|---|---|---|---|"]
    for name, write in methods.items():

        def work(write: Callable[[Path, dict], object] = write) -> None:
            for i in range(dumps):
                write(folder / f"loop-{i}.pt", tensors)

        t0 = time.perf_counter()
        work()
        rows.append(f"| {name} | (no loop) | {nbytes / (time.perf_counter() - t0) / 1e9:.2f} | - |")
        for kind in ("thread", "process"):
            alone, _ = run_loop(kind, 2.0)
            rate, dt = run_loop(kind, None, work)
            rows.append(f"| {name} | a {kind} | {nbytes / dt / 1e9:.2f} | {rate / alone:.2f} |")
            print(rows[-1], flush=True)
    for path in folder.glob("loop-*.pt"):
        path.unlink()
    return rows


class DumpEngine(Engine):
    """Hands out the plugin's dumps as the SGLang engine does once a reply came: the dump read once (its tensors
    views of the mapped file) and its file handed over to be renamed (`captured_from_dump`)."""

    compute_dtype = "bfloat16"  # what `captured_states` makes

    def __init__(self, root: Path, rids: dict[str, str]) -> None:
        self.spec = resolve_capture(list(LAYERS), convention="capture", num_layers=len(LAYERS) + 2, final="post")
        self.root, self.rids = root, rids

    def capture(self, samples: Iterable[TokenizedSample]) -> Iterator[CapturedSample]:
        for s in samples:
            yield captured_from_dump(read_dump(dump_dir(self.root, self.rids[s.sample_id])), s, self.spec)

    def describe(self) -> dict:
        return {"name": "plugin dumps"}


def bench_model(folder: Path, hidden: int) -> Path:
    """A model folder whose config says ``hidden`` wide, with no weights: only its config and tokenizer are read (the
    dumps are made here, the rows pretokenized)."""
    if not (folder / "config.json").exists():
        build_tiny_model("llama", folder)
        for weights in folder.glob("*.safetensors"):
            weights.unlink()
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "hidden_size": hidden, "num_hidden_layers": 5}))
    return folder


def writer_table(args: argparse.Namespace, states: dict[str, torch.Tensor], rids: list[str], nbytes: int) -> list[str]:
    """Table 2: `DumpWriter` by writer threads, on tmpfs and on the disk."""
    rows = ["| volume | writer threads | GB/s | vs 1 thread |", "|---|---|---|---|"]
    for volume, folder in (("tmpfs", args.tmpfs), ("disk", args.disk)):
        base = None
        for n in args.threads:
            rate = len(rids) * nbytes / write_dumps(folder / "dumps", states, rids, n)
            base = base or rate
            rows.append(f"| {volume} | {n} | {rate / 1e9:.2f} | {rate / base:.2f}x |")
            print(rows[-1], flush=True)
    return rows


def speculators_table(args: argparse.Namespace, states: dict[str, torch.Tensor], rids: list[str]) -> list[str]:
    """Table 5: speculators files written by N threads, stacked by the writer (before) or staged stacked (now)."""
    ids, aux = states[INPUT_IDS], states[AUX]
    pre = states[FINAL_TENSORS["post"]]  # any [T, H] state of the same size
    staged = stack_aux_final(aux, pre)
    folder = args.tmpfs / "speculators"

    def rate(threads: int, tensors: Callable[[], dict[str, torch.Tensor]]) -> float:
        def write_all() -> None:
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)
            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(lambda i: write_tensors_file(folder / f"{i}", SPECULATORS, tensors()), range(len(rids))))

        return best_rate(len(rids) * staged.nbytes, write_all)

    rows = ["| writer threads | before: the writer stacks aux + final (GB/s) | now: staged stacked (GB/s) | now / before |",
            "|---|---|---|---|"]  # fmt: skip
    for n in args.threads:
        before = rate(n, lambda: speculators_tensors(ids, stack_aux_final(aux, pre)))
        now = rate(n, lambda: speculators_tensors(ids, staged))
        rows.append(f"| {n} | {before / 1e9:.2f} | {now / 1e9:.2f} | {now / before:.2f}x |")
        print(rows[-1], flush=True)
    shutil.rmtree(folder, ignore_errors=True)
    return rows


def commit_table(args: argparse.Namespace, states: dict[str, torch.Tensor], rids: list[str]) -> list[str]:
    """Table 3: the worker's `Run.rows` + `OutputStore.commit` of the writers' dumps, by commit threads."""
    rows = ["| commit threads | GB/s | tokens/s | vs 1 thread |", "|---|---|---|---|"]
    rows_in = [{"id": f"s{i}", "input_ids": [5] * args.tokens} for i in range(len(rids))]
    data = write_jsonl(args.tmpfs / "data.jsonl", rows_in)
    model = bench_model(args.disk / "model", args.hidden)
    assert mask_runs(torch.ones(args.tokens, dtype=torch.uint8)) == ((0, args.tokens),)
    base = None
    for n in args.threads:
        write_dumps(args.tmpfs / "dumps", states, rids, 4)
        root = args.tmpfs / "store"
        shutil.rmtree(root, ignore_errors=True)
        spec = ExtractionSpec(model=model, data=data, layers=LAYERS)
        engine = DumpEngine(args.tmpfs / "dumps", {f"s{i}": rid for i, rid in enumerate(rids)})
        t0 = time.perf_counter()
        settings = RunSettings(commit_threads=n, resume_check="quick")
        run = Run.create(spec, root, lambda cap, folder, e=engine: e, settings)
        report = run.rows()
        dt = time.perf_counter() - t0
        assert len(report.computed) == len(rids) and report.failed == 0, report
        written = sum(r.nbytes for r in run.store.records().values())
        base = base or written / dt
        rows.append(f"| {n} | {written / dt / 1e9:.2f} | {report.tokens / dt:,.0f} | {written / dt / base:.2f}x |")
        print(rows[-1], flush=True)
        run.store.close()
        shutil.rmtree(root)
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = report.parser(__doc__)
    ap.add_argument("--tmpfs", type=Path, default=Path("/dev/shm/layertap-writer-bench"))
    ap.add_argument("--disk", type=Path, default=Path("/tmp/layertap-writer-bench"))
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--threads", type=lambda s: [int(t) for t in s.split(",")], default=[1, 2, 4, 8])
    ap.add_argument("--out", type=Path, help="where to write the result (NAME.json and NAME.md)")
    ap.add_argument("--tables", type=lambda s: {int(t) for t in s.split(",")}, default={1, 2, 3, 4, 5})
    args = ap.parse_args(argv)
    if args.smoke:
        args.hidden, args.tokens, args.samples, args.threads = 64, 32, 4, [1, 2]
    for folder in (args.tmpfs, args.disk):
        folder.mkdir(parents=True, exist_ok=True)
    states = captured_states(args.tokens, args.hidden, 0)
    stacked = torch.cat([states[AUX], states[FINAL_TENSORS["post"]].unsqueeze(1)], dim=1)
    rids = [format_rid("bench", f"s{i}", 0) for i in range(args.samples)]
    tables = {
        1: ("Per-thread costs", lambda: micro(stacked, args.tmpfs)),
        2: ("Plugin writers (DumpWriter, specforge dumps)", lambda: writer_table(args, states, rids, stacked.nbytes)),
        3: ("Worker commit of those dumps (tmpfs; dumps and store on one filesystem)",
            lambda: commit_table(args, states, rids)),
        4: ("One writer beside a busy Python loop (the scheduler's), tmpfs",
            lambda: beside_loop(states, args.tmpfs, args.samples)),
        5: ("Plugin writers, speculators layout (tmpfs)", lambda: speculators_table(args, states, rids)),
    }  # fmt: skip
    out = [f"{args.samples} samples x {args.tokens} tokens, hidden {args.hidden}, 3 aux + final, bf16 specforge "
           f"(~{stacked.nbytes / 1e6:.0f} MB per sample); {os.cpu_count()} cores."]  # fmt: skip
    for number, (title, table) in tables.items():
        if number in args.tables:
            out += ["", f"### {number}. {title}", "", *table()]
    for folder in (args.tmpfs, args.disk):
        shutil.rmtree(folder, ignore_errors=True)
    measured = report.result("writer", "\n".join(out) + "\n", parameters=vars(args))
    print(report.write(args.out, measured) if args.out else report.render(measured))
