"""One H200 run for the writer issue: plain prefill vs capture + commit, two model widths, two volumes.

For a Llama-8B-width model (hidden 4096, 8 layers; capture indices 2, 4, 6 + the post-norm final) and
a Kimi-K2-width DeepseekV3 (hidden 7168, 4 layers, first dense, 16 routed experts top-8, MLA; capture
indices 1, 2, 3 + final), both random bf16 weights, it measures in the same run:

- plain prefill tok/s at 1, 4, 16, 64 requests in flight (rids outside the capture namespace: the
  hooks return after one string test, so this is the server's own rate);
- capture + commit tok/s (prefill, D2H, the plugin's writers, the worker's checks and a rename into a
  specforge store) with the dump root and the store on tmpfs (/dev/shm), then on the local disk;
- each volume's own write rate: the same number of threads as the plugin's writers, files of the
  mean sample's size, written and fsynced;
- the ceiling min(plain prefill, disk rate / bytes per token), and the ratios against the targets.

Both servers start at once (their start-up and first-request kernel builds overlap) and run one at a
time; one server serves both volumes: its dump root is a symlink re-pointed between runs. The
results file is rewritten after every measurement, so a run killed at its time limit leaves a
partial table. Run on the device (sglang 0.5.14 in /tmp/site), from the repository root:

    PYTHONPATH=/tmp/site:. python3 benchmarks/gpu/capture_bench.py --out $OUT/gpu_capture_h200.md

``--cpu-smoke`` runs the same code on this machine's CPU SGLang (0.5.10) with the tiny models.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import torch

from layertap.data.scan import dataset_sha256
from layertap.engines.sglang import SGLangEngine
from layertap.engines.sglang_server import CPU_SERVER_ARGS, ServerConfig, SGLangServer
from layertap.models.folder import model_dims
from layertap.pipeline import run_shard
from layertap.spec import ExtractionSpec
from layertap.store.manifest import build_manifest
from layertap.store.store import OutputStore
from layertap.tiny.build import build_tiny_model
from sglang_patch.contract import FORMAT_FINAL

T0 = time.monotonic()
# Flags every GPU benchmark server gets; each adds its attention backend, chunk size and memory split.
GPU_COMMON = ("--skip-tokenizer-init", "--sampling-backend", "pytorch", "--grammar-backend", "none",
              "--disable-cuda-graph", "--skip-server-warmup", "--sleep-on-idle", "--dtype", "bfloat16")  # fmt: skip
GPU_ARGS = (*GPU_COMMON, "--attention-backend", "triton", "--chunked-prefill-size", "4096",
            # Two servers share the GPU: each sizes its static memory from what it sees free, and
            # max-total-tokens keeps the KV pool to what 64 prompts of 4000 tokens need.
            "--mem-fraction-static", "0.45", "--max-total-tokens", "300000")  # fmt: skip
CPU_ARGS = (*CPU_SERVER_ARGS, "--dtype", "bfloat16", "--chunked-prefill-size", "128")
CPU_STUB = Path("/opt/sglang-venv/layertap-cuda-stub")


@dataclass(frozen=True)
class Shape:
    name: str
    arch: str
    overrides: dict[str, Any]
    layers: tuple[int, ...]


SHAPES = (
    Shape("Llama-8B width", "llama", dict(hidden_size=4096, num_hidden_layers=8, intermediate_size=14336,
          num_attention_heads=32, num_key_value_heads=8), (2, 4, 6)),
    Shape("Kimi-K2 width", "kimi-k2", dict(hidden_size=7168, num_hidden_layers=4, first_k_dense_replace=1,
          intermediate_size=18432, moe_intermediate_size=2048, n_routed_experts=16, num_experts_per_tok=8,
          n_group=1, topk_group=1, n_shared_experts=1, num_attention_heads=64, num_key_value_heads=64,
          q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128),
          (1, 2, 3)),
)  # fmt: skip
TINY_SHAPES = (Shape("tiny Llama", "llama", {}, (1, 3, 5)), Shape("tiny Kimi-K2", "kimi-k2", {}, (1, 2, 4)))


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} +{time.monotonic() - T0:4.0f}s] {message}", flush=True)


@dataclass(frozen=True)
class CaptureRun:
    """One capture + commit run: rates, and where its time went. A `*_busy` is the share of that
    side's thread-time spent working (1.0: every thread busy the whole run, the side is the bound)."""

    tok_s: float
    bytes_s: float
    waited_s: float  # the forward pass, on the writers' host-memory cap
    writers_busy: float  # the plugin's writers serialising + writing + fsyncing (meta "write_s")
    copy_wait: float  # the plugin's writers waiting for the device-to-host copies (meta "ready_s")
    commit_busy: float  # the worker's checks + rename + hash + index append
    pinned_held: float  # torch's pinned allocator, cache included: the most it held (bytes)
    pinned_alloc_s: float  # seconds the forward pass's thread spent growing it (cudaHostAlloc) in this run
    store: Path | None = None  # the store, when the caller keeps it


