"""Regeneration on real CPU capture servers (float32): greedy turns equal HF transformers' greedy ``generate`` of the
same model on the same prompt ids, token for token, for ``last`` and ``all``, on the tiny Llama and the tiny
Kimi-K2.5 wrapper; cut turns say ``length``; rows with nothing to regenerate or a prompt the server refuses are
refused per row; a generation the server aborts costs its row an attempt; the plugin captures none of it; what SGLang
0.5.10 on the CPU does with a sampling seed."""

from __future__ import annotations

import json
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from layertap.data.chat import ChatTokenizer
from layertap.data.rows import parse_row
from layertap.engines.sglang import SGLangEngine
from layertap.engines.sglang.process import SGLangServer
from layertap.engines.sglang.session import ServerSession
from layertap.errors import RowError
from layertap.models.folder import ModelFolder, model_dims
from layertap.regenerate import GenerationSettings, Regenerated, Regenerator, RowJob, TurnFormat
from layertap.sample import CapturedSample
from layertap.spec import resolve_capture
from tests.conftest import _unwrapped
from tests.core.regenerate.test_turns import sample_of
from tests.sglang_fixtures import DEFAULT_LAYERS
from tests.sglang_patch.test_server import rel

pytestmark = pytest.mark.sglang

ROWS = [
    {"id": "a", "messages": [
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "And a fruit?"},
        {"role": "assistant", "content": "Pear."},
    ]},
    {"id": "b:2", "messages": [
        {"role": "user", "content": "What is two plus two?"},
        {"role": "assistant", "content": "Four."},
        {"role": "user", "content": "Times three?"},
        {"role": "assistant", "content": "Twelve."},
        {"role": "user", "content": "Thanks."},
    ]},
    {"id": "c", "messages": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi."}]},
]  # fmt: skip


@pytest.fixture(params=["llama", "kimi-k2.5"])
def served(request, sglang_servers, tiny_llama, tiny_kimi25):
    """(folder, running CPU capture server, ChatTokenizer of the folder) for each tiny model."""
    if request.param == "llama":
        folder, server = tiny_llama, sglang_servers(tiny_llama, layers=DEFAULT_LAYERS["llama"])
    else:
        folder = tiny_kimi25
        server = sglang_servers(tiny_kimi25, layers=DEFAULT_LAYERS["kimi-k2"], extra_args=("--trust-remote-code",))
    chat = ChatTokenizer(ModelFolder.read(folder).load_tokenizer(trust_remote_code=True))
    return folder, server, chat


@pytest.fixture(scope="module")
def hf_models():
    cache: dict[Path, torch.nn.Module] = {}

    def get(folder: Path) -> torch.nn.Module:
        if folder not in cache:
            cache[folder] = AutoModelForCausalLM.from_pretrained(_unwrapped(folder), dtype=torch.float32).eval()
        return cache[folder]

    return get


def regenerate(
    server, chat: ChatTokenizer, rows: list[dict], attempts: int = 1, **settings
) -> list[Regenerated | RowError]:
    session = ServerSession(SGLangServer(url=server.url))
    regen = Regenerator(session, chat, GenerationSettings(**settings), job="j", in_flight=4, attempts=attempts)
    try:
        return list(regen.regenerate_many(RowJob(i, str(r.get("id", i)), parse_row(i, r)) for i, r in enumerate(rows)))
    finally:
        regen.close()
        session.close()


def hf_greedy(
    model, tokenizer, row: dict, mode: str, max_new_tokens: int, stop: list[int], **variables: object
) -> list[tuple]:
    """HF's own run of the same job, written apart from the module: for each answered assistant turn in order, the
    template through ``apply_chat_template`` (with the template ``variables``) with the generation prompt, then
    ``generate``; under ``all`` the later turns see the earlier answers as HF wrote them: decoded whole, and when the
    prompt ended by opening ``<think>``, the text up to the first ``</think>`` as the reasoning."""
    messages = [dict(m) for m in row["messages"]]
    first_user = next(i for i, m in enumerate(messages) if m["role"] == "user")
    answers = [i for i, m in enumerate(messages) if m["role"] == "assistant" and i > first_user]
    out = []
    for k in answers if mode == "all" else answers[-1:]:
        text = tokenizer.apply_chat_template(messages[:k], tokenize=False, add_generation_prompt=True, **variables)
        prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
        new = hf_generate(model, prompt, max_new_tokens, stop)
        stopped = bool(new) and new[-1] in stop
        answer = tokenizer.decode(new[:-1] if stopped else new)
        messages[k] = {"role": "assistant", "content": answer}
        if text.endswith("<think>"):
            reasoning, _, content = answer.partition("</think>")
            messages[k] = {"role": "assistant", "content": content, "reasoning_content": reasoning}
        out.append((k, prompt, new, "stop" if stopped else "length"))
    return out


