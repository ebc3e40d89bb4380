#!/usr/bin/env bash
# Prepare a CPU-only SGLang server environment (developer machines and CI). Idempotent.
#
# - Creates the SGLang venv at ${LAYERTAP_SGLANG_VENV:-/opt/sglang-venv} with sglang==0.5.10.post1 if
#   it is missing (about 4 minutes, about 12 GB). It is kept apart from the project venv: sglang pins
#   torch and transformers versions of its own, and only runs as a separate server process.
# - Builds the libcuda.so.1 stub (scripts/libcuda_stub.c) into
#   ${LAYERTAP_CUDA_STUB_DIR:-<venv>/layertap-cuda-stub}: sgl_kernel links the driver library and sglang
#   imports it even on the CPU.
# - Prints the paths and the environment a CPU server needs.
set -euo pipefail

SGLANG_VERSION="0.5.10.post1"
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${LAYERTAP_SGLANG_VENV:-/opt/sglang-venv}"
STUB_DIR="${LAYERTAP_CUDA_STUB_DIR:-${VENV}/layertap-cuda-stub}"

installed_version() {
  "${VENV}/bin/python" -c "import importlib.metadata as m; print(m.version('sglang'))" 2>/dev/null || true
}

if [[ "$(installed_version)" != "${SGLANG_VERSION}" ]]; then
  echo "installing sglang==${SGLANG_VERSION} into ${VENV}" >&2
  [[ -x "${VENV}/bin/python" ]] || python3 -m venv "${VENV}"
  "${VENV}/bin/pip" install --quiet "sglang==${SGLANG_VERSION}"
fi

mkdir -p "${STUB_DIR}"
if [[ ! -f "${STUB_DIR}/libcuda.so.1" || "${REPO_ROOT}/scripts/libcuda_stub.c" -nt "${STUB_DIR}/libcuda.so.1" ]]; then
  gcc -O2 -Wall -shared -fPIC -Wl,-soname,libcuda.so.1 \
    -o "${STUB_DIR}/libcuda.so.1" "${REPO_ROOT}/scripts/libcuda_stub.c"
fi

cat <<EOF
LAYERTAP_SGLANG_PYTHON=${VENV}/bin/python
LAYERTAP_CUDA_STUB_DIR=${STUB_DIR}
# Start a CPU capture server with:
#   SGLANG_USE_CPU_ENGINE=1 LD_LIBRARY_PATH=${STUB_DIR} PYTHONPATH=${REPO_ROOT} \\
#   ${VENV}/bin/python -m sglang_patch.launch --dump-root DIR --capture-layers 1,2 --capture-final both \\
#     --model-path MODEL --device cpu --skip-tokenizer-init --attention-backend torch_native \\
#     --disable-cuda-graph --max-total-tokens 16384 --dtype float32
EOF
