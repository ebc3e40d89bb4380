"""Regeneration on one H200: ``--regenerate all`` through a launched server and through a worker job, its generation
rate against plain SGLang generation of the same prompts, then capture, verify and audit.

The model: the Kimi-K2.5 wrapper at Kimi-K2 width (hidden 7168, MLA, 16 routed experts top-8 + 1 shared, 4
layers), bf16 or the INT4 folder (``--model bf16|int4``). The data: ``--chats`` synthetic chats of 1-2 user/assistant
turns (``common.chat_rows``, cut to two: `chats`). Greedy, ``--max-new-tokens`` per turn, ``--generation-in-flight`` rows
at once. The random folder writes ordinary tokens only (`ordinary_outputs`), as a real model's text re-tokenizes.

Stages (``--stage``, in this order on a node), each adding its part to ``--results`` (JSON, one key per model and
stage) and the table:

- ``plain``: a stock SGLang server (``sglang.launch_server``, no plugin, the flags layertap's launcher gives its
  own: `launcher_flags`) regenerates the chats as a plain script would (`plain_generation`): a warm-up pass of the
  first ``--warm-chats``, then all of them, measured. A node's first server builds kernels (the bf16 MoE kernel
  for each decode graph, FlashInfer's, ...) into the kernel cache; the layertap runs after it find them built.
  ``--pack-kernel-cache`` returns what was built (< 16 MiB) for a later session's ``--kernel-cache-tgz``.
- ``cli``: ``layertap extract --engine sglang --regenerate all`` launching its own server with ``SERVER_ARGS``;
  then ``layertap verify --data`` and ``layertap audit``.
- ``job``: Redis, the coordinator and one Celery worker (``LAYERTAP_ENGINE=sglang``, its own server with the same
  flags); ``layertap submit --regenerate all --audit-samples N --wait`` of the same data; the worker's shard
  reports give the generation span, its Prometheus metrics the capture stages' time; ``layertap verify --data``.

The generation rate of a layertap run is its generated tokens over its generation span (each round's first
``/generate`` request to its last reply, summed: a round of rows is captured after its generation). On the device: docs/performance.md ("Benchmarks on the device") has its recipe.

``--smoke`` runs the same stages on this machine's CPU SGLang with the tiny float32 Kimi-K2.5 wrapper.

A call starts from ``--results`` (the committed JSON) and the parts that this node's earlier calls measured
(``WORK/parts.json``, kept while the work folder lives), so a ``cli`` part is compared with the ``plain`` part of its own node without copying the
JSON between calls (`ratio_to_plain` compares parts of one node only; plain SGLang's rate differs by 25% across nodes).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import secrets
import shlex
import shutil
import subprocess
import tarfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from benchmarks import common, report
from benchmarks.report import table_lines
from harness.processes import LAYERTAP, REPO_ROOT, Proc, wait_until_serving
from harness.services import RedisServer, Services
from harness.sglang import cpu_server_args, cpu_server_env
from layertap.data.chat import ChatTokenizer
from layertap.engines.sglang import free_port
from layertap.models.folder import ModelFolder
from layertap.regenerate import TurnFormat
from layertap.tiny import build_tiny_model

LAYERS = "1,2,3"
# A regenerating server decodes: CUDA graphs for decode stay on (layertap's launcher turns only prefill graphs off).
# Decode graphs up to the rows in flight (64: captures never decode), fewer to capture at each start.
SERVER_ARGS = ("--mem-fraction-static", "0.85", "--chunked-prefill-size", "8192", "--max-running-requests", "128",
               "--cuda-graph-max-bs", "64")  # fmt: skip
STAGES = ("plain", "cli", "job")


def run(cmd: list[str], env: dict[str, str], log: Path, timeout: float, profile: Path | None = None
        ) -> tuple[int, float]:  # fmt: skip
    """Run ``cmd`` to its end, its output appended to ``log``: (exit code, wall seconds). With ``profile``, py-spy
    samples the thread holding the GIL meanwhile (raw flame-graph lines in that file; a py-spy that cannot attach
    costs only the profile), without pausing it (``--nonblocking``: by default py-spy stops the process for each
    sample: a profiled extract generated at 0.52 of plain SGLang, the same commit's job unprofiled at 0.95)."""
    t0 = time.monotonic()
    with log.open("ab") as out:
        proc = subprocess.Popen(cmd, env=env, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT)
        spy = None
        if profile is not None and (py_spy := shutil.which("py-spy")) is not None:
            spy = subprocess.Popen([py_spy, "record", "--pid", str(proc.pid), "--gil", "--threads", "--nonblocking", "--rate", "50",
                                    "--format", "raw", "--output", str(profile)], stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
        try:
            code = proc.wait(timeout=timeout)
        finally:
            proc.kill()  # a no-op once it ended
        if spy is not None:
            spy.wait(timeout=60)
    return code, time.monotonic() - t0


def reports(out: Path) -> list[dict[str, Any]]:
    """The run reports under ``out/reports`` (one per run or worker shard)."""
    paths = sorted((out / "reports").glob("*.json"))
    return [json.loads(p.read_text()) for p in paths if not p.name.startswith("audit")]


def build(kind: str, work: Path, smoke: bool) -> Path:
    model = work / f"kimi-k25-{kind}"
    if not (model / "config.json").exists():
        if smoke:
            build_tiny_model("kimi-k2.5", model, dtype=torch.float32)
        elif kind == "int4":
            build_tiny_model("kimi-k2.5", model, quantize="int4", **common.KIMI_K2_WIDTH)
        else:
            build_tiny_model("kimi-k2.5", model, dtype=torch.bfloat16, **common.KIMI_K2_WIDTH)
        ordinary_outputs(model)
    return model


def ordinary_outputs(model: Path) -> None:
    """Zero the output rows (``lm_head``) of the tokenizer's special and reserved ids, so that the random model
    writes ordinary tokens. The tiny tokenizer has ~1.5K ordinary tokens in this folder's 4,096-id vocabulary;
    most of the rest are reserved ids whose names (``<|reserved_token_N|>``) a trainer re-tokenizes as text, ~4.5 tokens each.
    A random model's greedy turns were mostly those, so the stored conversations were ~4.5x what was generated
    (57 KB per token captured at this width: more hidden states per generated token than a real model's text,
    whose tokens re-tokenize as themselves, and more than this node's 125 GiB hold for 500 chats). The folder's
    layout (names, shapes, dtypes, shards) is unchanged."""
    tokenizer = ModelFolder.read(model).load_tokenizer(trust_remote_code=True)
    first_special = min(tokenizer.added_tokens_decoder)
    for shard in sorted(model.glob("*.safetensors")):
        with safe_open(shard, "pt") as f:
            names = [name for name in f.keys() if name.endswith("lm_head.weight")]  # noqa: SIM118
            metadata = f.metadata()
        if names:
            tensors = load_file(shard)
            for name in names:
                tensors[name][first_special:] = 0
            save_file(tensors, shard, metadata=metadata)


def verify_store(out: Path, data: Path, env: dict[str, str], log: Path) -> tuple[int, float]:
    """``layertap verify OUT --data DATA``: (exit code, wall seconds)."""
    return run([*LAYERTAP, "verify", str(out), "--data", str(data), "--trust-remote-code"], env, log, 1800)


def audit_verdict(out: Path, log: Path, env: dict[str, str], samples: int) -> dict[str, Any]:
    code, wall = run([*LAYERTAP, "audit", str(out), "--samples", str(samples), "--trust-remote-code"], env, log, 1800)
    newest = sorted((out / "reports").glob("audit-*.json"))[-1]
    report = json.loads(newest.read_text())
    return {"exit": code, "passed": report["passed"], "device": report["device"], "samples": len(report["samples"]),
            "seconds": round(wall, 1)}  # fmt: skip


def chats(n: int) -> list[dict[str, Any]]:
    """``common.chat_rows`` in OpenAI form, cut to their first two user/assistant pairs (before `ordinary_outputs`
    the random model's turns re-tokenized ~4.5x and a third turn's prompt outgrew the folder's 4,096-token context;
    the runs measured since keep the cut)."""
    roles = {"human": "user", "gpt": "assistant"}
    rows = []
    for row in common.chat_rows(n, random.Random(33)):
        messages = row.get("messages") or [
            {"role": roles[m["from"]], "content": m["value"]} for m in row["conversations"]
        ]
        rows.append({"id": row["id"], "messages": messages[:4]})
    return rows


# -- plain SGLang generation of the same prompts -----------------------------------------------------------------
def plain_generation(url: str, model: Path, rows: list[dict[str, Any]], settings: dict[str, Any], in_flight: int
                     ) -> dict[str, Any]:  # fmt: skip
    """Regenerate every assistant turn of ``rows`` the way a plain script would, through ``url``'s ``/generate``:
    each turn's prompt is the tokenizer's own ``apply_chat_template`` of the messages before it (earlier assistant
    turns replaced by what this server generated for them, formatted as layertap formats a generated turn), with
    the generation prompt; ``in_flight`` rows at once, a row's turns in order. Generated tokens, turns, wall seconds
    and their rate."""
    tokenizer = ModelFolder.read(model).load_tokenizer(trust_remote_code=True)
    chat = ChatTokenizer(tokenizer)
    form = TurnFormat.of(chat)
    stop = form.stop_token_ids(chat)
    client = httpx.Client(timeout=3600)
    lock = threading.Lock()
    counts = {"tokens": 0, "turns": 0}

    def one_row(row: dict[str, Any]) -> None:
        messages = list(row["messages"])
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            ids = list(tokenizer.apply_chat_template(
                messages[:i], add_generation_prompt=True, tokenize=True, return_dict=False
            ))  # fmt: skip
            body = {"input_ids": ids, "rid": f"plain-{uuid.uuid4().hex}",
                    "sampling_params": {**settings, "stop_token_ids": stop}}  # fmt: skip
            reply = client.post(url + "/generate", json=body)
            assert reply.status_code == 200, reply.text[:300]
            said = reply.json()
            finish = said["meta_info"]["finish_reason"]["type"]
            messages[i] = form.message(chat, ids, list(said["output_ids"]), finish)
            with lock:
                counts["tokens"] += len(said["output_ids"])
                counts["turns"] += 1

    t0 = time.monotonic()
    with ThreadPoolExecutor(in_flight) as pool:
        list(pool.map(one_row, rows))
    wall = time.monotonic() - t0
    client.close()
    return {"generated_tokens": counts["tokens"], "turns": counts["turns"], "seconds": round(wall, 2),
            "tok_s": round(counts["tokens"] / wall, 1)}  # fmt: skip


def launcher_flags(server_args: list[str], env: dict[str, str], smoke: bool) -> list[str]:
    """The flags layertap's launcher gives SGLang besides ``server_args`` (its GPU defaults before them, its forced
    ones after: prefill CUDA graphs, radix cache and all-reduce fusion off), asked of the launcher's own functions
    in the server's python."""
    script = ("import dataclasses, json, sys; from sglang.srt.server_args import ServerArgs; "
              "from sglang_patch.launch import default_flags, forced_flags; argv = json.loads(sys.argv[1]); "
              "print(json.dumps([default_flags(argv), forced_flags({f.name for f in dataclasses.fields(ServerArgs)})]))")  # fmt: skip
    env = {**env, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))}
    said = subprocess.run([str(common.sglang_python(smoke)), "-c", script, json.dumps(server_args)], env=env,
                          capture_output=True, text=True, check=True).stdout  # fmt: skip
    before, after = json.loads(said.strip().splitlines()[-1])
    return [*before, *server_args, *after]


