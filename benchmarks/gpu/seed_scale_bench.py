"""Speed at the seed's scale: a 61-layer Kimi-K2.5-shaped server (hidden 7168, MLA, first layer dense, 8 routed
experts top-8 + 1 shared: Kimi's work per token), capture indices 3, 31, 59 + the post-norm final (57 KB per
token), rows of the seed corpus's lengths, under each server setting that could matter.

The folder is config-only (``layertap tiny-model --arch kimi-k2.5 --shape seed-depth --config-only``) and the
server makes random weights (``--load-format dummy``). For each setting, in the same run and one server at a
time: plain prefill (rids outside the capture namespace), then capture + commit into a specforge store on
tmpfs and on the local disk, at the same in-flight count. Each measurement is a steady-state window: the rate
counts the tokens of requests that finished between the first finish and the moment fewer requests than the
in-flight count remained queued, so start-up and the tail are outside it (their share is printed).

Each invocation adds its rows to ``--results`` (JSON, committed beside the table) and rewrites the table and
the projection of the seed's job (87.8M tokens) from every row so far.
On the device: docs/performance.md ("Benchmarks on the device") has its recipe.

``--smoke`` runs the same code on this machine's CPU SGLang (0.5.10) with a 4-layer tiny folder.
"""

from __future__ import annotations

import argparse
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import torch

from benchmarks import common, report
from benchmarks.common import GPU_COMMON, KIMI_K2_ONE_GROUP, fresh, log, prompts, sglang_python, wait_side_by_side
from benchmarks.gpu.capture import capture as shared_capture
from benchmarks.gpu.capture import repoint, volume_rate
from harness.sglang import cpu_server_args, cpu_server_env
from layertap.engines.sglang import ServerConfig, SGLangServer
from layertap.spec import ExtractionSpec
from layertap.tiny import build_tiny_model

LAYERS = (3, 31, 59)
SEED_TOKENS = 87.8e6  # the seed job: 37,312 samples
SEED_HOURS = 9.4  # what the seed's own pipeline took at 2,600 tok/s
# What SGLang's own numbers say of TP=8 on one H200 node for DeepSeek-V3-shaped prefill: see the table's notes.
TP8_EFFICIENCY = 0.8
BASE = list(GPU_COMMON)
# Two 61-layer servers (60.6 GB of bf16 weights each) share the GPU. SGLang sizes its KV pool as the memory free
# after its weights minus (1 - fraction) of the GPU, so the other server's weights count against it: a high
# fraction with the pool capped (50K tokens x 70 KB with MLA at 61 layers, 3.5 GB: 12 requests of 4,000 tokens)
# lets both start in either order.
MEMORY = ["--load-format", "dummy", "--mem-fraction-static", "0.9", "--max-total-tokens", "50000"]
SETTINGS = {  # name -> flags; every name is "<attention backend>-<chunked prefill size>"
    f"{backend}-{chunk}": ["--attention-backend", backend, "--chunked-prefill-size", str(chunk)]
    for backend in ("triton", "flashinfer")
    for chunk in (4096, 8192, 16384)
}


@dataclass
class Row:
    setting: str
    what: str  # plain, tmpfs, disk
    in_flight: int
    tok_s: float
    window_share: float  # the share of the measurement's time inside the steady-state window
    tokens: int
    when: str


def steady_rate(finishes: list[tuple[float, int]], t0: float, in_flight: int) -> tuple[float, float]:
    """Tokens/s of the requests that finished inside [first finish, last moment every slot was busy]; and the
    share of the whole measurement that window covers."""
    finishes.sort()
    # The last request is handed to a slot when len(finishes) - in_flight have finished.
    queued_until = finishes[max(len(finishes) - in_flight, 0)][0]
    start = finishes[0][0]
    inside = [(t, n) for t, n in finishes if start < t <= queued_until]
    end = max((t for t, _ in inside), default=finishes[-1][0])
    if not inside or end <= start:  # too few requests for a window: the whole run
        return sum(n for _, n in finishes) / (finishes[-1][0] - t0), 1.0
    return sum(n for _, n in inside) / (end - start), (end - start) / (finishes[-1][0] - t0)


