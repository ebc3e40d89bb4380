#!/usr/bin/env bash
# Debian packages the tests need (each installed only if missing).
set -euo pipefail
need=()
command -v redis-server >/dev/null || need+=(redis-server)
command -v gcc >/dev/null || need+=(gcc)
command -v promtool >/dev/null || need+=(prometheus)  # promtool and the server the monitoring tests scrape with
command -v chromium >/dev/null || need+=(chromium)  # headless, for the status page test
ldconfig -p | grep 'libibverbs\.so\.1 ' >/dev/null || need+=(libibverbs1)  # Mooncake's wheel links it, even over TCP
if ((${#need[@]})); then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}"
fi