def hf_generate(model, prompt: list[int], max_new_tokens: int, stop: list[int]) -> list[int]:
    """HF's greedy ``generate`` of ``prompt``: the new ids, the stop id it ended on last (as SGLang returns them)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=stop, pad_token_id=stop[0])  # fmt: skip
    return out[0, len(prompt) :].tolist()


def model_eos(folder: Path) -> set[int]:
    """The eos ids SGLang stops on by itself: the (text) config's and the generation config's."""
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        if (folder / name).exists():
            config = json.loads((folder / name).read_text())
            for eos in (config.get("eos_token_id"), config.get("text_config", {}).get("eos_token_id")):
                ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return ids


@pytest.mark.parametrize("mode", ["last", "all"])
def test_greedy_turns_equal_hf_generate(served, hf_models, mode: str) -> None:
    folder, server, chat = served
    results = regenerate(server, chat, ROWS, mode=mode, max_new_tokens=12)
    assert all(isinstance(r, Regenerated) for r in results), results
    by_id = {r.sample_id: r for r in results}
    assert sorted(by_id) == sorted(r["id"] for r in ROWS)
    stop = sorted(model_eos(folder) | set(TurnFormat.of(chat).stop_token_ids(chat)))
    model = hf_models(folder)
    for row in ROWS:
        got = by_id[row["id"]]
        want = hf_greedy(model, chat.tokenizer, row, mode, 12, stop)
        assert [(t.index, t.prompt_ids, t.output_ids, t.finish_reason) for t in got.turns] == want, row["id"]
        record = got.record(sample_of(chat, got))
        assert record["id"] == row["id"] and len(record["messages"]) == len(row["messages"])
        for t in got.turns:
            assert record["messages"][t.index]["finish_reason"] == t.finish_reason
        untouched = set(range(len(row["messages"]))) - {t.index for t in got.turns}
        assert all(record["messages"][i] == parse_row(0, row).messages[i] for i in untouched)  # type: ignore[union-attr]


def test_cut_turns_say_length(served) -> None:
    _, server, chat = served
    (result,) = regenerate(server, chat, ROWS[:1], mode="all", max_new_tokens=3)
    assert isinstance(result, Regenerated)
    assert [(len(t.output_ids), t.finish_reason) for t in result.turns] == [(3, "length"), (3, "length")]
    record = result.record(sample_of(chat, result))
    assert [m.get("finish_reason") for m in record["messages"]] == [None, None, "length", None, "length"]


def test_rows_are_refused_one_by_one(served) -> None:
    _, server, chat = served
    too_long = {"id": "long", "messages": [{"role": "user", "content": "word " * 6000},
                                           {"role": "assistant", "content": "ok"}]}  # fmt: skip
    rows = [{"id": "t", "text": "already templated"}, {"id": "p", "input_ids": [1, 2, 3]},
            {"id": "n", "messages": [{"role": "system", "content": "s"}, {"role": "assistant", "content": "a"}]},
            too_long, ROWS[2]]  # fmt: skip
    results = {r.sample_id: r for r in regenerate(server, chat, rows, mode="last", max_new_tokens=4)}
    kinds = {k: (v.kind if isinstance(v, RowError) else "ok") for k, v in results.items()}
    assert kinds == {"t": "regenerate", "p": "regenerate", "n": "regenerate", "long": "generation", "c": "ok"}
    assert "context length" in results["long"].reason


class _FailedAttempts(logging.Handler):
    """Counts the Regenerator's failed generation attempts as it logs them; ``first`` is set at the first."""

    def __init__(self, sending: threading.Lock) -> None:
        super().__init__()
        self.sending, self.count, self.first = sending, 0, threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if "generation attempt" in record.getMessage():
            with self.sending:  # not while an abort is being sent: the retry that follows is never aborted
                self.count += 1
                self.first.set()


