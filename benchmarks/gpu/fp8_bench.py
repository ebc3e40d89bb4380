"""One H200 run for the FP8 issue: the same rows captured in bf16 and in FP8, to the local disk, two model widths.

For the Llama-8B-width and Kimi-K2-width models of `capture_bench.py` (random bf16 weights, speculators layout:
capture indices + the pre-norm final, [T, k+1, H] per file), two capture servers per width run side by side on
the GPU: one writing bf16 dumps, one quantizing them to FP8 on the device before the copy to the host
(``--quantize fp8``). In the same run it measures:

- each volume's own write rate first, with files of each store's mean sample size (nothing else running);
- plain prefill tok/s on each server (rids outside the capture namespace);
- capture + commit tok/s of the same prompts into a bf16 and an FP8 speculators store on the local disk (dump
  root beside the store: a commit is a rename), against plain prefill and against the disk's ceiling
  min(plain, disk rate / bytes per token), bytes per token as stored;
- per-state error: FP8's own rounding of the bf16 server's stored states (one scale per token and state, as the
  store keeps, and one per token, hs-connectors' own), and, when the stores are audited (`--audit-samples`), each
  store against HF float32 on the same weights with its noise floor and verdict (`layertap audit`'s rules).

A shape's servers stop once its captures are done, before its audit (the reference needs the GPU's memory).
The results file is rewritten after every measurement.
On the device: docs/performance.md ("Benchmarks on the device") has its recipe.

``--smoke`` runs the same code on this machine's CPU SGLang (0.5.10) with the tiny models.
"""

from __future__ import annotations

import argparse
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import torch

from benchmarks import report
from benchmarks.common import GPU_COMMON, T0, log, plain_rate, prompts
from benchmarks.gpu import capture
from benchmarks.report import Measured, command_line, git_commit
from layertap.audit import AuditReport, audit_store
from layertap.audit.compare import token_errors
from layertap.audit.run import state_name
from layertap.store.store import OutputStore
from sglang_patch.sample_files import dequantize_fp8, quantize_fp8

DTYPES = {"none": "bfloat16", "fp8": "fp8"}  # the server's quantize setting -> the store dtype it feeds
SCALE_BYTES = 4


@dataclass
class ShapeResult:
    plain: dict[str, float] = field(default_factory=dict)  # quantize -> tok/s
    capture: dict[str, capture.CaptureRun] = field(default_factory=dict)
    disk: dict[str, float] = field(default_factory=dict)  # quantize -> the disk's bytes/s for that file size
    rounding: dict[str, dict[bool, tuple[float, float, float]]] = field(default_factory=dict)  # state -> per_state
    audits: dict[str, AuditReport] = field(default_factory=dict)  # quantize -> audit


@dataclass
class Fp8Results(Measured):
    """Everything measured so far."""

    benchmark = "fp8"
    shapes: dict[str, ShapeResult] = field(default_factory=dict)

    def body(self) -> list[str]:
        lines = ["## Capture to the local disk, bf16 and FP8", "",
                 "Ceiling: min(plain prefill, the disk's rate for files of that size / bytes per token). Bytes per "
                 "token: the stored files (states, scales, ids, headers) over their tokens.", "",
                 "| shape | stored as | bytes/token | vs bf16 | disk MB/s | plain tok/s | ceiling tok/s | capture tok/s "
                 "| / plain | / ceiling | written MB/s | forward pass waited (s) | writers busy | worker commit busy |",
                 "|---" * 14 + "|"]  # fmt: skip
        for name, r in self.shapes.items():
            base = r.capture.get("none")
            for q, run in r.capture.items():
                bpt = run.bytes_s / run.tok_s
                plain = r.plain.get(q, 0.0)
                ceiling = min(plain, r.disk[q] / bpt) if plain else r.disk[q] / bpt
                ratio = f"{bpt / (base.bytes_s / base.tok_s):.3f}" if base else "-"
                lines.append(
                    f"| {name} | {DTYPES[q]} | {bpt / 1e3:.2f} KB | {ratio} | {r.disk[q] / 1e6:,.0f} | {plain:,.0f} "
                    f"| {ceiling:,.0f} | {run.tok_s:,.0f} | {run.tok_s / plain if plain else 0:.2f} "
                    f"| {run.tok_s / ceiling:.2f} | {run.bytes_s / 1e6:,.0f} | {run.waited_s:.2f} "
                    f"| {run.writers_busy:.2f} | {run.commit_busy:.2f} |"
                )
        lines += ["", "## Per-state error", "",
                  "FP8 rounding: the bf16 store's states quantized and dequantized as speculators reads them, "
                  "e_t = ||x_t - r_t|| / ||r_t|| per token against those bf16 states: with one scale per token and "
                  "state (what layertap stores, [T, k+1, 1]) and one per token ([T, 1, 1], hs-connectors' own). "
                  "Audit: each store against HF float32 on the same weights (median / max e_t, its floor's median: "
                  "the reference at bf16, rounded to the store's dtype), `layertap audit`'s verdict.", "",
                  "| shape | state | median norm | FP8 per state: median / max | FP8 per token: median / max "
                  "| audit bf16: median / max (floor) | audit FP8: median / max (floor) | verdicts bf16 / FP8 |",
                  "|---" * 8 + "|"]  # fmt: skip
        for name, r in self.shapes.items():
            for state, per in r.rounding.items():
                cells = [f"{per[s][1]:.2e} / {per[s][2]:.2e}" for s in (True, False)]
                audits = []
                for q in ("none", "fp8"):
                    v = next((v for v in r.audits[q].states if v.state == state), None) if q in r.audits else None
                    audits.append(f"{v.median:.2e} / {v.max:.2e} ({v.floor_median:.2e})" if v else "-")
                verdicts = " / ".join(_verdict(r.audits.get(q), state) for q in ("none", "fp8"))
                lines.append(f"| {name} | {state} | {per[True][0]:.3g} | {cells[0]} | {cells[1]} | {audits[0]} "
                             f"| {audits[1]} | {verdicts} |")  # fmt: skip
        return lines


