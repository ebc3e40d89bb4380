"""Streaming to a trainer through Mooncake Store against the file path, on one GPU: `layertap extract --stream mooncake`
(files and stream: its store on tmpfs or local disk) and `--stream-only` (no sample file: its run folder on local
disk), a consumer process on the same node reading every sample onto the GPU and acking it, against the same run
writing files only, to tmpfs and to local disk, and against plain prefill of the same tokens; samples/s and bytes/s
as ratios within one run, the bytes each run wrote (its process's ``write_bytes``), and where the time goes.

    python3 -m benchmarks stream --layers-deep 4 --out "$OUT/stream-4" --kernel-cache-tgz .whl2/kernel-cache-h200.tgz
    python3 -m benchmarks stream --layers-deep 12 --out "$OUT/stream-12" ...     # a second call: the deeper folder
    python3 -m benchmarks stream --report PART.json [PART.json ...] --out benchmarks/results/gpu_stream.md   # here
    python3 -m benchmarks stream --smoke --out /tmp/stream-smoke      # the CPU SGLang server, the tiny bf16 wrapper

Every arm is `layertap extract --engine sglang --server-url` against one capture server (the INT4 Kimi-K2.5 folder at
Kimi-K2's width, `--format speculators`, the server's dumps on tmpfs), in the order the arms are listed, repeated
``--rounds`` times. A stream arm's clock includes the wait for the consumer's last acks (`MooncakeSink.drain`).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import torch
from redis import Redis
from safetensors.torch import load_file

from benchmarks import report
from benchmarks.common import (
    GPU_WARMED,
    KIMI_K2_WIDTH,
    chat_rows,
    folder_bytes,
    fresh,
    log,
    plain_rate,
    sglang_python,
    unpack_kernel_cache,
    write_jsonl,
)
from harness.mooncake import MooncakeMaster
from harness.processes import REPO_ROOT, layertap
from harness.services import RedisServer
from harness.sglang import cpu_server_args, cpu_server_env
from layertap.engines.sglang import ServerConfig, SGLangServer
from layertap.engines.sglang.process import dump_layout
from layertap.models.folder import ModelFolder
from layertap.spec import ExtractionSpec
from layertap.state.keys import Keys
from layertap.tiny import build_tiny_model

LAYERS = (1, 2, 3)
FORMAT = "speculators"  # the layout hs-connectors reads: what a stream puts
ARMS = ("file-tmpfs", "stream-tmpfs", "only-disk")  # KIND-WHERE[-SUFFIX]..., only = --stream-only; -host: consumers
# without CUDA (unpinned buffers; else onto the server's GPU); -cN: N consumers (1); the others add extract's flags:
SUFFIX_FLAGS = {"plan": ("--plan-processes", 2), "plan4": ("--plan-processes", 4), "wide": ("--commit-threads", 16)}
# -siN: --switch-interval-ms N/10 (CPython's own is 5 ms: si50). Any other suffix only names the arm (-prof: the runs
# scripts/pyspy_sitecustomize.py profiles with LT_PROF_ONLY=prof).
GPU_FLAGS = (*GPU_WARMED, "--mem-fraction-static", "0.6", "--chunked-prefill-size", "8192", "--max-running-requests",
             "64", "--trust-remote-code")  # fmt: skip
STAGES = ("send", "prefill", "dump_wait", "validate", "handover", "refill", "plan", "settle", "commit", "server_ready",
          "server_write")  # fmt: skip
UNACKED = 64  # the CLI's default bound
SEGMENT_MIB = 8192  # holds 64 samples of up to ~2,300 tokens at hidden 7168 (57 KB a token)


# -- the consumer (a process of its own, as a trainer is) ----------------------------------------------------
def consume(redis_url: str, name: str, master: str, result: Path) -> None:
    """Read the stream ``name`` to its end as one trainer does: each sample received (quick checks), moved onto the GPU
    when it sees one (where a trainer's step wants it), then acked; the time in each part and the bytes to ``result``."""
    from layertap.stream.consumer import StreamConsumer

    device = "cuda" if torch.cuda.is_available() else "cpu"
    consumer = StreamConsumer(redis_url, name, master=master, consumer=result.stem, block_ms=50)
    torch.zeros(1, device=device)  # the device's context made before the first sample, not in its copy
    spent = {"receive_s": 0.0, "to_device_s": 0.0, "ack_s": 0.0}
    samples, nbytes, first, last = 0, 0, None, None
    while not consumer.finished():
        t0 = time.perf_counter()
        delivery = consumer.receive()
        t1 = time.perf_counter()
        if delivery is None:
            continue
        first = first if first is not None else t0
        on_device = {k: t.to(device) for k, t in delivery.tensors.items()}
        if device == "cuda":
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        consumer.ack(delivery)
        last = time.perf_counter()
        for part, seconds in zip(spent, (t1 - t0, t2 - t1, last - t2), strict=True):  # receive, to device, ack
            spent[part] += seconds
        samples += 1
        nbytes += sum(t.nbytes for t in on_device.values())
    consumer.close()
    span = (last - first) if first is not None and last is not None else 0.0
    result.write_text(json.dumps({"samples": samples, "bytes": nbytes, "span_s": span, **spent}))


# -- one part: a folder, its server, every arm ----------------------------------------------------------------
class Part:
    """One folder's run: its server, Redis and Mooncake master up once; each arm a `layertap extract` against them."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.smoke = args, args.smoke
        work, tmpfs = args.work, args.tmpfs
        self.dirs = {"disk": work / "stores", "tmpfs": tmpfs / "stores"}
        fresh(work, tmpfs)
        self.logs = args.out.parent / f"{args.out.name}-logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        shape = {} if self.smoke else {**KIMI_K2_WIDTH, "num_hidden_layers": args.layers_deep}
        t0 = time.perf_counter()
        self.int4 = build_tiny_model("kimi-k2.5", work / "int4", quantize="int4", **shape)
        self.build_s = time.perf_counter() - t0
        # CPU SGLang has no INT4 MoE kernel: the smoke serves the bf16 wrapper of the same shape.
        self.model = build_tiny_model("kimi-k2.5", work / "bf16", dtype=torch.bfloat16) if self.smoke else self.int4
        self.data = write_jsonl(work / "chats.jsonl", chat_rows(args.chats, random.Random(20261205), max_words=400))
        self.warm_data = write_jsonl(work / "warm.jsonl", chat_rows(args.in_flight, random.Random(1), max_words=400))
        self.cache = work / "kernel-cache"
        if args.kernel_cache_tgz:
            unpack_kernel_cache([args.kernel_cache_tgz], self.cache)
        self.dumps = tmpfs / "dumps"
        self.redis, self.master = RedisServer.ephemeral(work), MooncakeMaster.ephemeral(work)
        self.server = SGLangServer(self.server_config())
        self.prompts: list[list[int]] = []

    def close(self) -> None:
        for service in (self.server, self.master, self.redis):
            service.stop()

    def start(self) -> None:
        t0 = time.perf_counter()
        self.server.start()
        self.start_s = time.perf_counter() - t0
        log(f"server up in {self.start_s:.0f} s")

    def server_config(self) -> ServerConfig:
        spec = ExtractionSpec(model=self.model, data=self.data, layers=LAYERS, format=FORMAT, trust_remote_code=True)
        capture = spec.resolve(ModelFolder.read(self.model).num_layers)
        return ServerConfig(
            python=sglang_python(self.smoke), model=self.model, dump_root=self.dumps, layers=LAYERS,
            final=capture.final_kind, layout=dump_layout(FORMAT, capture), log_path=self.logs / "server.log",
            sglang_args=(*cpu_server_args("bfloat16", 256), "--trust-remote-code") if self.smoke else GPU_FLAGS,
            env={"LAYERTAP_KERNEL_CACHE": str(self.cache), **(cpu_server_env() if self.smoke else {})},
            start_attempts=1,
        )  # fmt: skip

    def extract(self, out: Path, data: Path, *stream: str, readers: tuple[subprocess.Popen, ...] = ()) -> dict:
        """`layertap extract` attached to the server into ``out``: its run report's tokens, samples, seconds, the sample
        files' bytes, the run folder's and what the process wrote (its last ``write_bytes`` seen: storage writes, tmpfs
        not counted). Stopped when one of ``readers`` (its stream's consumers) fails: the run would wait for ever.
        Logged at -v: its log says how many rows the run's own process planned while its planning processes started."""
        t0 = time.perf_counter()
        log_path = self.logs / f"extract-{out.name}.log"
        with log_path.open("w") as log_file:
            proc = layertap("-v", "extract", "--engine", "sglang", "--server-url", self.server.url, "--dump-root",
                            self.dumps, "--model", self.model, "--data", data, "--layers", ",".join(map(str, LAYERS)),
                            "--format", FORMAT, "--out", out, "--in-flight", self.args.in_flight, "--trust-remote-code",
                            *stream, env={**os.environ, "COLUMNS": "200"}, stdout=log_file,
                            stderr=subprocess.STDOUT)  # fmt: skip
            written = 0
            while proc.poll() is None:
                if any(reader.poll() not in (None, 0) for reader in readers):
                    proc.kill()
                    raise RuntimeError(f"a consumer of {out.name} failed")
                written = max(written, write_bytes(proc.pid))
                time.sleep(0.2)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            raise RuntimeError(f"extract {out.name} exited {proc.returncode}:\n{log_path.read_text()[-3000:]}")
        [run] = [json.loads(p.read_text()) for p in sorted((out / "reports").glob("run-*.json"))][-1:]
        return {"samples": len(run["computed"]), "tokens": run["tokens"], "seconds": run["seconds"], "wall_s": wall,
                "rows_s": run["rows_seconds"], "finish_s": run["finish_seconds"], "stages": run.get("stage_seconds", {}),
                "bytes": sum(p.stat().st_size for p in out.glob("samples/*.safetensors")), "folder_bytes": folder_bytes(out),
                "written_bytes": written}  # fmt: skip

    def arm(self, arm: str, rnd: int) -> dict:
        kind, where, *extra = arm.split("-")
        name, plan = f"{arm}-{rnd}", [flag for suffix in extra for flag in suffix_flags(suffix)]
        out = self.dirs[where] / name
        if kind == "file":
            row = self.extract(out, self.data, *plan)
            if not self.prompts:  # the tokens every arm captures, for plain prefill
                self.prompts = [load_file(f)["token_ids"].tolist() for f in sorted(out.glob("samples/*.safetensors"))]
        else:
            n = next((int(suffix[1:]) for suffix in extra if suffix[:1] == "c" and suffix[1:].isdigit()), 1)
            results = [self.logs / f"consumer-{name}-{i}.json" for i in range(n)]
            readers = tuple(subprocess.Popen([sys.executable, "-m", __name__, "consume", self.redis.url, name,
                                              self.master.address, str(result)], cwd=REPO_ROOT,
                                             env={**os.environ, **({"CUDA_VISIBLE_DEVICES": ""} if "host" in extra else {})},
                                             stdout=result.with_suffix(".log").open("w"), stderr=subprocess.STDOUT)
                            for result in results)  # fmt: skip
            try:
                row = self.extract(out, self.data, "--stream", "mooncake", "--mooncake-master", self.master.address,
                                   "--stream-redis-url", self.redis.url, "--stream-name", name,
                                   "--mooncake-segment-mib", SEGMENT_MIB, "--stream-unacked", UNACKED,
                                   *(["--stream-only"] if kind == "only" else []), *plan, readers=readers)  # fmt: skip
                if any(reader.wait(timeout=120) != 0 for reader in readers):
                    raise RuntimeError(f"a consumer of {name} failed")
            finally:
                for reader in readers:
                    reader.kill()
            gots = [json.loads(result.read_text()) for result in results]  # summed, the span the longest
            got = {key: (max if key == "span_s" else sum)(g[key] for g in gots) for key in gots[0]} | {"consumers": n}
            run = stream_run_facts(self.redis.url, name)
            row |= {"consumer": got, "held_s": float(run.get("held_s", 0.0)), "put_s": float(run.get("put_s", 0.0)),
                    "placed": int(run.get("placed", 0))}  # fmt: skip
            assert got["samples"] == row["samples"], (got, row)
            row["states"] = got["bytes"]  # the samples' bytes as received (a stream-only run has no file to count)
        shutil.rmtree(out)
        row.setdefault("states", row["bytes"])
        row |= {"arm": arm, "round": rnd, "samples_s": row["samples"] / row["seconds"],
                "bytes_s": row["states"] / row["seconds"]}  # fmt: skip
        log(f"{name}: {row['samples']} samples, {row['states'] / 1e9:.2f} GB in {row['seconds']:.1f} s "
            f"({row['bytes_s'] / 1e9:.2f} GB/s)")  # fmt: skip
        return row

    def run(self) -> dict:
        """The warm-up run (the capture path's first-use kernels), then every arm ``rounds`` times; stopped by SIGINT (a
        device call's time limit), the runs that ended, no plain prefill: a part cut short is still written."""
        t0 = time.perf_counter()
        warm = self.extract(self.dirs["tmpfs"] / "warm", self.warm_data)
        log(f"warm-up: {warm['samples']} samples in {warm['seconds']:.1f} s")
        planned, rows = [(arm, rnd) for rnd in range(self.args.rounds) for arm in self.args.arms.split(",")], []
        try:
            for arm, rnd in planned:
                rows.append(self.arm(arm, rnd))
        except KeyboardInterrupt:
            log(f"interrupted after {len(rows)} of {len(planned)} runs")
            if not rows:
                raise
        arms_s = time.perf_counter() - t0
        whole = self.prompts and len(rows) == len(planned)
        with httpx.Client(timeout=600) as client:  # the same tokens, no capture: what the GPU alone allows
            plain = plain_rate(client, self.server.url, self.prompts, self.args.in_flight) if whole else None
        gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
        return {"layers": self.args.layers_deep, "smoke": self.smoke, "gpu": gpu,
                "folder_bytes": folder_bytes(self.int4), "build_s": self.build_s, "start_s": self.start_s,
                "arms_s": arms_s, "plain_tok_s": plain, "in_flight": self.args.in_flight, "rows": rows,
                "runs_planned": len(planned)}  # fmt: skip


def write_bytes(pid: int) -> int:
    """What process ``pid`` has caused to be written to storage so far (``/proc/PID/io``; 0 once it is gone)."""
    try:
        text = Path(f"/proc/{pid}/io").read_text()
    except OSError:
        return 0
    return next(int(line.split()[1]) for line in text.splitlines() if line.startswith("write_bytes:"))


def suffix_flags(suffix: str) -> tuple[object, ...]:
    """The extract flags an arm's ``suffix`` adds (`SUFFIX_FLAGS`, -siN)."""
    if suffix[:2] == "si" and suffix[2:].isdigit():
        return ("--switch-interval-ms", int(suffix[2:]) / 10)
    return SUFFIX_FLAGS.get(suffix, ())


def stream_run_facts(url: str, name: str) -> dict[str, str]:
    """What the producer of stream ``name`` published about its run (``put``, ``held_s``...)."""
    with Redis.from_url(url) as client:
        return {k.decode(): v.decode() for k, v in client.hgetall(Keys().stream_run(name)).items()}


# -- the report -----------------------------------------------------------------------------------------------
def median_by_arm(rows: list[dict], key: str) -> dict[str, float]:
    arms = dict.fromkeys(r["arm"] for r in rows)
    return {arm: statistics.median(r[key] for r in rows if r["arm"] == arm) for arm in arms}


def file_arm(arms: dict[str, float]) -> str | None:
    """The arm the others are compared with: the file path to tmpfs (``file-tmpfs``, else one with suffixes)."""
    return next((arm for arm in sorted(arms, key=len) if arm.startswith("file-tmpfs")), None)


def part_lines(part: dict) -> list[str]:
    """One folder's tables: each arm's rate against the tmpfs file path, then where a stream arm's time went."""
    rows = part["rows"]
    samples_s, bytes_s = median_by_arm(rows, "samples_s"), median_by_arm(rows, "bytes_s")
    base = samples_s[base_arm] if (base_arm := file_arm(samples_s)) else None
    rounds = max(r["round"] for r in rows) + 1
    folder, written = median_by_arm(rows, "folder_bytes"), median_by_arm(rows, "written_bytes")
    table = [(arm, f"{samples_s[arm]:,.1f}", f"{bytes_s[arm] / 1e9:,.2f}",
              f"{samples_s[arm] / base:.2f}" if base else "", f"{folder[arm] / 1e6:,.1f}", f"{written[arm] / 1e9:,.3f}",
              ", ".join(f"{r['seconds']:.1f}" for r in rows if r["arm"] == arm)) for arm in samples_s]  # fmt: skip
    phases = [(f"{r['arm']} #{r['round']}", f"{r['seconds']:.1f}", f"{r['seconds'] - r['rows_s'] - r['finish_s']:.1f}",
               f"{r['rows_s']:.1f}", f"{r['finish_s']:.1f}", *(f"{r['stages'][s] / r['samples'] * 1e3:.1f}" if s in
               r.get("stages", {}) else "" for s in STAGES)) for r in rows if "rows_s" in r]  # fmt: skip
    where = []
    for r in rows:
        if "consumer" not in r:
            continue
        c = r["consumer"]
        where.append((f"{r['arm']} #{r['round']}", f"{r['seconds']:.1f}", f"{r.get('placed', 0)}",
                      f"{r['put_s']:.2f}", f"{r['held_s']:.2f}",
                      f"{c['receive_s']:.1f}",
                      f"{c['bytes'] / c['receive_s'] / 1e9:.2f}" if c["receive_s"] else "", f"{c['to_device_s']:.1f}",
                      f"{c['ack_s']:.1f}", f"{c['span_s']:.1f}"))  # fmt: skip
    r0, planned = rows[0], part.get("runs_planned", len(rows))
    cut = f" (stopped by its time limit after {len(rows)} of {planned} runs)" if len(rows) < planned else ""
    return [
        f"### {part['layers']} layers (folder {part['folder_bytes'] / 1e9:,.1f} GB, built in {part['build_s']:.0f} s; "
        f"server up in {part['start_s']:.0f} s; arms {part['arms_s']:.0f} s)", "",
        f"{r0['samples']} samples, {r0['tokens']:,} tokens, {r0['states'] / 1e9:,.2f} GB of states a run; medians "
        f"of {rounds} rounds{cut}; ratio = samples/s over the file path to tmpfs; only = --stream-only; run folder = "
        "its size after the run; written = the process's storage writes (`/proc/PID/io` write_bytes; tmpfs not "
        "counted).", "",
        *report.table_lines(("arm", "samples/s", "GB/s", "vs file-tmpfs", "run folder MB", "written GB",
                             "run seconds, each round"), table), "",
        *headline(part), "",
        *(["The run's own phases (seconds, from its report: start = the plan, the engine bound to the server, the "
           "store opened; rows = the rows read, tokenized, captured, committed; finish = the store finalized, a "
           f"stream acked), then a sample's mean ms in each stage ({part.get('in_flight', 16)} requests in flight; "
           "`RunReport.stage_seconds`; server_ready, server_write: the server's writer waiting for the dump's copies "
           "off the device, then writing it, a file or into its placement, from each dump's meta.json):", "",
           *report.table_lines(("run", "run s", "start s", "rows s", "finish s", *(f"{s} ms" for s in STAGES)),
                               phases), ""] if phases else []),
        "Where a stream run's time went (seconds; placed = the samples the server wrote into their objects; the "
        "producer's puts, summed over the threads that put side by side: each sample's tensors as captured copied "
        "into Mooncake Store, or a placed sample's reservation, then its manifest XADDed; its wait at the bound "
        f"of {UNACKED} unacked samples; the consumer's receive = the get over TCP into a pinned buffer, then the copy "
        "onto the GPU, then the ack and the object's removal):", "",
        *report.table_lines(("run", "run s", "placed", "producer put s", "producer held s", "consumers' receive s",
                             "receive GB/s a consumer", "to GPU s", "ack s", "first to last delivery s"), where), "",
    ]  # fmt: skip


def headline(part: dict) -> list[str]:
    """What bounds the stream on this folder, read from the medians: each stream arm's rate against the file run to
    tmpfs (the table's ratio, and each round's against that round's file run: a host's speed drifts between rounds) and
    to plain prefill, and how much of its time the producer spent putting and waiting at its bound."""
    rows = part["rows"]
    seconds, tokens, samples_s = (median_by_arm(rows, key) for key in ("seconds", "tokens", "samples_s"))
    if (base := file_arm(seconds)) is None:
        return []
    plain = part.get("plain_tok_s")
    base_s = {r["round"]: r["seconds"] for r in rows if r["arm"] == base}
    out = []
    for arm in (a for a in seconds if not a.startswith("file")):
        streams = [r for r in rows if r["arm"] == arm]
        extra = seconds[arm] - seconds[base]
        put = statistics.median(r["put_s"] for r in streams)
        held = statistics.median(r["held_s"] for r in streams)
        receive = statistics.median(r["consumer"]["bytes"] / r["consumer"]["receive_s"] for r in streams)
        paired = ", ".join(f"{base_s[r['round']] / r['seconds']:.2f}" for r in streams if r["round"] in base_s)
        readers = f"each of its {n} consumers" if (n := streams[0]["consumer"]["consumers"]) > 1 else "the consumer"
        bound = ("the consumer: the producer waited at its bound" if held >= 0.5 * max(extra, 1e-9) else
                 "the producer's side, its capture and puts (the consumer never held it at its bound)")  # fmt: skip
        vs_plain = f", {tokens[arm] / seconds[arm] / plain:.2f} of plain prefill ({plain:,.0f} tok/s)" if plain else ""
        out.append(f"- {arm}: {samples_s[arm] / samples_s[base]:.2f} of the file run to tmpfs ({base}; each round "
                   f"against its own: {paired}){vs_plain}; {extra:+.1f} s against it (medians), of which the producer's "
                   f"puts {put:.1f} s (summed over the threads that put, beside the captures) and its waits at the bound "
                   f"{held:.1f} s; {readers} received at {receive / 1e9:.2f} GB/s. What bounds it: {bound}.")  # fmt: skip
    return out


def write_report(parts: list[Path], out: Path, note: str = "") -> None:
    """The committed table: every part's (one call each on the device) under one header."""
    got = [report.read(p) for p in parts]
    header = [
        "# Streaming to a trainer through Mooncake Store against the file path (SGLang 0.5.14, one "
        + " / ".join(dict.fromkeys(g["rows"][0].get("gpu", "GPU: see below") for g in got)) + ")", "",
        f"Written by `benchmarks/gpu/stream_bench.py` from {len(got)} device calls "
        + ", ".join(f"at commit {g['commit']} on {g['node']} ({g['date']})" for g in got) + ". " + __doc__.split(
            "\n\n")[2].replace("\n", " "), "",
    ]  # fmt: skip
    body = [line for g in got for line in part_lines(g["rows"][0])] + ([note, ""] if note else [])
    result = report.result("stream", "\n".join(header + body), parameters={"parts": [g["parameters"] for g in got]},
                           rows=[g["rows"][0] for g in got])  # fmt: skip
    report.write(out, result)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["consume"]:
        return consume(argv[1], argv[2], argv[3], Path(argv[4]))
    ap = report.parser(__doc__)
    ap.add_argument("--out", type=Path, required=True, help="the result (NAME.json and NAME.md)")
    ap.add_argument("--report", type=Path, nargs="+", help="merge these parts' JSON into --out, run nothing")
    ap.add_argument("--note", default="", help="with --report: a closing paragraph (what was not run, and why)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/layertap-stream"), help="on local disk")
    ap.add_argument("--tmpfs", type=Path, default=Path("/dev/shm/layertap-stream"))
    ap.add_argument("--layers-deep", type=int, default=4, help="decoder layers of the Kimi-K2-width INT4 folder")
    ap.add_argument("--chats", type=int, default=480)
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--in-flight", type=int, default=16, help="requests each `layertap extract` keeps in flight")
    ap.add_argument("--kernel-cache-tgz", type=Path, default=None, help="a node's kernel builds (section I)")
    args = ap.parse_args(argv)
    if args.report:
        return write_report(args.report, args.out, args.note)
    if args.smoke:
        args.chats, args.rounds = min(args.chats, 12), 1
    part = Part(args)
    try:
        part.start()
        facts = part.run()
    finally:
        part.close()
    result = report.result("stream", "\n".join(part_lines(facts)), parameters=vars(args), rows=[facts])
    report.write(args.out, result)
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