def stock_server(model: Path, server_args: list[str], env: dict[str, str], log: Path, smoke: bool
                 ) -> tuple[Proc, str]:  # fmt: skip
    """SGLang's own server (no plugin) with the flags the layertap run's server got (`launcher_flags`)."""
    port = free_port()
    cmd = [str(common.sglang_python(smoke)), "-m", "sglang.launch_server", "--model-path", str(model), "--port",
           str(port), "--host", "127.0.0.1", "--trust-remote-code", "--skip-tokenizer-init",
           *launcher_flags(server_args, env, smoke)]  # fmt: skip
    proc, url = Proc("sglang-stock", cmd, env, log).start(), f"http://127.0.0.1:{port}"
    try:
        wait_until_serving(proc, url + "/health_generate", timeout=1800, what="SGLang's own server")
    except BaseException:
        proc.killpg()
        raise
    return proc, url


# -- the stages ---------------------------------------------------------------------------------------------------
def generation_args(args: argparse.Namespace) -> list[str]:
    return ["--regenerate", "all", "--max-new-tokens", str(args.max_new_tokens), "--temperature", "0",
            "--layers", LAYERS, "--trust-remote-code"]  # fmt: skip


def stage_cli(args: argparse.Namespace, model: Path, data: Path, env: dict[str, str], server_args: list[str]) -> dict:
    out = args.root / "cli-store"
    shutil.rmtree(out, ignore_errors=True)
    logs = args.work / "logs"
    # `layertap extract --regenerate all` launching its own server (its log beside its dump root)
    cmd = [*LAYERTAP, "extract", "--engine", "sglang", "--model", str(model), "--data", str(data), "--out", str(out),
           *generation_args(args), "--generation-in-flight", str(args.generation_in_flight),
           "--sglang-python", str(common.sglang_python(args.smoke)),
           "--sglang-args", shlex.join(server_args), "--dump-root", str(args.root / "cli" / "dumps")]  # fmt: skip
    common.log("layertap extract --regenerate all ...")
    profile = logs / "extract.py-spy.txt" if args.profile else None
    code, wall = run(cmd, env, logs / "extract.log", 3000, profile=profile)
    assert (out / "reports").is_dir(), f"extract exited {code} without a report: see {logs / 'extract.log'}"
    (report,) = reports(out)
    common.log(f"extract: {report['generated_tokens']:,} tokens generated in {report['generation_seconds']:.1f} s")
    started = server_start_seconds(args.root / "cli" / "sglang-server.log")  # the CLI's: beside its dump root
    verify, verify_wall = verify_store(out, data, env, logs / "verify.log")
    audit = audit_verdict(out, logs / "audit.log", env, args.audit_samples)
    common.log(f"verify exit {verify}; audit {'PASS' if audit['passed'] else 'FAIL'} on {audit['device']}")
    rate = report["generated_tokens"] / report["generation_seconds"]
    return {"extract_exit": code, "extract_wall_s": round(wall, 1), "server_start_s": started, "run_s": round(report["seconds"], 1),
            "samples": len(report["computed"]), "tokens": report["tokens"], "failed": report["failed"],
            "row_errors": report["row_errors"], "generated_tokens": report["generated_tokens"],
            "generation_s": round(report["generation_seconds"], 2), "tok_s": round(rate, 1),
            "turns_cut": report["turns_cut"], "retokenization_mismatches": report["retokenization_mismatches"],
            "verify_exit": verify, "verify_s": round(verify_wall, 1), "audit": audit}  # fmt: skip


