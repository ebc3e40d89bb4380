"""Real SGLang capture servers on the CPU, for tests (a pytest plugin listed in tests/conftest.py).

A server is SGLang 0.5.10.post1 from its own venv (``LAYERTAP_SGLANG_PYTHON``, default
/opt/sglang-venv/bin/python; `scripts/setup_sglang_cpu.sh` makes it), started as
``python -m sglang_patch.launch`` with the plugin's own folder on PYTHONPATH, the libcuda stub on
LD_LIBRARY_PATH and ``SGLANG_USE_CPU_ENGINE=1``, in float32 with small chunked-prefill passes so
that prompts span passes and passes hold several requests. Server warmup stays on: its one request takes about
a second of a 20-50 s start (measured, torch.compile off: `harness.sglang.cpu_server_env`), and it is the product's
path. Tests that need one are skipped when the SGLang venv is missing (they fail under scripts/test.sh and CI, which
install it).

Fixtures:
- ``sglang_servers``: session-scoped factory ``start(model_dir, layers=..., final=..., extra_args=..., tp_size=1,
  layout="states", quantize="none")``
  -> `SGLangServer`; the same arguments give the same (running) server; all stop at session end. The session's
  summary lists every start by key and the test that caused it (a restart after eviction shows as a second one).
- ``sglang_llama`` / ``sglang_kimi``: the factory applied to the tiny models with `DEFAULT_LAYERS`.
"""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import astuple, dataclass
from pathlib import Path
from typing import Any

import pytest

from harness.sglang import build_cuda_stub, cpu_server_args, cpu_server_env
from layertap.engines.sglang.launch import ServerConfig
from layertap.engines.sglang.process import SGLangServer as ServerProcess
from tests.venvs import SGLANG_PYTHON

REPO_ROOT = Path(__file__).resolve().parents[1]

# Capture indices per tiny model (llama: 6 layers, kimi-k2: 5 layers, first dense): the first and last
# legal index and one in between; for kimi, index 2 is the output of its first MoE layer.
DEFAULT_LAYERS = {"llama": (1, 3, 5), "kimi-k2": (1, 2, 4)}
CHUNKED_PREFILL_SIZE = 64
# Every test server's SGLang flags but its TP size: the CPU backend, float32, small chunked-prefill passes.
TEST_SERVER_ARGS = cpu_server_args("float32", CHUNKED_PREFILL_SIZE)
STARTUP_TIMEOUT_S = 900.0  # a start that outlasts it is not retried; a loaded 2-core box started TP=2 in > 300 s


@dataclass(frozen=True, slots=True)
class SGLangServer:
    """A running capture server: where to send requests and where its dumps appear."""

    url: str
    dump_root: Path
    model_dir: Path
    layers: tuple[int, ...]
    finals: tuple[str, ...]
    rid_prefix: str
    log_path: Path

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


@contextmanager
def run_sglang_server(
    model_dir: Path,
    workdir: Path,
    *,
    cuda_stub_dir: Path,
    layers: Sequence[int],
    final: str = "both",
    rid_prefix: str = "hscap",
    extra_args: Sequence[str] = (),
    tp_size: int = 1,
    layout: str = "states",
    quantize: str = "none",
) -> Iterator[SGLangServer]:
    """Start a CPU capture server with the product's own `layertap.engines.sglang.process.SGLangServer` (launched through
    `sglang_patch.launch`, dies with this process), wait until healthy, stop it on exit."""
    config = ServerConfig(
        python=SGLANG_PYTHON,
        model=Path(model_dir),
        dump_root=workdir / "dumps",
        layers=tuple(layers),
        final=final,
        rid_prefix=rid_prefix,
        log_path=workdir / "server.log",
        layout=layout,
        quantize=quantize,
        sglang_args=(*TEST_SERVER_ARGS, "--tp-size", str(tp_size), *extra_args),
        env=cpu_server_env(cuda_stub_dir, tp_size),
        startup_timeout_s=STARTUP_TIMEOUT_S,
    )
    process = ServerProcess(config)
    try:
        process.start()
        yield SGLangServer(
            url=process.url,
            dump_root=config.dump_root,
            model_dir=config.model,
            layers=config.layers,
            finals=("post", "pre") if final == "both" else (final,),
            rid_prefix=rid_prefix,
            log_path=config.log_path,
        )
    finally:
        process.stop()


@pytest.fixture(scope="session")
def cuda_stub_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Folder holding a freshly built libcuda.so.1 stub."""
    return build_cuda_stub(tmp_path_factory.mktemp("cuda-stub"))


# Servers kept running at once, by all of a run's pytest-xdist workers together: each CPU server holds ~1.5-2 GB (its
# scheduler and detokenizer); with every server of a session kept to its end, eleven at once ran the 24 GB CI box out
# of memory at the TP=2 test. A worker keeps its share, never fewer than two (a test may use two at once).
MAX_LIVE_SERVERS = 6


def live_servers_per_worker() -> int:
    """This process's share of `MAX_LIVE_SERVERS` (all of it without xdist)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    return max(2, MAX_LIVE_SERVERS // workers)


@dataclass(frozen=True, slots=True)
class ServerStart:
    """One start of a test server, for the session's summary: what it serves, the test that asked, its seconds."""

    key: str
    test: str
    seconds: float


SERVER_STARTS = pytest.StashKey[list[ServerStart]]()
CURRENT_TEST = pytest.StashKey[str]()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item) -> None:
    """Remember the running test: the factory charges each server start to it."""
    item.config.stash[CURRENT_TEST] = item.nodeid


