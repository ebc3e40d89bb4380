"""The CPU SGLang server (0.5.10.post1, made by ``scripts/setup_sglang_cpu.sh``): its interpreter, flags, environment
and the libcuda stub it needs. The server itself is the product's (``SGLangServer`` of ``layertap.engines.sglang``,
launched through ``sglang_patch.launch``); this module only says how to run it on a machine with no GPU."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from harness.processes import REPO_ROOT
from layertap.engines.sglang.launch import CPU_SERVER_ARGS, cpu_server_env

# The CPU server's own venv; a worker reads the same variable for the server it launches.
SGLANG_CPU_PYTHON = Path(os.environ.get("LAYERTAP_SGLANG_PYTHON", "/opt/sglang-venv/bin/python"))
# Where scripts/setup_sglang_cpu.sh builds the stub, beside the venv (LAYERTAP_CUDA_STUB_DIR overrides it there too).
INSTALLED_CUDA_STUB = Path(
    os.environ.get("LAYERTAP_CUDA_STUB_DIR", SGLANG_CPU_PYTHON.parents[1] / "layertap-cuda-stub")
)
CUDA_STUB_SOURCE = REPO_ROOT / "scripts" / "libcuda_stub.c"


def cpu_server_args(dtype: str, chunk: int) -> tuple[str, ...]:
    """A CPU server's SGLang flags: the product's CPU flags, the weights' dtype and a prefill chunk of ``chunk``
    tokens (small, so that prompts span passes and passes hold several requests)."""
    return (*CPU_SERVER_ARGS, "--dtype", dtype, "--chunked-prefill-size", str(chunk))


def cpu_env(tp_size: int = 1, cuda_stub_dir: Path = INSTALLED_CUDA_STUB) -> dict[str, str]:
    """A CPU server's environment (SGLang's CPU engine switch, the libcuda stub, a core share per TP rank)."""
    return cpu_server_env(cuda_stub_dir, tp_size)


def build_cuda_stub(out_dir: Path) -> Path:
    """Compile scripts/libcuda_stub.c into ``out_dir``/libcuda.so.1 (sgl_kernel links the driver library); returns
    ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(out_dir / "libcuda.so.1"),
                    str(CUDA_STUB_SOURCE)], check=True)  # fmt: skip
    return out_dir
