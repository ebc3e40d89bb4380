#!/usr/bin/env bash
# A device call's put and stream benches wrapped in host probes (call 3 of docs/performance.md's recipe, .whl3
# carried, the kernel cache at /tmp/kc.tgz from call 2): /proc/vmstat before and after (THP compaction, faults),
# vmstat each second, top's busiest threads every 2 s, archived with the bench's logs beside its part
# (gpu_stream_stages.md came from it).
#   bash scripts/gpu_probe.sh SHA LAYERS CHATS ROUNDS ARMS    e.g. bash scripts/gpu_probe.sh abc1234 4 480 3 file-tmpfs,only-disk
# STREAM_LIMIT_S (default 500) stops the stream bench by SIGINT: it writes the runs that ended (keep it under the call's
# own limit, which would lose them).
set -u
export BENCH_COMMIT=$1 PYTHONUNBUFFERED=1
grep -E 'compact|thp_|pgfault|pgmajfault|numa_' /proc/vmstat > "$OUT/vmstat-before-$2.txt"
cat /sys/kernel/mm/transparent_hugepage/enabled /sys/kernel/mm/transparent_hugepage/defrag > "$OUT/thp-$2.txt" 2>&1
lscpu > "$OUT/lscpu.txt" 2>&1
vmstat -t 1 > "$OUT/vmstat-$2.txt" 2>&1 &
VM=$!
(top -b -H -d 2 -w 200 2>&1 | awk '/^top -/{n=0} {n++; if (n<=32) print}' > "$OUT/top-$2.txt") &
# where a put lands on this host, by memcpy and sent over TCP (~15 s): what Mooncake picks by itself here reads off it
timeout -s INT 60 bash benchmarks/gpu/on_device.sh install .whl3 -- -m benchmarks put --out "$OUT/put-gpu" > "$OUT/put-gpu.log" 2>&1
timeout -s INT "${STREAM_LIMIT_S:-500}" bash benchmarks/gpu/on_device.sh install .whl3 -- -m benchmarks stream --layers-deep "$2" --chats "$3" --rounds "$4" --arms "$5" --out "$OUT/stream-$2" --kernel-cache-tgz /tmp/kc.tgz
kill $VM; pkill -x top
grep -E 'compact|thp_|pgfault|pgmajfault|numa_' /proc/vmstat > "$OUT/vmstat-after-$2.txt"
# one archive of the logs and probes: a call brings back only a few files from $OUT (the probes were left out once)
cd "$OUT" && tar czf "logs$2.tgz" "stream-$2-logs" top-$2.txt vmstat-*$2.txt thp-$2.txt lscpu.txt \
  && rm -rf "stream-$2-logs" top-$2.txt vmstat-*$2.txt thp-$2.txt lscpu.txt
