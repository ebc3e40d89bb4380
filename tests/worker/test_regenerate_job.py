"""A job that regenerates through ``POST /jobs`` and Celery workers on CPU SGLang capture servers: every sample stored
once, its regenerated row beside it (greedy: the text a clean run of the `Regenerator` on the same model gives), the
counts on ``GET /jobs/{id}``, also when a worker is SIGKILLed mid-generation and another takes its shard, when the
worker's own server is SIGKILLed mid-generation (restarted in place, as a capture's), when the coordinator is
SIGKILLed and restarted meanwhile, and for ``last`` on the tiny Kimi-K2.5 wrapper (model code run by the workers); over
every message shape (tool calls, reasoning, control characters) a job stores the rows a CLI run stores."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from harness.processes import Proc, wait_for
from harness.sglang import cpu_server_env
from layertap.data.chat import ChatTokenizer
from layertap.data.rows import parse_row
from layertap.engines.sglang.process import SGLangServer
from layertap.engines.sglang.session import ServerSession
from layertap.models.folder import ModelFolder
from layertap.regenerate import GenerationSettings, Regenerated, Regenerator, RowJob
from layertap.settings import COMMIT_THREADS
from layertap.store.index import INDEX_DIR, REGENERATED_DIR, read_json_lines
from layertap.store.store import REGENERATED, OutputStore
from layertap.verify import verify_store
from tests.core.datasets import conversation_rows, write_jsonl
from tests.core.regenerate.test_turns import ANSWERS, SHAPES, sample_of
from tests.sglang_fixtures import DEFAULT_LAYERS, TEST_SERVER_ARGS
from tests.worker.conftest import SHARD_SIZE

pytestmark = pytest.mark.sglang

ROWS = 100
MAX_NEW_TOKENS = 8
KIMI_ROWS = 12


def chat_rows() -> list[dict]:
    """The regenerating jobs' conversations (1 or 2 assistant turns each)."""
    return conversation_rows(ROWS, seed=2, max_words=18)


@pytest.fixture
def chats(tmp_path: Path) -> Path:
    return write_jsonl(tmp_path / "chats.jsonl", chat_rows())


def greedy_rows(url: str, model: Path, rows: list[dict], mode: str, *, trust_remote_code: bool = False) -> dict:
    """sample id -> the row a clean run of the `Regenerator` alone regenerates greedily on the server at ``url``."""
    chat = ChatTokenizer(ModelFolder.read(model).load_tokenizer(trust_remote_code))
    settings = GenerationSettings(mode=mode, max_new_tokens=MAX_NEW_TOKENS, temperature=0.0)
    session = ServerSession(SGLangServer(url=url))
    regen = Regenerator(session, chat, settings, job="clean")
    try:
        out = list(regen.regenerate_many(RowJob(i, r["id"], parse_row(i, r)) for i, r in enumerate(rows)))
    finally:
        regen.close()
        session.close()
    assert all(isinstance(r, Regenerated) for r in out), out
    return {r.sample_id: r.record(sample_of(chat, r)) for r in out}


@pytest.fixture(scope="module")
def clean_rows(sglang_servers, tiny_llama) -> dict:
    """The greedy rows of ``chats`` from a clean run on the CPU server the attached workers use."""
    server = sglang_servers(tiny_llama, layers=DEFAULT_LAYERS["llama"])
    return greedy_rows(server.url, tiny_llama, chat_rows(), "all")


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


def check_regenerated_job(job: dict, chats: Path, clean: dict, *, mode: str = "all", trust_remote_code: bool = False):
    """Every row's sample stored once with exactly one regenerated row, the ``clean`` run's (greedy: the same text,
    a ``finish_reason`` on each regenerated turn), verify against the data clean (stored ids = the regenerated row
    through the template), the job's generation counts and the manifest's generation settings."""
    out = Path(job["out"])
    given = {r["id"]: r["messages"] for r in read_json_lines(chats)}
    n = len(given)
    assert (job["samples_done"], job["samples_failed"], job["samples_total"]) == (n, 0, n)
    report = verify_store(out, data=chats, trust_remote_code=trust_remote_code)
    assert report.ok and report.complete and report.samples == n, report.problems
    records = OutputStore.open_existing(out).records()
    rows = list(read_json_lines(out / REGENERATED))
    assert len(records) == n and sorted(r["id"] for r in rows) == sorted(records)
    assert {r["id"]: r for r in rows} == clean
    for row in rows:
        turns = [m for m in row["messages"] if m["role"] == "assistant"]
        assert len(row["messages"]) == len(given[row["id"]]) and turns
        regenerated = turns if mode == "all" else turns[-1:]
        assert all(m["finish_reason"] in ("stop", "length") for m in regenerated), row
        assert all("finish_reason" not in m for m in turns[: len(turns) - len(regenerated)]), row
    generation = job["generation"]
    assert generation["rows"] == n and 0 < generation["tokens"] <= MAX_NEW_TOKENS * sum(map(len, given.values()))
    assert generation["cut_turns"] == sum(m.get("finish_reason") == "length" for r in rows for m in r["messages"])
    settings = json.loads((out / "manifest.json").read_text())["generation"]
    assert (settings["mode"], settings["max_new_tokens"], settings["temperature"]) == (mode, MAX_NEW_TOKENS, 0.0)
    assert settings["drop_truncated"] is False


