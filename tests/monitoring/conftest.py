"""A live stack for the monitoring tests, shared by the module that asks for it: Redis, a uvicorn
coordinator, one Celery worker (HF engine on the tiny Llama) serving its metrics, and a real
Prometheus scraping both every second with the project's alert rules loaded.

The output root is a 256 MiB tmpfs when this machine lets the tests mount one (root), so the
free-space guard can be driven below its floor by filling a real filesystem.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml

from harness.processes import REPO_ROOT, Proc, wait_for, wait_until_serving
from harness.services import Coordinator, RedisServer, Services
from layertap.engines.sglang import free_port
from tests.core.datasets import conversation_rows, write_jsonl
from tests.service_fixtures import quick_services

TMPFS_BYTES = 256 << 20
FLOOR_BYTES = 96 << 20  # the worker pauses below this much free space...
RESUME_BYTES = 128 << 20  # ...and goes on above this
LAYERS = [1, 3, 5]


@dataclass
class Stack:
    services: Services
    coordinator: Coordinator
    worker: Proc
    worker_metrics: str
    prometheus: str
    output_root: Path
    on_tmpfs: bool
    data_dir: Path

    def dataset(self, rows: int, seed: int, bad_lines: dict[int, str] | None = None) -> Path:
        """``rows`` conversations (~20-200 tokens), plus ``bad_lines`` (position -> raw line) that fail to parse."""
        path = self.data_dir / f"data-{rows}-{seed}.jsonl"
        return write_jsonl(path, conversation_rows(rows, seed=seed, max_words=18), bad_lines)

    def submit(self, model: Path, data: Path, **extra) -> str:
        body = {"model": str(model), "data": str(data), "layers": LAYERS, "shard_size": 25, "engine": {"batch_size": 1}}
        body.update(extra)
        with self.coordinator.client() as api:
            reply = api.post("/jobs", json=body)
        assert reply.status_code == 201, reply.text
        return reply.json()["job_id"]

    def get(self, path: str) -> dict:
        with self.coordinator.client() as api:
            reply = api.get(path)
        assert reply.status_code == 200, reply.text
        return reply.json()

    def wait_job(self, job_id: str, check, what: str, timeout: float = 180) -> dict:
        """Poll ``/jobs/{id}`` until ``check(job)`` holds."""

        def reached() -> dict | None:
            job = self.get(f"/jobs/{job_id}")
            assert job["state"] != "failed", job
            return job if check(job) else None

        return wait_for(reached, timeout=timeout, what=what, every=0.1)

    def cancel(self, job_id: str) -> dict:
        """Cancel the job and wait until its worker let go of it (nothing running, the worker idle)."""
        with self.coordinator.client() as api:
            assert api.post(f"/jobs/{job_id}/cancel").status_code == 200

        def settled() -> bool:
            workers = self.get("/workers")["workers"]
            return all(w["state"] == "idle" for w in workers) and not self.get(f"/jobs/{job_id}")["shards"].get(
                "running"
            )

        wait_for(settled, timeout=60, what=f"job {job_id} to stop running", every=0.1)
        return self.get(f"/jobs/{job_id}")

    def query(self, promql: str) -> list[dict]:
        """An instant query against the test's Prometheus; fails the test on a PromQL error."""
        reply = httpx.get(f"{self.prometheus}/api/v1/query", params={"query": promql}, timeout=10).json()
        assert reply["status"] == "success", (promql, reply)
        return reply["data"]["result"]


def mount_tmpfs(path: Path, size: int) -> bool:
    """Mount a size-limited tmpfs on ``path``; False where this user may not."""
    if shutil.which("mount") is None:
        return False
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True, timeout=30)  # fmt: skip
    return done.returncode == 0


def start_prometheus(services: Services, folder: Path, targets: dict[str, str]) -> str:
    """A real Prometheus scraping ``targets`` (job name -> host:port) every second, with monitoring/rules.yml."""
    port = free_port()
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(REPO_ROOT / "monitoring" / "rules.yml")],
        "scrape_configs": [{"job_name": job, "static_configs": [{"targets": [t]}]} for job, t in targets.items()],
    }
    (folder / "prometheus.yml").write_text(yaml.safe_dump(config))
    cmd = ["prometheus", f"--config.file={folder / 'prometheus.yml'}", f"--storage.tsdb.path={folder / 'tsdb'}",
           f"--web.listen-address=127.0.0.1:{port}"]  # fmt: skip
    proc = Proc("prometheus", cmd, dict(os.environ), services.logs / "prometheus.log").start()
    services.procs.append(proc)
    url = f"http://127.0.0.1:{port}"
    wait_until_serving(proc, f"{url}/-/ready", timeout=60, what="prometheus to be ready")
    return url


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path) -> Iterator[Stack]:
    base = tmp_path_factory.mktemp("monitoring")
    for name in ("logs", "outputs", "data", "redis", "prometheus"):
        (base / name).mkdir()
    output_root = base / "outputs"
    on_tmpfs = mount_tmpfs(output_root, TMPFS_BYTES)
    services = quick_services(base / "logs")
    redis = RedisServer(base / "redis", free_port(), ["--save", "", "--appendonly", "no"]).start()
    metrics_port = free_port()
    started = False
    try:
        worker = services.worker(
            "mon1", redis.url, wait=False, LAYERTAP_METRICS_PORT=str(metrics_port), LAYERTAP_METRICS_HOST="127.0.0.1",
            LAYERTAP_MIN_FREE_BYTES=str(FLOOR_BYTES), LAYERTAP_RESUME_FREE_BYTES=str(RESUME_BYTES),
            LAYERTAP_DISK_CHECK_S="0.2",
        )  # fmt: skip
        coordinator = services.coordinator(redis.url, output_root, LAYERTAP_MIN_FREE_BYTES=str(FLOOR_BYTES))
        services.wait_ready(worker)
        port = coordinator.url.rsplit(":", 1)[1]
        prometheus = start_prometheus(
            services,
            base / "prometheus",
            {"layertap-coordinator": f"127.0.0.1:{port}", "layertap-worker": f"127.0.0.1:{metrics_port}"},
        )
        started = True
        yield Stack(services, coordinator, worker, f"http://127.0.0.1:{metrics_port}/metrics", prometheus,
                    output_root, on_tmpfs, base / "data")  # fmt: skip
    finally:
        if not started:
            print(services.log_tails())
        services.stop_all()
        redis.stop(signal.SIGKILL)
        if on_tmpfs:
            subprocess.run(["umount", "-l", str(output_root)], capture_output=True, timeout=30)
