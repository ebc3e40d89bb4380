"""Monitoring on a live job (see conftest's ``stack``): the status page in headless Chromium, a real
Prometheus scraping the coordinator and the worker, and the free-space guard on a real filesystem.

``LAYERTAP_STATUS_SCREENSHOT=docs/status-page.png`` keeps the status page's screenshot there.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import subprocess
import sys
import time
from html.parser import HTMLParser
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from harness.processes import REPO_ROOT, wait_for
from layertap.diskspace import free_bytes
from layertap.verify import verify_store
from tests.monitoring.conftest import FLOOR_BYTES, RESUME_BYTES, Stack
from tests.monitoring.test_configs import METRIC, dashboard_queries
from worker.metrics import STATES

pytestmark = pytest.mark.services

# Series only a job that regenerates has (docs/monitoring.md): this stack's job runs the HF engine, which cannot
# regenerate; tests/coordinator/test_monitoring_api.py and tests/worker/test_generation_counts.py read them.
REGENERATING_ONLY = {"layertap_job_cut_turns", "layertap_job_generated_tokens_per_second",
                     "layertap_job_generated_tokens", "layertap_worker_generated_tokens_total"}  # fmt: skip
# Series only a streamed run has (--stream mooncake): this stack has no Mooncake master; tests/stream/test_stream.py
# reads them from the coordinator's /metrics during a streamed run.
STREAMING_ONLY = {"layertap_stream_samples", "layertap_stream_unacked_bound", "layertap_stream_held",
                  "layertap_stream_held_seconds_total"}  # fmt: skip
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# Rows per job: minutes of work, more than any test waits for; each test cancels its job when done with it.
# Tests that look at a worker's state use shards of 1000 rows (several seconds each), so that the few
# milliseconds a worker spends idle between two shards are unlikely to be what they see.
N_ROWS = 5000


def chromium(url: str, profile: Path, *args: str) -> subprocess.CompletedProcess:
    """Headless Chromium on ``url``; the page's scripts get 3 s of (virtual) time to fetch and draw."""
    assert CHROMIUM, "chromium is missing: run scripts/setup_system.sh"
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--hide-scrollbars",
           f"--user-data-dir={profile}", "--window-size=1280,900", "--virtual-time-budget=3000", *args, url]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done


class _Page(HTMLParser):
    """What the status page drew: each job card's data attributes and text, each worker row's text, each stream
    row's state and text."""

    def __init__(self) -> None:
        super().__init__()
        self.jobs: dict[str, dict] = {}
        self.workers: dict[str, str] = {}
        self.streams: dict[str, dict] = {}
        self._open: list[tuple[str, str, str]] = []  # (tag, kind, key) of the cards and rows being read

    def handle_starttag(self, tag: str, attrs: list) -> None:
        a = dict(attrs)
        if "data-job-id" in a:
            self.jobs[a["data-job-id"]] = {"progress": float(a["data-progress"]), "class": a["class"], "text": ""}
            self._open.append((tag, "job", a["data-job-id"]))
        elif "data-worker" in a:
            self.workers[a["data-worker"]] = ""
            self._open.append((tag, "worker", a["data-worker"]))
        elif "data-stream" in a:
            self.streams[a["data-stream"]] = {"state": a["data-state"], "text": ""}
            self._open.append((tag, "stream", a["data-stream"]))
        elif self._open and self._open[-1][0] == tag:
            self._open.append((tag, "", ""))

    def handle_endtag(self, tag: str) -> None:
        if self._open and self._open[-1][0] == tag:
            self._open.pop()

    def handle_data(self, data: str) -> None:
        for _, kind, key in self._open:
            if kind == "job":
                self.jobs[key]["text"] += data + " "
            elif kind == "worker":
                self.workers[key] += data + " "
            elif kind == "stream":
                self.streams[key]["text"] += data + " "


def render(stack: Stack, profile: Path) -> _Page:
    page = _Page()
    page.feed(chromium(f"{stack.coordinator.url}/status", profile, "--dump-dom").stdout)
    return page


def png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", head[16:24])


