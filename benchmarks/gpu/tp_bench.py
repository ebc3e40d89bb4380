"""Kimi-K2-width capture at TP=1 and TP=2 on two H200s: equality with HF, routing flips, all-reduce
fusion on/off, throughput. Writes ``benchmarks/results/gpu_tp2.md``-style markdown to ``--out``.

On the device: docs/performance.md ("Benchmarks on the device") has its recipe. It needs two GPUs.

Stages (``--stages``, default all); each one's results land in ``<work>/results/<stage>.json`` and a
later call skips stages already done:

- ``build``: the model folder (Kimi-K2.5 wrapper by default, Kimi-K2 width: hidden 7168, 4 layers with
  the first dense, 16 routed experts top-8 + 1 shared, MLA as Kimi's own) and two datasets: chats plus
  token-id prompts of 1..6000 tokens (equality), and 96 prompts of 512..4000 tokens (throughput).
- ``tp1``, ``tp2``, ``tp2-fused``: a capture server launched by `sglang_patch.launch` (TP=1 on GPU 0;
  TP=2 with FlashInfer all-reduce fusion forced off, as the launcher always does; TP=2 with fusion
  left at SGLang's default via ``--allreduce-fusion sglang``), then ``layertap extract --engine sglang
  --server-url`` over the equality set (as a user runs it), then plain prefill (rids outside the
  capture namespace) and capture + commit over the throughput set on the same server.
- ``ref``: each server's equality store audited by ``layertap.audit.audit_store`` (every sample; the
  folder's language model in HF transformers, float32 reference and bf16 noise floor, routing margins
  of every MoE layer, the negative controls, a verdict per state: the comparison ``layertap audit``
  makes, one implementation), and TP=2's states against TP=1's token by token.
- ``report``: the tables.

To fit one device call, the server stages run together: every server starts at once (each uses a
few GB: the model is small and the KV pool is capped), the fused one's first start spends
~6 min building FlashInfer's all-reduce kernels meanwhile; each server's equality run starts as soon
as it is up; throughput is measured one server at a time (the others idle), and skipped for what
the ``--deadline-s`` leaves no time for.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import httpx
import torch

from benchmarks import report
from benchmarks.common import KIMI_K2_ONE_GROUP, Stages, log, plain_rate, read_jsonl, sglang_python, write_jsonl
from harness.processes import run_layertap
from harness.sglang import cpu_server_args, cpu_server_env
from layertap.audit import audit_store  # the audit's reference and judging, one implementation
from layertap.audit.compare import token_errors
from layertap.audit.run import read_states, state_name
from layertap.engines.sglang import ServerConfig, SGLangServer
from layertap.store.store import OutputStore

GPU_ARGS = ("--skip-tokenizer-init", "--attention-backend", "triton", "--sampling-backend", "pytorch",
            "--grammar-backend", "none", "--disable-cuda-graph", "--chunked-prefill-size", "4096",
            "--sleep-on-idle", "--dtype", "bfloat16",
            # Three servers share GPU 0. Each uses what it needs: weights ~5 GB and a KV pool capped at
            # what 64 prompts of 4000 tokens need (~1.4 GB with MLA at 4 layers). SGLang sizes the pool as
            # free memory after loading minus (1 - fraction) x free memory before: a large fraction keeps
            # that positive when another server allocates in between.
            "--mem-fraction-static", "0.5", "--max-total-tokens", "300000")  # fmt: skip
# Its TP memory-balance check fails a TP=2 server whose GPU 0 already holds the TP=1 server.
GPU_ENV = {"SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK": "false"}
LAYERS = (1, 2, 3)  # capture indices: after the dense layer, after MoE layers 1 and 2; + the post-norm final
# stage -> (tp size, launcher extras, GPUs)
CONFIGS = {"tp1": (1, (), "0"), "tp2": (2, (), "0,1"), "tp2-fused": (2, ("--allreduce-fusion", "sglang"), "0,1")}


class TpRun:
    """The run's stages, each one's facts saved as it ends (``<work>/results/<stage>.json``, copied to
    ``<out>/tp_stages/`` so that they come back from the device: `Stages`) and skipped by a later call."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.work, self.out = args, args.work, args.out
        self.stages = Stages(self.work / "results", self.out / "tp_stages")
        self.model = self.work / "model"
        self.t0 = time.time()
        self.cpu = args.smoke
        self.device = "cpu" if self.cpu else "cuda"

    # -- build ------------------------------------------------------------------------------------

    def build(self) -> dict:
        from layertap.tiny.build import build_tiny_model

        shape = {} if self.cpu else {**KIMI_K2_ONE_GROUP, "shape": self.args.shape}
        t = time.time()
        build_tiny_model(self.args.arch, self.model, dtype=torch.bfloat16, seed=0, **shape)
        seconds = time.time() - t
        vocab = min(self.text_config()["vocab_size"], 1000)  # ids every tiny tokenizer knows
        rng = random.Random(0)
        from layertap.demo import demo_rows

        lengths = [1, 2, 17, 300, 1000, 2047, 2049, 3000, 6000] if not self.cpu else [1, 2, 17, 90]
        lengths += [int(math.exp(rng.uniform(0, math.log(lengths[-1])))) for _ in range(16 if not self.cpu else 4)]
        eq = (demo_rows()[:6] if self.cpu else demo_rows()) + [
            {"id": f"ids-{i}", "input_ids": [rng.randrange(vocab) for _ in range(n)]} for i, n in enumerate(lengths)
        ]
        low, high = (512, 4000) if not self.cpu else (16, 64)
        tput = [{"id": f"t{i}", "input_ids": [rng.randrange(vocab) for _ in range(rng.randint(low, high))]}
                for i in range(self.args.prompts)]  # fmt: skip
        write_jsonl(self.work / "eq.jsonl", eq)
        write_jsonl(self.work / "tput.jsonl", tput)
        return {
            "build_s": seconds,
            "shape": shape,
            "eq_rows": len(eq),
            "tput_rows": len(tput),
            "tput_range": [low, high],
        }

    def text_config(self) -> dict:
        config = json.loads((self.model / "config.json").read_text())
        return config.get("text_config", config)

    # -- servers ----------------------------------------------------------------------------------

    def server(self, stage: str) -> SGLangServer:
        """`stage`'s server, not started."""
        tp, extras, gpus = CONFIGS[stage]
        shutil.rmtree(self.work / stage, ignore_errors=True)
        if self.cpu:
            env, sglang_args = cpu_server_env(tp_size=tp), cpu_server_args("bfloat16", 256)
        else:
            env, sglang_args = {**GPU_ENV, "CUDA_VISIBLE_DEVICES": gpus}, GPU_ARGS
        python = sglang_python(self.cpu)
        sglang_args = (*sglang_args, "--tp-size", str(tp), *self.args.server_flags.split(), *extras)
        cfg = ServerConfig(python=python, env=env, model=self.model, dump_root=self.work / stage / "dumps",
                           layers=LAYERS, final="post", layout="specforge", log_path=self.out / f"server-{stage}.log",
                           sglang_args=sglang_args)  # fmt: skip
        return SGLangServer(cfg)

    def equality(self, stage: str, server: SGLangServer, launched: float) -> dict:
        """Start `stage`'s server (retried with backoff: servers sizing memory at once can collide), warm it
        up, capture the equality set. Runs in a pool thread that outlives the server (it dies with the
        thread that launched it)."""
        server.start()
        result: dict = {"tp": CONFIGS[stage][0], "server_up_s": time.time() - launched,
                        "flags": " ".join(server.config.sglang_args)}  # fmt: skip
        info = httpx.get(server.url + "/get_server_info", timeout=30).json()
        result["fusion"] = {k: info.get(k) for k in ("enable_flashinfer_allreduce_fusion",
                                                      "enforce_disable_flashinfer_allreduce_fusion",
                                                      "flashinfer_allreduce_fusion_backend") if k in info}  # fmt: skip
        t = time.time()
        with httpx.Client(timeout=900) as client:
            plain_rate(client, server.url, [[5] * 64, [7] * 600], 2)  # first-request kernel builds
        result["warmup_s"] = time.time() - t
        log(
            f"{stage}: up in {result['server_up_s']:.0f}s, warm-up {result['warmup_s']:.0f}s; fusion {result['fusion']}"
        )
        result["eq"] = self.extract(stage, "eq", server.url, server.config.dump_root, in_flight=16)
        log(f"{stage}: equality set captured")
        return result

    def throughput(self, stage: str, server: SGLangServer, result: dict) -> None:
        """Plain prefill and capture + commit at each in-flight setting, into `result` (the deadline allowing)."""
        tput = [row["input_ids"] for row in read_jsonl(self.work / "tput.jsonl")]
        with httpx.Client(timeout=900) as client:
            for n in self.args.in_flight:
                if time.time() - self.t0 > self.args.deadline_s:
                    result.setdefault("skipped", []).append(f"throughput at {n} in flight (past the deadline)")
                    continue
                result[f"plain_{n}"] = plain_rate(client, server.url, tput, n)
                result[f"capture_{n}"] = self.extract(stage, f"tput{n}", server.url, server.config.dump_root, n)
                log(f"{stage}: in flight {n}: plain {result[f'plain_{n}']:,.0f} tok/s, "
                         f"capture {result[f'capture_{n}']['tok_s']:,.0f} tok/s")  # fmt: skip

    def serve_all(self, stages: list[str]) -> None:
        """Every server stage at once (see the module docstring); a failed config is a result too."""
        launched = time.time()
        servers = {stage: self.server(stage) for stage in stages}
        results: dict[str, dict] = {}
        try:
            with ThreadPoolExecutor(len(servers)) as pool:
                pending: dict[str, Future] = {
                    s: pool.submit(self.equality, s, srv, launched) for s, srv in servers.items()
                }
                # No equality run beside a throughput run, except the fused server's (its kernel build
                # comes first and takes minutes): the unfused ones finish theirs before any throughput.
                for stage, future in pending.items():
                    if stage != "tp2-fused":
                        future.exception()
                for stage, future in pending.items():  # throughput in CONFIGS order, one server at a time
                    try:
                        results[stage] = future.result()
                        self.throughput(stage, servers[stage], results[stage])
                    except Exception as exc:
                        results[stage] = {"error": f"{type(exc).__name__}: {exc}"[-3000:]}
                        log(f"{stage}: FAILED {results[stage]['error']}")
                    servers[stage].stop()
        finally:
            for server in servers.values():
                server.stop()
        for stage, result in results.items():
            log_text = (self.out / f"server-{stage}.log").read_text(errors="replace")
            result.setdefault("partial_sum_warnings", log_text.count("capturing per-rank partial sums"))
            self.stages.save(stage, result)
        if "error" in results.get("tp1", {}):
            raise RuntimeError(f"tp1 failed: {results['tp1']['error']}")

    def extract(self, stage: str, data: str, url: str, dumps: Path, in_flight: int) -> dict:
        """``layertap extract --engine sglang`` attached to the running server, as a user runs it."""
        store = self.work / stage / f"store-{data}"
        dataset = self.work / f"{data.rstrip('0123456789')}.jsonl"
        t = time.time()
        proc = run_layertap("extract", "--engine", "sglang", "--server-url", url, "--dump-root", dumps, "--model",
                            self.model, "--data", dataset, "--layers", ",".join(map(str, LAYERS)), "--out", store,
                            "--in-flight", in_flight, *self.args.cli_flags.split(),
                            env={**os.environ, "COLUMNS": "300"})  # fmt: skip
        wall = time.time() - t
        (self.out / f"extract-{stage}-{data}.log").write_text(proc.stdout + proc.stderr)
        if proc.returncode != 0:
            raise RuntimeError(
                f"extract {stage}/{data} exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-3000:]}"
            )
        done = re.search(r"([\d,]+) tokens in ([\d.]+)s", proc.stderr + proc.stdout)
        tokens, seconds = int(done.group(1).replace(",", "")), float(done.group(2))
        return {"store": str(store), "tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds, "wall_s": wall}

    # -- audit ----------------------------------------------------------------------------------

    def ref(self) -> dict:
        """Every server config's equality store audited in full (the report's dict and markdown table), and
        TP=2's states against TP=1's: per state, the per-token relative error's median, p99 and max."""
        runs = {s: r for s in CONFIGS if (r := self.stages.get(s)) and "error" not in r}
        remote = "--trust-remote-code" in self.args.cli_flags.split()
        out: dict = {"audits": {}, "vs_tp1": {}}
        for stage, r in runs.items():
            report = audit_store(Path(r["eq"]["store"]), fraction=1.0, device=self.device, trust_remote_code=remote)
            out["audits"][stage] = report.to_dict() | {"markdown": report.markdown()}
            log(f"ref: {stage}: {report.summary()}")
        tp1 = stored_states(Path(runs["tp1"]["eq"]["store"]))
        for stage in ("tp2", "tp2-fused"):
            if stage in runs:
                got = stored_states(Path(runs[stage]["eq"]["store"]))
                out["vs_tp1"][stage] = {
                    state_name(point): stats(torch.cat([token_errors(got[sid][point], tp1[sid][point]) for sid in tp1]))
                    for point in next(iter(tp1.values()))
                }
        return out

    # -- report -----------------------------------------------------------------------------------

    def report(self) -> list[str]:
        runs = {s: r for s in CONFIGS if (r := self.stages.get(s)) and "error" not in r}
        failed = {s: r["error"] for s in CONFIGS if (r := self.stages.get(s)) and "error" in r}
        ref, build = self.stages.get("ref"), self.stages["build"]
        lines = ["# Kimi-K2-width capture at TP=1 and TP=2 (sglang 0.5.14, bf16)", "",
                 f"Model: `{self.args.arch}` folder built by `layertap tiny-model` at {build['shape'] or 'the tiny shape'}, "
                 f"bf16 weights, random (seed 0), built in {build['build_s']:.0f} s. Capture indices {list(LAYERS)} + "
                 f"post-norm final, specforge format, through `layertap extract --engine sglang --server-url`.",
                 f"Equality set: {build['eq_rows']} rows (the demo's chats, tool calls included, through the folder's "
                 "chat template; token-id prompts of 1..6000 tokens). Each store is judged by `layertap audit` (every "
                 "sample): HF transformers on the same weights in float32, the bf16 noise floor, routing near-ties.",
                 ""]  # fmt: skip
        rows = [[stage, r["tp"], f"{r['server_up_s']:.0f} s", f"{r['warmup_s']:.0f} s", f"`{r.get('fusion')}`",
                 r["partial_sum_warnings"]] for stage, r in runs.items()]  # fmt: skip
        head = ["config", "TP", "server up", "first request", "all-reduce fusion (server info)", "partial-sum warnings"]
        lines += ["## Servers", "", *report.table_lines(head, rows)]
        lines += [f"| {stage} | failed: `{error.splitlines()[0][:300]}` (log: server-{stage}.log) | | | | |"
                  for stage, error in failed.items()]  # fmt: skip
        lines += [f"- {stage}: skipped {what}" for stage, r in runs.items() for what in r.get("skipped", [])]
        lines += ["", f"This call ran for {time.time() - self.t0:.0f} s (stages done by earlier calls not included)."]
        if ref:
            lines += ["", *equality_tables(ref)]
        lines += ["", "## Throughput", "", f"{build['tput_rows']} prompts of {'..'.join(map(str, build.get('tput_range', [512, 4000])))} random token ids; plain = the same server, "
                  "rids outside the capture namespace; capture = `layertap extract` (prefill + capture + validate + commit, "
                  "its own clock).", "", "| config | in flight | plain prefill tok/s | capture+commit tok/s | ratio |", "|---|---|---|---|---|"]  # fmt: skip
        for stage, r in runs.items():
            for n in self.args.in_flight:
                if f"plain_{n}" in r:
                    p, c = r[f"plain_{n}"], r[f"capture_{n}"]["tok_s"]
                    lines.append(f"| {stage} | {n} | {p:,.0f} | {c:,.0f} | {c / p:.2f} |")
        return lines


def stored_states(root: Path) -> dict[str, dict]:
    """sample id -> point -> stored state [T, H], read as the audit reads a store."""
    store = OutputStore.open_existing(root)
    return {
        r.sample_id: read_states(store.manifest, store.format.load(root / r.file))[1] for r in store.records().values()
    }


def stats(errors: torch.Tensor) -> dict:
    return {"median": float(errors.median()), "p99": float(errors.quantile(0.99)), "max": float(errors.max()),
            "tokens": int(errors.numel())}  # fmt: skip


def equality_tables(ref: dict) -> list[str]:
    """Each config's audit (its verdict and per-state table), then TP=2 against TP=1."""
    lines = ["## Equality, per state and per token: `layertap audit` of each config's store", ""]
    for stage, audit in ref["audits"].items():
        markdown = audit["markdown"].replace("# Audit of", f"### {stage}: audit of", 1).replace("\n## ", "\n#### ")
        lines += [*markdown.splitlines(), ""]
    lines += ["## TP=2 against TP=1", "", "Per-token relative error of TP=2's stored state against TP=1's (no verdict: "
              "each config's own is its audit above).", "", "| config | state | median | p99 | max | tokens |",
              "|---|---|---|---|---|---|"]  # fmt: skip
    lines += [f"| {stage} | {state} | {s['median']:.2e} | {s['p99']:.2e} | {s['max']:.2e} | {s['tokens']:,} |"
              for stage, states in ref["vs_tp1"].items() for state, s in states.items()]  # fmt: skip
    return lines


def main(argv: list[str] | None = None) -> None:
    ap = report.parser(__doc__)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--work", type=Path, default=Path("/tmp/tpbench"))
    ap.add_argument("--stages", default="build,tp1,tp2,tp2-fused,ref,report")
    ap.add_argument("--arch", default="kimi-k2.5")
    ap.add_argument("--shape", default="kimi-k2-width", help="the builder's named shape on the GPU (mla-gpu: small)")
    ap.add_argument("--prompts", type=int, default=96)
    ap.add_argument("--in-flight", type=lambda s: [int(x) for x in s.split(",") if x], default=[16, 64],
                    help="throughput settings; empty: equality only")  # fmt: skip
    ap.add_argument("--server-flags", default="--trust-remote-code", help="extra SGLang flags for every server")
    ap.add_argument("--cli-flags", default="--trust-remote-code", help="extra `layertap extract` flags")
    ap.add_argument("--deadline-s", type=float, default=420, help="no throughput run starts after this many seconds")
    args = ap.parse_args(argv)
    bench = TpRun(args)
    stages = args.stages.split(",")
    for stage in ("build", *[s for s in CONFIGS if s in stages], "ref"):
        if stage not in stages or bench.stages.get(stage) is not None:
            continue
        log(f"{stage}: start")
        if stage in CONFIGS:
            bench.serve_all([s for s in CONFIGS if s in stages and bench.stages.get(s) is None])
        else:
            bench.stages.save(stage, getattr(bench, stage)())
        log(f"{stage}: end")
    done = [{"stage": stage, **facts} for stage in ("build", *CONFIGS, "ref") if (facts := bench.stages.get(stage))]
    result = report.result("tp", "\n".join(bench.report()) + "\n", parameters=vars(args), rows=done)
    print(report.write(args.out / "gpu_tp2", result))