class TimedStore(OutputStore):
    """An OutputStore that adds up its commits' seconds (commit threads append; list.append is atomic)."""

    commit_s: list[float]

    def commit(self, captured: Any) -> Any:
        t0 = time.perf_counter()
        record = super().commit(captured)
        self.commit_s.append(time.perf_counter() - t0)
        return record


@dataclass
class Results:
    """Everything measured so far; `write` renders it (called after each measurement)."""

    path: Path
    header: list[str]
    plain: dict[str, dict[int, float]] = field(default_factory=dict)
    capture: dict[tuple[str, str], dict[int, CaptureRun]] = field(default_factory=dict)
    volume: dict[tuple[str, str], float] = field(default_factory=dict)  # (shape, volume) -> bytes/s
    volume_threads: int = 8
    bytes_per_token: dict[str, float] = field(default_factory=dict)  # measured in the store
    expected_bpt: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def write(self) -> None:
        lines = [*self.header, "## Plain prefill (tok/s)", "", "| shape | " + " | ".join(
            f"{n} in flight" for n in IN_FLIGHT_PLAIN) + " |", "|---" * (len(IN_FLIGHT_PLAIN) + 1) + "|"]  # fmt: skip
        for shape, rates in self.plain.items():
            lines.append(
                f"| {shape} | " + " | ".join(f"{rates[n]:,.0f}" if n in rates else "-" for n in IN_FLIGHT_PLAIN) + " |"
            )
        lines += ["", "## Capture + commit", "",
                  "Busy: the share of each side's thread-time spent working (writers: serialise + write + "
                  "fsync; copy wait: writers waiting for the device-to-host copies; worker: checks + rename + "
                  "hash + index). A side near 1.0 is the bound.", "",
                  "| shape | volume | in flight | tok/s | written MB/s | forward pass waited on the writers (s) "
                  "| writers busy | writers' copy wait | worker commit busy | pinned held (GB) | pinned alloc (s) |",
                  "|---" * 11 + "|"]  # fmt: skip
        for (shape, volume), runs in self.capture.items():
            for n, r in runs.items():
                lines.append(f"| {shape} | {volume} | {n} | {r.tok_s:,.0f} | {r.bytes_s / 1e6:,.0f} | {r.waited_s:.2f} "
                             f"| {r.writers_busy:.2f} | {r.copy_wait:.2f} | {r.commit_busy:.2f} "
                             f"| {r.pinned_held / 1e9:.1f} | {r.pinned_alloc_s:.2f} |")  # fmt: skip
        lines += ["", "## Volumes' own write rate (whole files of the mean sample's size, each fsynced; measured "
                  "first, nothing else running)", "", "| shape | volume | threads | file MB | MB/s |",
                  "|---|---|---|---|---|"]  # fmt: skip
        for (shape, volume), rate in self.volume.items():
            size = self.expected_bpt[shape] * MEAN_TOKENS / 1e6
            lines.append(f"| {shape} | {volume} | {self.volume_threads} | {size:.1f} | {rate / 1e6:,.0f} |")
        lines += ["", "## Against the targets (best in-flight setting of each)", "",
                  "| shape | plain tok/s | tmpfs capture tok/s | tmpfs / plain (>= 0.90) | bytes/token | disk MB/s | "
                  "ceiling tok/s | disk capture tok/s | disk / ceiling (>= 0.90) |", "|---" * 9 + "|"]  # fmt: skip
        for shape, rates in self.plain.items():
            plain = max(rates.values())
            tmpfs = max((r.tok_s for r in self.capture.get((shape, "tmpfs"), {}).values()), default=0.0)
            disk = max((r.tok_s for r in self.capture.get((shape, "disk"), {}).values()), default=0.0)
            bpt = self.bytes_per_token.get(shape, self.expected_bpt[shape])
            disk_rate = self.volume.get((shape, "disk"))
            ceiling = min(plain, disk_rate / bpt) if disk_rate else None
            lines.append(
                f"| {shape} | {plain:,.0f} | {tmpfs:,.0f} | {tmpfs / plain:.2f} | "
                f"{bpt / 1e3:.1f} KB | {f'{disk_rate / 1e6:,.0f}' if disk_rate else '-'} | "
                f"{f'{ceiling:,.0f}' if ceiling else '-'} | {disk:,.0f} | {f'{disk / ceiling:.2f}' if ceiling else '-'} |"
            )
        self.path.write_text("\n".join([*lines, "", *self.notes, ""]))


