"""Reading the plugin's specforge dumps on the capture client, by reader threads: `read_dump` as it reads now (torch
maps the zip itself, ``mmap=True``) against torch reading the same zip through the mapped file as a Python file
object (how it read before), each followed by what a commit's check does with the tensors (a float sum of every
state, as the finiteness check reads them).

Why: on one H200 host (py-spy of a regenerating run, 2026-12-02) the capture's threads held the GIL in torch's
``load_tensor`` ~65 ms per 30 MB dump, which held the run's captures to ~15 a second whatever the threads.

    .venv/bin/python -m benchmarks dump_read [--tokens 660 --hidden 7168 --samples 48]
"""

from __future__ import annotations

import argparse
import mmap
import shutil
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from benchmarks import common, report
from benchmarks.writer_bench import LAYERS, captured_states, write_dumps
from sglang_patch.contract import INPUT_IDS, dump_dir, format_rid, read_dump

THREADS = (1, 4, 8, 16)


def checked(tensors: dict[str, torch.Tensor]) -> float:
    return sum(float(t.float().sum()) for k, t in tensors.items() if k != INPUT_IDS)


def now(dump: Path) -> float:
    dump_read = read_dump(dump)
    assert dump_read.tensors is not None
    return checked(dump_read.tensors)


def before(dump: Path) -> float:
    (file,) = (p for p in dump.iterdir() if p.suffix == ".ckpt")
    with file.open("rb") as f:
        data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    return checked(torch.load(data, weights_only=True))


def rate(read: Callable[[Path], float], dumps: list[Path], threads: int) -> float:
    with ThreadPoolExecutor(threads) as pool:
        t0 = time.perf_counter()
        list(pool.map(read, dumps))
        return len(dumps) / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=660, help="tokens a dump (the regeneration bench's mean)")
    ap.add_argument("--hidden", type=int, default=7168, help="Kimi-K2's width")
    ap.add_argument("--samples", type=int, default=48)
    ap.add_argument("--root", type=Path, default=Path("/dev/shm/layertap-dump-read"))
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/dump_read.md"))
    ap.add_argument("--smoke", action="store_true", help="a few small dumps (the code path, not a measurement)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.tokens, args.hidden, args.samples = 32, 64, 4
    shutil.rmtree(args.root, ignore_errors=True)
    rids = [format_rid("bench", f"s{i}", 0) for i in range(args.samples)]
    write_dumps(args.root, captured_states(args.tokens, args.hidden, seed=0), rids, threads=4)  # as the plugin does
    dumps = [dump_dir(args.root, rid) for rid in rids]
    size = sum(p.stat().st_size for p in dumps[0].iterdir()) / 1e6
    measured = []
    for threads in THREADS:
        rate(now, dumps[:4], threads)  # pages warm, threads started
        old, new = rate(before, dumps, threads), rate(now, dumps, threads)
        measured.append({"threads": threads, "before_per_s": old, "now_per_s": new})
        common.log(f"{threads} threads: before {old:.1f}/s, now {new:.1f}/s")
    shutil.rmtree(args.root, ignore_errors=True)
    lines = ["# Reading the plugin's specforge dumps on the capture client", "",
             f"Written by `benchmarks/dump_read_bench.py` (its docstring says why) at commit {report.git_commit()}, "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: `{report.command_line()}`. {args.samples} dumps "
             f"of {args.tokens} tokens, {len(LAYERS)} layers + the final at hidden {args.hidden}, bf16 ({size:.1f} MB "
             f"each) on tmpfs; each read followed by a float sum of every state. Dumps read per second (this machine "
             f"is shared: compare within a row).", "",
             *report.table_lines(["reader threads", "before (torch through the mapped file object)",
                             "now (`read_dump`: torch maps it)", "now / before"],
                                 [[m["threads"], f"{m['before_per_s']:.1f}", f"{m['now_per_s']:.1f}",
                                   f"{m['now_per_s'] / m['before_per_s']:.2f}"] for m in measured])]  # fmt: skip
    result = report.result("dump_read", "\n".join(lines) + "\n", parameters=vars(args), rows=measured)
    print(report.write(args.out, result))
