"""The run option for chat template variables (``chat_template_kwargs``): the command line parses a JSON object of
scalars and refuses anything else with a clear error; a run renders every row with them (the stored ids are HF's own
``apply_chat_template`` with the same variables), records them in the manifest and TRAIN.md, ``verify --data``
re-tokenizes with them, and a resume under other variables is refused, as one under another template is."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from layertap.cli import extract
from layertap.errors import StoreError
from layertap.models.folder import ModelFolder
from layertap.pipeline import run_extraction
from layertap.spec import ExtractionSpec
from layertap.store.store import OutputStore
from layertap.trainers import GUIDE
from layertap.verify import verify_store
from tests.hf_engines import cpu_hf

DATA = Path(__file__).resolve().parents[1] / "assets" / "datasets" / "kimi_chats.jsonl"


def parsed(tmp_path: Path, *args: str) -> dict:
    """``extract``'s options as the command line parses them (nothing run)."""
    base = ["--model", str(tmp_path), "--data", str(DATA), "--layers", "1", "--out", str(tmp_path / "o")]
    return extract.make_context("extract", [*base, *args]).params


def test_the_option_parses_a_json_object_of_scalars(tmp_path: Path) -> None:
    assert parsed(tmp_path)["chat_template_kwargs"] == {}
    given = '{"thinking": false, "effort": "low", "n": 2, "t": 0.5, "none": null}'
    assert parsed(tmp_path, "--chat-template-kwargs", given)["chat_template_kwargs"] == {
        "thinking": False, "effort": "low", "n": 2, "t": 0.5, "none": None}  # fmt: skip


@pytest.mark.parametrize(
    ("given", "says"),
    [
        ("{thinking: false}", "not JSON"),
        ("[1]", "a JSON object is needed"),
        ('"thinking"', "a JSON object is needed"),
        ('{"a": {"b": 1}, "c": [1]}', "JSON scalars (string, number, true/false, null); ['a', 'c'] are not"),
    ],
)
def test_the_option_refuses_what_is_not_a_json_object_of_scalars(tmp_path: Path, given: str, says: str) -> None:
    with pytest.raises(click.BadParameter) as err:
        parsed(tmp_path, "--chat-template-kwargs", given)
    assert says in err.value.format_message() and "--chat-template-kwargs" in err.value.format_message()


@pytest.mark.parametrize(
    ("given", "says"),
    [
        ('{"add_generation_prompt": true}', "['add_generation_prompt'] are set by the chat template renderer itself"),
        ('{"messages": "x", "tools": 1}', "['messages', 'tools'] are set by the chat template renderer itself"),
        ('{"not-a-name": 1}', "chat template variable names must be identifiers, got ['not-a-name']"),
    ],
)
def test_extract_refuses_names_a_template_cannot_take(tmp_path: Path, given: str, says: str) -> None:
    base = ["--model", str(tmp_path), "--data", str(DATA), "--layers", "1", "--out", str(tmp_path / "o")]
    result = CliRunner().invoke(extract, [*base, "--chat-template-kwargs", given])
    assert result.exit_code == 2
    assert f"error: --chat-template-kwargs: {says}" in " ".join(result.stderr.split())
    assert not (tmp_path / "o").exists()


def test_a_run_renders_records_verifies_and_resumes_only_under_its_variables(tiny_kimi25: Path, tmp_path) -> None:
    model = tmp_path / "kimi25"
    shutil.copytree(tiny_kimi25, model)
    off = ExtractionSpec(model=model, data=DATA, layers=(1, 2, 4), trust_remote_code=True,
                         chat_template_kwargs={"thinking": False})  # fmt: skip
    out = tmp_path / "out"
    report = run_extraction(off, out, cpu_hf())
    assert report.row_errors == 0 and report.computed

    store = OutputStore.open_existing(out)
    assert store.manifest.chat_template_kwargs == {"thinking": False}
    assert '`{"thinking": false}`' in (out / GUIDE).read_text()
    tokenizer = ModelFolder.read(model).load_tokenizer(trust_remote_code=True)
    rows = {json.loads(line).get("id"): json.loads(line) for line in DATA.read_text().splitlines()}
    thought = 0
    for rec in store.records().values():
        ids = store.format.load(out / rec.file)["input_ids"].flatten().tolist()
        row = rows[rec.sample_id]
        if "messages" not in row:
            continue
        text = tokenizer.apply_chat_template(row["messages"], tools=row.get("tools"), tokenize=False, thinking=False)
        thought += any(m.get("reasoning_content") for m in row["messages"])
        assert not any(m["reasoning_content"] in text for m in row["messages"] if m.get("reasoning_content"))
        if rec.sample_id == "k-tools":  # its answer saw the tool call's reasoning (the template drops it once answered)
            *before, answer = row["messages"]
            text = tokenizer.apply_chat_template(before, tools=row.get("tools"), tokenize=False, thinking=False,
                                                 add_generation_prompt=True) + answer["content"] + "<|im_end|>"  # fmt: skip
            assert "Two cities: two calls." in text
        assert ids == tokenizer(text, add_special_tokens=False)["input_ids"], rec.sample_id
    assert thought, "a row with reasoning shows it left out with thinking off"

    # verify --data tokenizes the dataset again as the run did: with the manifest's variables, so it is clean
    check = verify_store(out, data=DATA, trust_remote_code=True)
    assert check.ok, check.problems
    # a resume under other variables (here: none, thinking on by default) is refused before anything is written
    default = off.model_copy(update={"chat_template_kwargs": {}})
    with pytest.raises(StoreError, match=r"chat_template_kwargs: store has \{'thinking': False\}, this run has \{\}"):
        run_extraction(default, out, cpu_hf())
    assert OutputStore.open_existing(out).records() == store.records()
