"""Peak memory of `layertap audit` at one width and two depths: the streamed reference must not grow with depth.

Two INT4 Kimi-K2.5 folders of one width (`--shape`, default `mla-gpu`: hidden 1024, MLA, 8 routed experts
pack-quantized, the rest bf16) differ only in depth (`--depths`, default 8 and 32). Each gets a store of the same
chats from the HF engine (bf16, capture 1, 3, 5 + final); each store is audited in a fresh process, whose peak
resident memory (``ru_maxrss``) is read at its end. The same is done for a process that only imports the audit
(the baseline) and for one that loads the whole language model in float32 and bf16 as the audit did before the
streamed reference (what it would need). The deeper audit's peak may exceed the shallower one's by at most one
layer's weights (the largest layer dequantized to float32): the table says whether it does.

    .venv/bin/python -m benchmarks audit_memory --out benchmarks/results/audit_memory.md
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import report
from benchmarks.common import chat_rows, write_jsonl
from harness.processes import REPO_ROOT, run_layertap
from layertap.diskspace import human_bytes


def child(kind: str, path: Path, device: str) -> None:
    """Run one measured step in this process and print its JSON on the last line."""
    started = time.perf_counter()
    out: dict = {}
    if kind == "audit":
        from layertap.audit import audit_store

        report = audit_store(path, fraction=1.0, device=device, trust_remote_code=True, write=False)
        out = {"verdict": report.verdict, "tokens": report.tokens, "memory": report.memory,
               "host_estimate": report.host_estimate, "reading": report.reading, "gpu_peak": report.peak_device_bytes,
               "markdown": report.markdown()}  # fmt: skip
    else:
        import layertap.audit  # noqa: F401  the baseline: the imports alone
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps(out | {"seconds": time.perf_counter() - started, "maxrss": rss}))


def measure(kind: str, path: Path, device: str) -> dict:
    run = subprocess.run([sys.executable, "-m", "benchmarks", "audit_memory", "--child", kind, str(path), "--device",
                          device], capture_output=True, text=True, cwd=REPO_ROOT, timeout=3600)  # fmt: skip
    if run.returncode:
        raise SystemExit(f"{kind} {path} failed:\n{run.stderr[-3000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def weight_bytes(folder: Path, depth: int) -> tuple[int, int]:
    """(the largest decoder layer's weights dequantized to float32, the whole language model in float32 + bf16:
    what the audit loaded before it streamed), from the shards' headers."""
    from layertap.models.folder import ModelFolder
    from layertap.models.weights import FolderWeights

    weights = FolderWeights(ModelFolder.read(folder))
    layer = max(sum(weights.numel(n) for n in weights.layer(i)) for i in range(depth)) * 4
    return layer, sum(weights.numel(n) for n in weights.names if not n.startswith("lm_head.")) * (4 + 2)