@pytest.mark.parametrize("attempts", [1, 2])
def test_an_aborted_generation_costs_its_row_an_attempt(sglang_servers, tiny_llama, attempts: int) -> None:
    """The server aborts every generation in flight (``/abort_request``, finish_reason ``abort``) until the first
    failed attempt is logged: with two attempts the row is regenerated again, as a clean run does it (greedy); with
    one it is the row's error (kind ``generation``)."""
    server = sglang_servers(tiny_llama, layers=DEFAULT_LAYERS["llama"])
    chat = ChatTokenizer(ModelFolder.read(tiny_llama).load_tokenizer())
    settings = {"mode": "last", "max_new_tokens": 256}
    sending = threading.Lock()
    failures = _FailedAttempts(sending)
    logger = logging.getLogger("layertap.regenerate.client")
    logger.addHandler(failures)
    try:
        with ThreadPoolExecutor(1) as pool:
            run = pool.submit(regenerate, server, chat, ROWS[2:], attempts, **settings)
            while not failures.first.wait(0.005) and not run.done():
                with sending:
                    if not failures.first.is_set():
                        httpx.post(server.url + "/abort_request", json={"rid": "", "abort_all": True}, timeout=30)
            (result,) = run.result(timeout=600)
    finally:
        logger.removeHandler(failures)
    assert failures.count == 1
    if attempts == 1:
        assert isinstance(result, RowError) and result.kind == "generation", result
        assert "abort" in result.reason and "failed all 1 attempts" in result.reason
    else:
        (clean,) = regenerate(server, chat, ROWS[2:], **settings)
        assert isinstance(result, Regenerated) and isinstance(clean, Regenerated)
        assert result.record(sample_of(chat, result)) == clean.record(sample_of(chat, clean))


def test_generation_is_not_captured(served) -> None:
    _, server, chat = served
    before = set(server.dump_root.iterdir())
    results = regenerate(server, chat, ROWS, mode="all", max_new_tokens=6)
    assert all(isinstance(r, Regenerated) for r in results)
    assert set(server.dump_root.iterdir()) == before
    assert "layertap: capture of" not in server.log_tail(400)


def test_sampling_seed_on_the_cpu_server(served) -> None:
    """SGLang 0.5.10 takes ``sampling_params.sampling_seed`` but samples with it only under
    ``--enable-deterministic-inference``, which refuses every attention backend but flashinfer/fa3/triton: the CPU
    server (torch_native) cannot honour it. The same seed and sample id then give other text on every run: this
    test fails the day it does not."""
    _, server, chat = served
    runs = [regenerate(server, chat, ROWS[2:], mode="last", max_new_tokens=16, temperature=1.0, seed=7) for _ in "ab"]
    (first,), (second,) = runs
    assert isinstance(first, Regenerated) and isinstance(second, Regenerated)
    assert first.turns[0].seed == second.turns[0].seed
    assert first.turns[0].output_ids != second.turns[0].output_ids


def test_regenerated_rows_capture_equal_hf_while_others_generate(served, hf_reference) -> None:
    """The capture server keeps capturing right while it generates: the regenerated conversations, tokenized as the
    capture tokenizes them, are captured (no cached prefix, states equal HF float32) while more rows generate."""
    folder, server, chat = served
    results = regenerate(server, chat, ROWS, mode="all", max_new_tokens=8)
    samples = [chat.tokenize(i, r.sample_id, r.conversation, max_length=None, overlong="truncate")
               for i, r in enumerate(results) if isinstance(r, Regenerated)]  # fmt: skip
    more = [{**row, "id": f"{row['id']}-{n}"} for n in range(8) for row in ROWS]
    spec = resolve_capture(list(server.layers), convention="capture", num_layers=model_dims(folder)[0], final="both")
    engine = SGLangEngine(SGLangServer(url=server.url), spec, folder=ModelFolder.read(folder), dump_root=server.dump_root, job="regen",
                          in_flight=4)  # fmt: skip
    with ThreadPoolExecutor(1) as pool:
        generating = pool.submit(regenerate, server, chat, more, mode="all", max_new_tokens=32)
        captured = list(engine.capture(samples))
        assert not generating.done()  # the captures ran while rows were generating
        assert all(isinstance(r, Regenerated) for r in generating.result())
    assert sorted(c.sample.sample_id for c in captured if isinstance(c, CapturedSample)) == sorted(
        r["id"] for r in ROWS
    )
    ref = hf_reference(folder)
    for c in captured:
        hidden, pre = ref.states(c.sample.input_ids)
        errs = [rel(c.aux[:, j], hidden[i]) for j, i in enumerate(server.layers)]
        assert max([*errs, rel(c.final_post, hidden[-1]), rel(c.final_pre, pre)]) < 1e-4, c.sample.sample_id
        engine.release(c)
    engine.close()