def plain(client: httpx.Client, url: str, batch: list[list[int]], in_flight: int) -> tuple[float, float]:
    """Plain prefill of ``batch`` (rids outside the capture namespace) in a steady-state window."""
    finishes: list[tuple[float, int]] = []
    t0 = time.perf_counter()
    common.plain_rate(client, url, batch, in_flight, finishes)
    return steady_rate(finishes, t0, in_flight)


def capture(server: SGLangServer, model: Path, link: Path, root: Path, batch: list[list[int]], in_flight: int,
            tag: str, layers: tuple[int, ...], *, keep: bool = False) -> tuple[float, float]:  # fmt: skip
    """Capture + checks + commit of ``batch`` into a specforge store ``root/store-<tag>`` (the dumps under
    ``root`` too), removed afterwards unless ``keep``."""
    repoint(link, root / "dumps")
    data = common.write_jsonl(
        root / f"data-{tag}.jsonl", [{"id": f"r{i}", "input_ids": ids} for i, ids in enumerate(batch)]
    )
    spec = ExtractionSpec(model=model, data=data, layers=layers, format="specforge", trust_remote_code=True)
    done = shared_capture(server, spec, root / f"store-{tag}", link, in_flight, job=f"seed-{tag}", finalize=True,
                          allow_dummy_weights=True)  # fmt: skip
    done.run.store.close()
    if not keep:
        shutil.rmtree(root / f"store-{tag}")
    data.unlink()
    return steady_rate(done.times.finishes, done.started, in_flight)


def projection(rows: list[Row]) -> list[str]:
    """The seed job on one and on four 8-GPU nodes, from the fastest setting's capture rate on tmpfs and disk."""
    best: dict[str, Row] = {}
    for row in rows:
        if row.what in ("tmpfs", "disk") and (row.what not in best or row.tok_s > best[row.what].tok_s):
            best[row.what] = row
    out = ["", "## The seed's job (87.8M tokens) projected", "",
           f"Per-GPU rate (this table, TP=1, the same work per token as Kimi-K2.5) x GPUs x a TP=8 efficiency of "
           f"{TP8_EFFICIENCY} (see the notes), against the seed's {SEED_HOURS} h at 2,600 tok/s.", ""]  # fmt: skip
    head = ("capture on", "setting", "per-GPU tok/s", "1 node (8 GPUs) tok/s", "hours", "4 nodes tok/s", "hours",
            "vs seed (1 node)")  # fmt: skip
    table = []
    for what, row in best.items():
        node = row.tok_s * 8 * TP8_EFFICIENCY
        table.append((what, row.setting, f"{row.tok_s:,.0f}", f"{node:,.0f}", f"{SEED_TOKENS / node / 3600:.2f}",
                      f"{4 * node:,.0f}", f"{SEED_TOKENS / node / 4 / 3600:.2f}",
                      f"{SEED_HOURS / (SEED_TOKENS / node / 3600):.1f}x faster"))  # fmt: skip
    return out + report.table_lines(head, table)


def render(rows: list[Row], checks: list[Check], header: list[str]) -> str:
    lines = [*header, *report.table_lines(
        ("setting", "what", "in flight", "tok/s", "steady window / whole run", "tokens", "measured"),
        [(r.setting, r.what, r.in_flight, f"{r.tok_s:,.0f}", f"{r.window_share:.2f}", f"{r.tokens:,}", r.when)
         for r in rows])]  # fmt: skip
    by_setting: dict[str, dict[str, float]] = {}
    for r in rows:
        by_setting.setdefault(r.setting, {})[r.what] = r.tok_s
    ratios = [(name, *(f"{rates[w] / rates['plain']:.2f}" if w in rates else "-" for w in ("tmpfs", "disk")))
              for name, rates in by_setting.items() if "plain" in rates]  # fmt: skip
    lines += ["", *report.table_lines(("setting", "tmpfs capture / plain", "disk capture / plain"), ratios)]
    lines += ["", "## Which settings keep captures right", "",
              "Each setting's captures of the same rows at Kimi-K2 width, 4 layers (random weights HF can run), audited "
              "by `layertap audit` against HF float32 (every stored state, the bf16 noise floor, routing near-ties).", "",
              *report.table_lines(("setting", "audit", "samples", "tokens", "measured"),
                                  [(c.setting, "PASS" if c.passed else "FAIL", c.samples, f"{c.tokens:,}", c.when)
                                   for c in checks])]  # fmt: skip
    for c in checks:
        lines += ["", f"### Audit of {c.setting}", "", c.table]
    return "\n".join([*lines, *projection(rows), ""])