def stage_plain(args: argparse.Namespace, model: Path, data: Path, env: dict[str, str], server_args: list[str]
                ) -> dict:  # fmt: skip
    """SGLang's own server (`stock_server`) regenerating the chats as a plain script would (`plain_generation`):
    first the first ``--warm-chats`` of them, not measured (a node's first server builds kernels -- Triton's MoE
    for each batch shape, FlashInfer's -- in its start and its first batches, into the kernel cache every later
    server of the node reads), then all of them, measured. Run first on a node: the layertap runs after it find
    the kernels built."""
    rows = common.read_jsonl(data)
    settings = {"max_new_tokens": args.max_new_tokens, "temperature": 0.0, "top_p": 1.0}
    log = args.work / "logs" / "sglang-stock.log"
    stock, url = stock_server(model, server_args, env, log, args.smoke)
    try:
        common.log(f"plain SGLang: warm-up pass of {args.warm_chats} chats ...")
        warm = plain_generation(url, model, rows[: args.warm_chats], settings, args.generation_in_flight)
        common.log(f"plain SGLang: warm-up {warm['seconds']:.0f} s; measured pass of {len(rows)} chats ...")
        plain = plain_generation(url, model, rows, settings, args.generation_in_flight)
    finally:
        stock.killpg()
    common.log(f"plain SGLang: {plain['generated_tokens']:,} tokens in {plain['seconds']:.1f} s")
    return {"server_start_s": server_start_seconds(log), "warm": warm, **plain}


