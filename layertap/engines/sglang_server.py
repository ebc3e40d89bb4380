"""``SGLangServer``: the one class that owns a capture server's lifecycle.

It starts ``python -m sglang_patch.launch`` in SGLang's own environment (or attaches to a given URL),
waits until ``/health`` answers, keeps the server's log, notices when the process died and restarts
it. The server runs in its own process group (so stop() takes the scheduler and detokenizer with it)
and is told to die with its parent (PR_SET_PDEATHSIG), so a SIGKILLed worker leaves no orphan
holding GPU memory.
"""

from __future__ import annotations

import ctypes
import logging
import os
import random
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from layertap.errors import ServerError

log = logging.getLogger(__name__)
REPO_ROOT = Path(__file__).resolve().parents[1]
_PR_SET_PDEATHSIG = 1

# What a tiny model needs to run on SGLang 0.5.10's CPU backend (see scripts/setup_sglang_cpu.sh).
# --sleep-on-idle: an idle scheduler otherwise busy-polls half a core, which starves everything else
# on a small CPU box (the test suite keeps a few servers up for the whole session).
CPU_SERVER_ARGS = ("--device", "cpu", "--skip-tokenizer-init", "--attention-backend", "torch_native",
                   "--disable-cuda-graph", "--max-total-tokens", "16384", "--sleep-on-idle")  # fmt: skip


def cpu_server_env(cuda_stub_dir: Path, tp_size: int = 1) -> dict[str, str]:
    """Environment of a CPU server: SGLang's CPU engine switch and the libcuda stub.

    At ``--tp-size`` > 1 the ranks talk over gloo: each rank gets its own share of this process's
    cores (SGLang otherwise wants one NUMA node per rank), and NCCL is pointed at nothing (the
    venv's CUDA torch ships it, and SGLang would try to open a GPU communicator with it).
    """
    env = {"SGLANG_USE_CPU_ENGINE": "1", "LD_LIBRARY_PATH": str(cuda_stub_dir)}
    if tp_size > 1:
        cores = sorted(os.sched_getaffinity(0))
        shares = [cores[r::tp_size] or [cores[r % len(cores)]] for r in range(tp_size)]
        env["SGLANG_CPU_OMP_THREADS_BIND"] = "|".join(",".join(map(str, share)) for share in shares)
        env["SGLANG_NCCL_SO_PATH"] = "/nonexistent/libnccl.so"
    return env


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """How to launch one capture server. ``sglang_args`` go to SGLang (model flags, device, chunking)."""

    python: Path
    model: Path
    dump_root: Path
    layers: tuple[int, ...]
    final: str
    log_path: Path
    rid_prefix: str = "hscap"
    layout: str = "states"
    sglang_args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    host: str = "127.0.0.1"
    port: int | None = None
    startup_timeout_s: float = 900.0

    def command(self, port: int) -> list[str]:
        return [
            str(self.python), "-m", "sglang_patch.launch",
            "--dump-root", str(self.dump_root),
            "--capture-layers", ",".join(map(str, self.layers)),
            "--capture-final", self.final,
            "--rid-prefix", self.rid_prefix,
            "--dump-layout", self.layout,
            "--model-path", str(self.model),
            "--host", self.host, "--port", str(port),
            *self.sglang_args,
        ]  # fmt: skip


def free_port(low: int = 20000, high: int = 40000) -> int:
    """A free port well below 64K: SGLang 0.5.14 derives other ports from it (e.g. gRPC) by adding to it."""
    for port in random.sample(range(low, high), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise ServerError(f"no free port in [{low}, {high})")


def _die_with_parent() -> None:
    os.setsid()
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class SGLangServer:
    """A capture server this process launched (``config``) or one it only talks to (``url``)."""

    def __init__(self, config: ServerConfig | None = None, *, url: str | None = None) -> None:
        if (config is None) == (url is None):
            raise ValueError("give exactly one of config (launch a server) or url (attach to one)")
        self.config = config
        self._url = url
        self._proc: subprocess.Popen[bytes] | None = None
        self.restarts = 0

    @property
    def url(self) -> str:
        if self._url is None:
            raise ServerError("the SGLang server has not been started")
        return self._url

    def start(self) -> None:
        """Launch (if we own it) and block until it serves ``/health``."""
        if self.config is not None:
            self._launch(self.config)
        self.wait_ready()

    def _launch(self, cfg: ServerConfig) -> None:
        cfg.dump_root.mkdir(parents=True, exist_ok=True)
        cfg.log_path.parent.mkdir(parents=True, exist_ok=True)
        port = cfg.port or free_port()
        # The repo first (for sglang_patch), then whatever the server's environment already had.
        pythonpath = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)
        env = {**os.environ, **cfg.env, "PYTHONPATH": pythonpath}
        env.pop("VIRTUAL_ENV", None)
        with cfg.log_path.open("ab") as logf:
            self._proc = subprocess.Popen(
                cfg.command(port), env=env, stdout=logf, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent
            )
        self._url = f"http://{cfg.host}:{port}"
        log.info("started SGLang capture server pid %d at %s (log %s)", self._proc.pid, self._url, cfg.log_path)

    def wait_ready(self) -> None:
        timeout = self.config.startup_timeout_s if self.config else 60.0
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=10.0) as client:
            while time.monotonic() < deadline:
                if self._proc is not None and self._proc.poll() is not None:
                    raise ServerError(f"SGLang server exited with {self._proc.returncode}:\n{self.log_tail()}")
                try:
                    if client.get(self.url + "/health").status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                time.sleep(0.5)
        raise ServerError(f"SGLang server at {self.url} not healthy after {timeout:.0f} s:\n{self.log_tail()}")

    def alive(self, *, probe: bool = True) -> bool:
        """Whether the server answers ``/health`` (for an owned one: also whether its process still runs).

        ``probe=False`` checks an owned server's process only, sending nothing: cheap enough to ask
        often, and blind only to a hung server, which request timeouts catch.
        """
        if self._proc is not None:
            if self._proc.poll() is not None:
                return False
            if not probe:
                return True
        try:
            return httpx.get(self.url + "/health", timeout=30.0).status_code == 200
        except httpx.TransportError:
            return False

    def restart(self) -> None:
        """Replace a dead server (owned ones only; an attached server is someone else's to restart)."""
        if self.config is None:
            raise ServerError(f"the SGLang server at {self.url} is down and is not ours to restart")
        self.restarts += 1
        log.warning("restarting SGLang capture server (restart %d):\n%s", self.restarts, self.log_tail(20))
        self.stop()
        self.start()

    def kill(self) -> None:
        """SIGKILL the whole server process group (fault-injection in tests; stop() is the polite way)."""
        if self._proc is not None and self._proc.poll() is None:
            os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.wait()

    def stop(self) -> None:
        if self._proc is None or self._proc.poll() is not None:
            return
        os.killpg(self._proc.pid, signal.SIGTERM)
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.kill()

    def log_tail(self, lines: int = 40) -> str:
        if self.config is None or not self.config.log_path.exists():
            return "(no log: attached server)"
        return "\n".join(self.config.log_path.read_text(errors="replace").splitlines()[-lines:])