def test_a_regenerating_job_over_two_workers_stores_each_sample_once_with_its_regenerated_row(
    regenerating_cluster, tiny_llama, chats, clean_rows
) -> None:
    cluster, _ = regenerating_cluster
    job = cluster.wait_state(submit_regenerating(cluster, tiny_llama, chats), "done")
    check_regenerated_job(job, chats, clean_rows)
    servers = json.loads((Path(job["out"]) / "manifest.json").read_text())["servers"]
    assert {s["writer"].split("-")[0] for s in servers} <= {"w1", "w2"}


def test_a_worker_sigkilled_mid_shard_of_a_regenerating_job_leaves_every_sample_once_and_no_row_without_its_sample(
    regenerating_cluster, tiny_llama, chats, clean_rows
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
    check_regenerated_job(job, chats, clean_rows)


def test_a_job_stores_the_rows_a_cli_run_stores_for_every_message_shape(
    regenerating_cluster, layertap_cli, sglang_llama, tiny_llama, tmp_path
) -> None:
    """The shapes set (plain, system, single and parallel tool calls, reasoning, U+2028/\\r/control characters, a row
    that only calls tools) through ``POST /jobs`` and the workers, and through ``layertap extract`` on the same server
    (the same regenerate step): the same regenerated rows, ids and loss masks, the same refused row; both verify."""
    cluster, _ = regenerating_cluster
    settings = {"regenerate": "all", "max_new_tokens": MAX_NEW_TOKENS, "temperature": 0.0, "max_bad_rows": "1"}
    job = cluster.wait_state(cluster.submit(tiny_llama, SHAPES, **settings), "done")
    cli = layertap_cli("extract", "--model", tiny_llama, "--data", SHAPES, "--layers", "1,3,5", "--out", tmp_path / "cli",
                       "--engine", "sglang", "--server-url", sglang_llama.url, "--dump-root", sglang_llama.dump_root,
                       "--regenerate", "all", "--max-new-tokens", str(MAX_NEW_TOKENS), "--temperature", "0",
                       "--max-bad-rows", "1", timeout=900)  # fmt: skip
    assert cli.returncode == 0, cli.stderr[-3000:]
    job_store, cli_store = (OutputStore.open_existing(p) for p in (Path(job["out"]), tmp_path / "cli"))
    for store in (job_store, cli_store):
        report = verify_store(store.root)
        assert report.ok and report.samples == len(ANSWERS), report.problems
        assert [(e["sample_id"], e["kind"]) for e in store.errors()] == [("only-tool-calls", "regenerate")]
    rows = list(read_json_lines(cli_store.root / REGENERATED))
    assert list(read_json_lines(job_store.root / REGENERATED)) == rows and [r["id"] for r in rows] == list(ANSWERS)

    def samples(store: OutputStore) -> dict[str, tuple]:
        return {r.sample_id: (r.index, r.num_tokens, r.ids_sha256, r.mask_runs) for r in store.records().values()}

    assert samples(job_store) == samples(cli_store)
    assert job_store.manifest.generation == cli_store.manifest.generation


def generated_rows(cluster, job_id: str) -> int:
    """Rows the job's shards have counted as regenerated (read from Redis: works while the coordinator is down)."""
    return sum(int(shard.get("generated_rows", 0)) for shard in cluster.shards(job_id))


def test_the_coordinator_sigkilled_mid_generation_and_restarted_leaves_the_job_to_complete_as_a_clean_run(
    regenerating_cluster, tiny_llama, chats, clean_rows
) -> None:
    cluster, _ = regenerating_cluster
    job_id = submit_regenerating(cluster, tiny_llama, chats)
    wait_for(lambda: 1 <= generated_rows(cluster, job_id) < ROWS, timeout=120, what="rows regenerated, others not yet",
             every=0.01)  # fmt: skip
    cluster.coordinator.proc.kill(signal.SIGKILL)
    cluster.restart_coordinator()
    check_regenerated_job(cluster.wait_state(job_id, "done"), chats, clean_rows)


# --- A worker's own server (launched by the worker, as in production without LAYERTAP_SERVER_URL). ---


@pytest.fixture
def own_server_env(cuda_stub_dir, sglang_python, tmp_path: Path) -> dict[str, str]:
    """A worker's environment that has it launch its own CPU capture server (the test servers' flags), logging each
    request's arrival and end as JSON lines under ``tmp_path / "requests"`` (`generations_in_flight` reads them)."""
    requests = tmp_path / "requests"
    args = (*TEST_SERVER_ARGS, "--log-requests", "--log-requests-level", "0", "--log-requests-format", "json",
            "--log-requests-target", str(requests))  # fmt: skip
    return {"LAYERTAP_ENGINE": "sglang", "LAYERTAP_DUMP_ROOT": str(tmp_path / "dumps"),
            "LAYERTAP_SGLANG_PYTHON": str(sglang_python), "LAYERTAP_SGLANG_ARGS": " ".join(args),
            **cpu_server_env(cuda_stub_dir)}  # fmt: skip


def generations_in_flight(requests: Path) -> set[str]:
    """rids of generation requests (``gen.``, `generation_rid`) the server has received and not answered."""
    events: dict[str, set[str]] = {"request.received": set(), "request.finished": set()}
    for path in requests.glob("*.log"):
        for line in path.read_text().splitlines():
            try:
                event = json.loads(line[line.index("{") :])
            except ValueError:
                continue  # a line being written
            if event.get("event") in events and str(event.get("rid")).startswith("gen."):
                events[event["event"]].add(event["rid"])
    return events["request.received"] - events["request.finished"]


def launched_server(worker: Proc) -> int:
    """The pid of the SGLang server ``worker`` launched, the leader of its process group (scheduler, detokenizer)."""

    def child() -> int | None:
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
                cmdline = (stat.parent / "cmdline").read_bytes()
            except (OSError, IndexError, ValueError):
                continue  # a process that ended meanwhile
            if ppid == worker.pid and b"sglang_patch.launch" in cmdline:
                return int(stat.parent.name)
        return None

    return wait_for(child, timeout=120, what=f"{worker.name}'s SGLang server process", every=0.2)


def sigkill_mid_generation(group: int, requests: Path) -> set[str]:
    """SIGKILL process group ``group`` (a server) while it holds generation requests: it is frozen (SIGSTOP) until
    the request log shows one received and not answered, thawed otherwise; returns those rids."""

    def frozen() -> set[str] | None:
        if not generations_in_flight(requests):
            return None
        os.killpg(group, signal.SIGSTOP)
        if held := generations_in_flight(requests):
            return held
        os.killpg(group, signal.SIGCONT)
        return None

    held = wait_for(frozen, timeout=300, what="a generation in flight on the server", every=0.01)
    os.killpg(group, signal.SIGKILL)
    return held


def test_the_workers_own_server_sigkilled_mid_generation_is_restarted_and_the_job_stores_a_clean_runs_text(
    start_cluster, own_server_env, tiny_llama, clean_rows, tmp_path
) -> None:
    rows = chat_rows()[: 2 * SHARD_SIZE]  # one worker: two shards are enough
    chats = write_jsonl(tmp_path / "chats.jsonl", rows)
    cluster = start_cluster(workers=0)
    worker = cluster.add_worker("w1", **own_server_env)
    job_id = submit_regenerating(cluster, tiny_llama, chats)
    held = sigkill_mid_generation(launched_server(worker), tmp_path / "requests")

    job = cluster.wait_state(job_id, "done")
    assert held and not generations_in_flight(tmp_path / "requests") - held  # the restarted server answered the rest
    check_regenerated_job(job, chats, {r["id"]: clean_rows[r["id"]] for r in rows})
    # Restarted in place, as for a capture: no shard was given up and run again, no sample stored twice.
    assert all(int(shard["attempts"]) == 1 for shard in cluster.shards(job_id))
    # Once: the server restarted from a generation thread outlived that thread's pool (it was SIGKILLed with it).
    assert worker.log_path.read_text().count("restarting it and resending its requests") == 1


# --- ``last`` on the tiny Kimi-K2.5 wrapper: the folder's tokenizer and model are code the workers must run. ---


def test_a_job_regenerating_the_last_turn_on_kimi25_stores_a_clean_runs_text(
    start_cluster, sglang_servers, tiny_kimi25, tmp_path
) -> None:
    server = sglang_servers(tiny_kimi25, layers=DEFAULT_LAYERS["kimi-k2"], extra_args=("--trust-remote-code",))
    rows = conversation_rows(KIMI_ROWS, seed=5, max_words=12)
    chats = write_jsonl(tmp_path / "chats.jsonl", rows)
    cluster = start_cluster(workers=0, LAYERTAP_ALLOW_REMOTE_CODE="1")
    cluster.add_worker("w1", LAYERTAP_ENGINE="sglang", LAYERTAP_SERVER_URL=server.url,
                       LAYERTAP_DUMP_ROOT=str(server.dump_root), LAYERTAP_ALLOW_REMOTE_CODE="1")  # fmt: skip
    job_id = cluster.submit(tiny_kimi25, chats, layers=list(DEFAULT_LAYERS["kimi-k2"]), trust_remote_code=True,
                            regenerate="last", max_new_tokens=MAX_NEW_TOKENS, temperature=0.0)  # fmt: skip
    job = cluster.wait_state(job_id, "done")
    clean = greedy_rows(server.url, tiny_kimi25, rows, "last", trust_remote_code=True)
    check_regenerated_job(job, chats, clean, mode="last", trust_remote_code=True)