def test_the_status_page_shows_a_live_job_advancing(stack: Stack, tiny_llama: Path, tmp_path: Path) -> None:
    bad = {7: "{not json", 42: '{"id": "no-turns", "messages": []}'}  # shown as the job's errors
    job_id = stack.submit(tiny_llama, stack.dataset(N_ROWS, seed=11, bad_lines=bad), out="status", shard_size=1000)
    stack.wait_job(job_id, lambda j: j["samples_done"] >= 60 and j["samples_per_s"] > 0, "the job to be moving")
    first = render(stack, tmp_path / "profile")
    card = first.jobs[job_id]
    assert "running" in card["class"].split() and "samples/s" in card["text"] and "ETA" in card["text"]
    assert re.search(r"\d+\.\d%", card["text"]), card["text"]  # the bar's label
    assert "row 7 (row)" in card["text"] and "row 42 (row)" in card["text"], card["text"]
    assert "working" in first.workers["mon1"] and job_id in first.workers["mon1"], first.workers

    # Wait until the job has moved on, then look again.
    stack.wait_job(job_id, lambda j: j["samples_done"] >= (N_ROWS + 2) * card["progress"] + 40, "more progress")
    second = render(stack, tmp_path / "profile")
    assert second.jobs[job_id]["progress"] > card["progress"], (card, second.jobs[job_id])

    shot = Path(os.environ.get("LAYERTAP_STATUS_SCREENSHOT", tmp_path / "status-page.png")).resolve()
    shot.parent.mkdir(parents=True, exist_ok=True)
    chromium(f"{stack.coordinator.url}/status", tmp_path / "profile", f"--screenshot={shot}")
    assert png_size(shot) == (1280, 900) and shot.stat().st_size > 20_000  # a drawn page, not a blank one

    stack.cancel(job_id)
    last = render(stack, tmp_path / "profile")
    assert "cancelled" in last.jobs[job_id]["class"].split() and last.jobs[job_id]["progress"] < 1
    assert "idle" in last.workers["mon1"]


def scraped(url: str) -> dict[tuple[str, tuple], float]:
    text = httpx.get(url, timeout=10).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_prometheus_scrapes_the_coordinator_and_the_worker_during_a_job(
    stack: Stack, tiny_llama: Path, tmp_path: Path
) -> None:
    before = scraped(stack.worker_metrics)
    committed_before = before.get(("layertap_worker_samples_total", (("status", "committed"), ("worker", "mon1"))), 0)
    # It asks for an audit, which never runs (the job is cancelled): its series still shows the verdict pending.
    job_id = stack.submit(tiny_llama, stack.dataset(N_ROWS, seed=12), out="prometheus", audit_samples=4)

    def moving() -> list[dict]:
        return stack.query(f'layertap_job_tokens_per_second{{job_id="{job_id}"}} > 0')

    wait_for(moving, timeout=60, what="Prometheus to see the job moving", every=0.2)
    assert stack.query(f'layertap_job_state{{job_id="{job_id}",state="running"}} == 1')
    assert stack.query(f'layertap_job_audit{{job_id="{job_id}",verdict="pending"}} == 1')
    job = stack.cancel(job_id)

    def health() -> dict[str, str]:
        targets = httpx.get(f"{stack.prometheus}/api/v1/targets", timeout=10).json()["data"]["activeTargets"]
        return {t["labels"]["job"]: t["health"] for t in targets}

    # "unknown" until Prometheus's first scrape of a target (this test can run first, seconds after start).
    wait_for(lambda: "unknown" not in health().values(), timeout=30, what="Prometheus to scrape both targets")
    assert health() == {"layertap-coordinator": "up", "layertap-worker": "up"}

    # Once it has scraped the stopped job, Prometheus holds the API's and the store's numbers.
    def final() -> list[dict]:
        return stack.query(f'layertap_job_state{{job_id="{job_id}",state="cancelled"}} == 1')

    wait_for(final, timeout=20, what="Prometheus to scrape the cancelled job")
    done = stack.query(f'layertap_job_samples{{job_id="{job_id}",status="done"}}')
    assert float(done[0]["value"][1]) == job["samples_done"] > 0
    tokens = stack.query(f'layertap_job_tokens{{job_id="{job_id}",status="done"}}')
    assert float(tokens[0]["value"][1]) == job["tokens_done"]
    worker = scraped(stack.worker_metrics)
    committed = worker[("layertap_worker_samples_total", (("status", "committed"), ("worker", "mon1")))]
    records = [json.loads(line) for f in (Path(job["out"]) / "index").glob("*.jsonl") for line in f.open()]
    assert committed - committed_before == len(records) == job["samples_done"]
    commits = worker[("layertap_stage_duration_seconds_count", (("stage", "commit"), ("worker", "mon1")))]
    assert commits >= len(records) and worker[("layertap_worker_written_bytes_total", (("worker", "mon1"),))] >= sum(
        r["nbytes"] for r in records
    )
    waits = ("layertap_stage_duration_seconds_count", (("stage", "queue_wait"), ("worker", "mon1")))
    assert worker[waits] - before.get(waits, 0) >= max(job["shards"].get("done", 0), 1)  # one per claim

    def shards_ended(metrics: dict) -> float:
        return sum(v for (name, _), v in metrics.items() if name == "layertap_worker_shards_total")

    # Every claimed shard's attempt ended some way (done, released by the cancel...) and was counted.
    claims = worker[waits] - before.get(waits, 0)
    wait_for(lambda: shards_ended(scraped(stack.worker_metrics)) - shards_ended(before) >= claims,
             timeout=30, what="the worker to count its shards' ends", every=0.2)  # fmt: skip
    states = [v for (name, _), v in worker.items() if name == "layertap_worker_state"]
    assert sorted(states) == [0] * (len(STATES) - 1) + [1]  # one state at a time (of STATES)

    # Every dashboard query is valid PromQL that Prometheus runs, and every metric it names had series.
    for expr in dashboard_queries():
        if expr.startswith("label_values("):
            name, label = re.fullmatch(r"label_values\((\w+), (\w+)\)", expr).groups()
            assert {s["metric"][label] for s in stack.query(name)}, expr
        else:
            stack.query(expr.replace("$job_id", ".*").replace("$worker", ".*"))
    for name in {n for expr in dashboard_queries() for n in METRIC.findall(expr)} - REGENERATING_ONLY - STREAMING_ONLY:
        assert stack.query(f"count(count_over_time({name}[10m]))"), f"no series of {name}"
    rules = httpx.get(f"{stack.prometheus}/api/v1/rules", timeout=10).json()["data"]["groups"][0]["rules"]
    alerts = {r["alert"] for g in yaml.safe_load((REPO_ROOT / "monitoring" / "rules.yml").read_text())["groups"]
              for r in g["rules"]}  # fmt: skip
    assert {r["name"] for r in rules} == alerts and all(r["health"] == "ok" for r in rules), [
        (r["name"], r.get("lastError")) for r in rules
    ]  # every rule of the file loaded, and each evaluates


