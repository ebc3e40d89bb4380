"""Peak memory of `layertap audit` at one width and two depths: the streamed reference must not grow with depth.

Two INT4 Kimi-K2.5 folders of one width (`--shape`, default `mla-gpu`: hidden 1024, MLA, 8 routed experts
pack-quantized, the rest bf16) differ only in depth (`--depths`, default 8 and 32). Each gets a store of the same
chats from the HF engine (bf16, capture 1, 3, 5 + final); each store is audited in a fresh process, whose peak
resident memory (``ru_maxrss``) is read at its end. The same is done for a process that only imports the audit
(the baseline) and for one that loads the whole language model in float32 and bf16 as the audit did before the
streamed reference (what it would need). The deeper audit's peak may exceed the shallower one's by at most one
layer's weights (the largest layer dequantized to float32): the table says whether it does.

    .venv/bin/python benchmarks/audit_memory_bench.py --out benchmarks/results/audit_memory.md
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.core.datasets import conversation_rows, write_jsonl  # noqa: E402

MiB = 1024**2


def child(kind: str, path: Path) -> None:
    """Run one measured step in this process and print its JSON on the last line."""
    import torch

    started = time.perf_counter()
    out: dict = {}
    if kind == "audit":
        from layertap.audit import audit_store

        report = audit_store(path, fraction=1.0, device="cpu", trust_remote_code=True, write=False)
        out = {"passed": report.passed, "tokens": report.tokens, "memory": report.memory, "reading": report.reading}
    elif kind == "whole":
        from layertap.engines.hf import load_language_model
        from layertap.models.folder import ModelFolder

        folder = ModelFolder.read(path)
        models = [load_language_model(folder, dtype) for dtype in (torch.float32, torch.bfloat16)]
        out = {"parameters": sum(p.numel() for p in models[0].parameters())}
    else:
        import layertap.audit  # noqa: F401  the baseline: the imports alone
    out |= {
        "seconds": time.perf_counter() - started,
        "maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }
    print(json.dumps(out))


def measure(kind: str, path: Path) -> dict:
    run = subprocess.run([sys.executable, __file__, "--child", kind, str(path)], capture_output=True, text=True,
                         cwd=REPO, timeout=3600)  # fmt: skip
    if run.returncode:
        raise SystemExit(f"{kind} {path} failed:\n{run.stderr[-3000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def largest_layer_bytes(folder: Path, depth: int) -> int:
    """The largest decoder layer's weights dequantized to float32."""
    from layertap.models.folder import ModelFolder
    from layertap.models.weights import FolderWeights

    weights = FolderWeights(ModelFolder.read(folder))
    return max(sum(weights.numel(n) for n in weights.layer(i)) for i in range(depth)) * 4


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--work", type=Path, default=Path("/tmp/layertap-audit-memory"))
    ap.add_argument("--shape", default="mla-gpu")
    ap.add_argument("--depths", default="8,32")
    ap.add_argument("--chats", type=int, default=8)
    ap.add_argument("--child", nargs=2, metavar=("KIND", "PATH"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.child[0], Path(args.child[1]))
    from layertap.tiny import build_tiny_model

    args.work.mkdir(parents=True, exist_ok=True)
    data = write_jsonl(args.work / "chats.jsonl", conversation_rows(args.chats, seed=23, max_words=80))
    baseline = measure("baseline", args.work)
    rows = []
    for depth in map(int, args.depths.split(",")):
        folder = args.work / f"int4-{depth}"
        if not folder.exists():
            build_tiny_model("kimi-k2.5", folder, shape=args.shape, quantize="int4", num_hidden_layers=depth)
        store = args.work / f"store-{depth}"
        if not (store / "manifest.json").exists():
            subprocess.run([sys.executable, "-m", "layertap", "extract", "--model", str(folder), "--data", str(data),
                            "--layers", "1,3,5", "--format", "speculators", "--trust-remote-code", "--out", str(store)],
                           check=True, cwd=REPO, capture_output=True, timeout=3600)  # fmt: skip
        audit, whole = measure("audit", store), measure("whole", folder)
        size = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
        rows.append({"depth": depth, "folder_bytes": size, "layer_bytes": largest_layer_bytes(folder, depth),
                     "audit": audit, "whole": whole})  # fmt: skip
        print(
            f"depth {depth}: audit peak {audit['maxrss'] / MiB:,.0f} MiB, whole model {whole['maxrss'] / MiB:,.0f} MiB"
        )
    shallow, deep = rows[0], rows[-1]
    growth = deep["audit"]["maxrss"] - shallow["audit"]["maxrss"]
    holds = growth <= deep["layer_bytes"]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout
    lines = [
        "# Peak memory of `layertap audit` at two depths (CPU)", "",
        f"Written by `benchmarks/audit_memory_bench.py` at commit {commit.strip()} "
        f"({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}). Folders: `layertap tiny-model --arch kimi-k2.5 "
        f"--quantize int4 --shape {args.shape}` at {args.depths} layers (INT4 routed experts, the rest bf16); each "
        f"store: {args.chats} chats through the HF engine (bf16), capture 1, 3, 5 + final, audited whole (float32 "
        "reference + bf16 floor, every layer run for the final state). Peak = the process's `ru_maxrss`; the baseline "
        f"process (imports only) peaks at {baseline['maxrss'] / MiB:,.0f} MiB.", "",
        "| layers | folder | largest layer (float32) | audit: estimate | audit: peak RSS | above baseline "
        "| audit time | verdict | whole model f32 + bf16 (before #23): peak RSS |",
        "|---|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for r in rows:
        a, w = r["audit"], r["whole"]
        lines.append(
            f"| {r['depth']} | {r['folder_bytes'] / MiB:,.0f} MiB | {r['layer_bytes'] / MiB:,.0f} MiB "
            f"| {a['memory'].split(': ', 1)[1].split(';')[0]} | {a['maxrss'] / MiB:,.0f} MiB "
            f"| {(a['maxrss'] - baseline['maxrss']) / MiB:,.0f} MiB | {a['seconds']:.1f} s "
            f"| {'PASS' if a['passed'] else 'FAIL'} | {w['maxrss'] / MiB:,.0f} MiB |"
        )
    lines += [
        "",
        f"From {shallow['depth']} to {deep['depth']} layers the audit's peak grew by {growth / MiB:,.0f} MiB; one "
        f"layer's weights are {deep['layer_bytes'] / MiB:,.0f} MiB: the bound "
        f"{'holds' if holds else 'does NOT hold'}. Reading ({deep['depth']} layers): {deep['audit']['reading']}.",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
