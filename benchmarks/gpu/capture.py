"""The SGLang capture measurements that capture_bench, fp8_bench, seed_scale_bench and int4_bench share: the model
shapes, their servers (launched together, one per dump quantization), capture + commit runs into a store, and a
volume's own write rate."""

from __future__ import annotations

import argparse
import os
import shutil
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import torch

from benchmarks.common import GPU_COMMON, log, plain_rate, prompts, sglang_python, wait_side_by_side, write_jsonl
from harness.sglang import cpu_server_args, cpu_server_env
from layertap.engines.sglang import ServerConfig, SGLangEngine, SGLangServer
from layertap.pipeline import Committed, ProgressEvents, Run, RunReport
from layertap.settings import COMMIT_THREADS, RunSettings
from layertap.spec import ExtractionSpec
from layertap.tiny.build import build_tiny_model
from sglang_patch.contract import FORMAT_FINAL

GPU_ARGS = (*GPU_COMMON, "--attention-backend", "triton", "--chunked-prefill-size", "4096",
            # Two servers share the GPU: each sizes its static memory from what it sees free, and
            # max-total-tokens keeps the KV pool to what 64 prompts of 4000 tokens need.
            "--mem-fraction-static", "0.45", "--max-total-tokens", "300000")  # fmt: skip
CPU_ARGS = cpu_server_args("bfloat16", 128)


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


class CommitTimes(ProgressEvents):
    """The run's events (told in the run's thread): its commits' seconds added up (the commit side's busy share),
    and when each commit ended (``time.perf_counter``) with its tokens (a steady-state window's rate)."""

    def __init__(self) -> None:
        super().__init__()
        self.seconds = 0.0
        self.finishes: list[tuple[float, int]] = []

    def committed(self, done: Committed) -> None:
        self.seconds += done.seconds
        self.finishes.append((done.ended, done.sample.num_tokens))


@dataclass(frozen=True)
class Captured:
    """A capture run as `capture` hands it back, its store still open (the caller reads it, then closes it)."""

    run: Run
    report: RunReport
    times: CommitTimes
    started: float  # time.perf_counter() as its rows started
    seconds: float  # its rows' wall time


def capture(server: SGLangServer, spec: ExtractionSpec, out: Path, dump_root: Path, in_flight: int, *, job: str,
            commit_threads: int = COMMIT_THREADS, finalize: bool = False, **engine: Any) -> Captured:  # fmt: skip
    """Every row of ``spec`` captured through the running ``server`` (its dumps under ``dump_root``) and committed
    into the store ``out`` (``engine``: more `SGLangEngine` options): the one capture call of capture_bench,
    fp8_bench, seed_scale_bench and int4_bench. ``finalize``: the store marked complete, as `layertap extract`
    leaves it for `layertap audit`."""
    settings = RunSettings(resume_check="quick", commit_threads=commit_threads)
    run = Run.create(spec, out, lambda cap, folder: SGLangEngine(server, cap, folder=folder, dump_root=dump_root,
                     job=job, in_flight=in_flight, **engine), settings)  # fmt: skip
    times = CommitTimes()
    started = time.perf_counter()
    report = run.rows(events=times)
    seconds = time.perf_counter() - started
    assert len(report.computed) == report.rows and report.failed == 0 and report.row_errors == 0, report
    if finalize:
        run.store.finalize(complete=True, target=run.plan.folder)
    return Captured(run, report, times, started, seconds)


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
    data = write_jsonl(work / f"data-{tag}.jsonl", [{"id": f"b{i}", "input_ids": ids} for i, ids in enumerate(batch)])
    spec = ExtractionSpec(model=bench.model, data=data, layers=bench.shape.layers, format=fmt,  # type: ignore[arg-type]
                          store_dtype=store_dtype)  # type: ignore[arg-type]  # fmt: skip
    writer: list[dict[str, float]] = []
    store_root = root / f"store-{tag}"
    done = capture(bench.server, spec, store_root, bench.link, in_flight, job=f"bench-{tag}",
                   commit_threads=commit_threads, on_writer=writer.append)  # fmt: skip
    dt = done.seconds
    nbytes = sum(r.nbytes for r in done.run.store.records().values())
    done.run.store.close()
    if not keep:
        shutil.rmtree(store_root)
    data.unlink()
    writer_time = dt * (writer[0]["threads"] if writer else 1)

    def total(key: str) -> float:
        return sum(float(stats.get(key, 0.0)) for stats in writer)

    grown = [float(stats.get("pinned_alloc_s", 0.0)) for stats in writer] or [0.0]
    return CaptureRun(tok_s=done.report.tokens / dt, bytes_s=nbytes / dt, waited_s=total("wait_s"),
                      writers_busy=total("write_s") / writer_time, copy_wait=total("ready_s") / writer_time,
                      commit_busy=done.times.seconds / (dt * commit_threads),
                      pinned_held=max((float(s.get("pinned_held_bytes", 0)) for s in writer), default=0.0),
                      pinned_alloc_s=max(grown) - min(grown), store=store_root if keep else None)  # fmt: skip


def start_servers(shapes: tuple[Shape, ...], args: argparse.Namespace, smoke: bool, *, layout: str = "specforge",
                  quantize: tuple[str, ...] = ("none",), sglang_args: tuple[str, ...] | None = None) -> list[Bench]:  # fmt: skip
    """Build each model and launch its servers (one per `quantize` setting, writing `layout` dumps) without
    waiting; the next model builds meanwhile. The processes are launched from this (main) thread: a server
    dies with the thread that launched it."""
    python, env = sglang_python(smoke), cpu_server_env() if smoke else {}
    benches: dict[str, Bench] = {}
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
            bench = benches[f"{shape.name} ({q})"] = Bench(shape, model, link, SGLangServer(config), quantize=q)
            bench.server.launch()
    wait_side_by_side({name: bench.server for name, bench in benches.items()})
    return list(benches.values())


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
