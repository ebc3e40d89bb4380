"""A job that regenerates (``regenerate: all``) through ``POST /jobs`` and two Celery workers attached to one CPU
SGLang capture server: every sample stored once, its regenerated row beside it, the counts on ``GET /jobs/{id}``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from layertap.store.store import REGENERATED, OutputStore
from layertap.verify import verify_store
from tests.core.datasets import conversation_rows, write_jsonl
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


def test_a_regenerating_job_over_two_workers_stores_each_sample_once_with_its_regenerated_row(
    start_cluster, sglang_llama, tiny_llama, chats
) -> None:
    cluster = start_cluster(workers=0)
    engine_env = {"LAYERTAP_ENGINE": "sglang", "LAYERTAP_SERVER_URL": sglang_llama.url,
                  "LAYERTAP_DUMP_ROOT": str(sglang_llama.dump_root)}  # fmt: skip
    cluster.add_worker("w1", **engine_env)
    cluster.add_worker("w2", **engine_env)
    job_id = cluster.submit(tiny_llama, chats, regenerate="all", max_new_tokens=MAX_NEW_TOKENS, temperature=0.0)
    job = cluster.wait_state(job_id, "done")
    out = Path(job["out"])

    assert (job["samples_done"], job["samples_failed"], job["samples_total"]) == (ROWS, 0, ROWS)
    report = verify_store(out)  # also: each stored sample's ids are its regenerated row through the template
    assert report.ok and report.complete and report.samples == ROWS, report.problems
    records = OutputStore.open_existing(out).records()
    assert len(records) == ROWS
    rows = [json.loads(line) for line in (out / REGENERATED).read_text().splitlines()]
    assert sorted(r["id"] for r in rows) == sorted(records)  # one row per committed sample, none without one
    given = {r["id"]: r["messages"] for r in map(json.loads, chats.read_text().splitlines())}
    for row in rows:
        turns = [m for m in row["messages"] if m["role"] == "assistant"]
        assert len(row["messages"]) == len(given[row["id"]]) and turns
        assert all(m["finish_reason"] in ("stop", "length") for m in turns), row
    # Both workers regenerated; the coordinator counts each row once and its new tokens.
    assert {s["writer"].split("-")[0] for s in json.loads((out / "manifest.json").read_text())["servers"]} == {
        "w1",
        "w2",
    }
    generation = job["generation"]
    assert generation["rows"] == ROWS and generation["tokens"] > 0
    assert generation["tokens"] <= MAX_NEW_TOKENS * sum(len(r["messages"]) for r in rows)
    cut = sum(m.get("finish_reason") == "length" for r in rows for m in r["messages"])
    assert generation["cut_turns"] == cut
    settings = json.loads((out / "manifest.json").read_text())["generation"]
    assert (settings["mode"], settings["max_new_tokens"], settings["temperature"]) == ("all", MAX_NEW_TOKENS, 0.0)
    assert settings["drop_truncated"] is False
