"""``SGLangServer``: the one class that owns a capture server's process (`start_server`: attach or launch one).

It starts ``python -m sglang_patch.launch`` in SGLang's own environment (or attaches to a given URL),
waits until ``/health`` answers, keeps the server's log, notices when the process died and restarts
it. The server imports the capture plugin from a folder that holds it alone (`PluginFolder`), whatever the
working directory and however layertap is installed. A start that fails (e.g. SGLang's own warm-up timing
out on a cold node) is retried with backoff a bounded number of times, except one that would fail the same
way again (`not_retried`: a hang, a watchdog timeout, an import error, a refused command line); the final
error says in two lines how the last try ended, the decisive line of its log, and the log's path; SGLang's
crash diagnostics (a minute of py-spy and CUDA core dumps before a crashed server exits) are off, so a retry
comes within seconds. The server runs in its own process group (so stop() takes the scheduler and
detokenizer with it) and is told to die with the process that launched it (PR_SET_PDEATHSIG, from a thread that
lives as long as that process: `_Launcher`), so a SIGKILLed worker leaves no orphan holding GPU memory.
"""

from __future__ import annotations

import ctypes
import logging
import os
import random
import re
import shlex
import signal
import socket
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from pathlib import Path
from typing import Any

import httpx

import sglang_patch
from layertap.engines.sglang.launch import ServerConfig, dump_layout, dump_quantize, server_model_args
from layertap.errors import ServerConfigError, ServerError
from layertap.models.folder import ModelFolder
from layertap.spec import CaptureSpec
from sglang_patch.launch import USAGE_ERROR

log = logging.getLogger(__name__)
_PR_SET_PDEATHSIG = 1

# Seconds a stopped server's processes get between SIGTERM and SIGKILL, and after SIGKILL to be gone.
STOP_GRACE_S = 30.0
KILL_WAIT_S = 10.0

# Crash diagnostics of SGLang 0.5.14 (0.5.10 reads neither): before a crashed server exits, a py-spy dump of
# every scheduler and a CUDA core dump with a 60 s wait. An owned server is restarted at once instead, so
# they are off unless the server's environment turns them on (its variables win over these).
CRASH_DIAGNOSTICS_OFF = {"SGLANG_PYSPY_DUMP_BEFORE_CRASH": "0", "SGLANG_CUDA_COREDUMP_BEFORE_CRASH": "0"}


def free_port(low: int = 20000, high: int | None = None) -> int:
    """A free port well below 64K: SGLang 0.5.14 derives other ports from it (e.g. gRPC) by adding to it.

    Below the kernel's ephemeral range (``ip_local_port_range``, 32768 on Linux by default, less 2,000 for what
    SGLang adds), so that no outgoing connection is handed the port between this check and the server's bind
    (where that range starts too low to leave room, up to 40000 as before).
    """
    if high is None:
        below_ephemeral = _ephemeral_low() - 2000
        high = below_ephemeral if below_ephemeral >= low + 1000 else 40000
    for port in random.sample(range(low, high), min(200, high - low)):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise ServerError(f"no free port in [{low}, {high})")


def _ephemeral_low() -> int:
    """The lowest port the kernel hands to outgoing connections (32768 where it does not say)."""
    with suppress(OSError, ValueError, IndexError):
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    return 32768


# After the last traceback's exception line: a line that names an error, then one that says something failed.
_DECISIVE = (
    re.compile(r"\b[A-Za-z_.]*(Error|Exception|Interrupt)\b:"),
    re.compile(r"\b(error|fatal|killed|out of memory|timed? ?out|failed)\b", re.IGNORECASE),
)
# A forward pass that outran SGLang's scheduler watchdog (it kills the server): the cause whatever follows, and one a
# restart would meet again in the same pass (a first start's kernel builds: the launcher allows them FIRST_START_S).
WATCHDOG = re.compile(r"watchdog timeout", re.IGNORECASE)
NOT_HEALTHY = "was not healthy after"
# A module that did not import (the plugin, a hook's factory, one of SGLang's own): the same environment fails again.
IMPORT_FAILED = re.compile(r"\b(ModuleNotFoundError|ImportError)\b")
# SGLang's crash diagnostics (py-spy stack dumps, CUDA core dumps) say how it reported a death, never why.
_DIAGNOSTICS = re.compile(r"py-?spy|core ?dump", re.IGNORECASE)


