"""Real SGLang capture servers on the CPU, for tests (a pytest plugin listed in tests/conftest.py).

A server is SGLang 0.5.10.post1 from its own venv (``LAYERTAP_SGLANG_PYTHON``, default
/opt/sglang-venv/bin/python; `scripts/setup_sglang_cpu.sh` makes it), started as
``python -m sglang_patch.launch`` with this repository on PYTHONPATH, the libcuda stub on
LD_LIBRARY_PATH and ``SGLANG_USE_CPU_ENGINE=1``, in float32 with small chunked-prefill passes so
that prompts span passes and passes hold several requests. Server warmup stays on. Tests that need
one are skipped when the SGLang venv is missing.

Fixtures:
- ``sglang_servers``: session-scoped factory ``start(model_dir, layers=..., final=..., extra_args=...)``
  -> `SGLangServer`; the same arguments give the same (running) server; all stop at session end.
- ``sglang_llama`` / ``sglang_kimi``: the factory applied to the tiny models with `DEFAULT_LAYERS`.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
SGLANG_PYTHON = Path(os.environ.get("LAYERTAP_SGLANG_PYTHON", "/opt/sglang-venv/bin/python"))
CUDA_STUB_SOURCE = REPO_ROOT / "scripts" / "libcuda_stub.c"

# Capture indices per tiny model (llama: 6 layers, kimi-k2: 5 layers, first dense): the first and last
# legal index and one in between; for kimi, index 2 is the output of its first MoE layer.
DEFAULT_LAYERS = {"llama": (1, 3, 5), "kimi-k2": (1, 2, 4)}
CHUNKED_PREFILL_SIZE = 64
STARTUP_TIMEOUT_S = 300.0


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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_cuda_stub(out_dir: Path) -> Path:
    """Compile scripts/libcuda_stub.c into `out_dir`/libcuda.so.1; returns `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [
            "gcc",
            "-O2",
            "-shared",
            "-fPIC",
            "-Wl,-soname,libcuda.so.1",
            "-o",
            str(out_dir / "libcuda.so.1"),
            str(CUDA_STUB_SOURCE),
        ],
        check=True,
    )
    return out_dir


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the server's process group (launcher, scheduler, detokenizer), SIGKILL if it lingers."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def _wait_healthy(proc: subprocess.Popen[bytes], url: str, log_path: Path) -> None:
    """Until ``GET /health`` answers 200: SGLang answers 503 until its own warmup request is done."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    with httpx.Client(timeout=10.0) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"SGLang server exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}")
            try:
                if client.get(url + "/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
    raise RuntimeError(f"SGLang server not healthy after {STARTUP_TIMEOUT_S} s:\n{log_path.read_text()[-4000:]}")


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
) -> Iterator[SGLangServer]:
    """Start a CPU capture server through `sglang_patch.launch`, wait until healthy, stop it on exit."""
    workdir.mkdir(parents=True, exist_ok=True)
    dump_root, log_path, port = workdir / "dumps", workdir / "server.log", _free_port()
    command = [
        str(SGLANG_PYTHON), "-m", "sglang_patch.launch",
        "--dump-root", str(dump_root),
        "--capture-layers", ",".join(map(str, layers)),
        "--capture-final", final,
        "--rid-prefix", rid_prefix,
        "--model-path", str(model_dir),
        "--host", "127.0.0.1", "--port", str(port),
        "--device", "cpu", "--dtype", "float32",
        "--skip-tokenizer-init", "--attention-backend", "torch_native", "--disable-cuda-graph",
        "--max-total-tokens", "8192", "--chunked-prefill-size", str(CHUNKED_PREFILL_SIZE),
        *extra_args,
    ]  # fmt: skip
    env = {
        **os.environ,
        "SGLANG_USE_CPU_ENGINE": "1",
        "LD_LIBRARY_PATH": str(cuda_stub_dir),
        "PYTHONPATH": str(REPO_ROOT),
    }
    env.pop("VIRTUAL_ENV", None)
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            command, env=env, cwd=workdir, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(proc, url, log_path)
        yield SGLangServer(
            url=url,
            dump_root=dump_root,
            model_dir=Path(model_dir),
            layers=tuple(layers),
            finals=("post", "pre") if final == "both" else (final,),
            rid_prefix=rid_prefix,
            log_path=log_path,
        )
    finally:
        _stop(proc)


@pytest.fixture(scope="session")
def cuda_stub_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Folder holding a freshly built libcuda.so.1 stub."""
    return build_cuda_stub(tmp_path_factory.mktemp("cuda-stub"))


@pytest.fixture(scope="session")
def sglang_servers(
    tmp_path_factory: pytest.TempPathFactory, cuda_stub_dir: Path
) -> Iterator[Callable[..., SGLangServer]]:
    """Factory of CPU capture servers, one per distinct argument set, all stopped at session end."""
    if not SGLANG_PYTHON.exists():
        pytest.skip(f"no SGLang venv at {SGLANG_PYTHON}: run scripts/setup_sglang_cpu.sh")
    running: dict[tuple, SGLangServer] = {}
    with ExitStack() as stack:

        def start(
            model_dir: Path, *, layers: Sequence[int], final: str = "both", extra_args: Sequence[str] = ()
        ) -> SGLangServer:
            key = (Path(model_dir), tuple(layers), final, tuple(extra_args))
            if key not in running:
                workdir = tmp_path_factory.mktemp(f"sglang-{Path(model_dir).name}")
                running[key] = stack.enter_context(
                    run_sglang_server(
                        model_dir,
                        workdir,
                        cuda_stub_dir=cuda_stub_dir,
                        layers=layers,
                        final=final,
                        extra_args=extra_args,
                    )
                )
            return running[key]

        yield start


@pytest.fixture(scope="session")
def sglang_llama(sglang_servers: Callable[..., SGLangServer], tiny_llama: Path) -> SGLangServer:
    """CPU capture server on the tiny Llama: capture indices 1, 3, 5 and both finals."""
    return sglang_servers(tiny_llama, layers=DEFAULT_LAYERS["llama"])


@pytest.fixture(scope="session")
def sglang_kimi(sglang_servers: Callable[..., SGLangServer], tiny_kimi: Path) -> SGLangServer:
    """CPU capture server on the tiny Kimi-K2-like DeepseekV3: capture indices 1, 2, 4 and both finals."""
    return sglang_servers(tiny_kimi, layers=DEFAULT_LAYERS["kimi-k2"])