def _verdict(report: AuditReport | None, state: str) -> str:
    v = next((v for v in report.states if v.state == state), None) if report else None
    return "-" if v is None else v.verdict.upper()


def rounding_errors(store_root: Path, device: str) -> dict[str, dict[bool, tuple[float, float, float]]]:
    """Per stored state: (median token norm, median e_t, max e_t) of FP8's rounding of the bf16 store's states,
    with a scale per token and state (True) and one per token (False)."""
    store = OutputStore.open_existing(store_root)
    points = [*store.manifest.capture_indices, "pre"]
    errors: dict[str, dict[bool, list[torch.Tensor]]] = {state_name(p): {True: [], False: []} for p in points}
    norms: dict[str, list[torch.Tensor]] = {state_name(p): [] for p in points}
    for rec in store.records().values():
        states = store.format.load(store_root / rec.file)["hidden_states"].to(device)  # bf16 [T, k+1, H]
        for per_state in (True, False):
            back = dequantize_fp8(*quantize_fp8(states, per_state=per_state))
            for j, p in enumerate(points):
                errors[state_name(p)][per_state].append(token_errors(back[:, j], states[:, j]).cpu())
        for j, p in enumerate(points):
            norms[state_name(p)].append(states[:, j].float().norm(dim=-1).cpu())
    out = {}
    for state, per in errors.items():
        norm = float(torch.cat(norms[state]).median())
        out[state] = {s: (norm, float(torch.cat(e).median()), float(torch.cat(e).max())) for s, e in per.items()}
    return out


def measure_shape(pair: list[capture.Bench], batch: list[list[int]], client: httpx.Client, results: Fp8Results,
                  args: argparse.Namespace) -> None:  # fmt: skip
    """Plain prefill and capture to the disk on both servers of one shape, then (servers stopped) its errors."""
    name = pair[0].shape.name
    r = results.shapes[name]
    stores: dict[str, Path] = {}
    try:
        for bench in pair:
            if time.monotonic() - T0 > args.deadline_s:
                results.notes.append(f"- Skipped (past the {args.deadline_s:.0f} s deadline): {name} {bench.quantize}.")
                continue
            r.plain[bench.quantize] = plain_rate(client, bench.server.url, batch, args.in_flight)
            log(f"{name} ({bench.quantize}): plain prefill {r.plain[bench.quantize]:,.0f} tok/s")
            run = capture.capture_rate(bench, args.disk, args.work, batch, args.in_flight, args.commit_threads,
                               fmt="speculators", store_dtype=DTYPES[bench.quantize], keep=True)  # fmt: skip
            r.capture[bench.quantize], stores[bench.quantize] = run, run.store  # type: ignore[assignment]
            log(f"{name} ({bench.quantize}): capture to the disk {run.tok_s:,.0f} tok/s, {run.bytes_s / 1e6:,.0f} MB/s")
            results.write()
    finally:
        for bench in pair:
            bench.server.stop()
    device = "cpu" if args.smoke else "cuda"
    if "none" in stores:
        r.rounding = rounding_errors(stores["none"], device)
        results.write()
    for q, root in stores.items():
        if args.audit_samples and time.monotonic() - T0 < args.deadline_s:
            r.audits[q] = audit_store(root, samples=args.audit_samples, seed=0, device=device, write=False)
            log(f"{name} ({q}): {r.audits[q].summary()}")
            results.write()
        shutil.rmtree(root)