@dataclass
class Check:
    """A setting's captures audited against HF float32 at a depth HF can run."""

    setting: str
    passed: bool
    samples: int
    tokens: int
    when: str
    table: str


def start(settings: list[str], model: Path, layers: tuple[int, ...], flags: dict[str, list[str]], args: argparse.Namespace
          ) -> dict[str, tuple[SGLangServer, Path]]:  # fmt: skip
    """A capture server per setting, started together (a start that fails is retried alone)."""
    smoke = args.smoke
    servers: dict[str, tuple[SGLangServer, Path]] = {}
    for name in settings:
        link = args.work / f"dumps-{name}-{model.name}"
        repoint(link, args.tmpfs / "dumps")
        config = ServerConfig(python=sglang_python(smoke), env=cpu_server_env() if smoke else {},
                              model=model, dump_root=link, layers=layers, final="post", layout="specforge",
                              log_path=args.out / f"server-{name}-{model.name}.log",
                              sglang_args=tuple(flags[name]))  # fmt: skip
        servers[name] = (SGLangServer(config), link)
        servers[name][0].launch()
    wait_side_by_side({name: server for name, (server, _) in servers.items()})
    return servers


def server_flags(settings: list[str], smoke: bool, memory: list[str]) -> dict[str, list[str]]:
    """Each setting's server flags; the Kimi-K2.5 wrapper's config class is code in the folder."""
    if smoke:
        return {n: [*cpu_server_args("bfloat16", int(n.rsplit("-", 1)[1])), "--trust-remote-code"] for n in settings}
    return {n: [*BASE, *memory, *SETTINGS[n], "--trust-remote-code"] for n in settings}


def speed(settings: list[str], batch: list[list[int]], rows: list[Row], save: Callable[[], None],
          args: argparse.Namespace) -> None:  # fmt: skip
    """Plain prefill and capture + commit (tmpfs, disk) at 61 layers for each setting, one server at a time."""
    model = args.work / "seed-depth"
    if args.smoke:  # the CPU server cannot make up 61 layers of weights fast enough: a 4-layer folder
        build_tiny_model("kimi-k2.5", model, num_hidden_layers=4)
    else:
        build_tiny_model("kimi-k2.5", model, shape="seed-depth", config_only=True)
    layers = (1, 2, 3) if args.smoke else LAYERS
    servers = start(settings, model, layers, server_flags(settings, args.smoke, MEMORY), args)
    client = httpx.Client(timeout=1200)
    try:
        for name, (server, link) in servers.items():
            log(f"{name}: warm ({plain(client, server.url, batch[:4], 4)[0]:,.0f} tok/s)")  # kernels build here
            stamp = time.strftime("%Y-%m-%d %H:%M")
            rate, share = plain(client, server.url, batch, args.in_flight)
            rows.append(Row(name, "plain", args.in_flight, rate, share, sum(map(len, batch)), stamp))
            log(f"{name}: plain {rate:,.0f} tok/s (window {share:.2f})")
            for what, root in (("tmpfs", args.tmpfs), ("disk", args.work / "disk")):
                rate, share = capture(server, model, link, root, batch, args.in_flight, f"{name}-{what}", layers)
                rows.append(Row(name, what, args.in_flight, rate, share, sum(map(len, batch)), stamp))
                log(f"{name}: capture on {what} {rate:,.0f} tok/s (window {share:.2f})")
                save()
            server.stop()
    finally:
        for server, _ in servers.values():
            server.stop()
        client.close()