def pytest_sessionfinish(session: pytest.Session) -> None:
    """An xdist worker hands its starts to the controller, which prints the summary (`pytest_testnodedown`)."""
    if hasattr(session.config, "workeroutput"):
        starts = session.config.stash.get(SERVER_STARTS, [])
        session.config.workeroutput["server_starts"] = [astuple(s) for s in starts]


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: object) -> None:
    """The controller gathers each worker's starts (``node``: xdist's WorkerController) for the summary."""
    starts = node.config.stash.setdefault(SERVER_STARTS, [])
    starts += [ServerStart(*s) for s in getattr(node, "workeroutput", {}).get("server_starts", [])]


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    """Every server the factory started, by key: how many starts (more than one is a restart after eviction, or the
    same server in another xdist worker), their seconds, and the tests that caused them. Starts are the suite's main
    cost: a CPU server takes 20-50 s."""
    starts = config.stash.get(SERVER_STARTS, [])
    if not starts:
        return
    terminalreporter.section("SGLang test servers started (tests/sglang_fixtures.py)")
    by_key: dict[str, list[ServerStart]] = {}
    for started in starts:
        by_key.setdefault(started.key, []).append(started)
    for key, group in sorted(by_key.items(), key=lambda kv: -len(kv[1])):
        terminalreporter.write_line(f"{len(group)}x {sum(s.seconds for s in group):6.0f} s  {key}")
        for started in group:
            terminalreporter.write_line(f"        {started.seconds:5.0f} s  {started.test}")
    total = sum(s.seconds for s in starts)
    terminalreporter.write_line(f"{len(starts)} starts of {len(by_key)} servers, {total:.0f} s in all")


def _described(key: tuple) -> str:
    """A factory key as one line: the model folder's name and every argument that differs from its default."""
    model, layers, final, extra_args, tp_size, layout, quantize = key
    words = [Path(model).name, f"layers={','.join(map(str, layers))}"]
    words += [f"final={final}"] * (final != "both") + [f"tp={tp_size}"] * (tp_size != 1)
    words += [f"layout={layout}"] * (layout != "states") + [f"quantize={quantize}"] * (quantize != "none")
    return " ".join([*words, *extra_args])


@pytest.fixture(scope="session")
def sglang_servers(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, cuda_stub_dir: Path, sglang_python: Path
) -> Iterator[Callable[..., SGLangServer]]:
    """Factory of CPU capture servers, one per distinct argument set. At most this worker's share of
    ``MAX_LIVE_SERVERS`` (`live_servers_per_worker`) run at once; to
    start another, the one asked for by the fewest test modules so far is stopped (the least recently asked for
    among equals, never one the running test asked for): a server many modules share (the tiny Llama's default)
    outlives the one-module servers between its uses instead of being restarted after each. A stopped server is
    started again when asked for again, so a test must ask the factory (or a function-scoped fixture that does) for
    each server it uses, never keep one across tests. Each start is charged to the asking test in the session's
    summary (`pytest_terminal_summary`)."""
    running: OrderedDict[tuple, tuple[ExitStack, SGLangServer]] = OrderedDict()
    modules: dict[tuple, set[str]] = {}
    last_asked_by: dict[tuple, str] = {}
    starts = request.config.stash.setdefault(SERVER_STARTS, [])

    def start(
        model_dir: Path,
        *,
        layers: Sequence[int],
        final: str = "both",
        extra_args: Sequence[str] = (),
        tp_size: int = 1,
        layout: str = "states",
        quantize: str = "none",
    ) -> SGLangServer:
        key = (Path(model_dir), tuple(layers), final, tuple(extra_args), tp_size, layout, quantize)
        test = request.config.stash.get(CURRENT_TEST, "")
        modules.setdefault(key, set()).add(test.split("::")[0])
        last_asked_by[key] = test
        if key in running:
            running.move_to_end(key)
            return running[key][1]
        while len(running) >= live_servers_per_worker():
            # Never one this test holds (it may use several at once); the first of equals is the least recently asked.
            others = [k for k in running if last_asked_by[k] != test] or list(running)
            running.pop(min(others, key=lambda k: len(modules[k])))[0].close()
        stack = ExitStack()
        workdir = tmp_path_factory.mktemp(f"sglang-{Path(model_dir).name}")
        began = time.monotonic()
        server = stack.enter_context(
            run_sglang_server(
                model_dir,
                workdir,
                cuda_stub_dir=cuda_stub_dir,
                layers=layers,
                final=final,
                extra_args=extra_args,
                tp_size=tp_size,
                layout=layout,
                quantize=quantize,
            )
        )
        starts.append(ServerStart(_described(key), test, time.monotonic() - began))
        running[key] = (stack, server)
        return server

    try:
        yield start
    finally:
        for stack, _ in running.values():
            stack.close()


@pytest.fixture
def sglang_llama(sglang_servers: Callable[..., SGLangServer], tiny_llama: Path) -> SGLangServer:
    """CPU capture server on the tiny Llama: capture indices 1, 3, 5 and both finals."""
    return sglang_servers(tiny_llama, layers=DEFAULT_LAYERS["llama"])


@pytest.fixture
def sglang_kimi(sglang_servers: Callable[..., SGLangServer], tiny_kimi: Path) -> SGLangServer:
    """CPU capture server on the tiny Kimi-K2-like DeepseekV3: capture indices 1, 2, 4 and both finals."""
    return sglang_servers(tiny_kimi, layers=DEFAULT_LAYERS["kimi-k2"])