IN_FLIGHT_PLAIN = (1, 4, 16, 64)
MEAN_TOKENS = 0.0  # set from the prompts


def prompts(n: int, seed: int, low: int, high: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 1500) for _ in range(rng.randint(low, high))] for _ in range(n)]


def plain_rate(client: httpx.Client, url: str, batch: list[list[int]], in_flight: int) -> float:
    def one(ids: list[int]) -> None:
        body = {"input_ids": ids, "rid": f"plain-{uuid.uuid4().hex}", "sampling_params": {"max_new_tokens": 0}}
        reply = client.post(url + "/generate", json=body)
        assert reply.status_code == 200, reply.text[:300]

    t0 = time.perf_counter()
    with ThreadPoolExecutor(in_flight) as pool:
        list(pool.map(one, batch))
    return sum(map(len, batch)) / (time.perf_counter() - t0)


def volume_rate(folder: Path, file_bytes: int, threads: int, total_bytes: int) -> float:
    """Bytes/s of `threads` threads each writing whole files of `file_bytes` and fsyncing them."""
    folder.mkdir(parents=True, exist_ok=True)
    chunk = os.urandom(min(file_bytes, 16 << 20))
    files = max(2 * threads, total_bytes // max(file_bytes, 1))

    def write(i: int) -> None:
        with open(folder / f"f{i}", "wb") as f:
            left = file_bytes
            while left > 0:
                left -= f.write(chunk[: min(left, len(chunk))])
            f.flush()
            os.fsync(f.fileno())

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(write, range(files)))
    rate = files * file_bytes / (time.perf_counter() - t0)
    shutil.rmtree(folder)
    return rate


@dataclass
class Bench:
    """One shape's model and server; `link` is the server's dump root, a symlink re-pointed per volume;
    `quantize`: what the server's plugin quantizes its dumps to ("none" or "fp8")."""

    shape: Shape
    model: Path
    link: Path
    server: SGLangServer
    quantize: str = "none"


def repoint(link: Path, target: Path) -> None:
    target.mkdir(parents=True, exist_ok=True)
    tmp = link.with_name(link.name + ".new")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(target)
    os.replace(tmp, link)


