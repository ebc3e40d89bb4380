"""Acceptance: a drafter trained on a layertap store, served by SGLang's EAGLE-3, and the data mistakes that cost it.

The path a user takes, with nothing edited by hand: `layertap extract --engine sglang` (the CLI, launching its
server) -> the store's TRAIN.md, followed as written (its draft config, its `run.yaml`, `specforge train`,
`specforge export --to sglang`) -> SGLang serving the target with that drafter (EAGLE3, 3 steps, top-k 1, 4 draft
tokens, greedy) over held-out prompts -> acceptance length from SGLang's own counters (per request,
`meta_info.spec_accept_length` = completion_tokens / spec_verify_ct) and decode tokens/s with and without it.

Arms, each the same recipe with one mistake:
- correct: TRAIN.md as written;
- a-other-sample: every sample's states are another sample's (the store's files re-written with the states of
  the sample next in length order, both cut to the shorter; input_ids and loss mask kept);
- b-ids-off-by-one: the correct drafter served with draft-config aux ids = capture indices (TRAIN.md: - 1);
- c-pre-norm-final: `hidden_state` holds the pre-norm final state where SpecForge wants the post-norm one.
  layertap refuses `--final pre` for the specforge format, so those states come from a second extraction of the
  same data in the speculators format (whose files end with the pre-norm final; layertap's HF engine, no second
  server) and replace `hidden_state`;
- e-no-eagle-config: the correct drafter served with a draft config without `eagle_config` (what SpecForge 0.2.0
  generates itself, and what TRAIN.md led to before it wrote the draft config): SGLang captures [2, L//2, L-3];
- d (given vs regenerated responses) needs `layertap extract --regenerate`: `--responses regenerated` says so
  until that option exists, and then extracts with it.

Stages (each reads the previous ones' files from --work and is reproducible from --seed; `all` runs them in order):
corpus, tokenizer, target, data, extract, controls, train, serve, report. `--cpu-smoke` runs every stage on this
machine with tiny sizes (SGLang 0.5.10 CPU server, SpecForge from /opt/trainers-venv) and writes the report in
the work folder, never into benchmarks/results/.

The H200 run fits one session (30 minutes of device time; the work folder and /tmp/site live only while the
machine stays warm, about 30 s after each call, so chain the calls). Prepared here, both folders ignored by git:
`.whl1/` = the SGLang GPU bundle's chunk1 (sglang 0.5.14 and its kernels, ~55 MiB); `.whl2/` = its chunk2
(transformers 5.8.1, tokenizers 0.22.2) + the cp312 wheels the device image lacks for the layertap CLI and SpecForge:
datasets 4.4.1, ijson 3.3.0, multiprocess 0.70.18, tzlocal, pydantic-settings, python-dotenv, xxhash, tiktoken 0.12,
redis, celery, kombu, billiard, vine, amqp, click-didyoumean, click-repl, click-plugins, prompt-toolkit, wcwidth and
specforge-0.2.0-py3-none-any.whl (pydantic, loguru and dill come with chunk1). The calls of the committed run
(benchmarks/results/gpu_acceptance.md), wall time measured:

    1. carry .whl1:  bash benchmarks/gpu/on_device.sh install .whl1                                        (26 s)
    2. carry .whl2:  bash benchmarks/gpu/on_device.sh install .whl2 -- -m benchmarks.gpu.acceptance_bench \
                         --work /dev/shm/acc corpus tokenizer target data                                 (160 s)
    3. carry .whl2:  ... -- -m benchmarks.gpu.acceptance_bench --work /dev/shm/acc extract               (~250 s)
    4. carry .whl2:  ... -- -m benchmarks.gpu.acceptance_bench --work /dev/shm/acc controls train        (450 s)
    5. carry .whl2:  ... -- -m benchmarks.gpu.acceptance_bench --work /dev/shm/acc serve report \
                         --out $OUT/gpu_acceptance.md                                                     (440 s)

then commit the returned table as benchmarks/results/gpu_acceptance.md. A serve call that runs out of time is continued
by the next (measured arms are kept).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import torch
import yaml

from benchmarks.gpu.acceptance_target import (
    GPU,
    PROBE,
    SMOKE,
    Sizes,
    build_corpus,
    build_tokenizer_folder,
    conversation,
    held_out_conversations,
    train_conversations,
    train_target,
)
from benchmarks.harness import GPU_COMMON, REPO, git_commit, log, sglang_python, smoke_env
from layertap.engines.sglang_server import CPU_SERVER_ARGS, ServerConfig, SGLangServer
from layertap.store.store import OutputStore
from layertap.trainers import GUIDE

STAGES = ("corpus", "tokenizer", "target", "data", "extract", "controls", "train", "serve", "report")
SPEC_FLAGS = ("--speculative-algorithm", "EAGLE3", "--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
              "--speculative-num-draft-tokens", "4")  # fmt: skip
GPU_EXTRACT_ARGS = (*GPU_COMMON, "--attention-backend", "triton", "--mem-fraction-static", "0.5")
# Serving: CUDA graphs on (SGLang's default; decode tok/s of a small model is launch-bound without them).
GPU_SERVE_ARGS = ("--skip-tokenizer-init", "--sampling-backend", "pytorch", "--grammar-backend", "none",
                  "--attention-backend", "triton", "--dtype", "bfloat16")  # fmt: skip
CPU_ARGS = (*CPU_SERVER_ARGS, "--chunked-prefill-size", "128")
TRAINERS_PYTHON = Path("/opt/trainers-venv/bin/python")
# SpecForge's EAGLE-3 loss is a Triton kernel: on a CPU it runs through the interop tests' shim (its docstring says
# what it bypasses); on the GPU SpecForge runs as shipped.
SPECFORGE_CPU = REPO / "tests" / "trainers" / "run_specforge.py"


@dataclass(frozen=True)
class Arm:
    """One served configuration: the store its drafter is trained on, or (store None) `same_drafter_as`'s drafter
    served with other aux ids: "capture" (the capture indices themselves) or "none" (no eagle_config, as SpecForge
    0.2.0's own draft config has: SGLang then captures its default layers)."""

    name: str
    what: str
    store: str | None
    same_drafter_as: str | None = None
    served_ids: str = "train-md"


ARMS = (
    Arm("correct", "TRAIN.md as written", "correct"),
    Arm("a-other-sample", "each sample's states from another sample", "permuted"),
    Arm("b-ids-off-by-one", "draft-config aux ids = capture indices (not - 1)", None, "correct", "capture"),
    Arm("c-pre-norm-final", "pre-norm final state where the format wants post-norm", "prenorm"),
    Arm(
        "e-no-eagle-config",
        "draft config without eagle_config (SGLang's default [2, L//2, L-3])",
        None,
        "correct",
        "none",
    ),
)
ARM_BY_NAME = {arm.name: arm for arm in ARMS}
NO_DRAFTER = "no drafter"
# Why a smoke run serves no drafter: SGLang 0.5.10's CPU server cannot start any speculative algorithm. With one,
# the target's KV pool is built with enable_kv_cache_copy (model_runner_kv_cache_mixin.py:696-698), whose warm-up
# launches the Triton kernel copy_all_layer_kv_cache_tiled (mem_cache/memory_pool.py:787-788, 833) and Triton
# finds no GPU driver: "RuntimeError: 0 active drivers ([]). There should only be one." (triton/runtime/driver.py:9).
CPU_NO_SPECULATIVE = "not served on the CPU: SGLang 0.5.10's CPU server cannot start speculative decoding"


@dataclass
class Run:
    """The parsed command line and what follows from it."""

    work: Path
    seed: int
    smoke: bool
    sizes: Sizes
    device: str
    arms: tuple[str, ...]
    corpus_root: Path
    sglang_python: Path
    trainers_python: Path
    in_flight: int
    out: Path

    def path(self, *parts: str) -> Path:
        return self.work.joinpath(*parts)

    def facts(self, stage: str) -> dict[str, Any]:
        path = self.path(f"{stage}.json")
        if not path.exists():
            raise SystemExit(f"stage {stage!r} has not run in {self.work} (no {path.name}): run it first")
        return json.loads(path.read_text())

    def done(self, stage: str, facts: dict[str, Any]) -> None:
        self.path(f"{stage}.json").write_text(json.dumps(facts, indent=1, default=str))
        log(f"{stage}: done")

    def server_env(self) -> dict[str, str]:
        return {**os.environ, **smoke_env()} if self.smoke else dict(os.environ)


def stage_corpus(run: Run) -> None:
    run.done("corpus", build_corpus(run.corpus_root, run.path("corpus"), run.seed, run.sizes))


def stage_tokenizer(run: Run) -> None:
    t0 = time.monotonic()
    tokenizer = build_tokenizer_folder(run.path("corpus"), run.path("tokenizer"), run.sizes)
    run.done("tokenizer", {"vocab": len(tokenizer), "seconds": time.monotonic() - t0})


def stage_target(run: Run) -> None:
    run.done("target", train_target(run.path("corpus"), run.path("tokenizer"), run.path("target"), run.seed,
                                    run.sizes, run.device))  # fmt: skip


def stage_data(run: Run) -> None:
    """The drafter's conversations (training files, responses as given) and the held-out prompts."""
    rows = train_conversations(run.path("corpus"), run.seed + 1, run.sizes)[: run.sizes.conversations]
    prompts = [conversation(r["id"].rsplit("#", 1)[0], 0, r["messages"][0]["content"], None)
               for r in held_out_conversations(run.path("corpus"), run.sizes)][: run.sizes.prompts]  # fmt: skip
    if len(rows) < run.sizes.conversations or len(prompts) < run.sizes.prompts:
        raise SystemExit(f"the corpus gives {len(rows)} conversations and {len(prompts)} held-out prompts; "
                         f"{run.sizes.conversations} and {run.sizes.prompts} are needed: select more files")  # fmt: skip
    data = run.path("data")
    data.mkdir(exist_ok=True)
    for name, part in (("given.jsonl", rows), ("prompts.jsonl", prompts)):
        (data / name).write_text("".join(json.dumps(r) + "\n" for r in part))
    run.done("data", {"conversations": len(rows), "prompts": len(prompts), "responses": "given"})


def layertap_extract(run: Run, out: Path, fmt: str, engine: str) -> dict[str, Any]:
    """`layertap extract` as a user runs it (the CLI; with the sglang engine it launches its own server)."""
    cmd = [sys.executable, "-m", "layertap", "extract", "--engine", engine, "--model", str(run.path("target")),
           "--data", str(run.path("data", "given.jsonl")), "--layers", ",".join(map(str, run.sizes.capture)),
           "--format", fmt, "--out", str(out)]  # fmt: skip
    if engine == "sglang":
        cmd += ["--sglang-python", str(run.sglang_python), "--in-flight", str(run.in_flight),
                "--sglang-args", shlex.join(CPU_ARGS if run.smoke else GPU_EXTRACT_ARGS)]  # fmt: skip
    else:
        cmd += ["--device", run.device]
    log(f"extract: {shlex.join(cmd)}")
    t0 = time.monotonic()
    done = subprocess.run(cmd, env=run.server_env(), capture_output=True, text=True, cwd=REPO)
    if done.returncode != 0:
        raise SystemExit(f"layertap extract failed ({done.returncode}):\n{done.stderr[-4000:]}")
    summary = " ".join(done.stderr[done.stderr.rfind("done:") :].split())  # the CLI's last line, unwrapped
    return {"command": shlex.join(cmd), "seconds": time.monotonic() - t0, "summary": summary}


def stage_extract(run: Run, responses: str) -> None:
    """The correct store (specforge, SGLang), and the same data in the speculators format for the pre-norm control
    (the HF engine: layertap's other capture path, no second server to start)."""
    if responses == "regenerated":
        raise SystemExit("arm d (regenerated responses) needs `layertap extract --regenerate`, which this layertap "
                         "does not have yet; run with --responses given")  # fmt: skip
    stores = run.path("stores")
    for name in ("correct", "speculators"):
        shutil.rmtree(stores / name, ignore_errors=True)
    facts = {"correct": layertap_extract(run, stores / "correct", "specforge", "sglang"),
             "speculators": layertap_extract(run, stores / "speculators", "speculators", "hf")}  # fmt: skip
    facts["train_md"] = (stores / "correct" / GUIDE).read_text()
    run.done("extract", facts)


def stage_controls(run: Run) -> None:
    """Stores (a) and (c) from the correct store's files: one mistake each, nothing else changed."""
    stores = run.path("stores")
    correct = OutputStore.open_existing(stores / "correct")
    speculators = OutputStore.open_existing(stores / "speculators")
    records = sorted(correct.records().values(), key=lambda r: (r.num_tokens, r.sample_id))
    pre_by_id = {r.sample_id: r for r in speculators.records().values()}
    for name in ("permuted", "prenorm"):
        shutil.rmtree(stores / name, ignore_errors=True)
    cut = 0
    for i, rec in enumerate(records):
        own = correct.format.load(stores / "correct" / rec.file)
        # (a): the states of the sample next in length order (a derangement), both cut to the shorter
        other = correct.format.load(stores / "correct" / records[(i + 1) % len(records)].file)
        n = min(own["input_ids"].shape[0], other["input_ids"].shape[0])
        cut += own["input_ids"].shape[0] - n
        _save(stores / "permuted" / rec.file, {"input_ids": own["input_ids"][:n], "loss_mask": own["loss_mask"][:n],
              "hidden_state": other["hidden_state"][:, :n], "aux_hidden_state": other["aux_hidden_state"][:, :n]})  # fmt: skip
        # (c): the pre-norm final state of the same sample (the last slot of its speculators file)
        # (the HF engine has no server limit: a row the server's limit truncated is longer there, and a causal
        # model's states of a prefix are the prefix's states)
        pre = speculators.format.load(stores / "speculators" / pre_by_id[rec.sample_id].file)
        t = own["input_ids"].shape[0]
        if not torch.equal(pre["token_ids"][:t], own["input_ids"]):
            raise SystemExit(f"sample {rec.sample_id}: the speculators store holds other tokens")
        _save(stores / "prenorm" / rec.file,
              {**own, "hidden_state": pre["hidden_states"][:t, -1].to(own["hidden_state"].dtype)[None]})  # fmt: skip
    shutil.rmtree(stores / "speculators")  # only the pre-norm states were needed (disk: three stores are enough)
    run.done("controls", {"samples": len(records), "a_tokens_cut": cut})


def _save(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({k: v.contiguous().clone() for k, v in tensors.items()}, path)


def block(text: str, lang: str) -> str:
    """The one fenced ```lang block of TRAIN.md."""
    blocks = re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S)
    if len(blocks) != 1:
        raise SystemExit(f"TRAIN.md has {len(blocks)} ```{lang} blocks, expected one")
    return blocks[0]


def specforge(run: Run, args: list[str], cwd: Path, log_name: str) -> str:
    """`specforge ARGS` in the trainers' environment (on a CPU through the interop tests' Triton shim)."""
    entry = [str(SPECFORGE_CPU)] if run.smoke else ["-m", "specforge.cli"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "400"}
    done = subprocess.run([str(run.trainers_python), *entry, *args], cwd=cwd, env=env, capture_output=True, text=True)
    output = done.stdout + done.stderr
    (cwd / log_name).write_text(output)
    if done.returncode != 0:
        raise SystemExit(f"specforge {args[0]} failed ({done.returncode}); log {cwd / log_name}:\n{output[-4000:]}")
    return output


def stage_train(run: Run) -> None:
    """Every arm with a store of its own is trained (on a GPU all at once: each small drafter leaves it mostly
    idle); arm b serves the correct drafter with the ids off by one."""
    guide = run.path("stores", "correct", GUIDE).read_text()
    facts = run.facts("train") if run.path("train.json").exists() else {}
    trained = [ARM_BY_NAME[name] for name in run.arms if ARM_BY_NAME[name].store is not None]
    with ThreadPoolExecutor(1 if run.smoke else max(1, len(trained))) as pool:
        facts |= dict(
            zip((a.name for a in trained), pool.map(lambda a: train_arm(run, guide, a), trained), strict=True)
        )
    for arm in (ARM_BY_NAME[name] for name in run.arms if ARM_BY_NAME[name].same_drafter_as):
        _served_copy(run, arm)
    run.done("train", facts)


def train_arm(run: Run, guide: str, arm: Arm) -> dict[str, Any]:
    """TRAIN.md's draft config and run.yaml with only the arm's store swapped in and the hyper-parameters TRAIN.md
    leaves to the user added; `specforge train`, then `specforge export --to sglang` as TRAIN.md says."""
    folder = run.path("arms", arm.name)
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    (folder / "draft.json").write_text(block(guide, "json"))
    config = yaml.safe_load(block(guide, "yaml"))
    config["data"]["hidden_states_path"] = str(run.path("stores", str(arm.store)).resolve())
    # What TRAIN.md leaves to the user: epochs, learning rate, logging, the seed; SDPA attention (flex attention
    # would be compiled first on a GPU and has no backward on a CPU), and without an accelerator DDP (FSDP refuses
    # the CPU).
    config["training"] |= {"num_epochs": run.sizes.drafter_epochs, "learning_rate": run.sizes.drafter_lr,
                           "batch_size": run.sizes.drafter_batch, "log_interval": 1 if run.smoke else 50, "seed": run.seed, "attention_backend": "sdpa"}  # fmt: skip
    if run.smoke:
        config["training"]["fsdp_sharding"] = "NO_SHARD"
    config["output_dir"] = str(folder / "specforge-run")
    config["data"]["cache_dir"] = str(folder / "specforge-cache")
    (folder / "run.yaml").write_text(yaml.safe_dump(config))
    t0 = time.monotonic()
    output = specforge(run, ["train", "--config", "run.yaml"], folder, "train.log")
    seconds = time.monotonic() - t0
    specforge(run, ["export", "--to", "sglang", "--checkpoint", "specforge-run", "--draft-config", "draft.json",
                    "--output-dir", "drafter"], folder, "export.log")  # fmt: skip
    steps = [ast.literal_eval(m) for m in re.findall(r"^step \d+: (\{.*\})$", output, flags=re.M)]
    if not steps:
        raise SystemExit(f"specforge train logged no step; log {folder / 'train.log'}")
    log(f"train {arm.name}: {len(steps)} logged steps in {seconds:.0f} s, loss {steps[0]['loss']:.2f} -> "
        f"{steps[-1]['loss']:.2f}")  # fmt: skip
    return {"seconds": seconds, "steps": len(steps), "run_yaml": (folder / "run.yaml").read_text(),
            **{f"{k}_{when}": step[k] for when, step in (("first", steps[0]), ("last", steps[-1]))
               for k in ("loss", "acc_0")}}  # fmt: skip


def _served_copy(run: Run, arm: Arm) -> None:
    """`arm`'s drafter: its source arm's weights (linked), its config with the aux ids `arm.served_ids` says."""
    source, folder = run.path("arms", str(arm.same_drafter_as), "drafter"), run.path("arms", arm.name, "drafter")
    if not source.exists():
        raise SystemExit(f"arm {arm.name} serves {arm.same_drafter_as}'s drafter: train that arm first")
    shutil.rmtree(folder.parent, ignore_errors=True)
    folder.mkdir(parents=True)
    for item in source.iterdir():
        if item.name != "config.json":
            (folder / item.name).symlink_to(item.resolve())
    config = json.loads((source / "config.json").read_text())
    if arm.served_ids == "capture":
        config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = list(run.sizes.capture)
    else:
        del config["eagle_config"]
    (folder / "config.json").write_text(json.dumps(config, indent=1))


class PlainServer(ServerConfig):
    """SGLang's own launcher (no capture plugin): the target served as users serve it."""

    def command(self, port: int) -> list[str]:
        return [str(self.python), "-m", "sglang.launch_server", "--model-path", str(self.model),
                "--host", self.host, "--port", str(port), *self.sglang_args]  # fmt: skip


def launch_server(run: Run, name: str, memory_share: float) -> SGLangServer:
    """Launch (without waiting) SGLang on the target, with `name`'s drafter unless NO_DRAFTER, taking
    `memory_share` of the GPU. Called from the main thread: a server dies with the thread that launched it."""
    args = CPU_ARGS if run.smoke else (*GPU_SERVE_ARGS, "--mem-fraction-static", f"{memory_share:.2f}")
    if name != NO_DRAFTER:
        args = (*args, *SPEC_FLAGS, "--speculative-draft-model-path", str(run.path("arms", name, "drafter")))
    config = PlainServer(python=run.sglang_python, model=run.path("target"), dump_root=run.path("serve"), layers=(),
                         final="post", log_path=run.path("serve", f"{name.replace(' ', '-')}.log"), sglang_args=args,
                         env=smoke_env() if run.smoke else {})  # fmt: skip
    server = SGLangServer(config)
    server.launch()
    return server


def measure(run: Run, name: str, server: SGLangServer, prompts: list[list[int]]) -> dict[str, Any]:
    """Every prompt, greedy, `run.in_flight` at a time: per-request acceptance lengths (SGLang's own
    spec_accept_length = completion tokens / verify steps) and the decode rate."""
    client = httpx.Client(timeout=1800)

    def one(ids: list[int]) -> dict[str, Any]:
        body = {"input_ids": ids, "sampling_params": {"temperature": 0.0, "max_new_tokens": run.sizes.max_new_tokens}}
        reply = client.post(server.url + "/generate", json=body)
        if reply.status_code != 200:
            raise SystemExit(f"{name}: /generate answered {reply.status_code}: {reply.text[:500]}")
        return reply.json()["meta_info"]

    try:
        one(prompts[0])  # first-use kernel builds
        t0 = time.monotonic()
        with ThreadPoolExecutor(run.in_flight) as pool:
            metas = list(pool.map(one, prompts))
        wall = time.monotonic() - t0
    finally:
        client.close()
    tokens = sum(m["completion_tokens"] for m in metas)
    out = {"arm": name, "prompts": len(metas), "completion_tokens": tokens, "wall_s": wall, "tok_s": tokens / wall,
           "in_flight": run.in_flight, "flags": shlex.join(server.config.sglang_args if server.config else ())}  # fmt: skip
    if name != NO_DRAFTER:
        lengths = [m["spec_accept_length"] for m in metas if "spec_accept_length" in m]
        if len(lengths) != len(metas):
            raise SystemExit(
                f"{name}: {len(metas) - len(lengths)} replies carry no spec_accept_length (no verify step)"
            )
        verify = sum(m["spec_verify_ct"] for m in metas)
        out |= {"accept_lengths": lengths, "mean": statistics.fmean(lengths), "stdev": statistics.pstdev(lengths),
                "p10": _quantile(lengths, 0.1), "p90": _quantile(lengths, 0.9), "verify_steps": verify,
                "tokens_per_verify": tokens / verify}  # fmt: skip
    return out


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def stage_serve(run: Run) -> None:
    """One server at a time: started with most of the GPU, measured, stopped. A server already measured in this work
    folder (its ``serve/NAME.json``) is not served again, so a call that ran out of time is continued by the next.
    Not side by side: SGLang 0.5.14 sizes its KV cache from the memory it sees free while it starts, so a server
    starting beside others loading their weights is refused (seen on the H200 with `--probe`: "Loaded weights leave
    no GPU memory for the KV cache under --mem-fraction-static=0.13"). A smoke run serves no drafter
    (CPU_NO_SPECULATIVE)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(run.path("target"))
    rows = [json.loads(line) for line in run.path("data", "prompts.jsonl").read_text().splitlines()]
    prompts = [tokenizer.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=True,
                                             return_dict=False) for r in rows]  # fmt: skip
    run.path("serve").mkdir(exist_ok=True)
    names = [NO_DRAFTER, *([] if run.smoke else run.arms)]
    for name in names:
        result_path = run.path("serve", f"{name.replace(' ', '-')}.json")
        if result_path.exists():
            log(f"serve {name}: measured before in {run.work}, kept")
            continue
        server = launch_server(run, name, 0.8)
        try:
            server.wait_ready()
            result = measure(run, name, server, prompts)
        finally:
            server.stop()
        result_path.write_text(json.dumps(result, indent=1))
        log(f"serve {name}: " + json.dumps({k: v for k, v in result.items() if k != "accept_lengths"}))
    run.done("serve", {"arms": names})


def stage_report(run: Run) -> None:
    """The results table: the target's facts, then per arm acceptance length and decode tok/s."""
    corpus, target, data, extract, trained = (run.facts(s) for s in ("corpus", "target", "data", "extract", "train"))
    served = {p.stem: json.loads(p.read_text()) for p in sorted(run.path("serve").glob("*.json"))}
    base = served.get(NO_DRAFTER.replace(" ", "-"))
    without = f"{base['tok_s']:,.1f}" if base else "not run"
    title = (
        "CPU smoke test: tiny sizes, SGLang 0.5.10 on the CPU"
        if run.smoke
        else "one H200, SGLang 0.5.14"
        + (
            ", PROBE sizes (a tenth of the work: the path runs, not the benchmark's result)"
            if run.sizes == PROBE
            else ""
        )
    )
    lines = [f"# Acceptance of a drafter trained on a layertap store ({title})", "",
             f"Written by `benchmarks/gpu/acceptance_bench.py` ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
             f"commit {git_commit()}, seed {run.seed}).", "", "## Target", "",
             f"- Llama, {target['params'] / 1e6:.1f}M parameters ({target['config']}), {target['dtype']}; trained "
             f"from scratch for {target['train_seconds']:.0f} s on {target['tokens_seen'] / 1e6:.1f}M tokens "
             f"({target['epochs']:.1f} epochs of {target['train_blocks']} packed blocks), loss "
             f"{target['first_loss']:.2f} -> {target['last_loss']:.2f}; held-out loss (assistant tokens of "
             f"{target['held_out_conversations']} held-out files) {target['held_out_loss']:.3f}.",
             f"- Tokenizer: byte-level BPE, {target['config']['vocab_size']} ids, layertap's chat template.",
             f"- Corpus: {corpus['train_files']} training / {corpus['held_out_files']} held-out files (.py .md .rst "
             f".txt of 2-64 KB) under `{corpus['root']}` ({corpus['train_chars'] / 1e6:.1f}M / "
             f"{corpus['held_out_chars'] / 1e6:.1f}M characters), split by file; selection sha256 "
             f"`{corpus['files_sha256'][:16]}`.",
             f"- Drafter data: {data['conversations']} conversations (user: a window of a training file, assistant: "
             f"the lines that follow; responses {data['responses']}); {data['prompts']} held-out prompts (the head "
             f"of each held-out file), greedy, at most {run.sizes.max_new_tokens} new tokens.",
             f"- Capture indices {list(run.sizes.capture)}; extraction: `{extract['correct']['command']}` "
             f"({extract['correct']['seconds']:.0f} s; {extract['correct']['summary']}).", "",
             "## Acceptance (EAGLE3: 3 steps, top-k 1, 4 draft tokens)", "",
             "Acceptance length: SGLang's `spec_accept_length` of each request (completion tokens / verify steps); "
             "mean, population standard deviation and 10th / 90th percentiles over the prompts.", "",
             "| arm | mistake | acceptance length mean | stdev | p10 | p90 | decode tok/s | tok/s without drafter |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for arm in ARMS:
        r = served.get(arm.name)
        if r is None:
            lines.append(f"| {arm.name} | {arm.what} | {CPU_NO_SPECULATIVE if run.smoke else 'not run'} | | | | | |")
            continue
        lines.append(f"| {arm.name} | {arm.what} | {r['mean']:.3f} | {r['stdev']:.3f} | {r['p10']:.2f} | "
                     f"{r['p90']:.2f} | {r['tok_s']:,.1f} | {without} |")  # fmt: skip
    lines += ["| d-regenerated | responses regenerated by the target | not run: needs `layertap extract "
              "--regenerate` | | | | | |", ""]  # fmt: skip
    if base:
        lines.append(f"Without a drafter: {base['tok_s']:,.1f} decode tok/s ({base['completion_tokens']} tokens of "
                     f"{base['prompts']} prompts, {base['in_flight']} in flight).")  # fmt: skip
    correct = served.get("correct")
    controls = {a.name: served[a.name]["mean"] for a in ARMS if a.name != "correct" and a.name in served}
    if correct and controls:
        losers = [name for name, mean in controls.items() if mean >= correct["mean"]]
        lines.append(
            f"Correct arm beats every control served: {'yes' if not losers else 'NO, not ' + ', '.join(losers)}."
        )
    lines += paired_lines(served)
    lines += ["", "## Drafters (SpecForge 0.2.0, offline EAGLE-3, as TRAIN.md says)", ""]
    lines += [f"- {arm}: {t['steps']} logged steps in {t['seconds']:.0f} s; loss {t['loss_first']:.3f} -> "
              f"{t['loss_last']:.3f}, first-position accuracy {t['acc_0_first']:.3f} -> {t['acc_0_last']:.3f}"
              for arm, t in trained.items()]  # fmt: skip
    lines += ["", "## Commands", "", "Servers (`python -m sglang.launch_server --model-path TARGET` plus):", "", "```"]
    lines += [f"{arm}: {r['flags']}" for arm, r in served.items()]
    if "correct" in trained:
        lines += ["```", "", "run.yaml of the correct arm (`specforge train --config run.yaml`, then `specforge export "
                  "--to sglang --checkpoint specforge-run --draft-config draft.json --output-dir drafter`):", "",
                  "```yaml", trained["correct"]["run_yaml"].rstrip()]  # fmt: skip
    lines += ["```", "", "TRAIN.md the drafters were trained from:", "", "````markdown", extract["train_md"], "````"]
    run.out.parent.mkdir(parents=True, exist_ok=True)
    run.out.write_text(portable("\n".join(lines) + "\n", run, corpus["root"]))
    log(f"report: {run.out}")


def portable(text: str, run: Run, corpus_root: str) -> str:
    """``text`` with the machine's paths named by what they are: the work folder ``$WORK``, the corpus root
    ``$SITE_PACKAGES``, any Python interpreter ``python3`` (a report is read on other machines)."""
    text = text.replace(str(run.work), "$WORK").replace(corpus_root, "$SITE_PACKAGES")
    return re.sub(r"[^\s`'\"]*/bin/python3?\b", "python3", text)


def paired_lines(served: dict[str, dict[str, Any]]) -> list[str]:
    """The correct arm against each control on the same prompts: the per-prompt difference of acceptance lengths
    (mean, standard error, the mean over its standard error) and how many prompts each side wins. The spread over
    prompts is mostly the prompts' own (some continue predictably); the paired difference removes it."""
    correct = served.get("correct")
    if not correct or "accept_lengths" not in correct:
        return []
    out = ["", "Paired over the same prompts (correct minus control, per prompt):", "",
           "| control | mean difference | standard error | mean / s.e. | prompts correct wins | ties | control wins |",
           "|---|---|---|---|---|---|---|"]  # fmt: skip
    for arm in ARMS:
        other = served.get(arm.name)
        if arm.name == "correct" or not other or "accept_lengths" not in other:
            continue
        diffs = [c - o for c, o in zip(correct["accept_lengths"], other["accept_lengths"], strict=True)]
        mean, se = statistics.fmean(diffs), statistics.stdev(diffs) / len(diffs) ** 0.5
        wins, losses = sum(d > 0 for d in diffs), sum(d < 0 for d in diffs)
        out.append(f"| {arm.name} | {mean:+.3f} | {se:.3f} | {mean / se:.1f} | {wins} | {len(diffs) - wins - losses} "
                   f"| {losses} |")  # fmt: skip
    return out


def parse(argv: list[str] | None = None) -> tuple[Run, list[str], str]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stages", nargs="*", help=f"of {', '.join(STAGES)}, or all (the default)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/layertap-acceptance"))
    ap.add_argument("--seed", type=int, default=20261201)
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny sizes, this machine's CPU SGLang and SpecForge")
    ap.add_argument("--probe", action="store_true", help="on the GPU at a tenth of the work (one call): not a result")
    ap.add_argument("--arms", default=",".join(a.name for a in ARMS), help="comma-separated arms to train / serve")
    ap.add_argument("--responses", choices=["given", "regenerated"], default="given")
    ap.add_argument("--corpus-root", type=Path, default=None, help="default: this Python's site-packages")
    ap.add_argument("--sglang-python", type=Path, default=None, help="default: /opt/sglang-venv (smoke), python3")
    ap.add_argument("--trainers-python", type=Path, default=None, help="default: /opt/trainers-venv (smoke), python3")
    ap.add_argument("--in-flight", type=int, default=None, help="requests in flight (default 16, smoke 2)")
    ap.add_argument("--out", type=Path, default=None, help="report (default: benchmarks/results/gpu_acceptance.md; "
                    "smoke: WORK/acceptance.md)")  # fmt: skip
    args = ap.parse_args(argv)
    if unknown_stages := [s for s in args.stages if s not in (*STAGES, "all")]:
        ap.error(f"unknown stages {unknown_stages}; known: {', '.join(STAGES)}, all")
    import sysconfig

    smoke = args.cpu_smoke
    work = args.work.resolve()
    out = args.out or (work / "acceptance.md" if smoke else REPO / "benchmarks" / "results" / "gpu_acceptance.md")
    if smoke and out.resolve().is_relative_to(REPO / "benchmarks" / "results"):
        raise SystemExit("a smoke run's report never goes into benchmarks/results/")
    arms = tuple(a for a in args.arms.split(",") if a)
    if unknown := [a for a in arms if a not in ARM_BY_NAME]:
        raise SystemExit(f"unknown arms {unknown}; known: {list(ARM_BY_NAME)}")
    run = Run(work=work, seed=args.seed, smoke=smoke, sizes=SMOKE if smoke else PROBE if args.probe else GPU,
              device="cpu" if smoke or not torch.cuda.is_available() else "cuda", arms=arms,
              corpus_root=args.corpus_root or Path(sysconfig.get_paths()["purelib"]),
              sglang_python=args.sglang_python or sglang_python(smoke),
              trainers_python=args.trainers_python or (TRAINERS_PYTHON if smoke else Path(sys.executable)),
              in_flight=args.in_flight or (2 if smoke else 16), out=out)  # fmt: skip
    stages = list(STAGES) if not args.stages or "all" in args.stages else [s for s in STAGES if s in args.stages]
    return run, stages, args.responses


def main(argv: list[str] | None = None) -> None:
    run, stages, responses = parse(argv)
    run.work.mkdir(parents=True, exist_ok=True)
    steps = {"corpus": stage_corpus, "tokenizer": stage_tokenizer, "target": stage_target, "data": stage_data,
             "extract": lambda r: stage_extract(r, responses), "controls": stage_controls, "train": stage_train,
             "serve": stage_serve, "report": stage_report}  # fmt: skip
    for stage in stages:
        log(f"{stage}: start")
        steps[stage](run)


if __name__ == "__main__":
    main()