def correctness(settings: list[str], batch: list[list[int]], checks: list[Check], save: Callable[[], None],
                args: argparse.Namespace) -> None:  # fmt: skip
    """Each setting's captures at Kimi-K2 width, 4 layers (real random weights HF can run), audited."""
    from layertap.audit import audit_store

    model = args.work / "kimi-k2-width"
    shape = {"num_hidden_layers": 4} if args.smoke else KIMI_K2_ONE_GROUP
    build_tiny_model("kimi-k2.5", model, dtype=torch.bfloat16, **shape)
    memory = ["--mem-fraction-static", "0.3", "--max-total-tokens", "300000"]
    servers = start(settings, model, (1, 2, 3), server_flags(settings, args.smoke, memory), args)
    try:
        for name, (server, link) in servers.items():
            tag = f"{name}-check"
            capture(server, model, link, args.tmpfs, batch, args.in_flight, tag, (1, 2, 3), keep=True)
            server.stop()
            report = audit_store(args.tmpfs / f"store-{tag}", samples=len(batch), seed=0,
                                 device="cpu" if args.smoke else "cuda", trust_remote_code=True)  # fmt: skip
            checks.append(Check(name, report.passed, len(report.samples), report.tokens,
                                time.strftime("%Y-%m-%d %H:%M"), report.markdown()))  # fmt: skip
            log(f"{name}: audit {report.verdict.upper()} ({report.tokens:,} tokens)")
            shutil.rmtree(args.tmpfs / f"store-{tag}")
            save()
    finally:
        for server, _ in servers.values():
            server.stop()


def main(argv: list[str] | None = None) -> None:
    ap = report.parser(__doc__)
    ap.add_argument("--settings", default="triton-4096,flashinfer-8192", help=f"speed at 61 layers: {sorted(SETTINGS)}")
    ap.add_argument("--check", default="", help="settings whose captures to audit at Kimi-K2 width, 4 layers")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="folder for the table and rows")
    ap.add_argument("--results", type=Path, default=Path("benchmarks/results/gpu_seed_scale.json"),
                    help="rows of earlier invocations (read, then written with this one's added to --out)")  # fmt: skip
    ap.add_argument("--rows", type=int, default=48, help="token-id rows of the seed's lengths")
    ap.add_argument("--in-flight", type=int, default=8)
    ap.add_argument("--work", type=Path, default=Path("/tmp/layertap-seed"))
    ap.add_argument("--tmpfs", type=Path, default=Path("/dev/shm/layertap-seed"))
    args = ap.parse_args(argv)
    speed_settings = [s for s in args.settings.split(",") if s]
    check_settings = [s for s in args.check.split(",") if s]
    unknown = set(speed_settings + check_settings) - set(SETTINGS)
    if unknown:
        ap.error(f"unknown settings {sorted(unknown)}; known: {sorted(SETTINGS)}")
    fresh(args.work, args.tmpfs)
    args.out.mkdir(parents=True, exist_ok=True)
    earlier = report.read(args.results)["rows"] if args.results.exists() and not args.smoke else []
    rows = [Row(**{k: v for k, v in r.items() if k != "kind"}) for r in earlier if r["kind"] == "speed"]
    checks = [Check(**{k: v for k, v in c.items() if k != "kind"}) for c in earlier if c["kind"] == "check"]
    batch = prompts(args.rows, 61, 64 if args.smoke else 700, 300 if args.smoke else 4000)
    log(f"{len(batch)} rows, {sum(map(len, batch)):,} tokens (mean {sum(map(len, batch)) / len(batch):,.0f})")
    disk_rate = volume_rate(args.work / "rate", 57 * 2350 * 1000, 8, 256 << 20 if args.smoke else 4 << 30)
    log(f"local disk takes {disk_rate / 1e9:.2f} GB/s (8 threads, fsync)")
    header = ["# Speed at the seed's scale: 61 layers, capture 3, 31, 59 + final (one H200, sglang 0.5.14)", "",
              "Written by `benchmarks/gpu/seed_scale_bench.py`: a config-only Kimi-K2.5-shaped folder (hidden 7168, "
              "61 layers, MLA, first layer dense, 8 routed experts top-8 + 1 shared), random bf16 weights "
              "(`--load-format dummy`), rows of 700-4,000 random token ids (the seed's mean ~2,350), specforge "
              f"dumps renamed into the store after the worker's checks. Common flags: `{' '.join(BASE)}`; local "
              f"disk {disk_rate / 1e9:.2f} GB/s (8 threads, fsync).", ""]  # fmt: skip

    def save() -> None:
        measured = [{"kind": "speed", **asdict(r)} for r in rows] + [{"kind": "check", **asdict(c)} for c in checks]
        result = report.result("seed_scale", render(rows, checks, header), parameters=vars(args), rows=measured)
        report.write(args.out / "gpu_seed_scale", result)

    if speed_settings:
        speed(speed_settings, batch, rows, save, args)
    if check_settings:
        correctness(check_settings, batch, checks, save, args)
    print((args.out / "gpu_seed_scale.md").read_text())