def server_start_seconds(log: Path) -> float | None:
    """Seconds from a server log's first stamped line to SGLang's "ready to roll" (its warm-up included)."""
    stamp = r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)"
    text = log.read_text(errors="replace") if log.exists() else ""
    first, ready = re.search(stamp, text, re.M), re.search(stamp + r".*ready to roll", text, re.M)
    if not (first and ready):
        return None
    seconds = [time.mktime(time.strptime(m[1], "%Y-%m-%d %H:%M:%S")) for m in (first, ready)]
    return seconds[1] - seconds[0]


def stage_job(args: argparse.Namespace, model: Path, data: Path, env: dict[str, str], server_args: list[str]) -> dict:
    logs = args.work / "logs"
    services = Services(logs, {**env, "LAYERTAP_ALLOW_REMOTE_CODE": "1"})  # the wrapper's code
    redis: RedisServer | None = None
    try:
        redis = RedisServer.ephemeral(args.work)
        senv = services.process_env({"LAYERTAP_REDIS_URL": redis.url})
        coordinator = services.coordinator(redis.url, args.root / "jobs", token=secrets.token_hex(16))
        metrics_port = free_port()
        worker_env = common.worker_env(args.root / "job-dumps", server_args, args.smoke, metrics_port=metrics_port,
                                       generation_in_flight=args.generation_in_flight)  # fmt: skip
        services.worker("gpu-worker", redis.url, wait=False, **worker_env)
        submit_env = {**senv, "LAYERTAP_API_URL": coordinator.url, "LAYERTAP_API_TOKEN": coordinator.token,
                      "COLUMNS": "200"}  # fmt: skip
        cmd = [*LAYERTAP, "submit", "--model", str(model), "--data", str(data), *generation_args(args),
               "--shard-size", str(args.shard_size), "--audit-samples", str(args.audit_samples), "--wait"]  # fmt: skip
        common.log("layertap submit --regenerate all --wait ...")
        t0 = time.monotonic()
        with (logs / "submit.out").open("w") as said, (logs / "submit.err").open("w") as err:
            code = subprocess.run(cmd, env=submit_env, cwd=REPO_ROOT, stdout=said, stderr=err, timeout=3000).returncode
        wall = time.monotonic() - t0
        job_id = (logs / "submit.out").read_text().partition("\n")[0].strip()
        with coordinator.client() as client:
            job = client.get(f"/jobs/{job_id}").json()
        stages = scrape_stages(f"http://127.0.0.1:{metrics_port}/metrics")
    finally:
        common.stop_stack(services, redis)
    out = Path(job["out"])
    shards = reports(out)
    generated = sum(r["generated_tokens"] for r in shards)
    span = sum(r["generation_seconds"] for r in shards)
    verify, _ = verify_store(out, data, env, logs / "verify-job.log")
    audit = job.get("audit") or {}
    common.log(f"job {job['state']}, {generated:,} tokens generated over {span:.1f} s; verify exit {verify}")
    return {"submit_exit": code, "submit_wall_s": round(wall, 1), "state": job["state"], "samples": job["samples_done"],
            "failed": job["samples_failed"], "tokens": job["tokens_done"], "shards": len(shards),
            "generated_tokens": generated, "generation_s": round(span, 2), "tok_s": round(generated / span, 1),
            "generation": job.get("generation"), "stages_s": stages, "verify_exit": verify,
            "audit": {"state": audit.get("state"), "device": audit.get("device")}}  # fmt: skip