def test_the_free_space_guard_pauses_a_worker_on_a_full_volume_and_resumes_it(stack: Stack, tiny_llama: Path) -> None:
    if not stack.on_tmpfs:
        pytest.skip("cannot mount a tmpfs here (needs root): no small filesystem to fill")
    job_id = stack.submit(tiny_llama, stack.dataset(N_ROWS, seed=13), out="guarded", shard_size=1000)
    stack.wait_job(job_id, lambda j: j["samples_done"] >= 20, "the job to be moving")

    # Fill the volume to 32 MiB under the floor.
    ballast = stack.output_root / "ballast.bin"
    with ballast.open("wb") as f:
        os.posix_fallocate(f.fileno(), 0, free_bytes(stack.output_root) - FLOOR_BYTES + (32 << 20))
    assert free_bytes(stack.output_root) < FLOOR_BYTES

    def paused() -> dict | None:
        workers = {w["name"]: w for w in stack.get("/workers")["workers"]}
        return workers["mon1"] if workers.get("mon1", {}).get("state") == "paused" else None

    worker = wait_for(paused, timeout=30, what="the worker to say it paused", every=0.1)
    assert "low disk" in worker["reason"] and worker["free_bytes"] < FLOOR_BYTES and worker["job"] == job_id
    metrics = scraped(stack.worker_metrics)
    assert metrics[("layertap_worker_paused", (("reason", "low_disk"), ("worker", "mon1")))] == 1
    assert metrics[("layertap_worker_state", (("state", "paused"), ("worker", "mon1")))] == 1
    assert metrics[("layertap_worker_state", (("state", "working"), ("worker", "mon1")))] == 0
    assert metrics[("layertap_worker_output_free_bytes", (("worker", "mon1"),))] < FLOOR_BYTES
    wait_for(lambda: stack.query('layertap_worker_paused{reason="low_disk"} == 1'), timeout=10,
             what="Prometheus to see the pause")  # fmt: skip

    # Paused means nothing more is committed: the count holds still while the volume stays full.
    held = stack.get(f"/jobs/{job_id}")["samples_done"]
    time.sleep(2)
    job = stack.get(f"/jobs/{job_id}")
    assert job["samples_done"] == held and job["state"] == "running"

    ballast.unlink()
    assert free_bytes(stack.output_root) > RESUME_BYTES
    stack.wait_job(job_id, lambda j: j["samples_done"] >= held + 50, "the worker to go on after the pause")
    metrics = scraped(stack.worker_metrics)
    assert metrics[("layertap_worker_paused", (("reason", "low_disk"), ("worker", "mon1")))] == 0
    assert metrics[("layertap_worker_state", (("state", "working"), ("worker", "mon1")))] == 1
    job = stack.cancel(job_id)
    assert job["samples_failed"] == 0
    report = verify_store(Path(job["out"]))
    assert report.ok, report.problems


def test_the_cli_submits_a_disk_budget_and_is_told_when_it_does_not_fit(stack: Stack, tiny_llama: Path) -> None:
    data = stack.dataset(20, seed=14)
    jobs_before = stack.get("/jobs")["count"]
    cli = subprocess.run(
        [sys.executable, "-m", "layertap", "submit", "--api", stack.coordinator.url, "--model", str(tiny_llama),
         "--data", str(data), "--layers", "1,3,5", "--expected-tokens", str(10**12)],
        capture_output=True, text=True, timeout=300, cwd=REPO_ROOT,
    )  # fmt: skip
    assert cli.returncode == 2 and "507" in cli.stderr and "LAYERTAP_MIN_FREE_BYTES" in " ".join(cli.stderr.split())
    assert stack.get("/jobs")["count"] == jobs_before
