#!/usr/bin/env bash
# Run a GPU benchmark on an H200 machine with no network: SGLang 0.5.14 and its dependencies come as wheels.
#
#   call 1 (carry .whl1):  bash benchmarks/gpu/on_device.sh install .whl1
#   call 2 (carry .whl2):  bash benchmarks/gpu/on_device.sh install .whl2 -- -m benchmarks NAME --out "$OUT"
#
# .whl1, .whl2, .whl3: scripts/gpu_wheels.sh (docs/performance.md says what each holds, which call carries it and
# how long it takes). /tmp/site survives between calls only while the machine stays warm (~30 s idle). What follows
# -- goes to python3, from the repository root: -m benchmarks NAME (benchmarks/__main__.py).
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
# Bytecode, as a user's install has it: the image sets PYTHONDONTWRITEBYTECODE and the wheels come without, so each
# process compiled torch's, transformers' and layertap's sources at its start (what it cost: gpu_stream.md's note).
PYTHONPATH=/tmp/site python3 -m compileall -q -j 0 /tmp/site "$PWD"/{layertap,sglang_patch,harness,benchmarks} $(python3 -c 'import importlib.util as u; print(*(s.submodule_search_locations[0] for s in map(u.find_spec, ("torch", "sympy")) if s))') >/dev/null || true
shift 2
[[ "${1:-}" == -- ]] || exit 0
shift
export PYTHONPATH=/tmp/site:$PWD CUDA_HOME=/usr/local/cuda FLASHINFER_CUDA_ARCH_LIST=9.0a
export PATH=$CUDA_HOME/bin:/tmp/site/bin:$PATH
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
echo "cores: $(nproc), memory: $(free -g | awk '/Mem/{print $2}') GiB"
exec python3 "$@"
