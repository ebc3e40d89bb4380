"""A worker whose SGLang server cannot start as configured (here a flag SGLang rejects) stops taking shards: it says
``broken`` (its record, the coordinator's metrics) and hands its one shard back, which another worker then runs; the
job ends done with every sample once."""

from __future__ import annotations

from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from harness.processes import wait_for
from harness.sglang import cpu_server_env
from layertap.state.keys import Keys
from layertap.state.views import live_workers
from tests.core.datasets import conversation_rows, write_jsonl

ROWS = 12


def test_a_worker_whose_server_cannot_start_stops_taking_shards(
    start_cluster, tiny_llama, cuda_stub_dir, sglang_python, tmp_path: Path
) -> None:
    cluster = start_cluster(workers=0)
    bad = cluster.add_worker("bad", LAYERTAP_ENGINE="sglang", LAYERTAP_DUMP_ROOT=str(tmp_path / "dumps"),
                             LAYERTAP_SGLANG_PYTHON=str(sglang_python), LAYERTAP_SGLANG_ARGS="--no-such-flag",
                             **cpu_server_env(cuda_stub_dir))  # fmt: skip
    job_id = cluster.submit(tiny_llama, write_jsonl(tmp_path / "data.jsonl", conversation_rows(ROWS, seed=3)))

    def broken() -> dict[str, str] | None:
        record = live_workers(cluster.state, Keys()).get("bad")
        return record if record and record.get("state") == "broken" else None

    record = wait_for(broken, timeout=180, what="the worker with the bad flag to say it is broken")
    assert record["reason"].startswith("SGLang server failed to start (try 1, not retried: "), record["reason"]
    metrics = httpx.get(f"{cluster.coordinator.url}/metrics", timeout=10).text
    workers = {s.labels["state"]: s.value for f in text_string_to_metric_families(metrics) for s in f.samples
               if s.name == "layertap_workers"}  # fmt: skip
    assert workers["broken"] == 1

    cluster.add_worker("good")
    job = cluster.wait_state(job_id, "done")
    assert (job["samples_done"], job["samples_failed"]) == (ROWS, 0)
    assert all(shard["state"] == "done" for shard in cluster.shards(job_id))
    # The broken worker tried its server once, then took no shard (one that reached it before it stopped consuming
    # went back untried); it is still up, still broken, its shards given back unspent.
    log = bad.log_path.read_text()
    assert log.count("started SGLang capture server") == 1, log[-3000:]
    assert bad.alive() and live_workers(cluster.state, Keys())["bad"]["state"] == "broken"
    assert all(int(shard.get("attempts", 0)) == 1 for shard in cluster.shards(job_id))
