"""The CPU SGLang server (0.5.10.post1, made by ``scripts/setup_sglang_cpu.sh``): its interpreter, flags, environment
and the libcuda stub it needs. The server itself is the product's (``SGLangServer`` of ``layertap.engines.sglang``,
launched through ``sglang_patch.launch``); this module only says how to run it on a machine with no GPU."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from harness.processes import REPO_ROOT

# The CPU server's own venv; a worker reads the same variable for the server it launches.
SGLANG_CPU_PYTHON = Path(os.environ.get("LAYERTAP_SGLANG_PYTHON", "/opt/sglang-venv/bin/python"))
# Where scripts/setup_sglang_cpu.sh builds the stub, beside the venv (LAYERTAP_CUDA_STUB_DIR overrides it there too).
INSTALLED_CUDA_STUB = Path(
    os.environ.get("LAYERTAP_CUDA_STUB_DIR", SGLANG_CPU_PYTHON.parents[1] / "layertap-cuda-stub")
)
CUDA_STUB_SOURCE = REPO_ROOT / "scripts" / "libcuda_stub.c"

# What a tiny model needs to run on SGLang 0.5.10's CPU backend (see scripts/setup_sglang_cpu.sh).
# --sleep-on-idle: an idle scheduler otherwise busy-polls half a core, which starves everything else
# on a small CPU box (the test suite keeps a few servers up for the whole session).
CPU_SERVER_ARGS = ("--device", "cpu", "--skip-tokenizer-init", "--attention-backend", "torch_native",
                   "--disable-cuda-graph", "--max-total-tokens", "16384", "--sleep-on-idle")  # fmt: skip


def cpu_server_env(cuda_stub_dir: Path = INSTALLED_CUDA_STUB, tp_size: int = 1) -> dict[str, str]:
    """Environment of a CPU server: SGLang's CPU engine switch and the libcuda stub (by default the one
    scripts/setup_sglang_cpu.sh built; tests build their own).

    At ``--tp-size`` > 1 the ranks talk over gloo: each rank gets its own share of this process's
    cores (SGLang otherwise wants one NUMA node per rank), and NCCL is pointed at nothing (the
    venv's CUDA torch ships it, and SGLang would try to open a GPU communicator with it).

    ``torch.compile`` is off: on the CPU its inductor builds C++ for SGLang's compiled helpers (embedding mask,
    MoE top-k, sampler) on a server's first passes, ~10 s of a tiny Kimi server's ~25 s start and a fifth of its
    first 40 samples (measured, 2-core box); eager runs them as HF does.
    """
    env = {"SGLANG_USE_CPU_ENGINE": "1", "LD_LIBRARY_PATH": str(cuda_stub_dir), "TORCH_COMPILE_DISABLE": "1"}
    if tp_size > 1:
        cores = sorted(os.sched_getaffinity(0))
        shares = [cores[r::tp_size] or [cores[r % len(cores)]] for r in range(tp_size)]
        env["SGLANG_CPU_OMP_THREADS_BIND"] = "|".join(",".join(map(str, share)) for share in shares)
        env["SGLANG_NCCL_SO_PATH"] = "/nonexistent/libnccl.so"
    return env


def cpu_server_args(dtype: str, chunk: int) -> tuple[str, ...]:
    """A CPU server's SGLang flags: `CPU_SERVER_ARGS`, the weights' dtype and a prefill chunk of ``chunk``
    tokens (small, so that prompts span passes and passes hold several requests)."""
    return (*CPU_SERVER_ARGS, "--dtype", dtype, "--chunked-prefill-size", str(chunk))


def build_cuda_stub(out_dir: Path) -> Path:
    """Compile scripts/libcuda_stub.c into ``out_dir``/libcuda.so.1 (sgl_kernel links the driver library); returns
    ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(out_dir / "libcuda.so.1"),
                    str(CUDA_STUB_SOURCE)], check=True)  # fmt: skip
    return out_dir
