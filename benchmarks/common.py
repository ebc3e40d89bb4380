"""What the benchmarks share beside the harness: the log line, the GPU servers' flags, synthetic data, plain prefill.

Processes, Redis, the coordinator, workers and the CPU SGLang server come from ``harness`` (tests start them the same
way); a result's JSON and its table from ``benchmarks.report``.
"""

from __future__ import annotations

import json
import random
import shlex
import shutil
import signal
import sys
import tarfile
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from harness.services import RedisServer, Services
from harness.sglang import SGLANG_CPU_PYTHON, cpu_server_env
from layertap.demo import demo_rows
from layertap.engines.sglang import SGLangServer

T0 = time.monotonic()

# Flags every GPU benchmark server gets; each adds its attention backend, chunk size and memory split.
GPU_COMMON = ("--skip-tokenizer-init", "--sampling-backend", "pytorch", "--grammar-backend", "none",
              "--disable-cuda-graph", "--skip-server-warmup", "--sleep-on-idle", "--dtype", "bfloat16")  # fmt: skip
# The same with SGLang's warm-up: it runs the first pass (and its kernel builds) before /health answers.
GPU_WARMED = tuple(a for a in GPU_COMMON if a != "--skip-server-warmup")
# Kimi-K2's width (hidden 7168, MLA, 16 routed experts top-8 + 1 shared) at 4 layers: `layertap tiny-model`'s shape.
KIMI_K2_WIDTH = {"shape": "kimi-k2-width", "num_hidden_layers": 4}
# The same, first layer dense and the 16 experts in one group as Kimi-K2 routes them (a routing margin is then
# exactly what selection compares).
KIMI_K2_ONE_GROUP = {**KIMI_K2_WIDTH, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1}
WORDS = "the model reads a prompt and computes hidden states for every token while drafts learn from them".split()  # noqa: SIM905


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} +{time.monotonic() - T0:4.0f}s] {message}", flush=True)


def sglang_python(smoke: bool) -> Path:
    """The server's interpreter: the CPU SGLang venv for a smoke run, else this one (the device installs SGLang
    beside layertap)."""
    return SGLANG_CPU_PYTHON if smoke else Path(sys.executable)


def folder_bytes(path: Path) -> int:
    """The bytes ``path`` holds on its device: a file hard-linked under several names (a speculators store's
    published links) counted once."""
    return sum({(s.st_dev, s.st_ino): s.st_size for p in path.rglob("*") if p.is_file() for s in [p.stat()]}.values())


def fresh(*folders: Path) -> None:
    """Each folder emptied (made if missing): a run never reads a stale one's files."""
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)


def unpack_kernel_cache(tgzs: list[Path], cache: Path) -> set[Path]:
    """A node's kernel builds (``--kernel-cache-tgz``) unpacked into ``cache``: the files they gave."""
    for path in tgzs:
        with tarfile.open(path) as tgz:
            tgz.extractall(cache, filter="data")
    return {p for p in cache.rglob("*") if p.is_file()}


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def worker_env(dump_root: Path, server_args: Sequence[str], smoke: bool, **settings: object) -> dict[str, str]:
    """A Celery worker's environment as e2e, job_audit and regenerate stand theirs up: the SGLang engine launching
    its own server (its interpreter, flags and dump root; on a smoke run the CPU server's environment) and each of
    ``settings`` as ``LAYERTAP_<NAME>`` (``metrics_port=9100``: ``LAYERTAP_METRICS_PORT=9100``)."""
    settings |= {"engine": "sglang", "dump_root": dump_root, "sglang_args": shlex.join(server_args),
                 "sglang_python": sglang_python(smoke)}  # fmt: skip
    return {**(cpu_server_env() if smoke else {}), **{f"LAYERTAP_{k.upper()}": str(v) for k, v in settings.items()}}


class Stages:
    """A staged benchmark's results, one ``NAME.json`` a stage, in its work folder and in any ``copies`` (a folder that
    comes back from the device): written as a stage ends, read by the stages after it and by later calls, which skip
    or continue what an earlier call did."""

    def __init__(self, folder: Path, *copies: Path) -> None:
        self.folder, self.folders = folder, (folder, *copies)
        for path in self.folders:
            path.mkdir(parents=True, exist_ok=True)

    def get(self, name: str, default: Any = None) -> Any:
        path = self.folder / f"{name}.json"
        return json.loads(path.read_text()) if path.exists() else default

    def __getitem__(self, name: str) -> Any:
        """A stage's results, which a later stage needs: its absence says which stage to run first."""
        if (facts := self.get(name)) is None:
            raise SystemExit(f"stage {name!r} has not run in {self.folder} (no {name}.json): run it first")
        return facts

    def save(self, name: str, facts: Any) -> None:
        for folder in self.folders:
            (folder / f"{name}.json").write_text(json.dumps(facts, indent=1, default=str))

    def all(self) -> dict[str, Any]:
        """Every result in the folder, by name (sorted)."""
        return {p.stem: json.loads(p.read_text()) for p in sorted(self.folder.glob("*.json"))}


