"""What a job's end says, through the command line users run against a real coordinator and Celery worker:
a job on a folder whose tokenizer is code (``layertap submit --trust-remote-code``) ends ``done`` with what a
single process stores; a job that stores nothing ends ``failed`` (``submit --wait`` exits 1), naming the cause."""

from __future__ import annotations

from pathlib import Path

from layertap.pipeline import run_extraction
from layertap.spec import ExtractionSpec
from layertap.store.store import OutputStore
from layertap.verify import verify_store
from tests.core.datasets import write_jsonl
from tests.hf_engines import cpu_hf
from tests.worker.conftest import layertap

KIMI_CHATS = Path(__file__).resolve().parents[1] / "assets" / "datasets" / "kimi_chats.jsonl"


def test_submit_runs_a_remote_code_job_to_done_and_a_job_storing_nothing_fails(
    start_cluster, tiny_kimi25, tiny_llama, tmp_path
) -> None:
    cluster = start_cluster(workers=1, LAYERTAP_ALLOW_REMOTE_CODE="1")
    api = {"LAYERTAP_API_URL": cluster.coordinator.url}
    submitted = layertap("submit", "--model", str(tiny_kimi25), "--data", str(KIMI_CHATS), "--layers", "1,2,4",
                         "--trust-remote-code", "--shard-size", "4", "--batch-size", "1", "--wait", env=api)  # fmt: skip
    assert submitted.returncode == 0, submitted.stderr[-3000:]
    job = cluster.job(submitted.stdout.splitlines()[0].strip())
    assert job["state"] == "done" and job["samples_failed"] == 0 and job["samples_done"] == job["samples_total"] > 0
    out = Path(job["out"])
    assert verify_store(out).ok
    alone = tmp_path / "alone"
    spec = ExtractionSpec(model=tiny_kimi25, data=KIMI_CHATS, layers=(1, 2, 4), trust_remote_code=True)
    run_extraction(spec, alone, cpu_hf(batch_size=1))
    stored = {sid: r.sha256 for sid, r in OutputStore.open_existing(out).records().items()}
    assert stored == {sid: r.sha256 for sid, r in OutputStore.open_existing(alone).records().items()}

    # Every row holds token ids beyond the tokenizer's vocabulary: nothing is stored, so the job failed.
    rows = [{"id": f"r{i}", "input_ids": [1, 99_000 + i], "loss_mask": [0, 1]} for i in range(6)]
    data = write_jsonl(tmp_path / "bad.jsonl", rows)
    failed = layertap("submit", "--model", str(tiny_llama), "--data", str(data), "--layers", "1,3,5",
                      "--shard-size", "3", "--max-bad-rows", "100%", "--wait", env=api)  # fmt: skip
    assert failed.returncode == 1, failed.stderr[-3000:]
    job = cluster.job(failed.stdout.splitlines()[0].strip())
    assert job["state"] == "failed" and job["shards"] == {"done": 2} and job["samples_failed"] == 6
    assert job["error"].startswith("nothing was stored: none of the 6 rows gave a sample (6 bad); by kind: row 6; ")
    assert "most frequent: 6 x row: " in job["error"]
    assert "failed: 0/6 samples, 6 failed" in failed.stderr