def describe_exit(code: int) -> str:
    """``subprocess`` return code -> "with code 1" or "on signal 9 (SIGKILL)"."""
    if code >= 0:
        return f"with code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = "unknown"
    return f"on signal {-code} ({name})"


def decisive_log_line(path: Path, offset: int = 0, *, limit: int = 300) -> str:
    """The line of the log (from byte ``offset``) that best says why the server stopped, quoted, at most
    ``limit`` characters: a scheduler watchdog timeout, else the exception line of the last Python traceback, else
    the last line naming an error, else the last line; crash-diagnostics lines never."""
    try:
        with path.open("rb") as f:
            f.seek(offset)
            text = f.read().decode(errors="replace")
    except OSError as exc:
        return f"(log unreadable: {exc})"
    lines = [ln.rstrip() for ln in text.splitlines() if ln.strip() and not _DIAGNOSTICS.search(ln)]
    if not lines:
        return "(the log is empty)"
    hit = next((ln for ln in reversed(lines) if WATCHDOG.search(ln)), None)
    tracebacks = [i for i, ln in enumerate(lines) if ln.lstrip().startswith("Traceback (most recent call last)")]
    if tracebacks and hit is None:  # its exception line is the first unindented line after the frames
        hit = next((ln for ln in lines[tracebacks[-1] + 1 :] if not ln[0].isspace()), None)
    for pattern in _DECISIVE:
        if hit is None:
            hit = next((ln for ln in reversed(lines) if pattern.search(ln)), None)
    line = (hit if hit is not None else lines[-1]).strip()
    return repr(line if len(line) <= limit else line[: limit - 3] + "...")


def command_line_refused(failure: str) -> bool:
    """Whether a start ended as the launcher ends on flags it (or SGLang's parser) rejects."""
    return failure == f"exited {describe_exit(USAGE_ERROR)}"


def not_retried(failure: str, decisive: str) -> str | None:
    """Why a start that ended so would end so again, which is then not retried; None when a retry may succeed.

    ``failure`` says how the try ended (`SGLangServer._wait_ready`), ``decisive`` is its log's `decisive_log_line`.
    """
    if failure.startswith(NOT_HEALTHY):
        return "a start that hung would hang as long again"
    if WATCHDOG.search(decisive):
        return ("a pass outran SGLang's watchdog and would again; allow it more with --watchdog-timeout in the server "
                "flags")  # fmt: skip
    if IMPORT_FAILED.search(decisive):
        return "a module did not import, and would not again"
    if command_line_refused(failure):
        return "its command line was refused, and would be again"
    return None


class PluginFolder:
    """A temporary folder holding only a link to the installed capture plugin (``sglang_patch``), for the server's
    PYTHONPATH: the package's own parent (the repository, or the project venv's site-packages) holds layertap's other
    packages and, in a venv, torch and transformers pinned apart from the server's. Removed when this object goes;
    made again if something (a temp cleaner) removed it meanwhile."""

    PACKAGE = Path(sglang_patch.__file__).resolve().parent

    def __init__(self) -> None:
        self._folder: tempfile.TemporaryDirectory[str] | None = None

    @property
    def path(self) -> Path:
        if self._folder is None or not (Path(self._folder.name) / self.PACKAGE.name).exists():
            self._folder = tempfile.TemporaryDirectory(prefix="layertap-plugin-")
            (Path(self._folder.name) / self.PACKAGE.name).symlink_to(self.PACKAGE, target_is_directory=True)
        return Path(self._folder.name)


