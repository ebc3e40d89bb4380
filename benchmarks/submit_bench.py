"""How long submitting a 37,000-sample job takes, and how many Redis round trips per sample the
coordinator and a worker make.

    .venv/bin/python benchmarks/submit_bench.py            # writes benchmarks/results/submit.md

What runs, all real: a private redis-server on a free port; the coordinator app (its POST /jobs
handler in-process for the per-phase timing and round-trip counts, and a uvicorn subprocess for the
end-to-end HTTP time); a ``celery -A worker worker --pool solo`` subprocess with the HF engine on the
tiny Llama for the worker's counts. A round trip is one packet sent to Redis: one command, or one
whole pipeline; they are counted by patching redis-py's connection class (which kombu uses too).
The synthetic corpus has rows of about ``--chars`` characters (default ~2,400 tokens, the motivating
corpus's 88M tokens over 37K samples), as JSONL (the scan parses every row) and Parquet (it reads
the id column only).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import pyarrow as pa
import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

WORDS = [
    "the",
    "model",
    "reads",
    "a",
    "prompt",
    "and",
    "computes",
    "hidden",
    "states",
    "for",
    "every",
    "token",
    "of",
    "the",
    "conversation",
]


def install_counter() -> Counter[str]:
    """Count packets sent to Redis by every redis-py connection of this process, by command name.

    ``packets`` is every round trip; single commands are also counted under their name (EVALSHA
    under the layertap script it runs), so ``packets`` minus the named ones is the pipelines.
    """
    import redis.connection as rc

    from layertap.state import scripts

    names = {s.sha: name for name, s in vars(scripts).items() if hasattr(s, "sha")}
    counts: Counter[str] = Counter()
    lock = threading.Lock()
    send_packed, send_command = rc.AbstractConnection.send_packed_command, rc.AbstractConnection.send_command

    def packed(self, command, check_health=True):
        with lock:
            counts["packets"] += 1
        return send_packed(self, command, check_health)

    def single(self, *args, **kwargs):
        name = str(args[0]).upper()
        if name == "EVALSHA":
            name = f"EVALSHA {names.get(str(args[1]), '(kombu binding script)')}"
        with lock:
            counts[name] += 1
        return send_command(self, *args, **kwargs)

    rc.AbstractConnection.send_packed_command = packed
    rc.AbstractConnection.send_command = single
    return counts


def pipelines(counts: Counter[str]) -> int:
    return counts["packets"] - sum(n for name, n in counts.items() if name != "packets")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: process exited")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not come up")


def synthetic_rows(n: int, chars: int, seed: int = 0) -> list[dict]:
    """``n`` two-turn conversations of about ``chars`` characters each, with unique ids."""
    rng = random.Random(seed)

    def text(k: int) -> str:
        return " ".join(rng.choices(WORDS, k=max(1, k // 6)))

    def row(i: int) -> dict:
        turns = [("user", chars // 3), ("assistant", 2 * chars // 3)]
        return {"id": f"s{i}", "messages": [{"role": role, "content": text(k)} for role, k in turns]}

    return [row(i) for i in range(n)]


def write_datasets(rows: list[dict], folder: Path) -> dict[str, Path]:
    jsonl = folder / "corpus.jsonl"
    with open(jsonl, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    parquet = folder / "corpus.parquet"
    pq.write_table(pa.Table.from_pylist(rows), parquet, row_group_size=1000)
    return {"jsonl": jsonl, "parquet": parquet}


def bench_coordinator(redis_url: str, model: Path, data: Path, root: Path, shard_size: int) -> dict:
    """The submit handler's phases, timed and counted in this process (same calls as the route)."""
    from redis import Redis

    from coordinator.dispatch import Dispatcher
    from layertap.state.jobs import create_job, dispatch_pending
    from layertap.state.keys import Keys
    from layertap.state.model import JobSpec
    from layertap.state.plan import plan_job
    from layertap.state.views import job_view

    counts = COUNTS
    redis, keys, dispatcher = Redis.from_url(redis_url, decode_responses=True), Keys(), Dispatcher(redis_url)
    spec = JobSpec(model=model, data=data, layers=(1, 3, 5), shard_size=shard_size)
    job_id = f"bench-{data.suffix[1:]}"
    out: dict = {"dataset": data.suffix[1:], "MB": data.stat().st_size / 1e6}
    t0, c0 = time.perf_counter(), counts.copy()
    planned = plan_job(spec, output_root=root, job_id=job_id)
    t1 = time.perf_counter()
    create_job(redis, keys, job_id, planned.spec, planned.shards)
    t2, c2 = time.perf_counter(), counts.copy()
    sent = dispatch_pending(redis, keys, job_id, dispatcher.send)
    t3 = time.perf_counter()
    job_view(redis, keys, job_id)
    t4, c4 = time.perf_counter(), counts.copy()
    out.update(
        samples=planned.shards[-1][1],
        shards=sent,
        plan_s=t1 - t0,
        create_s=t2 - t1,
        dispatch_s=t3 - t2,
        total_s=t4 - t0,
        rt_create=(c2 - c0)["packets"],
        rt_dispatch=(c4 - c2)["packets"],
        rt_total=(c4 - c0)["packets"],
    )
    redis.flushall()  # no worker runs yet: drop this job and its messages
    dispatcher.close()
    return out