def capture_rate(bench: Bench, root: Path, work: Path, batch: list[list[int]], in_flight: int, commit_threads: int,
                 *, fmt: str = "specforge", store_dtype: str = "bfloat16", keep: bool = False) -> CaptureRun:  # fmt: skip
    """Prefill + capture + checks + commit into a `fmt` store in `store_dtype` under `root`, the server's dumps
    under `root` too (a commit is a rename); the store is removed unless `keep` (then `CaptureRun.store`)."""
    tag = f"{bench.shape.arch}-{bench.quantize}-{in_flight}-{uuid.uuid4().hex[:6]}"
    repoint(bench.link, root / f"dumps-{bench.shape.arch}-{bench.quantize}")
    data = work / f"data-{tag}.jsonl"
    data.write_text("".join(json.dumps({"id": f"b{i}", "input_ids": ids}) + "\n" for i, ids in enumerate(batch)))
    spec = ExtractionSpec(model=bench.model, data=data, layers=bench.shape.layers, format=fmt,  # type: ignore[arg-type]
                          store_dtype=store_dtype)  # type: ignore[arg-type]  # fmt: skip
    num_layers, hidden = model_dims(bench.model)
    cap = spec.resolve(num_layers)
    writer: list[dict[str, float]] = []
    engine = SGLangEngine(bench.server, cap, model=bench.model, dump_root=bench.link, job=f"bench-{tag}", in_flight=in_flight,
                          on_writer=writer.append)  # fmt: skip
    manifest = build_manifest(spec, cap, hidden_size=hidden, compute_dtype="bfloat16", dataset_rows=len(batch),
                              dataset_sha256=dataset_sha256(data),
                              engine=engine.describe())  # fmt: skip
    store_root = root / f"store-{tag}"
    store = TimedStore.create_or_resume(store_root, manifest)
    store.commit_s = []
    t0 = time.perf_counter()
    report = run_shard(spec, store, engine, check_level="quick", commit_threads=commit_threads)
    dt = time.perf_counter() - t0
    assert len(report.computed) == len(batch) and report.failed == 0, report
    nbytes = sum(r.nbytes for r in store.records().values())
    store.close()
    if not keep:
        shutil.rmtree(store_root)
    data.unlink()
    writer_time = dt * (writer[0]["threads"] if writer else 1)

    def total(key: str) -> float:
        return sum(float(stats.get(key, 0.0)) for stats in writer)

    def spread(key: str) -> float:
        values = [float(stats.get(key, 0.0)) for stats in writer] or [0.0]
        return max(values) - min(values)

    return CaptureRun(tok_s=report.tokens / dt, bytes_s=nbytes / dt, waited_s=total("wait_s"),
                      writers_busy=total("write_s") / writer_time, copy_wait=total("ready_s") / writer_time,
                      commit_busy=sum(store.commit_s) / (dt * commit_threads),
                      pinned_held=max((float(s.get("pinned_held_bytes", 0)) for s in writer), default=0.0),
                      pinned_alloc_s=spread("pinned_alloc_s"), store=store_root if keep else None)  # fmt: skip


def start_servers(shapes: tuple[Shape, ...], args: argparse.Namespace, smoke: bool, *, layout: str = "specforge",
                  quantize: tuple[str, ...] = ("none",), sglang_args: tuple[str, ...] | None = None) -> list[Bench]:  # fmt: skip
    """Build each model and launch its servers (one per `quantize` setting, writing `layout` dumps) without
    waiting; the next model builds meanwhile. The processes are launched from this (main) thread: a server
    dies with the thread that launched it."""
    python = Path("/opt/sglang-venv/bin/python") if smoke else Path(shutil.which("python3") or "python3")
    env = {"SGLANG_USE_CPU_ENGINE": "1", "LD_LIBRARY_PATH": str(CPU_STUB)} if smoke else {}
    benches, starting = [], ThreadPoolExecutor(len(shapes) * len(quantize))
    futures = []
    for shape in shapes:
        model = build_tiny_model(shape.arch, args.work / f"model-{shape.arch}", dtype=torch.bfloat16, **shape.overrides)
        log(f"{shape.name}: model built ({sum(p.stat().st_size for p in model.glob('*.safetensors')) / 1e9:.1f} GB)")
        for q in quantize:
            link = args.work / f"dumproot-{shape.arch}-{q}"
            repoint(link, Path(args.tmpfs) / f"dumps-{shape.arch}-{q}")
            config = ServerConfig(python=python, env=env, model=model, dump_root=link, layers=shape.layers,
                                  final=FORMAT_FINAL[layout], layout=layout, quantize=q,
                                  log_path=args.out.with_name(f"server-{shape.arch}-{q}.log"),
                                  sglang_args=sglang_args or (CPU_ARGS if smoke else GPU_ARGS),
                                  writer_threads=args.writer_threads, pinned_cap=args.pinned_cap)  # fmt: skip
            bench = Bench(shape, model, link, SGLangServer(config), quantize=q)
            benches.append(bench)
            bench.server.launch()
            futures.append(starting.submit(bench.server.wait_ready))
    for bench, future in zip(benches, futures, strict=True):
        try:
            future.result()
        except Exception as exc:  # two servers sizing GPU memory at once can collide: retry alone
            log(
                f"{bench.shape.name} ({bench.quantize}): server failed to start ({type(exc).__name__}); starting it again alone"
            )
            bench.server.stop()
            bench.server.start()
        log(f"{bench.shape.name} ({bench.quantize}): server up at {bench.server.url}")
    starting.shutdown()
    return benches