def disk_rates(shapes: tuple[capture.Shape, ...], results: Fp8Results, args: argparse.Namespace, mean_tokens: float
               ) -> None:  # fmt: skip
    """The disk's own rate for files of each store's mean sample, measured first, nothing else running."""
    for shape in shapes:
        k1, hidden = len(shape.layers) + 1, shape.overrides.get("hidden_size", 64)
        r = results.shapes.setdefault(shape.name, ShapeResult())
        for q, per_value in (("none", 2 * hidden), ("fp8", hidden + SCALE_BYTES)):
            file_bytes = int((k1 * per_value + 8) * mean_tokens)
            total = max(8 * file_bytes, (64 << 20) if args.smoke else (4 << 30))
            r.disk[q] = capture.volume_rate(args.disk / "rate", file_bytes, 8, total)
            log(
                f"{shape.name} ({DTYPES[q]}): the disk takes {r.disk[q] / 1e9:.2f} GB/s ({file_bytes / 1e6:.0f} MB files)"
            )


def main(argv: list[str] | None = None) -> None:
    ap = report.parser(__doc__)
    ap.add_argument("--out", type=Path, default=None, help="results markdown (default: benchmarks/results/gpu_fp8.md)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/layertap-fp8"), help="models, data (local disk)")
    ap.add_argument("--disk", type=Path, default=Path("/tmp/layertap-fp8/disk"), help="a folder on the local disk")
    ap.add_argument("--tmpfs", type=Path, default=Path("/dev/shm/layertap-fp8"), help="the servers' idle dump roots")
    ap.add_argument("--prompts", type=int, default=96)
    ap.add_argument("--in-flight", type=int, default=16)
    ap.add_argument("--writer-threads", type=int, default=8, help="the plugin's writer threads (as capture_bench)")
    ap.add_argument("--pinned-cap", default=None, help="the plugin's host-memory cap, e.g. 4G (default: its own)")
    ap.add_argument("--commit-threads", type=int, default=8)
    ap.add_argument("--mem-fraction", default="0.2", help="--mem-fraction-static of each of the four GPU servers")
    ap.add_argument("--audit-samples", type=int, default=4, help="samples of each store audited (0: no audit)")
    ap.add_argument("--deadline-s", type=float, default=420.0, help="skip measurements that would start past this")
    ap.add_argument("--archs", default="llama,kimi-k2", help="the widths to run, by arch: llama (Llama-8B width), "
                    "kimi-k2 (Kimi-K2 width); one per device call if time is short")  # fmt: skip
    ap.add_argument("--commit", default=None, help="the commit of the tree run (default: git rev-parse)")
    args = ap.parse_args(argv)
    smoke = args.smoke
    args.out = args.out or (Path("/tmp/fp8_bench_smoke.md") if smoke else Path("benchmarks/results/gpu_fp8.md"))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    shapes = tuple(s for s in (capture.TINY_SHAPES if smoke else capture.SHAPES) if s.arch in args.archs.split(","))
    low, high = (32, 300) if smoke else (512, 4000)
    batch = prompts(args.prompts, 7, low, high)
    mean_tokens = sum(map(len, batch)) / len(batch)
    for folder in (args.work, args.tmpfs):
        shutil.rmtree(folder, ignore_errors=True)
    args.work.mkdir(parents=True)
    sglang_args = capture.CPU_ARGS if smoke else (*GPU_COMMON, "--attention-backend", "triton", "--chunked-prefill-size",
                                          "4096", "--mem-fraction-static", args.mem_fraction,
                                          "--max-total-tokens", "300000")  # fmt: skip
    results = Fp8Results(args.out, parameters=vars(args), header=[
        f"# FP8 vs bf16 hidden states, captured to the local disk ({'CPU smoke test, tiny models' if smoke else 'one H200, sglang 0.5.14'})",
        "",
        f"Written by `benchmarks/gpu/fp8_bench.py` ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}), "
        f"command `{command_line()}`, commit {args.commit or git_commit()}. {args.prompts} prompts of {low}-{high} random "
        f"token ids (mean {mean_tokens:.0f}), max_new_tokens 0, random bf16 weights, {args.in_flight} in flight; "
        "speculators stores ([T, k+1, H]: the capture indices of capture_bench.py and the pre-norm final), dumps "
        "written by the plugin on the local disk and renamed into the store after the worker's checks. Per width "
        "two servers side by side: bf16 dumps, and FP8 dumps quantized on the GPU before the copy to the host. "
        f"Plugin: {args.writer_threads} writer threads; worker: {args.commit_threads} commit threads. Server flags: "
        f"`{' '.join(sglang_args)}`.",
        "",
    ])  # fmt: skip
    disk_rates(shapes, results, args, mean_tokens)
    results.write()
    benches = capture.start_servers(shapes, args, smoke, layout="speculators", quantize=("none", "fp8"),
                            sglang_args=tuple(sglang_args))  # fmt: skip

    def measure_all(client: httpx.Client) -> None:
        for shape in shapes:
            measure_shape([b for b in benches if b.shape == shape], batch, client, results, args)

    capture.run_warm(benches, (low, high), results, args.out, measure_all)
