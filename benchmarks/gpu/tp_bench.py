"""Kimi-K2-width capture at TP=1 and TP=2 on two H200s: equality with HF, routing flips, all-reduce
fusion on/off, throughput. Writes ``benchmarks/results/gpu_tp2.md``-style markdown to ``--out``.

Run on ``nvidia-h200-x2`` (sglang 0.5.14 in /tmp/site from the two wheel chunks), one command::

    PYTHONPATH=/tmp/site:. python3 benchmarks/gpu/tp_bench.py --out $OUT --work /tmp/tpbench

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
- ``ref``: HF transformers on the same bf16 weights (DeepseekV3 built from ``text_config``, the
  ``language_model.`` weights; nothing from our engines), in float32 and in bf16, on the token ids
  the servers stored; per token: the relative error of every captured state, and the routing margin
  of every MoE layer (the gap between the k-th and (k+1)-th expert score, k = experts per token: a
  near-tie where bf16 can flip).
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
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import httpx
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from capture_bench import plain_rate  # noqa: E402  (beside this script: the same plain-prefill measure)

from layertap.audit.compare import TIE, token_errors  # noqa: E402  (the audit's comparison, one implementation)
from layertap.engines.sglang_server import CPU_SERVER_ARGS, ServerConfig, SGLangServer, cpu_server_env  # noqa: E402

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
# Kimi-K2's own MLA and width (the builder's named shape), 4 layers (first dense), 16 routed experts top-8
# in one group as Kimi-K2 routes them (so the routing margin below is exactly what selection compares).
WIDE = dict(shape="kimi-k2-width", num_hidden_layers=4, first_k_dense_replace=1, n_group=1, topk_group=1)
LAYERS = (1, 2, 3)  # capture indices: after the dense layer, after MoE layers 1 and 2; + the post-norm final
POINTS = [f"layer {i}" for i in LAYERS] + ["final (post-norm)"]
CONFIGS = {  # stage -> (tp size, launcher extras, GPUs)
    "tp1": (1, (), "0"),
    "tp2": (2, (), "0,1"),
    "tp2-fused": (2, ("--allreduce-fusion", "sglang"), "0,1"),
}
FLIP = 0.1  # a per-token relative error above this is an outlier (O(1) after a routing flip)


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.work, self.out = args, args.work, args.out
        self.results = self.work / "results"
        self.results.mkdir(parents=True, exist_ok=True)
        self.out.mkdir(parents=True, exist_ok=True)
        self.model = self.work / "model"
        self.t0 = time.time()
        self.cpu = args.cpu_smoke
        self.device = "cpu" if self.cpu else "cuda"

    def log(self, msg: str) -> None:
        print(f"[{time.time() - self.t0:6.0f}s] {msg}", flush=True)

    def done(self, stage: str) -> dict | None:
        path = self.results / f"{stage}.json"
        return json.loads(path.read_text()) if path.exists() else None

    def save(self, stage: str, result: dict) -> None:
        (self.results / f"{stage}.json").write_text(json.dumps(result, indent=1))
        shutil.copy(self.results / f"{stage}.json", self.out / f"{stage}.json")

    # -- build ------------------------------------------------------------------------------------

    def build(self) -> dict:
        from layertap.tiny.build import build_tiny_model

        shape = {} if self.cpu else {**WIDE, "shape": self.args.shape}
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
        tput = [
            {"id": f"t{i}", "input_ids": [rng.randrange(vocab) for _ in range(rng.randint(low, high))]}
            for i in range(self.args.prompts)
        ]
        for name, rows in (("eq", eq), ("tput", tput)):
            (self.work / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
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
            env, sglang_args, python = cpu_server_env(Path("/opt/sglang-venv/layertap-cuda-stub"), tp), (
                *CPU_SERVER_ARGS, "--dtype", "bfloat16", "--chunked-prefill-size", "256"), Path("/opt/sglang-venv/bin/python")  # fmt: skip
        else:
            env, sglang_args, python = {**GPU_ENV, "CUDA_VISIBLE_DEVICES": gpus}, GPU_ARGS, Path(sys.executable)
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
        self.log(
            f"{stage}: up in {result['server_up_s']:.0f}s, warm-up {result['warmup_s']:.0f}s; fusion {result['fusion']}"
        )
        result["eq"] = self.extract(stage, "eq", server.url, server.config.dump_root, in_flight=16)
        self.log(f"{stage}: equality set captured")
        return result

    def throughput(self, stage: str, server: SGLangServer, result: dict) -> None:
        """Plain prefill and capture + commit at each in-flight setting, into `result` (the deadline allowing)."""
        tput = [json.loads(line)["input_ids"] for line in (self.work / "tput.jsonl").read_text().splitlines()]
        with httpx.Client(timeout=900) as client:
            for n in self.args.in_flight:
                if time.time() - self.t0 > self.args.deadline_s:
                    result.setdefault("skipped", []).append(f"throughput at {n} in flight (past the deadline)")
                    continue
                result[f"plain_{n}"] = plain_rate(client, server.url, tput, n)
                result[f"capture_{n}"] = self.extract(
                    stage, f"tput{n}", server.url, server.config.dump_root, in_flight=n
                )
                self.log(f"{stage}: in flight {n}: plain {result[f'plain_{n}']:,.0f} tok/s, "
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
                        self.log(f"{stage}: FAILED {results[stage]['error']}")
                    servers[stage].stop()
        finally:
            for server in servers.values():
                server.stop()
        for stage, result in results.items():
            log_text = (self.out / f"server-{stage}.log").read_text(errors="replace")
            result.setdefault("partial_sum_warnings", log_text.count("capturing per-rank partial sums"))
            self.save(stage, result)
        if "error" in results.get("tp1", {}):
            raise RuntimeError(f"tp1 failed: {results['tp1']['error']}")

    def extract(self, stage: str, data: str, url: str, dumps: Path, in_flight: int) -> dict:
        """``layertap extract --engine sglang`` attached to the running server, as a user runs it."""
        store = self.work / stage / f"store-{data}"
        dataset = self.work / f"{data.rstrip('0123456789')}.jsonl"
        cmd = [sys.executable, "-m", "layertap", "extract", "--engine", "sglang", "--server-url", url,
               "--dump-root", str(dumps), "--model", str(self.model), "--data", str(dataset),
               "--layers", ",".join(map(str, LAYERS)), "--out", str(store), "--in-flight", str(in_flight),
               *self.args.cli_flags.split()]  # fmt: skip
        t = time.time()
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "COLUMNS": "300"})
        wall = time.time() - t
        (self.out / f"extract-{stage}-{data}.log").write_text(proc.stdout + proc.stderr)
        if proc.returncode != 0:
            raise RuntimeError(
                f"extract {stage}/{data} exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-3000:]}"
            )
        done = re.search(r"([\d,]+) tokens in ([\d.]+)s", proc.stderr + proc.stdout)
        tokens, seconds = int(done.group(1).replace(",", "")), float(done.group(2))
        return {"store": str(store), "tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds, "wall_s": wall}

    # -- HF reference -----------------------------------------------------------------------------

    def hf_model(self, dtype: torch.dtype) -> torch.nn.Module:
        """DeepseekV3 from the folder's text_config with the language model's weights (the ``language_model.``
        prefix mapped away, the vision tower's weights left unused), on `self.device`."""
        from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

        fields = {k: v for k, v in self.text_config().items() if k not in ("architectures", "model_type", "auto_map")}
        return (
            DeepseekV3ForCausalLM.from_pretrained(
                self.model, config=DeepseekV3Config(**fields), dtype=dtype, key_mapping={r"^language_model\.": ""}
            )
            .to(self.device)
            .eval()
        )

    def ref(self) -> dict:
        """Per-token errors of every captured state vs HF float32, for each server config and HF bf16."""
        runs = {s: r for s in CONFIGS if (r := self.done(s)) and "error" not in r}
        samples = {sid: s for sid, s in read_store(Path(runs["tp1"]["eq"]["store"])).items()}
        captured = {stage: read_store(Path(r["eq"]["store"])) for stage, r in runs.items()}
        out: dict = {"per_token": {}, "margins": {}, "sample_worst": {}}
        hf32 = self.hf_model(torch.float32)
        margins: dict[str, list[torch.Tensor]] = {}
        self._router_hooks(hf32, margins)
        ref32 = {}
        with torch.no_grad():
            for sid, s in samples.items():
                margins["cur"] = []
                ref32[sid] = hf_states(hf32, s["input_ids"], self.device)
                out["margins"][sid] = torch.stack(margins["cur"]).tolist()  # [moe layers, T]
        del hf32
        hf16 = self.hf_model(torch.bfloat16)
        with torch.no_grad():
            ref16 = {sid: hf_states(hf16, s["input_ids"], self.device) for sid, s in samples.items()}
        del hf16
        sources = {"HF bf16": ref16, **{f"SGLang {stage}": got for stage, got in captured.items()}}
        for name, got in sources.items():
            out["per_token"][name] = {sid: token_errors(got[sid]["states"], ref32[sid]["states"]).tolist()
                                      for sid in samples if sid in got}  # fmt: skip
            out["sample_worst"][name] = max(
                sample_error(got[sid]["states"], ref32[sid]["states"]) for sid in samples if sid in got
            )
        tp1 = captured["tp1"]
        for stage in ("tp2", "tp2-fused"):
            if stage in captured:
                out["per_token"][f"SGLang {stage} vs tp1"] = {
                    sid: token_errors(captured[stage][sid]["states"], tp1[sid]["states"]).tolist() for sid in tp1
                }
        # Negative controls: TP=1's capture read one layer off, and one token shifted.
        out["per_token"]["control: one layer off"] = {
            sid: token_errors(tp1[sid]["states"][1:2], ref32[sid]["states"][2:3]).tolist() for sid in tp1
        }
        out["per_token"]["control: one token shifted"] = {
            sid: token_errors(tp1[sid]["states"][:, 1:], ref32[sid]["states"][:, :-1]).tolist()
            for sid in tp1 if tp1[sid]["states"].shape[1] > 1
        }  # fmt: skip
        out["lengths"] = {sid: int(s["input_ids"].numel()) for sid, s in samples.items()}
        return out

    def _router_hooks(self, model: torch.nn.Module, margins: dict) -> None:
        """Record, per MoE layer and token, the gap between the k-th and (k+1)-th selection score."""
        k = self.text_config()["num_experts_per_tok"]
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is None:
                continue

            def hook(mod, inputs, output, k=k):
                logits = output[0] if isinstance(output, tuple) else output
                scores = logits.float().reshape(-1, logits.shape[-1]).sigmoid() + mod.e_score_correction_bias.float()
                top = scores.topk(k + 1, dim=-1).values
                margins["cur"].append((top[:, k - 1] - top[:, k]).cpu())

            gate.register_forward_hook(hook)

    # -- report -----------------------------------------------------------------------------------

    def report(self) -> list[str]:
        runs = {s: r for s in CONFIGS if (r := self.done(s)) and "error" not in r}
        failed = {s: r["error"] for s in CONFIGS if (r := self.done(s)) and "error" in r}
        ref, build = self.done("ref"), self.done("build")
        lines = ["# Kimi-K2-width capture at TP=1 and TP=2 (sglang 0.5.14, bf16)", "",
                 f"Model: `{self.args.arch}` folder built by `layertap tiny-model` at {build['shape'] or 'the tiny shape'}, "
                 f"bf16 weights, random (seed 0), built in {build['build_s']:.0f} s. Capture indices {list(LAYERS)} + "
                 f"post-norm final, specforge format, through `layertap extract --engine sglang --server-url`.",
                 f"Equality set: {build['eq_rows']} rows (the demo's chats, tool calls included, through the folder's "
                 "chat template; token-id prompts of 1..6000 tokens). Reference: HF transformers DeepseekV3 on the "
                 "same weights in float32.", ""]  # fmt: skip
        lines += ["## Servers", "", "| config | TP | server up | first request | all-reduce fusion (server info) | partial-sum warnings |",
                  "|---|---|---|---|---|---|"]  # fmt: skip
        for stage, r in runs.items():
            lines.append(
                f"| {stage} | {r['tp']} | {r['server_up_s']:.0f} s | {r['warmup_s']:.0f} s | `{r.get('fusion')}` | {r['partial_sum_warnings']} |"
            )
        for stage, error in failed.items():
            lines.append(f"| {stage} | failed: `{error.splitlines()[0][:300]}` (log: server-{stage}.log) | | | | |")
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


def read_store(root: Path) -> dict[str, dict]:
    """sample id -> input_ids [T] and states [points, T, H] float32 from a specforge store (read directly)."""
    out = {}
    for log in sorted((root / "index").glob("*.jsonl")):
        for line in log.read_text().splitlines():
            rec = json.loads(line)
            data = torch.load(root / rec["file"], weights_only=True)
            aux = data["aux_hidden_state"][0].float()
            h = data["hidden_state"][0].float()
            k = aux.shape[-1] // h.shape[-1]
            states = torch.stack([*aux.reshape(aux.shape[0], k, h.shape[-1]).unbind(1), h])
            out[rec["sample_id"]] = {"input_ids": data["input_ids"], "states": states}
    return out


def hf_states(model: torch.nn.Module, ids: torch.Tensor, device: str) -> dict:
    hs = model(ids[None].to(device), output_hidden_states=True).hidden_states
    return {"states": torch.stack([hs[i][0].float().cpu() for i in LAYERS] + [hs[-1][0].float().cpu()])}


def sample_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Worst over points of the whole-sample relative error (the metric of the earlier H200 tables)."""
    return max(float((g - r).norm() / r.norm()) for g, r in zip(got, ref, strict=True))


def _stats(per_token: dict[str, list[list[float]]], point: int) -> dict:
    values = torch.cat([torch.tensor(v[point]) for v in per_token.values() if point < len(v)])
    return {"median": float(values.median()), "p99": float(values.quantile(0.99)), "max": float(values.max()),
            "outliers": int((values > FLIP).sum()), "tokens": int(values.numel())}  # fmt: skip


def equality_tables(ref: dict) -> list[str]:
    hf = [_stats(ref["per_token"]["HF bf16"], p) for p in range(len(POINTS))]
    # bf16 arithmetic alone (HF bf16 vs HF float32) sets the scale: twice its median, twice its outlier share.
    tol = [(max(2 * s["median"], 1e-2), max(2 * s["outliers"] / s["tokens"], 0.02)) for s in hf]
    lines = ["## Equality, per layer and per token", "",
             "Per-token relative error e_t = ||x_t - r_t|| / ||r_t|| against HF float32 (or the named run). Outliers: "
             f"tokens with e_t > {FLIP}. Tolerance per captured state: median e_t <= max(2 x HF-bf16 median, 1e-2) "
             "and outliers <= max(2 x HF-bf16 outlier share, 2%) of tokens (bf16 arithmetic alone flips some routing "
             "near-ties: see the next table).", "",
             "| compared | state | median | p99 | max | outliers / tokens | verdict |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, per_token in ref["per_token"].items():
        n_points = len(next(iter(per_token.values())))
        for p in range(n_points):
            s = _stats(per_token, p)
            label = (
                POINTS[p] if n_points == len(POINTS) else ("layer 2 read as layer 3" if "layer" in name else POINTS[p])
            )
            med_tol, share_tol = tol[min(p, len(tol) - 1)]
            verdict = "PASS" if s["median"] <= med_tol and s["outliers"] <= share_tol * s["tokens"] else "FAIL"
            verdict = "(sets the scale)" if name == "HF bf16" else verdict
            lines.append(f"| {name} | {label} | {s['median']:.2e} | {s['p99']:.2e} | {s['max']:.2e} | "
                         f"{s['outliers']} / {s['tokens']} | {verdict} |")  # fmt: skip
    lines += ["", "## Where the outliers come from: routing near-ties", "",
              "For every outlier token of a state after MoE layers (capture index >= 2), the smallest HF float32 routing margin "
              "(score of the k-th minus the (k+1)-th expert, k = experts per token) over the MoE layers before it; the base rate is over all tokens.", "",
              "| compared | state | outliers | of which at a near-tie | tokens at a near-tie (all) | median margin: outliers / all |",
              "|---|---|---|---|---|---|"]  # fmt: skip
    margins = {sid: torch.tensor(m) for sid, m in ref["margins"].items()}
    for name, per_token in ref["per_token"].items():
        if name.startswith("control") or len(next(iter(per_token.values()))) != len(POINTS):
            continue
        for p in range(len(POINTS)):
            moe_before = p  # point p (capture index p+1) follows MoE layers 1..p (layer 0 is dense); the final all
            if moe_before == 0:
                s = _stats(per_token, p)
                lines.append(f"| {name} | {POINTS[p]} (dense only) | {s['outliers']} | - | - | - |")
                continue
            errs = torch.cat([torch.tensor(e[p]) for e in per_token.values()])
            m = torch.cat([margins[sid][:moe_before].min(dim=0).values for sid in per_token])
            out, near = errs > FLIP, m < TIE
            med_out = f"{float(m[out].median()):.1e}" if out.any() else "-"
            lines.append(f"| {name} | {POINTS[p]} | {int(out.sum())} | {int((out & near).sum())} | "
                         f"{int(near.sum())} / {m.numel()} | {med_out} / {float(m.median()):.1e} |")  # fmt: skip
    lines += ["", "Worst whole-sample relative error (the metric of the earlier H200 tables, max over samples and states):", "",
              "| compared | worst |", "|---|---|", *[f"| {k} vs HF float32 | {v:.2e} |" for k, v in ref["sample_worst"].items()], ""]  # fmt: skip
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--work", type=Path, default=Path("/tmp/tpbench"))
    ap.add_argument("--stages", default="build,tp1,tp2,tp2-fused,ref,report")
    ap.add_argument("--arch", default="kimi-k2.5")
    ap.add_argument("--shape", default="kimi-k2-width", help="the builder's named shape on the GPU (mla-gpu: small)")
    ap.add_argument("--prompts", type=int, default=96)
    ap.add_argument(
        "--in-flight",
        type=lambda s: [int(x) for x in s.split(",") if x],
        default=[16, 64],
        help="throughput settings; empty: equality only",
    )
    ap.add_argument("--server-flags", default="--trust-remote-code", help="extra SGLang flags for every server")
    ap.add_argument("--cli-flags", default="--trust-remote-code", help="extra `layertap extract` flags")
    ap.add_argument("--deadline-s", type=float, default=420, help="no throughput run starts after this many seconds")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shape on the CPU SGLang server, to debug the script")
    args = ap.parse_args()
    bench = Bench(args)
    stages = args.stages.split(",")
    for stage in ("build", *[s for s in CONFIGS if s in stages], "ref"):
        if stage not in stages or bench.done(stage) is not None:
            continue
        bench.log(f"{stage}: start")
        if stage in CONFIGS:
            bench.serve_all([s for s in CONFIGS if s in stages and bench.done(s) is None])
        else:
            bench.save(stage, getattr(bench, stage)())
        bench.log(f"{stage}: end")
    (args.out / "gpu_tp2.md").write_text("\n".join(bench.report()) + "\n")
    print((args.out / "gpu_tp2.md").read_text())


if __name__ == "__main__":
    main()
