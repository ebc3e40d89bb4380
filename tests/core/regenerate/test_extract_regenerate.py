"""`layertap extract --engine sglang --regenerate` on real CPU capture servers (float32): the stored regenerated
turns are HF transformers' greedy ``generate`` of the same prompts; the stored ids are HF's own chat template applied
to the stored regenerated rows, masked on the regenerated turns only; the states equal the HF float32 reference of
them; rows with nothing to regenerate are refused per row; cut turns are kept and counted, or dropped; a run killed
mid-generation resumes with every sample once and the committed samples' text unchanged; a round of rows is
regenerated whole before any of its samples is captured."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from layertap.data.chat import ChatTokenizer
from layertap.engines.factory import sglang_engine_factory
from layertap.models.folder import ModelFolder
from layertap.pipeline import run_extraction
from layertap.regenerate import AHEAD_BATCHES, TurnFormat
from layertap.settings import RunSettings
from layertap.spec import ExtractionSpec
from layertap.store.index import load_index_candidates
from layertap.store.store import REGENERATED, OutputStore
from layertap.verify import verify_store
from tests.core.regenerate.test_sglang_regenerate import ROWS, hf_greedy, model_eos
from tests.core.test_kimi_k25_run import LAYERS, check_states_equal_hf

pytestmark = pytest.mark.sglang

REFUSED = [
    {"id": "pre", "text": "<s>already templated</s>"},
    {"id": "ids", "input_ids": [1, 2, 3]},
    {"id": "nouser", "messages": [{"role": "system", "content": "Be brief."}, {"role": "assistant", "content": "Hi."}]},
]


@pytest.fixture(params=["llama", "kimi-k2.5"])
def served(request, sglang_servers, tiny_llama, tiny_kimi25):
    """(folder, running CPU capture server capturing LAYERS, extra CLI args) for each tiny model."""
    if request.param == "llama":
        return tiny_llama, sglang_servers(tiny_llama, layers=LAYERS), ()
    server = sglang_servers(tiny_kimi25, layers=LAYERS, extra_args=("--trust-remote-code",))
    return tiny_kimi25, server, ("--trust-remote-code",)


def extract(cli, folder: Path, server, data: Path, out: Path, *args: object) -> subprocess.CompletedProcess:
    return cli("extract", "--model", folder, "--data", data, "--layers", ",".join(map(str, LAYERS)), "--out", out,
               "--store-dtype", "float32", "--engine", "sglang", "--server-url", server.url, "--dump-root",
               server.dump_root, "--in-flight", "4", *args, timeout=900)  # fmt: skip


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def stored_rows(out: Path) -> dict[str, dict]:
    return {row["id"]: row for row in map(json.loads, (out / REGENERATED).read_text().splitlines())}


@pytest.mark.parametrize("mode", ["last", "all"])
def test_extract_regenerates_as_hf_generate_and_captures_the_regenerated_text(
    layertap_cli, served, hf_reference, tmp_path, mode: str
) -> None:
    folder, server, args = served
    data = write_rows(tmp_path / "rows.jsonl", ROWS + REFUSED)
    out = tmp_path / "out"
    cli = extract(layertap_cli, folder, server, data, out, "--regenerate", mode, "--temperature", "0",
                  "--max-new-tokens", "12", "--max-bad-rows", "3", *args)  # fmt: skip
    assert cli.returncode == 0, cli.stderr[-3000:]
    check = verify_store(out, trust_remote_code=True)
    assert check.ok, check.problems
    store = OutputStore.open_existing(out)
    assert store.manifest.generation == {"mode": mode, "max_new_tokens": 12, "temperature": 0.0, "top_p": 1.0,
                                         "seed": 0, "drop_truncated": False}  # fmt: skip
    assert sorted((e["sample_id"], e["kind"]) for e in store.errors()) == [
        ("ids", "regenerate"), ("nouser", "regenerate"), ("pre", "regenerate")
    ]  # fmt: skip

    stored = stored_rows(out)
    records = {r.sample_id: r for r in store.records().values()}
    assert sorted(stored) == sorted(records) == sorted(r["id"] for r in ROWS)
    chat = ChatTokenizer(ModelFolder.read(folder).load_tokenizer(trust_remote_code=True))
    turn_format = TurnFormat.of(chat)
    stop = sorted(model_eos(folder) | set(turn_format.stop_token_ids(chat)))
    model, tokenizer = hf_reference(folder).model, chat.tokenizer
    for row in ROWS:
        got = stored[row["id"]]
        want = hf_greedy(model, tokenizer, row, mode, 12, stop)
        assert [i for i, m in enumerate(got["messages"]) if "finish_reason" in m] == [k for k, *_ in want]
        for k, prompt, new, finish in want:
            assert got["messages"][k] == {**turn_format.message(chat, prompt, new, finish), "finish_reason": finish}
        # What a trainer tokenizes: HF's own template applied to the stored row gives the stored ids.
        messages = [{k: v for k, v in m.items() if k != "finish_reason"} for m in got["messages"]]
        text = tokenizer.apply_chat_template(messages, tokenize=False)
        tensors = store.format.load(out / records[row["id"]].file)
        ids = tensors["input_ids"].flatten().tolist()
        assert ids == tokenizer(text, add_special_tokens=False)["input_ids"]
        mask = tensors["loss_mask"].flatten()
        first_prompt = want[0][1]
        assert not mask[: len(first_prompt)].any() and mask[len(first_prompt) :].any()  # regenerated turns only
    assert check_states_equal_hf(out, folder, hf_reference) == len(ROWS)


def test_kimi_k25_regenerates_under_its_thinking_switch(
    layertap_cli, sglang_servers, tiny_kimi25, hf_reference, tmp_path
) -> None:
    """Kimi-K2.5 thinks by default; ``--chat-template-kwargs '{"thinking": false}'`` turns it off, as SGLang's
    ``chat_template_kwargs`` does: each turn's generation prompt ends with an open ``<think>`` or an empty
    ``<think></think>`` (the first turn's prompts differ by that closing id only), the regenerated turns have or lack
    ``reasoning_content``, each is HF's greedy ``generate`` of the same prompt ids (HF's template with the same
    variables), the stored ids are HF's template with them applied to the stored rows, verify is clean and the
    manifest records the variables."""
    server = sglang_servers(tiny_kimi25, layers=LAYERS, extra_args=("--trust-remote-code",))
    data = write_rows(tmp_path / "rows.jsonl", ROWS)
    tokenizer = ModelFolder.read(tiny_kimi25).load_tokenizer(trust_remote_code=True)
    model = hf_reference(tiny_kimi25).model
    first_prompts = {}
    for variables in ({}, {"thinking": False}):
        thinks = variables.get("thinking", True)
        out = tmp_path / f"thinking-{thinks}"
        flags = ["--chat-template-kwargs", json.dumps(variables)] if variables else []
        cli = extract(layertap_cli, tiny_kimi25, server, data, out, "--regenerate", "all", "--max-new-tokens", "12",
                      "--trust-remote-code", *flags)  # fmt: skip
        assert cli.returncode == 0, cli.stderr[-3000:]
        check = verify_store(out, trust_remote_code=True)
        assert check.ok, check.problems
        store = OutputStore.open_existing(out)
        assert store.manifest.chat_template_kwargs == variables
        chat = ChatTokenizer(tokenizer, template_kwargs=variables)
        fmt = TurnFormat.of(chat)
        block = [fmt.think_open] if thinks else [fmt.think_open, fmt.think_close]  # how each prompt ends
        stop = sorted(model_eos(tiny_kimi25) | set(fmt.stop_token_ids(chat)))
        stored, records = stored_rows(out), {r.sample_id: r for r in store.records().values()}
        assert sorted(stored) == sorted(records) == sorted(r["id"] for r in ROWS)
        for row in ROWS:
            got = stored[row["id"]]
            want = hf_greedy(model, tokenizer, row, "all", 12, stop, **variables)
            assert [i for i, m in enumerate(got["messages"]) if "finish_reason" in m] == [k for k, *_ in want]
            for k, prompt, new, finish in want:
                assert prompt[-len(block) :] == block
                assert got["messages"][k] == {**fmt.message(chat, prompt, new, finish), "finish_reason": finish}
                assert ("reasoning_content" in got["messages"][k]) == thinks, got["messages"][k]
            first_prompts.setdefault(row["id"], []).append(want[0][1])
            messages = [{k: v for k, v in m.items() if k != "finish_reason"} for m in got["messages"]]
            text = tokenizer.apply_chat_template(messages, tokenize=False, **variables)
            ids = store.format.load(out / records[row["id"]].file)["input_ids"].flatten().tolist()
            assert ids == tokenizer(text, add_special_tokens=False)["input_ids"]
        assert check_states_equal_hf(out, tiny_kimi25, hf_reference) == len(ROWS)
    think_close = tokenizer.convert_tokens_to_ids("</think>")
    assert all(off == [*on, think_close] for on, off in first_prompts.values()), first_prompts


def test_truncated_turns_are_kept_and_counted_or_dropped(layertap_cli, sglang_servers, tiny_llama, tmp_path) -> None:
    server = sglang_servers(tiny_llama, layers=LAYERS)
    data = write_rows(tmp_path / "rows.jsonl", ROWS)
    kept = extract(layertap_cli, tiny_llama, server, data, tmp_path / "kept", "--regenerate", "all",
                   "--max-new-tokens", "2")  # fmt: skip
    assert kept.returncode == 0, kept.stderr[-3000:]
    (report,) = (json.loads(p.read_text()) for p in (tmp_path / "kept" / "reports").glob("run-*.json"))
    assert report["turns_cut"] == 5 and report["generated_tokens"] == 10 and len(report["computed"]) == 3
    assert all(m.get("finish_reason") in (None, "length") for r in stored_rows(tmp_path / "kept").values()
               for m in r["messages"])  # fmt: skip
    # verify holds each sample to its stored row: a row whose text is not the sample's is reported.
    (log,) = (tmp_path / "kept" / "regenerated").glob("*.jsonl")
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    lines[0]["row"]["messages"][-1]["content"] += " edited"
    log.write_text("".join(json.dumps(line) + "\n" for line in lines))
    check = verify_store(tmp_path / "kept")
    assert [p for p in check.problems if "not its regenerated row" in p] and len(check.problems) == 1, check.problems
    dropped = extract(layertap_cli, tiny_llama, server, data, tmp_path / "dropped", "--regenerate", "all",
                      "--max-new-tokens", "2", "--drop-truncated")  # fmt: skip
    assert dropped.returncode == 1, dropped.stderr[-3000:]
    errors = OutputStore.open_existing(tmp_path / "dropped").errors()
    assert [e["kind"] for e in errors] == ["generation_truncated"] * 3


def test_hf_engine_is_refused(layertap_cli, tiny_llama, tmp_path) -> None:
    data = write_rows(tmp_path / "rows.jsonl", ROWS)
    cli = layertap_cli("extract", "--model", tiny_llama, "--data", data, "--layers", "1,2,4", "--out", tmp_path / "o",
                       "--regenerate", "last")  # fmt: skip
    assert cli.returncode == 2 and "--engine sglang" in " ".join(cli.stderr.split())
    assert not (tmp_path / "o").exists()


def test_resume_after_sigkill_mid_generation_keeps_committed_text(
    layertap_cli, sglang_servers, tiny_llama, tmp_path
) -> None:
    server = sglang_servers(tiny_llama, layers=LAYERS)
    rows = [{"id": f"r{i}", "messages": [{"role": "user", "content": f"Count to {i}."},
                                         {"role": "assistant", "content": "One."}]} for i in range(40)]  # fmt: skip
    data = write_rows(tmp_path / "rows.jsonl", rows)
    out = tmp_path / "out"
    args = ["extract", "--model", tiny_llama, "--data", data, "--layers", "1,2,4", "--out", out, "--store-dtype",
            "float32", "--engine", "sglang", "--server-url", server.url, "--dump-root", server.dump_root,
            "--in-flight", "2", "--regenerate", "all", "--temperature", "1.0", "--seed", "7",
            "--max-new-tokens", "48", "--generation-in-flight", "1"]  # fmt: skip
    first_round = AHEAD_BATCHES  # rows of the first round (one in flight); the next generates once it is captured
    proc = subprocess.Popen([*layertap_cli.argv, *map(str, args)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 600
        while len(OutputStore.open_existing(out).records() if (out / "manifest.json").exists() else {}) < first_round:
            assert proc.poll() is None and time.monotonic() < deadline, "the run ended before it could be killed"
            time.sleep(0.2)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
    store = OutputStore.open_existing(out)
    before = store.regenerated_rows(store.records())
    assert first_round <= len(before) < len(rows)
    cli = layertap_cli(*args, timeout=900)
    assert cli.returncode == 0, cli.stderr[-3000:]
    # The CPU server cannot sample with seeds (test_sglang_regenerate): the run says so, the manifest records it.
    assert "without --enable-deterministic-inference" in cli.stderr
    assert store.manifest.engine["server"]["deterministic"] is False
    after = stored_rows(out)
    assert sorted(after) == sorted(r["id"] for r in rows)  # every sample once
    assert all(after[sid] == row for sid, row in before.items())  # committed text never regenerated
    assert all(len(load_index_candidates(out)[sid]) == 1 for sid in before)  # nor committed again
    store = OutputStore.open_existing(out)
    assert len(store.records()) == len(rows) and not store.errors()
    check = verify_store(out, data=data)
    assert check.ok, check.problems


def test_a_round_is_regenerated_whole_before_any_of_its_captures(sglang_servers, tiny_llama, tmp_path) -> None:
    """Rows go in rounds of `AHEAD_BATCHES` x the generation in flight (2 here: 32 rows, then 8): no sample of a
    round is committed before every row of it is regenerated. Captured as each row ended, every capture was a
    prefill between the decode steps of the rows still generating (0.76 of SGLang's own generation rate on an H200)."""
    server = sglang_servers(tiny_llama, layers=LAYERS)
    rows = [{"id": f"r{i}", "messages": [{"role": "user", "content": f"Count to {i}."},
                                         {"role": "assistant", "content": "One."}]} for i in range(40)]  # fmt: skip
    spec = ExtractionSpec(model=tiny_llama, data=write_rows(tmp_path / "rows.jsonl", rows), layers=LAYERS,
                          store_dtype="float32", regenerate="all", max_new_tokens=6, temperature=0.0)  # fmt: skip
    settings = RunSettings(server_url=server.url, in_flight=4, generation_in_flight=2)
    make = sglang_engine_factory(spec, settings, job="rounds", dump_root=server.dump_root, log_path=tmp_path / "x.log")
    events: list[str] = []

    class Recorder:  # the run's progress sink: what the CLI's bar and a worker's metrics are told, in order
        def start(self, total: int, already_done: int) -> None: ...

        def advance(self, samples: int, tokens: int) -> None:
            events.extend(["commit"] * samples)

        def generated(self, tokens: int) -> None:
            events.append("generated")

    report = run_extraction(spec, tmp_path / "out", make, progress=Recorder())
    first_round = AHEAD_BATCHES * 2
    assert report.failed == 0 and sorted(report.computed) == sorted(r["id"] for r in rows)
    assert events.count("generated") == events.count("commit") == len(rows)
    assert events[:first_round] == ["generated"] * first_round, events  # round one whole, before its first commit
    last_generated = len(events) - 1 - events[::-1].index("generated")
    assert events[last_generated + 1 :].count("commit") >= len(rows) - first_round  # round two after its generation