def main(argv: list[str] | None = None) -> None:
    ap = report.parser(__doc__)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--work", type=Path, default=Path("/tmp/layertap-audit-memory"))
    ap.add_argument("--shape", default="mla-gpu")
    ap.add_argument("--depths", default="8,32")
    ap.add_argument("--chats", type=int, default=8)
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (the stores are made there too)")
    ap.add_argument("--commit", default="")
    ap.add_argument("--child", nargs=2, metavar=("KIND", "PATH"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.smoke:
        args.shape, args.depths, args.chats = "tiny", "6,8", 2
    if args.child:
        return child(args.child[0], Path(args.child[1]), args.device)
    from layertap.tiny import build_tiny_model

    args.work.mkdir(parents=True, exist_ok=True)
    data = write_jsonl(args.work / "chats.jsonl", chat_rows(args.chats, random.Random(23), max_words=80))
    baseline = measure("baseline", args.work, args.device)
    rows = []
    for depth in map(int, args.depths.split(",")):
        folder = args.work / f"int4-{depth}"
        if not folder.exists():
            build_tiny_model("kimi-k2.5", folder, shape=args.shape, quantize="int4", num_hidden_layers=depth)
        store = args.work / f"store-{depth}"
        if not (store / "manifest.json").exists():
            run_layertap("extract", "--model", folder, "--data", data, "--layers", "1,3,5", "--format", "speculators",
                         "--trust-remote-code", "--out", store, "--device", args.device,
                         timeout=3600).check_returncode()  # fmt: skip
        audit = measure("audit", store, args.device)
        layer, whole = weight_bytes(folder, depth)
        size = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
        rows.append({"depth": depth, "folder_bytes": size, "layer_bytes": layer, "whole_bytes": whole, "audit": audit})
        print(f"depth {depth}: audit peak RSS {human_bytes(audit['maxrss'])}, GPU {audit['gpu_peak']}", flush=True)
    gpu = args.device != "cpu"
    peak = "gpu_peak" if gpu else "maxrss"
    shallow, deep = rows[0], rows[-1]
    growth = deep["audit"][peak] - shallow["audit"][peak]
    commit = args.commit or report.git_commit()
    lines = [
        f"# Peak memory of `layertap audit` at two depths ({'one GPU' if gpu else 'CPU'})", "",
        f"Written by `benchmarks/audit_memory_bench.py --device {args.device} --shape {args.shape}` at commit {commit} "
        f"({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}). Folders: `layertap tiny-model --arch kimi-k2.5 "
        f"--quantize int4 --shape {args.shape}` at {args.depths} layers (INT4 routed experts, the rest bf16); each "
        f"store: {args.chats} chats through the HF engine (bf16, on {args.device}), capture 1, 3, 5 + final, audited "
        "whole (float32 reference + bf16 floor; the final state runs every layer). "
        + ("Peak = torch's `max_memory_allocated` on the GPU (exact), beside the process's `ru_maxrss`. " if gpu else
           "Peak = the process's `ru_maxrss`. ")
        + f"The baseline process (imports only) peaks at {human_bytes(baseline['maxrss'])} of RSS.", "",
        "| layers | folder | largest layer (float32) | the audit's estimate | peak GPU | peak RSS | RSS above baseline "
        "| host estimate (what the audit checks) | audit time | verdict | whole model f32 + bf16 weights (what the "
        "audit loaded before #23) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for r in rows:
        a = r["audit"]
        lines.append(
            f"| {r['depth']} | {human_bytes(r['folder_bytes'])} | {human_bytes(r['layer_bytes'])} "
            f"| {a['memory'].split(': ', 1)[1].split(';')[0]} | {human_bytes(a['gpu_peak']) if a['gpu_peak'] else '-'} "
            f"| {human_bytes(a['maxrss'])} | {human_bytes(a['maxrss'] - baseline['maxrss'])} "
            f"| {human_bytes(a['host_estimate'])} | {a['seconds']:.1f} s | {a['verdict'].upper()} "
            f"| {human_bytes(r['whole_bytes'])} |"
        )
    lines += [
        "",
        f"From {shallow['depth']} to {deep['depth']} layers the audit's peak {'GPU memory' if gpu else 'RSS'} grew by "
        f"{human_bytes(growth)}; one layer's weights are {human_bytes(deep['layer_bytes'])}: the bound "
        f"{'holds' if growth <= deep['layer_bytes'] else 'does NOT hold'}. Reading ({deep['depth']} layers): "
        f"{deep['audit']['reading']}.",
    ]
    if not gpu:
        over = [r["depth"] for r in rows if r["audit"]["maxrss"] - baseline["maxrss"] > r["audit"]["host_estimate"]]
        lines += ["", "The host estimate is " + (f"BELOW the measured RSS above baseline at {over} layers." if over else
                                                 "at or above the measured RSS above baseline at every depth.")]  # fmt: skip
    for r in rows:
        if r["audit"]["verdict"] != "pass":
            causes = [line for line in r["audit"]["markdown"].splitlines() if line.startswith("- **")]
            lines += [
                "",
                f"The {r['depth']}-layer audit's verdict: {r['audit']['verdict'].upper()}, " + " ".join(causes),
            ]
    measured = report.result("audit_memory", "\n".join(lines) + "\n", parameters=vars(args),
                             metrics={"baseline_maxrss": baseline["maxrss"], "growth_bytes": growth}, rows=rows)  # fmt: skip
    print(report.write(args.out, measured) if args.out else report.render(measured))