def scrape_stages(url: str) -> dict[str, float]:
    """The worker's seconds per stage (prefill, dump_wait, validate, commit): its histogram sums."""
    text = httpx.get(url, timeout=10).text
    pattern = r'^layertap_stage_duration_seconds_sum\{[^}]*stage="(\w+)"[^}]*\} (\S+)$'
    return {stage: round(float(value), 2) for stage, value in re.findall(pattern, text, re.M)}


# -- the table ----------------------------------------------------------------------------------------------------
def ratio_to_plain(part: dict[str, Any], plain: dict[str, Any] | None) -> str:
    """``part``'s generation rate over plain SGLang's, compared only when both ran on one node: plain SGLang ran
    at 19,013 and at 15,073 tok/s on two H200 nodes a day apart (INT4, `gpu_regenerate_first_runs.md`)."""
    if plain is None:
        return "no plain rate measured"
    value = part["result"]["tok_s"] / plain["result"]["tok_s"]
    here, there = part["meta"].get("node"), plain["meta"].get("node")
    if here and there and here != there:
        return f"{value:.3f}, not comparable: plain SGLang ran on another node ({there})"
    return f"**{value:.3f}**" + ("" if here and there else " (nodes not recorded)")


def markdown(results: dict[str, Any]) -> str:
    """``gpu_regenerate.md`` from every part measured so far."""
    lines = ["# Regeneration on one H200: `--regenerate all`, then capture", "",
             "Written by `benchmarks/gpu/regenerate_bench.py` (its docstring says how each figure is measured). "
             "Generation rate: generated tokens over the generation span (each round's first `/generate` request to "
             "its last reply, summed; layertap regenerates its rows in rounds of 16 decode batches (16 x the rows in flight) "
             "and captures a round after its generation). "
             "Plain SGLang: a stock `sglang.launch_server` with the same flags, regenerating the same chats as a "
             "plain script would (each turn's prompt through the tokenizer's own `apply_chat_template`, earlier "
             "turns its own output), the same sampling settings and stop tokens, the same rows in flight, each "
             "row's turns in order, no capture; measured after a warm-up pass, on the node where every "
             "measured server after it finds the kernels built (a cold node's first request waits for them: 5 s "
             "of a 15 s span). A ratio compares two parts of one node only.", ""]  # fmt: skip
    for key, part in results.items():
        meta, r = part["meta"], part["result"]
        model, stage = key.split("/")
        lines += [f"## {key}", "", f"{meta['model']}; {meta['rows']} chats ({meta['data']}); command "
                  f"`{meta['command']}` at commit {meta['commit']} ({meta['when']}); {meta['device']}, node "
                  f"{meta.get('node', 'not recorded')}.", ""]  # fmt: skip
        ratio = ratio_to_plain(part, results.get(f"{model}/plain"))
        if stage == "plain":
            lines += [f"Stock server start {r['server_start_s'] or '?'} s (its log, warm-up included); warm-up pass "
                      f"of {r['warm']['turns']:,} turns {r['warm']['seconds']:.0f} s, not measured. Measured: "
                      f"{r['generated_tokens']:,} tokens over {r['turns']:,} turns in {r['seconds']:.1f} s, "
                      f"**{r['tok_s']:,.0f} tok/s**.", ""]  # fmt: skip
        elif stage == "cli":
            lines += table_lines(
                ["layertap extract --regenerate all (launched server)", ""],
                [["generated tokens", f"{r['generated_tokens']:,}"],
                 ["generation span", f"{r['generation_s']:.1f} s"],
                 ["generation tok/s", f"{r['tok_s']:,.0f}"],
                 ["ratio to plain SGLang", ratio]])  # fmt: skip
            rest = r["run_s"] - (r["server_start_s"] or 0) - r["generation_s"]
            lines += ["", f"`layertap extract` exited {r['extract_exit']}. Where its {r['extract_wall_s']:.0f} s went: the run "
                      f"{r['run_s']:.0f} s: the server's start {r['server_start_s'] or '?'} s (its log), generation "
                      f"{r['generation_s']:.0f} s, then {rest:.0f} s capturing and committing (and scanning the data, "
                      f"writing the report). Stored: {r['samples']:,} samples, {r['tokens']:,} tokens, {r['failed']} failed, "
                      f"{r['row_errors']} row errors; {r['turns_cut']:,} turns cut at max_new_tokens; "
                      f"{r['retokenization_mismatches']} turns re-tokenized as other ids. `layertap verify --data` "
                      f"exit {r['verify_exit']} ({r['verify_s']:.0f} s); `layertap audit --samples "
                      f"{r['audit']['samples']}`: {'PASS' if r['audit']['passed'] else 'FAIL'} on "
                      f"{r['audit']['device']} (exit {r['audit']['exit']}).", ""]  # fmt: skip
        else:
            lines += table_lines(
                ["worker job (`layertap submit --regenerate all --wait`)", ""],
                [["state, `submit --wait` exit", f"{r['state']}, {r['submit_exit']}"],
                 ["samples, tokens, failed", f"{r['samples']:,}, {r['tokens']:,}, {r['failed']}"],
                 ["generated tokens", f"{r['generated_tokens']:,} over {r['shards']} shards"],
                 ["generation span (shard reports)", f"{r['generation_s']:.1f} s"],
                 ["generation tok/s", f"{r['tok_s']:,.0f}"],
                 ["ratio to plain SGLang", ratio],
                 ["worker stage seconds (metrics)", ", ".join(f"{k} {v}" for k, v in sorted(r["stages_s"].items()))],
                 ["submit wall (server start included)", f"{r['submit_wall_s']:.0f} s"],
                 ["verify --data exit; job audit", f"{r['verify_exit']}; {r['audit']['state']} on {r['audit']['device']}"]])  # fmt: skip
            lines += [""]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = report.parser(__doc__)
    ap.add_argument("--model", choices=("bf16", "int4"), default="bf16")
    ap.add_argument("--stage", default="plain,cli,job", help=f"comma-separated: {', '.join(STAGES)}")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="folder for the JSON and the table")
    ap.add_argument("--results", type=Path, default=Path("benchmarks/results/gpu_regenerate.json"),
                    help="parts measured before (kept, this run's replace their keys)")  # fmt: skip
    ap.add_argument("--work", type=Path, default=Path("/tmp/layertap-regen"))
    ap.add_argument("--root", type=Path, default=Path("/dev/shm/layertap-regen"), help="stores and dumps")
    ap.add_argument("--kernel-cache-tgz", type=Path, action="append", default=[], help="a node's kernel builds "
                    "(kernel-cache-h200.tgz; again for a --pack-kernel-cache of before)")  # fmt: skip
    ap.add_argument("--pack-kernel-cache", type=Path, help="at the end, the kernel cache as this run left it (for a "
                    "later run's --kernel-cache-tgz)")  # fmt: skip
    ap.add_argument("--chats", type=int, default=512)
    ap.add_argument("--warm-chats", type=int, default=64, help="the plain stage's warm-up pass")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--generation-in-flight", type=int, default=64)
    ap.add_argument("--shard-size", type=int, default=256)
    ap.add_argument("--audit-samples", type=int, default=40)
    ap.add_argument("--profile", action="store_true", help="py-spy (on PATH) samples the cli stage's extract")
    args = ap.parse_args(argv)
    stages = [s for s in args.stage.split(",") if s]
    assert set(stages) <= set(STAGES), stages
    if args.smoke:
        args.chats, args.max_new_tokens, args.generation_in_flight, args.shard_size, args.audit_samples = 6, 8, 4, 4, 3
        args.warm_chats = 2
        args.work, args.root = Path("/tmp/layertap-regen-smoke"), Path("/tmp/layertap-regen-smoke/root")
    common.fresh(args.work / "logs", args.root)
    args.out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    if args.smoke:
        env |= cpu_server_env()
        server_args = list(cpu_server_args("float32", 256))
    else:
        server_args = list(SERVER_ARGS)
    if args.kernel_cache_tgz:
        given = common.unpack_kernel_cache(args.kernel_cache_tgz, cache := args.work / "kernel-cache")
        from sglang_patch.launch import first_start_env

        env |= {"LAYERTAP_KERNEL_CACHE": str(cache), **first_start_env(server_args, str(cache), env)}
    model = build(args.model, args.work, args.smoke)
    data = common.write_jsonl(args.work / "chats.jsonl", chats(args.chats))
    folder = ModelFolder.read(model)
    common.log(f"model {model.name}: {folder.num_layers} layers, hidden {folder.hidden_size}, "
                f"{common.folder_bytes(model) / 1e9:.1f} GB; {args.chats} chats")  # fmt: skip
    committed = report.read(args.results)["rows"] if args.results.exists() and not args.smoke else []
    results = {row["part"]: {k: v for k, v in row.items() if k != "part"} for row in committed}
    this_node = args.work / "parts.json"  # the parts of this node's earlier calls (the work folder lives while it does)
    ours = json.loads(this_node.read_text()) if this_node.exists() and not args.smoke else {}
    results.update(ours)
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU (smoke)"
    meta = {"model": ("tiny Kimi-K2.5 wrapper, float32" if args.smoke else
                      f"Kimi-K2.5 wrapper at Kimi-K2 width ({'INT4 routed experts, group 32' if args.model == 'int4' else 'bf16'}), "
                      f"{folder.num_layers} layers, hidden {folder.hidden_size}"),
            "rows": args.chats, "data": f"1-2 turns each, max_new_tokens {args.max_new_tokens}, greedy, "
            f"{args.generation_in_flight} rows in flight, server flags `{shlex.join(server_args)}`",
            "command": report.command_line(), "commit": report.git_commit(),
            "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "device": device,
            "node": report.node()}  # fmt: skip
    name = "regenerate_smoke" if args.smoke else "gpu_regenerate"
    try:
        for stage in stages:
            run_stage = {"plain": stage_plain, "cli": stage_cli, "job": stage_job}[stage]
            part = {"meta": meta, "result": run_stage(args, model, data, env, server_args)}
            results[f"{args.model}/{stage}"] = ours[f"{args.model}/{stage}"] = part
            if not args.smoke:
                this_node.write_text(json.dumps(ours))
            rows = [{"part": key, **value} for key, value in results.items()]  # each part as it ends
            report.write(
                args.out / name, report.result("regenerate", markdown(results), parameters=vars(args), rows=rows)
            )
    finally:
        if args.pack_kernel_cache and args.kernel_cache_tgz:  # what this run built (a file back is 16 MiB at most)
            with tarfile.open(args.pack_kernel_cache, "w:gz") as packed:
                for path in sorted(p for p in cache.rglob("*") if p.is_file() and p not in given):
                    packed.add(path, str(path.relative_to(cache)))
        with tarfile.open(args.out / f"{name}.logs.tgz", "w:gz") as logs:  # one file: what each process said
            logs.add(args.work / "logs", "logs")
            for server_log in args.root.rglob("*.log"):
                logs.add(server_log, f"servers/{server_log.relative_to(args.root)}")
    print((args.out / f"{name}.md").read_text())
