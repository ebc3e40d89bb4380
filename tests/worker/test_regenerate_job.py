"""A job that regenerates (``regenerate: all``) through ``POST /jobs`` and Celery workers attached to one CPU SGLang
capture server: every sample stored once, its regenerated row beside it, the counts on ``GET /jobs/{id}``, also when
a worker is SIGKILLed mid-generation and another takes its shard."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from layertap.settings import COMMIT_THREADS
from layertap.store.index import INDEX_DIR, REGENERATED_DIR
from layertap.store.store import REGENERATED, OutputStore
from layertap.verify import verify_store
from tests.core.datasets import conversation_rows, write_jsonl
from tests.worker.conftest import SHARD_SIZE
from tests.worker.test_failures import SGLANG_READY

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.skipif(not SGLANG_READY, reason="worker/sglang_engine.py has no build_engine() yet"),
]

ROWS = 100
MAX_NEW_TOKENS = 8


@pytest.fixture
def chats(tmp_path: Path) -> Path:
    return write_jsonl(tmp_path / "chats.jsonl", conversation_rows(ROWS, seed=2, max_words=18))


@pytest.fixture
def regenerating_cluster(start_cluster, sglang_llama):
    """``(cluster, env)``: a cluster with workers w1, w2 on the CPU SGLang server; ``env`` attaches another."""
    cluster = start_cluster(workers=0)
    env = {"LAYERTAP_ENGINE": "sglang", "LAYERTAP_SERVER_URL": sglang_llama.url,
           "LAYERTAP_DUMP_ROOT": str(sglang_llama.dump_root)}  # fmt: skip
    cluster.add_worker("w1", **env)
    cluster.add_worker("w2", **env)
    return cluster, env


def submit_regenerating(cluster, model: Path, chats: Path) -> str:
    return cluster.submit(model, chats, regenerate="all", max_new_tokens=MAX_NEW_TOKENS, temperature=0.0)


def check_regenerated_job(job: dict, chats: Path) -> None:
    """Every row's sample stored once with exactly one regenerated row (a ``finish_reason`` on each regenerated
    turn), verify clean (stored ids = the regenerated row through the template), the job's generation counts and
    the manifest's generation settings."""
    out = Path(job["out"])
    assert (job["samples_done"], job["samples_failed"], job["samples_total"]) == (ROWS, 0, ROWS)
    report = verify_store(out)
    assert report.ok and report.complete and report.samples == ROWS, report.problems
    records = OutputStore.open_existing(out).records()
    rows = [json.loads(line) for line in (out / REGENERATED).read_text().splitlines()]
    assert len(records) == ROWS and sorted(r["id"] for r in rows) == sorted(records)
    given = {r["id"]: r["messages"] for r in map(json.loads, chats.read_text().splitlines())}
    for row in rows:
        turns = [m for m in row["messages"] if m["role"] == "assistant"]
        assert len(row["messages"]) == len(given[row["id"]]) and turns
        assert all(m["finish_reason"] in ("stop", "length") for m in turns), row
    generation = job["generation"]
    assert generation["rows"] == ROWS and 0 < generation["tokens"] <= MAX_NEW_TOKENS * sum(map(len, given.values()))
    assert generation["cut_turns"] == sum(m.get("finish_reason") == "length" for r in rows for m in r["messages"])
    settings = json.loads((out / "manifest.json").read_text())["generation"]
    assert (settings["mode"], settings["max_new_tokens"], settings["temperature"]) == ("all", MAX_NEW_TOKENS, 0.0)
    assert settings["drop_truncated"] is False


def test_a_regenerating_job_over_two_workers_stores_each_sample_once_with_its_regenerated_row(
    regenerating_cluster, tiny_llama, chats
) -> None:
    cluster, _ = regenerating_cluster
    job = cluster.wait_state(submit_regenerating(cluster, tiny_llama, chats), "done")
    check_regenerated_job(job, chats)
    servers = json.loads((Path(job["out"]) / "manifest.json").read_text())["servers"]
    assert {s["writer"].split("-")[0] for s in servers} <= {"w1", "w2"}


def test_a_worker_sigkilled_mid_shard_of_a_regenerating_job_leaves_every_sample_once_and_no_row_without_its_sample(
    regenerating_cluster, tiny_llama, chats
) -> None:
    cluster, env = regenerating_cluster
    job_id = submit_regenerating(cluster, tiny_llama, chats)
    victim = cluster.freeze_mid_shard(job_id)
    cluster.workers[victim["worker"]].kill(signal.SIGKILL)
    cluster.add_worker("w3", **env)

    job = cluster.wait_state(job_id, "done")
    shard = cluster.shards(job_id)[victim["n"]]
    assert int(shard["attempts"]) >= 2 and shard["worker"] != victim["worker"]
    writer = f"{victim['worker']}-s{victim['n']}-t{victim['token']}.jsonl"
    out = Path(job["out"])
    committed = len((out / INDEX_DIR / writer).read_text().splitlines())
    assert 2 <= committed < SHARD_SIZE  # it died in the middle of its shard, its texts logged with its commits
    # a commit logs its text, then its record: each commit thread may have died between the two
    assert committed <= len((out / REGENERATED_DIR / writer).read_text().splitlines()) <= committed + COMMIT_THREADS
    check_regenerated_job(job, chats)