def bench_http(redis_url: str, model: Path, data: Path, root: Path, shard_size: int, logs: Path) -> float:
    """Seconds for POST /jobs through a uvicorn coordinator (HTTP, validation, planning, enqueueing)."""
    port = free_port()
    token = secrets.token_hex(16)  # closed as a deployment is: the timed call carries the token
    env = {**os.environ, "LAYERTAP_REDIS_URL": redis_url, "LAYERTAP_OUTPUT_ROOT": str(root), "PYTHONPATH": str(REPO),
           "LAYERTAP_API_TOKEN": token}  # fmt: skip
    cmd = [sys.executable, "-m", "uvicorn", "coordinator.app:app", "--port", str(port), "--log-level", "warning"]
    with open(logs / "coordinator.log", "wb") as log:
        proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_http(f"http://127.0.0.1:{port}/health", proc)
        body = {"model": str(model), "data": str(data), "layers": [1, 3, 5], "shard_size": shard_size,
                "out": f"http-{data.suffix[1:]}"}  # fmt: skip
        t0 = time.perf_counter()
        reply = httpx.post(f"http://127.0.0.1:{port}/jobs", json=body, timeout=600,
                           headers={"Authorization": f"Bearer {token}"})  # fmt: skip
        seconds = time.perf_counter() - t0
        reply.raise_for_status()
        return seconds
    finally:
        proc.terminate()
        proc.wait(30)
        flush_redis(redis_url)


def flush_redis(redis_url: str) -> None:
    """Drop what a benchmark phase left in Redis (no worker runs yet)."""
    from redis import Redis

    Redis.from_url(redis_url).flushall()


def bench_worker(redis_url: str, model: Path, folder: Path, samples: int, shard_size: int) -> dict:
    """Run a job through one real Celery worker process that counts its own Redis packets."""
    from redis import Redis

    from coordinator.dispatch import Dispatcher
    from layertap.state.jobs import create_job, dispatch_pending
    from layertap.state.keys import Keys
    from layertap.state.model import JobSpec
    from layertap.state.plan import plan_job
    from layertap.state.views import job_view

    data = folder / "worker-corpus.jsonl"
    with open(data, "w") as f:
        for row in synthetic_rows(samples, chars=600, seed=1):
            f.write(json.dumps(row) + "\n")
    counts_file = folder / "worker-counts.json"
    env = {**os.environ, "LAYERTAP_REDIS_URL": redis_url, "LAYERTAP_WORKER_NAME": "bench", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(REPO)}  # fmt: skip
    cmd = [sys.executable, __file__, "--count-worker", str(counts_file), "--", "-A", "worker", "worker",
           "--pool", "solo", "--without-gossip", "--without-mingle", "--without-heartbeat", "--loglevel", "INFO"]  # fmt: skip
    log_path = folder / "worker.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    while " ready." not in log_path.read_text(errors="replace"):
        if proc.poll() is not None:
            raise RuntimeError(f"worker exited:\n{log_path.read_text()[-3000:]}")
        time.sleep(0.2)
    redis, keys, dispatcher = Redis.from_url(redis_url, decode_responses=True), Keys(), Dispatcher(redis_url)
    planned = plan_job(
        JobSpec(model=model, data=data, layers=(1, 3, 5), shard_size=shard_size), output_root=folder, job_id="w"
    )
    create_job(redis, keys, "w", planned.spec, planned.shards)
    t0 = time.monotonic()
    dispatch_pending(redis, keys, "w", dispatcher.send)
    while (view := job_view(redis, keys, "w")).state != "done":
        if proc.poll() is not None or time.monotonic() - t0 > 900:
            raise RuntimeError(f"worker run did not finish: {view}")
        time.sleep(0.5)
    seconds = time.monotonic() - t0
    proc.send_signal(signal.SIGTERM)
    proc.wait(60)
    counts = Counter(json.loads(counts_file.read_text()))
    dispatcher.close()
    return {"samples": view.samples_done, "shards": view.num_shards, "seconds": seconds, "counts": counts}


def count_worker(out: Path, celery_args: list[str]) -> None:
    """Child mode: run the Celery worker CLI with the counter installed; dump the counts as it goes and at exit."""
    import atexit

    counts = install_counter()

    def dump() -> None:
        out.write_text(json.dumps(dict(counts)))

    def every_second() -> None:
        while True:
            time.sleep(1)
            dump()

    threading.Thread(target=every_second, daemon=True).start()
    atexit.register(dump)
    from celery.__main__ import main

    sys.argv = ["celery", *celery_args]
    main()


