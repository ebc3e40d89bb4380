"""`layertap extract --engine sglang --regenerate` on real CPU capture servers (float32): the stored regenerated
turns are HF transformers' greedy ``generate`` of the same prompts; the stored ids are HF's own chat template applied
to the stored regenerated rows, masked on the regenerated turns only (a cut turn without the end of turn it never
produced); the states equal the HF float32 reference of them; over every message shape (tool calls single and
parallel, reasoning, Kimi-K2.5's thinking on and off, U+2028/U+2029/\r/control characters) each regenerated turn is
HF's ``generate`` on the stored messages before it and each stored conversation is coherent (a tool result answers a
call it holds); rows with nothing to regenerate are refused per row; cut turns are kept and counted, or dropped; a run
killed mid-generation resumes with every sample once and the committed samples' text unchanged; a round of rows is
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
from layertap.data.rows import parse_row
from layertap.engines.factory import sglang_engine_factory
from layertap.models.folder import ModelFolder
from layertap.pipeline import run_extraction
from layertap.regenerate import AHEAD_BATCHES, RULES, TurnFormat
from layertap.settings import RunSettings
from layertap.spec import ExtractionSpec
from layertap.store.index import load_index_candidates, read_json_lines
from layertap.store.store import REGENERATED, OutputStore
from layertap.verify import verify_store
from tests.core.regenerate.test_sglang_regenerate import ROWS, hf_generate, hf_greedy, model_eos
from tests.core.regenerate.test_turns import ANSWERS, SHAPES, masked_runs, shape_rows
from tests.core.test_kimi_k25_run import LAYERS, check_states_equal_hf
from tests.sglang_fixtures import DEFAULT_LAYERS

pytestmark = pytest.mark.sglang

REFUSED = [
    {"id": "pre", "text": "<s>already templated</s>"},
    {"id": "ids", "input_ids": [1, 2, 3]},
    {"id": "nouser", "messages": [{"role": "system", "content": "Be brief."}, {"role": "assistant", "content": "Hi."}]},
]


@pytest.fixture(params=["llama", "kimi-k2.5"])
def served(request, sglang_servers, tiny_llama, tiny_kimi25):
    """(folder, running CPU capture server, extra CLI args) for each tiny model. The Llama's is the session's shared
    one (its default layers: which layers are captured is no concern of regeneration's), Kimi-K2.5's captures LAYERS."""
    if request.param == "llama":
        return tiny_llama, sglang_servers(tiny_llama, layers=DEFAULT_LAYERS["llama"]), ()
    server = sglang_servers(tiny_kimi25, layers=LAYERS, extra_args=("--trust-remote-code",))
    return tiny_kimi25, server, ("--trust-remote-code",)


def extract(cli, folder: Path, server, data: Path, out: Path, *args: object) -> subprocess.CompletedProcess:
    return cli("extract", "--model", folder, "--data", data, "--layers", ",".join(map(str, server.layers)), "--out", out,
               "--store-dtype", "float32", "--engine", "sglang", "--server-url", server.url, "--dump-root",
               server.dump_root, "--in-flight", "4", *args, timeout=900)  # fmt: skip


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def stored_rows(out: Path) -> dict[str, dict]:
    return {row["id"]: row for row in read_json_lines(out / REGENERATED)}


def expected_sample(tokenizer, messages: list[dict], tools, generated: dict[int, list[int]], **variables) -> tuple:
    """The rule for a sample, written apart from the code with HF's ``apply_chat_template``: each regenerated turn
    ``k`` as generated is HF's template of ``messages[:k]`` with the generation prompt, then its new ids decoded, closed
    as the template closes a turn (``</think>`` when it ended while thinking, ``<|im_end|>``). Where HF's template of
    the whole row begins with every turn so, it is the sample; else the last turn as generated is, the messages after
    it left out. -> (the sample's text, the turns it holds as generated: the trained ones, in order, and how many
    messages it holds)."""

    def as_generated(k: int) -> tuple[str, str]:
        prompt = tokenizer.apply_chat_template(messages[:k], tools=tools, tokenize=False, add_generation_prompt=True,
                                               **variables)  # fmt: skip
        body = tokenizer.decode(generated[k]).removesuffix("<|im_end|>")
        closing = ("</think>" if prompt.endswith("<think>") and "</think>" not in body else "") + "<|im_end|>"
        return prompt + body, prompt + body + closing

    full = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, **variables)
    turns = {k: as_generated(k) for k in generated}
    whole = all(full.startswith(closed) for _, closed in turns.values())
    text, held = (full, len(messages)) if whole else (turns[max(turns)][1], max(turns) + 1)
    return text, [k for k, (upto, _) in turns.items() if text.startswith(upto)], held


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
                                         "seed": None, "rules": RULES, "drop_truncated": False}  # fmt: skip
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
        # What a trainer tokenizes: HF's own template applied to the stored row gives the stored ids (Kimi-K2.5's,
        # which drops a thinking turn's reasoning, the last turn as generated: `expected_sample`).
        messages = [{k: v for k, v in m.items() if k != "finish_reason"} for m in got["messages"]]
        text, trained, _ = expected_sample(tokenizer, messages, None, {k: new for k, _, new, _ in want})
        tensors = store.format.load(out / records[row["id"]].file)
        ids = tensors["input_ids"].flatten().tolist()
        assert ids == tokenizer(text, add_special_tokens=False)["input_ids"]
        mask = tensors["loss_mask"].flatten()
        first_prompt = next(prompt for k, prompt, *_ in want if k == trained[0])
        assert not mask[: len(first_prompt)].any() and mask[len(first_prompt) :].any()  # regenerated turns only
        context = [k for k, *_ in want if k not in trained]
        assert [c["turn"] for c in got["regeneration"]["context"]] == context
    assert check_states_equal_hf(out, folder, hf_reference) == len(ROWS)


def coherent(messages: list[dict]) -> bool:
    """Whether each tool result answers a call the conversation holds before it (by its ``tool_call_id``)."""
    calls: set[str] = set()
    for m in messages:
        calls |= {c["id"] for c in m.get("tool_calls", [])}
        if m["role"] == "tool" and m.get("tool_call_id") not in calls:
            return False
    return True


def check_shapes_store(out: Path, folder: Path, hf_reference, max_new_tokens: int, **variables: object) -> None:
    """The store of `SHAPES` regenerated (``all``, greedy) with the template ``variables``: verify clean, the rules in
    the manifest, the row that only calls tools refused; each stored row regenerated exactly its turns answering in
    text (`ANSWERS`) and kept every other message as given, says so, and is coherent; each regenerated turn is HF's
    greedy ``generate`` on HF's template of the stored messages before it (with the row's tools); the stored ids are
    HF's template of the stored row (the last turn as generated where that template does not hold every turn so:
    `expected_sample`), masked on exactly what each trained turn generated (a cut turn without its closing), the others
    named as context in the row; the states equal HF float32 on those ids."""
    check = verify_store(out, trust_remote_code=True)
    assert check.ok, check.problems
    store = OutputStore.open_existing(out)
    assert store.manifest.generation is not None and store.manifest.generation["rules"] == RULES
    assert [(e["sample_id"], e["kind"]) for e in store.errors()] == [("only-tool-calls", "regenerate")]
    tokenizer = ModelFolder.read(folder).load_tokenizer(trust_remote_code=True)
    chat = ChatTokenizer(tokenizer, template_kwargs=variables)
    fmt = TurnFormat.of(chat)
    stop = sorted(model_eos(folder) | set(fmt.stop_token_ids(chat)))
    model = hf_reference(folder).model
    stored, records = stored_rows(out), {r.sample_id: r for r in store.records().values()}
    given = {row["id"]: parse_row(n, row) for n, row in enumerate(shape_rows()) if row["id"] in ANSWERS}
    assert sorted(stored) == sorted(records) == sorted(given)
    finishes = [m["finish_reason"] for row in stored.values() for m in row["messages"] if "finish_reason" in m]
    assert "length" in finishes  # cut turns are among them (12 new tokens of a random model)
    for sid, row in stored.items():
        messages = [{k: v for k, v in m.items() if k != "finish_reason"} for m in row["messages"]]
        turns = [i for i, m in enumerate(row["messages"]) if "finish_reason" in m]
        assert turns == ANSWERS[sid] == row["regeneration"]["regenerated"], sid
        assert [m for i, m in enumerate(messages) if i not in turns] == [
            m for i, m in enumerate(given[sid].messages) if i not in turns]  # fmt: skip
        assert row.get("tools") == given[sid].tools and coherent(messages), sid
        generated = {}
        for k in turns:
            text = tokenizer.apply_chat_template(messages[:k], tools=row.get("tools"), tokenize=False,
                                                 add_generation_prompt=True, **variables)  # fmt: skip
            prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
            new = hf_generate(model, prompt, max_new_tokens, stop)
            finish = "stop" if new[-1] in stop else "length"
            assert row["messages"][k] == {**fmt.message(chat, prompt, new, finish), "finish_reason": finish}, (sid, k)
            generated[k] = new
        text, trained, held = expected_sample(tokenizer, messages, row.get("tools"), generated, **variables)
        tensors = store.format.load(out / records[sid].file)
        ids, mask = tensors["input_ids"].flatten().tolist(), tensors["loss_mask"].flatten().tolist()
        assert ids == tokenizer(text, add_special_tokens=False)["input_ids"], sid
        assert masked_runs(tokenizer, ids, mask) == [g for k in trained if (g := tokenizer.decode(generated[k]))], sid
        assert [c["turn"] for c in row["regeneration"]["context"]] == [k for k in turns if k not in trained], sid
        assert row["regeneration"]["messages_in_sample"] == held, sid
    assert check_states_equal_hf(out, folder, hf_reference) == len(given)


def test_every_message_shape_is_regenerated_coherently_as_hf_generate(
    layertap_cli, sglang_llama, tiny_llama, hf_reference, tmp_path
) -> None:
    """The shapes set on the tiny Llama (its template renders no reasoning: a kept turn's is dropped as HF drops it)."""
    out = tmp_path / "out"
    cli = layertap_cli("extract", "--model", tiny_llama, "--data", SHAPES, "--layers", "1,3,5", "--out", out,
                       "--store-dtype", "float32", "--engine", "sglang", "--server-url", sglang_llama.url,
                       "--dump-root", sglang_llama.dump_root, "--in-flight", "4", "--regenerate", "all",
                       "--temperature", "0", "--max-new-tokens", "12", "--max-bad-rows", "1", timeout=900)  # fmt: skip
    assert cli.returncode == 0, cli.stderr[-3000:]
    check_shapes_store(out, tiny_llama, hf_reference, 12)


def test_kimi_k25_regenerates_every_shape_under_its_thinking_switch(
    layertap_cli, sglang_servers, tiny_kimi25, tmp_path, hf_reference
) -> None:
    """Kimi-K2.5 thinks by default; ``--chat-template-kwargs '{"thinking": false}'`` turns it off, as SGLang's
    ``chat_template_kwargs`` does: each turn's generation prompt ends with an open ``<think>`` or an empty
    ``<think></think>`` (a first answer's prompts differ by that closing id only), the regenerated turns have or lack
    ``reasoning_content`` (thinking, the sample holds a turn whose reasoning the template drops once a later answer
    follows as context: `expected_sample`); either way the store of the shapes set holds what `check_shapes_store` asks, with the same
    variables, and the manifest records them."""
    server = sglang_servers(tiny_kimi25, layers=LAYERS, extra_args=("--trust-remote-code",))
    tokenizer = ModelFolder.read(tiny_kimi25).load_tokenizer(trust_remote_code=True)
    first_prompts: dict[str, list[list[int]]] = {}
    for variables in ({}, {"thinking": False}):
        thinks = variables.get("thinking", True)
        out = tmp_path / f"thinking-{thinks}"
        flags = ["--chat-template-kwargs", json.dumps(variables)] if variables else []
        cli = extract(layertap_cli, tiny_kimi25, server, SHAPES, out, "--regenerate", "all", "--max-new-tokens", "12",
                      "--max-bad-rows", "1", "--trust-remote-code", *flags)  # fmt: skip
        assert cli.returncode == 0, cli.stderr[-3000:]
        assert OutputStore.open_existing(out).manifest.chat_template_kwargs == variables
        check_shapes_store(out, tiny_kimi25, hf_reference, 12, **variables)
        chat = ChatTokenizer(tokenizer, template_kwargs=variables)
        fmt = TurnFormat.of(chat)
        block = [fmt.think_open] if thinks else [fmt.think_open, fmt.think_close]  # how each prompt ends
        # Thinking, an answer's reasoning is dropped once a later answer follows: such turns are context (each row's
        # sample its last turn as generated); not thinking, every turn is trained.
        context = [c["turn"] for row in stored_rows(out).values() for c in row["regeneration"]["context"]]
        assert bool(context) == thinks, context
        for sid, row in stored_rows(out).items():
            for k in row["regeneration"]["regenerated"]:
                assert ("reasoning_content" in row["messages"][k]) == thinks, row["messages"][k]
                messages = [{k: v for k, v in m.items() if k != "finish_reason"} for m in row["messages"][:k]]
                text = tokenizer.apply_chat_template(messages, tools=row.get("tools"), tokenize=False,
                                                     add_generation_prompt=True, **variables)  # fmt: skip
                prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
                assert prompt[-len(block) :] == block
                if not any(m["role"] == "assistant" for m in messages):  # the first answer: the switch alone differs
                    first_prompts.setdefault(sid, []).append(prompt)
    think_close = tokenizer.convert_tokens_to_ids("</think>")
    assert len(first_prompts) == 5 and all(off == [*on, think_close] for on, off in first_prompts.values())


def test_truncated_turns_are_kept_and_counted_or_dropped(layertap_cli, sglang_servers, tiny_llama, tmp_path) -> None:
    server = sglang_servers(tiny_llama, layers=DEFAULT_LAYERS["llama"])
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
    lines = list(read_json_lines(log))
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


def test_seeded_sampling_on_a_server_that_cannot_reproduce_it_is_refused(
    layertap_cli, sglang_llama, tiny_llama, tmp_path
) -> None:
    """``--seed`` at a temperature above 0 asks for reproducible sampling; the CPU server samples without the requests'
    seeds (no --enable-deterministic-inference, which its backend cannot take): refused in one line before any work."""
    out = tmp_path / "out"
    cli = layertap_cli("extract", "--model", tiny_llama, "--data", write_rows(tmp_path / "rows.jsonl", ROWS),
                       "--layers", "1,3,5", "--out", out, "--engine", "sglang", "--server-url", sglang_llama.url,
                       "--dump-root", sglang_llama.dump_root, "--regenerate", "all", "--temperature", "0.7",
                       "--seed", "3")  # fmt: skip
    said = " ".join(cli.stderr.split())
    assert cli.returncode == 2 and "--seed 3 at --temperature 0.7 asks for reproducible sampling" in said, said
    assert "without --enable-deterministic-inference" in said and not out.exists()


def test_resume_after_sigkill_mid_generation_keeps_committed_text(
    layertap_cli, sglang_servers, tiny_llama, tmp_path
) -> None:
    server = sglang_servers(tiny_llama, layers=DEFAULT_LAYERS["llama"])
    rows = [{"id": f"r{i}", "messages": [{"role": "user", "content": f"Count to {i}."},
                                         {"role": "assistant", "content": "One."}]} for i in range(40)]  # fmt: skip
    data = write_rows(tmp_path / "rows.jsonl", rows)
    out = tmp_path / "out"
    args = ["extract", "--model", tiny_llama, "--data", data, "--layers", "1,3,5", "--out", out, "--store-dtype",
            "float32", "--engine", "sglang", "--server-url", server.url, "--dump-root", server.dump_root,
            "--in-flight", "2", "--regenerate", "all", "--temperature", "1.0",
            "--max-new-tokens", "16", "--generation-in-flight", "1"]  # fmt: skip
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
    # The CPU server cannot sample with seeds (test_sglang_regenerate): unseeded (no --seed), the run says so, the
    # manifest records it.
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
    server = sglang_servers(tiny_llama, layers=DEFAULT_LAYERS["llama"])
    rows = [{"id": f"r{i}", "messages": [{"role": "user", "content": f"Count to {i}."},
                                         {"role": "assistant", "content": "One."}]} for i in range(40)]  # fmt: skip
    spec = ExtractionSpec(model=tiny_llama, data=write_rows(tmp_path / "rows.jsonl", rows), layers=server.layers,
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