def stop_stack(services: Services, redis: RedisServer | None) -> None:
    """Every process of ``services`` (each with its group: a worker's server too), then Redis."""
    services.stop_all(groups=True)
    if redis is not None:
        redis.stop(signal.SIGKILL)


# -- data -----------------------------------------------------------------------------------------------------
def chat_rows(n: int, rng: random.Random, *, max_words: int = 160) -> list[dict]:
    """``n`` synthetic chats of 1-3 turns (replies of up to ``max_words`` words), ShareGPT and OpenAI shaped in
    turn, with unique ids."""

    def text(low: int, high: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))

    rows = []
    for i in range(n):
        turns = []
        for _ in range(rng.randint(1, 3)):
            turns += [("user", text(10, 60)), ("assistant", text(20, max_words))]
        if i % 2:
            rows.append({"id": f"chat-{i}", "conversations": [
                {"from": {"user": "human", "assistant": "gpt"}[r], "value": t} for r, t in turns]})  # fmt: skip
        else:
            rows.append({"id": f"chat-{i}", "messages": [{"role": r, "content": t} for r, t in turns]})
    return rows


def token_row(i: int, rng: random.Random, vocab: int, low: int, high: int) -> dict:
    """A pre-tokenized row of the seed corpus's lengths (uniform in [low, high]); the last ~40% is loss."""
    n = rng.randint(low, high)
    cut = int(n * 0.6)
    return {"id": f"tok-{i}", "input_ids": [rng.randrange(10, vocab) for _ in range(n)],
            "loss_mask": [0] * cut + [1] * (n - cut)}  # fmt: skip


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_dataset(path: Path, chats: int, token_rows: int, vocab: int, low: int, high: int) -> int:
    """The demo's chats, ``chats`` synthetic ones and ``token_rows`` token-id rows, shuffled: the row count."""
    rng = random.Random(20261201)
    rows = demo_rows() + chat_rows(chats, rng)
    rows += [token_row(i, rng, vocab, low, high) for i in range(token_rows)]
    rng.shuffle(rows)
    write_jsonl(path, rows)
    return len(rows)


def prompts(n: int, seed: int, low: int, high: int) -> list[list[int]]:
    """``n`` prompts of ``low``-``high`` random token ids every tiny tokenizer knows."""
    rng = random.Random(seed)
    return [[rng.randrange(4, 1500) for _ in range(rng.randint(low, high))] for _ in range(n)]


# -- SGLang ---------------------------------------------------------------------------------------------------
def plain_rate(client: httpx.Client, url: str, batch: list[list[int]], in_flight: int,
               finishes: list[tuple[float, int]] | None = None) -> float:  # fmt: skip
    """Plain prefill tok/s of a server: rids outside the capture namespace, so the hooks return at once. With
    ``finishes``, each request's end (``time.perf_counter``) and tokens are appended to it (a steady-state window's
    rate: seed_scale_bench)."""

    def one(ids: list[int]) -> None:
        body = {"input_ids": ids, "rid": f"plain-{uuid.uuid4().hex}", "sampling_params": {"max_new_tokens": 0}}
        reply = client.post(url + "/generate", json=body)
        assert reply.status_code == 200, reply.text[:300]
        if finishes is not None:
            finishes.append((time.perf_counter(), len(ids)))

    t0 = time.perf_counter()
    with ThreadPoolExecutor(in_flight) as pool:
        list(pool.map(one, batch))
    return sum(map(len, batch)) / (time.perf_counter() - t0)


def wait_side_by_side(servers: dict[str, SGLangServer]) -> None:
    """Wait for servers launched side by side (``SGLangServer.launch``, from the main thread: a server dies with the
    thread that launched it); one that fails to start is started again alone (two servers sizing GPU memory at once
    can collide)."""
    with ThreadPoolExecutor(len(servers)) as pool:
        for name, future in [(n, pool.submit(s.wait_ready)) for n, s in servers.items()]:
            try:
                future.result()
            except Exception as exc:
                log(f"{name}: server failed to start ({type(exc).__name__}: {exc}); starting it again alone")
                servers[name].stop()
                servers[name].start()
            log(f"{name}: server up at {servers[name].url}")