def report(coord: list[dict], http: dict[str, float], worker: dict, args: argparse.Namespace) -> str:
    c = worker["counts"]
    n = worker["samples"]
    scripts = {k.removeprefix("EVALSHA "): v for k, v in c.items() if k.startswith("EVALSHA")}
    per_sample = scripts.get("SAMPLE_DONE", 0)
    per_shard = sum(scripts.get(k, 0) for k in ("CLAIM", "START", "COMPLETE"))
    heartbeat = scripts.get("HEARTBEAT", 0)
    piped = pipelines(c)
    polling = c["BRPOP"]
    lines = [
        "# Submit benchmark",
        "",
        f"`benchmarks/submit_bench.py --samples {args.samples} --shard-size {args.shard_size} --chars {args.chars}`,"
        f" {time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPU cores shared with other work (load average"
        f" {args.load:.1f} at the start), a local redis-server, the tiny Llama. Times vary with that load;"
        " round-trip counts do not.",
        "",
        f"## Submitting a {args.samples:,}-sample job ({args.samples // args.shard_size} shards)",
        "",
        "| dataset | size | POST /jobs over HTTP | plan (scan, checks, store) | Redis create | enqueue | "
        "Redis round trips (create / enqueue) | round trips per sample |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in coord:
        lines.append(
            f"| {r['dataset']} | {r['MB']:.0f} MB | {http[r['dataset']]:.2f} s | {r['plan_s']:.2f} s | "
            f"{r['create_s'] * 1000:.0f} ms | {r['dispatch_s']:.2f} s | {r['rt_create']} / {r['rt_dispatch']} | "
            f"{r['rt_total'] / r['samples']:.4f} |"
        )
    lines += [
        "",
        "Enqueueing is one broker push per shard (Celery `send_task`), plus a fixed few for the state;",
        "planning time is the dataset scan (every JSONL row parsed; only the id column of Parquet).",
        "",
        f"## A worker: {n:,} samples in {worker['shards']} shards of {args.shard_size}, one `celery` process, "
        f"{worker['seconds']:.1f} s",
        "",
        "| what | round trips | per sample |",
        "|---|---|---|",
        f"| sample committed (`SAMPLE_DONE` script) | {per_sample} | {per_sample / n:.3f} |",
        f"| shard claim / start / complete (scripts) | {per_shard} | {per_shard / n:.3f} |",
        f"| lease renewals (`HEARTBEAT` script, time-based) | {heartbeat} | {heartbeat / n:.3f} |",
        f"| pipelines: worker record each heartbeat, kombu ack/unacked bookkeeping | {piped} | {piped / n:.3f} |",
        f"| Celery broker: waiting for messages (`BRPOP`, 1 s timeout, time-based) | {polling} | {polling / n:.3f} |",
    ]
    other = c["packets"] - per_sample - per_shard - heartbeat - piped - polling
    lines += [
        f"| other single commands (kombu, redis-py connection setup) | {other} | {other / n:.3f} |",
        f"| **all** | **{c['packets']}** | **{c['packets'] / n:.3f}** |",
        "",
        "Every command the worker sent, by name (EVALSHA by the layertap script it ran; each script's",
        "first call on a fresh server costs one extra EVALSHA and a SCRIPT LOAD):",
        "",
        "```",
        *(f"{name:<28} {count}" for name, count in sorted(c.items())),
        "```",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=37_000)
    parser.add_argument("--shard-size", type=int, default=100)
    parser.add_argument("--chars", type=int, default=10_000, help="Characters per synthetic row (~2,400 tokens).")
    parser.add_argument("--worker-samples", type=int, default=2_000)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "submit.md")
    parser.add_argument("--count-worker", type=Path, help=argparse.SUPPRESS)
    args, rest = parser.parse_known_args()
    if args.count_worker:
        count_worker(args.count_worker, [a for a in rest if a != "--"])
        return

    global COUNTS
    COUNTS = install_counter()
    args.load = os.getloadavg()[0]
    from layertap.tiny import build_tiny_model

    folder = Path(tempfile.mkdtemp(prefix="submit-bench-"))
    port = free_port()
    redis_proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--save", "", "--appendonly", "no", "--dir", str(folder)],
        stdout=subprocess.DEVNULL,
    )
    redis_url = f"redis://127.0.0.1:{port}/0"
    try:
        time.sleep(0.5)
        model = build_tiny_model("llama", folder / "model")
        print(f"writing {args.samples:,} synthetic rows of ~{args.chars:,} characters to {folder}", flush=True)
        datasets = write_datasets(synthetic_rows(args.samples, args.chars), folder)
        coord, http = [], {}
        for name, path in datasets.items():
            coord.append(bench_coordinator(redis_url, model, path, folder / "outputs", args.shard_size))
            http[name] = bench_http(redis_url, model, path, folder / "outputs-http", args.shard_size, folder)
            print(coord[-1], f"http {http[name]:.2f}s", flush=True)
        worker = bench_worker(redis_url, model, folder, args.worker_samples, args.shard_size)
        text = report(coord, http, worker, args)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
        print(text)
    finally:
        redis_proc.terminate()
        redis_proc.wait(10)
        shutil.rmtree(folder, ignore_errors=True)


COUNTS: Counter[str] = Counter()

if __name__ == "__main__":
    main()