def live_group_members(pgid: int) -> list[int]:
    """The pids of process group ``pgid`` that have not exited, from /proc (zombies left out: orphans are reaped by
    the init process, not by us; none where there is no /proc)."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with suppress(OSError, ValueError, IndexError):
            state, _ppid, group = stat.read_text().rpartition(")")[2].split()[:3]
            if int(group) == pgid and state != "Z":
                members.append(int(stat.parent.name))
    return members


def _die_with_parent() -> None:
    os.setsid()
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class _Launcher:
    """Forks every server from one thread that lives as long as the process. PR_SET_PDEATHSIG fires when the thread
    that forked the child ends, not the process: a server restarted from a capture or generation pool's thread was
    SIGKILLed when that pool shut down (a worker's regeneration job restarted its server twice for one crash)."""

    def __init__(self) -> None:
        self._reset()
        os.register_at_fork(after_in_child=self._reset)  # a forked child holds none of its parent's threads

    def _reset(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="layertap-server-launcher")

    def popen(self, command: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
        return self._executor.submit(subprocess.Popen, command, preexec_fn=_die_with_parent, **kwargs).result()


_launcher = _Launcher()


class SGLangServer:
    """A capture server this process launched (``config``) or one it only talks to (``url``)."""

    def __init__(self, config: ServerConfig | None = None, *, url: str | None = None) -> None:
        if (config is None) == (url is None):
            raise ValueError("give exactly one of config (launch a server) or url (attach to one)")
        self.config = config
        self._url = url
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_offset = 0  # where the current try's lines start in the log
        self._plugin = PluginFolder()
        self.restarts = 0

    @property
    def owned(self) -> bool:
        """Whether this process launched the server (and so may restart it)."""
        return self.config is not None

    @property
    def url(self) -> str:
        if self._url is None:
            raise ServerError("the SGLang server has not been started")
        return self._url

    def start(self) -> None:
        """Launch (if we own it) and block until it serves ``/health``, retrying a failed start with backoff
        ``start_attempts`` times; raises ServerError (two lines) when every try failed."""
        if self.config is None:
            self.wait_ready()
            return
        cfg = self.config
        for attempt in range(1, cfg.start_attempts + 1):
            self._launch(cfg, f"start attempt {attempt}/{cfg.start_attempts}")
            failure = self._wait_ready(cfg.startup_timeout_s)
            if failure is None:
                return
            self.kill()
            if reason := not_retried(failure, decisive_log_line(cfg.log_path, self._log_offset)):
                # A refused command line is the flags this process was given: any model's start ends so. A module
                # that did not import, a hang, may be the model's (its code, its size): not this process's fault.
                error = ServerConfigError if command_line_refused(failure) else ServerError
                raise error(self.failure(f"failed to start (try {attempt}, not retried: {reason}); it {failure}"))
            if attempt == cfg.start_attempts:
                raise ServerError(self.failure(f"failed to start ({attempt} tries); the last {failure}"))
            delay = cfg.start_backoff_s * 2 ** (attempt - 1)
            log.warning(
                "SGLang server start %d/%d failed (%s: %s); retrying in %.0f s",
                attempt, cfg.start_attempts, failure, decisive_log_line(cfg.log_path, self._log_offset), delay,
            )  # fmt: skip
            time.sleep(delay)

    def launch(self) -> None:
        """Start an owned server's process without waiting for it (`wait_ready` waits; `start` does both and
        retries). It forks from the launcher thread (`_Launcher`): it dies with this process, not with the calling
        thread."""
        if self.config is not None:
            self._launch(self.config, "launch")

    def wait_ready(self) -> None:
        """Block until the server answers ``/health``; raises ServerError if it dies or times out first."""
        if (failure := self._wait_ready(self.config.startup_timeout_s if self.config else 60.0)) is not None:
            raise ServerError(self.failure(failure))

    def ended(self, wait_s: float = 5.0) -> str:
        """How a down owned server's process ended ("exited on signal 9 (SIGKILL)"), given ``wait_s`` to finish
        dying (SGLang kills its process tree after a child failed), or that it still runs without serving."""
        if self._proc is None:
            return "was never started"
        try:
            return f"exited {describe_exit(self._proc.wait(timeout=wait_s))}"
        except subprocess.TimeoutExpired:
            return "stopped serving (its process still runs)"

    def failure(self, what: str) -> str:
        """Two lines: what happened with the decisive line of this try's log, then the log's path."""
        if self.config is None:
            return f"SGLang server at {self.url} {what}"
        decisive = decisive_log_line(self.config.log_path, self._log_offset)
        return f"SGLang server {what}: {decisive}\nserver log: {self.config.log_path}"

    def _launch(self, cfg: ServerConfig, what: str) -> None:
        """Start the server process; notes where this try's lines start in the log."""
        cfg.dump_root.mkdir(parents=True, exist_ok=True)
        cfg.log_path.parent.mkdir(parents=True, exist_ok=True)
        port = cfg.port or free_port()
        # The plugin first, then whatever the server's environment already had.
        pythonpath = os.pathsep.join(p for p in (str(self._plugin.path), os.environ.get("PYTHONPATH", "")) if p)
        env = {**CRASH_DIAGNOSTICS_OFF, **os.environ, **cfg.env, "PYTHONPATH": pythonpath}
        env.pop("VIRTUAL_ENV", None)
        with cfg.log_path.open("ab") as logf:
            logf.write(f"--- layertap: {what} on port {port} ---\n".encode())
            logf.flush()
            self._log_offset = logf.tell()
            try:
                self._proc = _launcher.popen(cfg.command(port), env=env, stdout=logf, stderr=subprocess.STDOUT)
            except OSError as exc:  # no such python, not executable: no retry can help
                raise ServerError(f"cannot run the SGLang server's python {cfg.python}: {exc}") from exc
        self._url = f"http://{cfg.host}:{port}"
        log.info("started SGLang capture server pid %d at %s (log %s)", self._proc.pid, self._url, cfg.log_path)

    def _wait_ready(self, timeout: float) -> str | None:
        """None once ``/health`` answers 200; else how the wait ended ("exited with code 1", ...)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc is not None and (code := self._proc.poll()) is not None:
                return f"exited {describe_exit(code)}"
            if self._healthy(10.0):
                return None
            time.sleep(0.5)
        return f"{NOT_HEALTHY} {timeout:.0f} s"

    def _healthy(self, timeout: float) -> bool:
        """Whether ``/health`` answers 200 within ``timeout`` s: one request of its own (requests go through the
        server's `ServerSession`; a probe must get through while that session's client is busy or closed)."""
        try:
            return httpx.get(self.url + "/health", timeout=timeout).status_code == 200
        except httpx.TransportError:
            return False

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
        return self._healthy(30.0)

    def restart(self) -> None:
        """Replace a dead server (owned ones only; an attached server is someone else's to restart)."""
        if self.config is None:
            raise ServerError(f"the SGLang server at {self.url} is down and is not ours to restart")
        self.restarts += 1
        log.info("restarting SGLang capture server (restart %d)", self.restarts)
        self.stop()
        self.start()

    def kill(self) -> None:
        """SIGKILL the whole server process group (fault-injection in tests; stop() is the polite way),
        also when the launcher itself already died: its scheduler processes may not have."""
        if self._proc is None or not self._group_alive():
            return
        with suppress(ProcessLookupError):  # the group is gone already
            os.killpg(self._proc.pid, signal.SIGKILL)
        self._wait_group_end(KILL_WAIT_S)

    def stop(self) -> None:
        """SIGTERM the server's process group and return once none of its processes is left: SGLang's scheduler
        outlives its launcher for a moment, holding the GPU memory the next server on this GPU needs (a restart's,
        the next run's). What is left after ``STOP_GRACE_S`` is SIGKILLed."""
        if self._proc is None or not self._group_alive():
            return
        with suppress(ProcessLookupError):
            os.killpg(self._proc.pid, signal.SIGTERM)
        if not self._wait_group_end(STOP_GRACE_S):
            self.kill()

    def _group_alive(self) -> bool:
        """Whether a process of the server's group still runs (its launcher is reaped here; a group's id is not
        reused while it has members, so the ones found are ours)."""
        assert self._proc is not None
        return self._proc.poll() is None or bool(live_group_members(self._proc.pid))

    def _wait_group_end(self, timeout: float) -> bool:
        """Whether the server's whole process group ended within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while self._group_alive():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True


def start_server(
    capture: CaptureSpec,
    folder: ModelFolder,
    *,
    dump_root: Path,
    server_url: str | None,
    python: Path,
    sglang_args: str,
    rid_prefix: str,
    log_path: Path,
    store_format: str,
    store_dtype: str = "bfloat16",
    trust_remote_code: bool = False,
) -> SGLangServer:
    """Attach to ``server_url``, or launch a capture server for ``capture`` that this process owns (its
    environment, e.g. SGLANG_USE_CPU_ENGINE on a CPU box, is inherited; SGLang's crash diagnostics are off),
    writing dumps for a store in `store_format` and `store_dtype` (`dump_layout`, `dump_quantize`), with the
    flags of `server_model_args` (no SGLang tokenizer, the model's own dtype, unless ``sglang_args`` say
    otherwise); returns it ready."""
    if server_url:
        server = SGLangServer(url=server_url)
    else:
        args = server_model_args(folder, shlex.split(sglang_args), trust_remote_code=trust_remote_code)
        config = ServerConfig(python=python, model=folder.path, dump_root=dump_root, layers=capture.layers,
                              final=capture.final_kind, rid_prefix=rid_prefix, log_path=log_path,
                              sglang_args=tuple(args), layout=(layout := dump_layout(store_format, capture)),
                              quantize=dump_quantize(layout, store_dtype))  # fmt: skip
        server = SGLangServer(config)
    server.start()
    return server
