"""Kimi-K2.5 as it ships (INT4 routed experts) through a launched SGLang server on one GPU: first start on a fresh
node (kernel builds under the launcher's first-start allowance, into a kernel cache folder), a second start that
finds the cache, >= 100 chats captured and committed, `layertap verify`, `layertap audit` against the dequantized
float32 reference with its bf16 floor, and capture against plain prefill of the same server on the same ids.

    python3 -m benchmarks int4 --out benchmarks/results/gpu_int4.md    # on the H200 (docs/performance.md)
    python3 -m benchmarks int4 --smoke --out /tmp/int4.md              # here: bf16 stand-in

On the CPU (smoke) the server serves the tiny bf16 wrapper (CPU SGLang has no INT4 MoE kernel) in bf16, and its
store is audited against that folder; the INT4 folder is built only. The smoke PASSes (2026-12-01, SGLang 0.5.10.post1
CPU, 5 layers): every state's median error 0.86-0.90 x the HF bf16 floor's, no outlier, controls 42-312 x.
"""

from __future__ import annotations

import random
import shutil
import time
from pathlib import Path

import httpx
import torch

from benchmarks import report
from benchmarks.common import (
    GPU_WARMED,
    KIMI_K2_WIDTH,
    chat_rows,
    folder_bytes,
    log,
    plain_rate,
    sglang_python,
    write_jsonl,
)
from benchmarks.gpu.capture import capture
from benchmarks.report import git_commit, table_lines
from harness.sglang import cpu_server_args, cpu_server_env
from layertap.audit import audit_store
from layertap.engines.sglang import ServerConfig, SGLangServer
from layertap.spec import ExtractionSpec
from layertap.tiny import build_tiny_model
from layertap.verify import verify_store

LAYERS = (1, 2, 3)  # after the dense layer, after MoE layers 1 and 2; + the post-norm final (specforge)
SHAPES = {"mla-gpu": {"shape": "mla-gpu"}, "kimi-k2-width": KIMI_K2_WIDTH}
GPU_FLAGS = (*GPU_WARMED, "--mem-fraction-static", "0.5", "--max-total-tokens", "200000", "--trust-remote-code")
IN_FLIGHT = 16


def start(server: SGLangServer) -> float:
    t0 = time.perf_counter()
    server.start()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    ap = report.parser(__doc__)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--work", type=Path, default=Path("/tmp/layertap-int4"))
    ap.add_argument("--shape", choices=tuple(SHAPES), default="mla-gpu")
    ap.add_argument("--chats", type=int, default=120)
    ap.add_argument("--reuse", action="store_true", help="keep --work's folders and kernel cache (a warm machine)")
    args = ap.parse_args(argv)
    smoke = args.smoke
    if not args.reuse:
        shutil.rmtree(args.work, ignore_errors=True)
    for stale in ("store", "dumps"):
        shutil.rmtree(args.work / stale, ignore_errors=True)
    args.work.mkdir(parents=True, exist_ok=True)
    overrides = {} if smoke else SHAPES[args.shape]
    int4 = build_tiny_model("kimi-k2.5", args.work / "int4", quantize="int4", **overrides)
    log(f"INT4 folder built: {folder_bytes(int4) / 1e6:,.0f} MB")
    served = build_tiny_model("kimi-k2.5", args.work / "bf16", dtype=torch.bfloat16) if smoke else int4
    data = args.work / "chats.jsonl"
    rows = args.chats if not smoke else 8
    write_jsonl(data, chat_rows(rows, random.Random(20261201), max_words=200))
    cache = args.work / "kernel-cache"
    dumps = args.work / "dumps"
    config = ServerConfig(
        python=sglang_python(smoke), model=served,
        dump_root=dumps, layers=LAYERS, final="post", layout="specforge", log_path=args.out.with_suffix(".server.log"),
        sglang_args=(*cpu_server_args("bfloat16", 128), "--trust-remote-code") if smoke else GPU_FLAGS,
        env={"LAYERTAP_KERNEL_CACHE": str(cache),
             **(cpu_server_env() if smoke else {})},
        start_attempts=1,
    )  # fmt: skip
    server = SGLangServer(config)
    cold = start(server)
    log(f"cold start: {cold:.0f} s; kernel cache {folder_bytes(cache) / 1e6:,.0f} MB")
    store = args.work / "store"
    spec = ExtractionSpec(model=served, data=data, layers=LAYERS, format="specforge", trust_remote_code=True)
    done = capture(server, spec, store, dumps, IN_FLIGHT, job="int4", finalize=True)
    seconds, tokens = done.seconds, done.report.tokens
    ids = [done.run.store.format.load(store / r.file)["input_ids"].tolist() for r in done.run.store.records().values()]
    done.run.store.close()
    log(f"captured {tokens:,} tokens in {seconds:.1f} s")
    with httpx.Client(timeout=600) as client:
        plain_rate(client, server.url, ids[:IN_FLIGHT], IN_FLIGHT)  # same warm state for both
        plain = plain_rate(client, server.url, ids, IN_FLIGHT)
    server.stop()
    warm = start(server)
    log(f"warm start: {warm:.0f} s")
    server.stop()
    check = verify_store(store)
    audit = audit_store(store, samples=min(100, len(ids)), seed=0, device="cpu" if smoke else "cuda",
                        trust_remote_code=True)  # fmt: skip
    log(audit.summary())
    lines = [
        f"# INT4 Kimi-K2.5 folder through a launched SGLang server ({'CPU smoke' if smoke else 'one H200'})", "",
        f"Written by `benchmarks/gpu/int4_bench.py --shape {args.shape}` at commit {git_commit()} "
        f"({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}). Folder: `layertap tiny-model --arch kimi-k2.5 "
        f"--quantize int4 --shape {args.shape}` ({folder_bytes(int4) / 1e6:,.0f} MB: routed experts compressed-tensors "
        f"pack-quantized INT4, group 32, the rest bf16). Server flags: `{' '.join(config.sglang_args)}` (the launcher "
        f"adds its forced flags, `--watchdog-timeout 1800` and the capture plugin); {IN_FLIGHT} in flight.", "",
        *table_lines(("measure", "value"), [
            ("first start on a fresh machine (empty kernel cache; launch to /health)", f"{cold:.0f} s"),
            ("second start (kernel cache kept)", f"{warm:.0f} s"),
            ("kernel cache", f"{folder_bytes(cache) / 1e6:,.0f} MB"),
            ("rows captured (chats)", f"{len(ids)} of {rows}"),
            ("tokens", f"{tokens:,}"),
            ("capture + commit", f"{tokens / seconds:,.0f} tok/s"),
            ("plain prefill, same server, same ids", f"{plain:,.0f} tok/s"),
            ("capture / plain", f"{tokens / seconds / plain:.2f}"),
            ("layertap verify", "clean" if check.ok else "PROBLEMS: " + "; ".join(check.problems[:3])),
            ("layertap audit", audit.summary()),
        ]), "",
        audit.markdown(), "",
    ]  # fmt: skip
    result = report.result("int4", "\n".join(lines), parameters=vars(args),
                           metrics={"cold_s": cold, "warm_s": warm}, rows=[audit.to_dict()])  # fmt: skip
    report.write(args.out, result)
    log(f"wrote {args.out}")