def main() -> None:
    global MEAN_TOKENS
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--out", type=Path, default=None, help="results markdown (default: benchmarks/results/gpu_capture_h200.md)"
    )
    ap.add_argument("--work", type=Path, default=Path("/tmp/layertap-bench"), help="models, data (local disk)")
    ap.add_argument("--tmpfs", type=Path, default=Path("/dev/shm/layertap-bench"))
    ap.add_argument("--disk", type=Path, default=Path("/tmp/layertap-bench/disk"), help="a folder on the local disk")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--capture-in-flight", default="4,16,64")
    # 8, not the plugin's default of 4: these 8- and 4-layer models prefill several times faster per GPU
    # than the real 32- and 61-layer ones, so each server here makes several times a real one's bytes/s.
    ap.add_argument("--writer-threads", type=int, default=8, help="the plugin's writer threads")
    ap.add_argument("--pinned-cap", default=None, help="the plugin's host-memory cap, e.g. 4G (default: its own)")
    ap.add_argument("--commit-threads", type=int, default=8)
    ap.add_argument("--deadline-s", type=float, default=460.0, help="skip measurements that would start past this")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny models on this machine's CPU SGLang")
    args = ap.parse_args()
    smoke = args.cpu_smoke
    args.out = args.out or (
        Path("/tmp/capture_bench_smoke.md") if smoke else Path("benchmarks/results/gpu_capture_h200.md")
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    shapes = TINY_SHAPES if smoke else SHAPES
    low, high = (32, 300) if smoke else (512, 4000)
    batch = prompts(args.prompts, 7, low, high)
    MEAN_TOKENS = sum(map(len, batch)) / len(batch)
    capture_in_flight = [int(n) for n in args.capture_in_flight.split(",")]
    shutil.rmtree(args.work, ignore_errors=True)
    shutil.rmtree(args.tmpfs, ignore_errors=True)
    args.work.mkdir(parents=True)
    from sglang_patch.settings import DEFAULT_PINNED_CAP_BYTES

    writer_threads = args.writer_threads
    results = Results(args.out, header=[
        f"# SGLang capture vs plain prefill ({'CPU smoke test, tiny models' if smoke else 'one H200, sglang 0.5.14'})", "",
        f"Written by `benchmarks/gpu/capture_bench.py` ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}). "
        f"{args.prompts} prompts of {low}-{high} random token ids (mean {MEAN_TOKENS:.0f}), max_new_tokens 0, "
        "random bf16 weights, specforge dumps written by the plugin and renamed into the store after the "
        "worker's checks (ids, shapes, dtypes, loss mask, finite), its sha256 hashed by the worker. Plugin: "
        f"{writer_threads} writer threads, pinned cap {args.pinned_cap or f'{DEFAULT_PINNED_CAP_BYTES >> 30}G'}; "
        f"worker: {args.commit_threads} commit threads. Server flags: `{' '.join(CPU_ARGS if smoke else GPU_ARGS)}`.",
        "",
    ])  # fmt: skip
    results.expected_bpt = {shape.name: expected_bytes_per_token(shape) for shape in shapes}
    volume_rates(shapes, results, args, writer_threads)
    benches = start_servers(shapes, args, smoke)

    def measure_all(client: httpx.Client) -> None:
        for bench in benches:
            measure(bench, batch, capture_in_flight, client, results, args)

    run_warm(benches, (low, high), results, args.out, measure_all)


def run_warm(benches: list[Bench], lengths: tuple[int, int], results: Any, out: Path,
             measure_all: Callable[[httpx.Client], None]) -> None:  # fmt: skip
    """Warm every server (first requests build kernels: all at once), run `measure_all`, then stop the servers,
    write `results` (whatever was measured) and print them."""
    client = httpx.Client(timeout=600)
    try:
        with ThreadPoolExecutor(len(benches)) as pool:
            list(pool.map(lambda b: plain_rate(client, b.server.url, prompts(4, 99, *lengths), 4), benches))
        log("kernels warm")
        measure_all(client)
    finally:
        for bench in benches:
            bench.server.stop()
        client.close()
        results.write()
        log(f"results in {out}")
    print(out.read_text())


def measure(bench: Bench, batch: list[list[int]], capture_in_flight: list[int], client: httpx.Client,
            results: Results, args: argparse.Namespace) -> None:  # fmt: skip
    """Every measurement of one shape, each written to the results file as it lands."""
    name = bench.shape.name

    def on_time(what: str) -> bool:
        if time.monotonic() - T0 > args.deadline_s:
            results.notes.append(f"- Skipped (past the {args.deadline_s:.0f} s deadline): {name}, {what}.")
            log(f"{name}: past the deadline, skipping {what}")
            return False
        return True

    results.plain[name] = {}
    for n in IN_FLIGHT_PLAIN:
        if on_time(f"plain prefill at {n} in flight"):
            results.plain[name][n] = plain_rate(client, bench.server.url, batch, n)
            log(f"{name}: plain prefill, {n} in flight: {results.plain[name][n]:,.0f} tok/s")
            results.write()
    warm = min(8, len(batch))
    capture_rate(bench, Path(args.tmpfs), args.work, batch[:warm], warm, args.commit_threads)  # pinned allocator
    for volume, root in (("tmpfs", Path(args.tmpfs)), ("disk", Path(args.disk))):
        runs = results.capture.setdefault((name, volume), {})
        for n in capture_in_flight:
            if on_time(f"capture on {volume} at {n} in flight"):
                run = runs[n] = capture_rate(bench, root, args.work, batch, n, args.commit_threads)
                results.bytes_per_token[name] = run.bytes_s / run.tok_s
                log(f"{name}: capture on {volume}, {n} in flight: {run}")
                results.write()


def volume_rates(shapes: tuple[Shape, ...], results: Results, args: argparse.Namespace, writer_threads: int) -> None:
    """Each volume's own write rate with files of each shape's mean sample, measured first, while
    nothing else runs (a ceiling even if the run is cut short)."""
    threads = results.volume_threads = max(8, writer_threads)  # the volume's best, not our writers'
    for shape in shapes:
        file_bytes = int(expected_bytes_per_token(shape) * MEAN_TOKENS)
        for volume, root in (("tmpfs", Path(args.tmpfs)), ("disk", Path(args.disk))):
            total = max(8 * file_bytes, (64 << 20) if args.cpu_smoke else (4 << 30))
            results.volume[(shape.name, volume)] = volume_rate(root / "rate", file_bytes, threads, total)
            log(f"{shape.name}: {volume} takes {results.volume[(shape.name, volume)] / 1e9:.2f} GB/s "
                f"({threads} threads, {file_bytes / 1e6:.0f} MB files, fsync)")  # fmt: skip
            results.write()


def expected_bytes_per_token(shape: Shape) -> float:
    """A specforge sample's bytes per token: k aux states + the final, bf16, and two int64 (ids, mask)."""
    return (len(shape.layers) + 1) * shape.overrides.get("hidden_size", 64) * 2 + 16


if __name__ == "__main__":
    main()
