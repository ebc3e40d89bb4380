"""Whole runs through the CLI entry points: bad rows are reported per row, the rest completes."""

import json
import subprocess
import sys
from collections import Counter

import pytest

from layertap.errors import DatasetError
from layertap.pipeline import run_extraction
from layertap.settings import RunSettings
from layertap.spec import ExtractionSpec
from layertap.store.index import ERRORS_DIR, INDEX_DIR, read_jsonl_dir
from layertap.store.store import OutputStore
from layertap.verify import verify_store
from tests.core.datasets import conversation_rows, malformed_dataset, strict_template_model, write_jsonl
from tests.core.trainer_reads import masked_token_counts
from tests.hf_engines import cpu_hf


def test_bad_rows_get_per_row_errors_and_the_rest_completes(layertap_cli, tiny_llama, tmp_path) -> None:
    rows = conversation_rows(10, seed=5)
    rows[2] = {"id": "no-assistant", "messages": [{"role": "user", "content": "anyone?"}]}
    rows[5] = {"id": "empty-text", "text": ""}
    rows[7] = {
        "id": "bad-role",
        "messages": [{"role": "wizard", "content": "hi"}, {"role": "assistant", "content": "yo"}],
    }
    # Line 4 of the file (row 4) is not JSON at all; the file then has 11 rows.
    data = write_jsonl(tmp_path / "data.jsonl", rows, raw_lines={4: '{"id": "broken", "messages": [ '})
    out = tmp_path / "out"
    cli = layertap_cli("extract", "--model", tiny_llama, "--data", data, "--layers", "2,3,4", "--out", out,
                       "--max-bad-rows", "4")  # fmt: skip
    assert cli.returncode == 0, cli.stderr[-3000:]
    stderr = " ".join(cli.stderr.split())
    assert "4 bad rows" in stderr and "warning: 4 bad rows of 11 (36.36%), within max_bad_rows=4 (4 rows)" in stderr

    store = OutputStore.open_existing(out)
    errors = {e["row"]: e for e in store.errors()}
    assert sorted(errors) == [2, 4, 6, 8]  # file rows: the malformed line shifted rows 4.. by one
    assert "JSON" in errors[4]["reason"]
    assert "assistant" in errors[2]["reason"] and errors[2]["sample_id"] == "no-assistant"
    assert "empty" in errors[6]["reason"]
    assert "wizard" in errors[8]["reason"]
    assert all(e["kind"] == "row" for e in errors.values())
    check = verify_store(out)
    assert check.ok, check.problems
    assert check.samples == 7


def test_overlong_truncate_and_skip_are_counted(tiny_llama, tmp_path) -> None:
    data = write_jsonl(tmp_path / "data.jsonl", conversation_rows(12, seed=2, max_words=80))
    base = {"model": tiny_llama, "data": data, "layers": (1, 2, 3), "max_length": 240}
    factory = cpu_hf(batch_tokens=4096)

    skipped = run_extraction(ExtractionSpec(**base, overlong="skip"), tmp_path / "skip", factory)
    truncated = run_extraction(ExtractionSpec(**base, overlong="truncate"), tmp_path / "trunc", factory)

    assert skipped.skipped_overlong > 0 and skipped.row_errors == 0
    assert len(skipped.computed) + skipped.skipped_overlong == 12
    assert {e["kind"] for e in OutputStore.open_existing(tmp_path / "skip").errors()} == {"overlong"}
    assert truncated.truncated == skipped.skipped_overlong and len(truncated.computed) == 12
    records = OutputStore.open_existing(tmp_path / "trunc").records().values()
    assert max(r.num_tokens for r in records) == 240
    assert sum(r.truncated for r in records) == truncated.truncated


def test_broken_template_stops_the_run(tiny_llama, tmp_path) -> None:
    model = tmp_path / "model"
    subprocess.run(["cp", "-r", str(tiny_llama), str(model)], check=True)
    # A template that renders user turns only: every assistant token vanishes, the mask is all 0.
    (model / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if m.role == 'user' %}{{ m.content }}{% endif %}{% endfor %}"
    )
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))
    data = write_jsonl(tmp_path / "data.jsonl", conversation_rows(4))
    with pytest.raises(DatasetError, match="all 0"):
        run_extraction(
            ExtractionSpec(model=model, data=data, layers=(1, 2, 3)),
            tmp_path / "out",
            cpu_hf(batch_tokens=4096),
        )


def test_a_file_with_every_kind_of_bad_row_stores_every_good_row_and_reports_each_bad_one(
    layertap_cli, tiny_llama, tmp_path
) -> None:
    model = strict_template_model(tiny_llama, tmp_path / "model")
    bad = malformed_dataset(tmp_path / "data.jsonl")
    out = tmp_path / "out"
    args = ["extract", "--model", str(model), "--data", str(bad.data), "--layers", "1,2,4", "--out", str(out),
            "--max-length", str(bad.max_length), "--overlong", "skip"]  # fmt: skip
    cli = layertap_cli(*args)
    # Far more bad rows than the default 1%: the run ends 1, saying so with the most frequent causes; every
    # good row is stored all the same.
    assert cli.returncode == 1, cli.stderr[-3000:]
    assert "Traceback" not in cli.stderr
    failed = next(line for line in cli.stderr.splitlines() if line.startswith("failed: "))
    rows, bad_rows = len(bad.kinds) + len(bad.good), len(bad.kinds) - 1  # the overlong row is no bad row
    assert f"failed: {bad_rows} bad rows of {rows} " in failed and "over the limit max_bad_rows=1% (0 rows)" in failed
    assert "; by kind: row 11, encoding 2, duplicate_id 1, template 1; most frequent: 1 x row: " in " ".join(
        cli.stderr.split()
    )

    store = OutputStore.open_existing(out)
    errors = {e["row"]: e for e in store.errors()}
    assert {row: e["kind"] for row, e in errors.items()} == bad.kinds
    assert {sid: r.index for sid, r in store.records().items()} == bad.good
    assert "row 0 has it first" in errors[8]["reason"] and errors[8]["sample_id"] == "good-openai"
    assert "Conversation roles must alternate" in errors[21]["reason"]
    # Each bad row once in errors/, each good row once in the index.
    assert Counter(e["row"] for e in read_jsonl_dir(out / ERRORS_DIR)) == dict.fromkeys(bad.kinds, 1)
    assert Counter(d["sample_id"] for d in read_jsonl_dir(out / INDEX_DIR)) == dict.fromkeys(bad.good, 1)
    check = verify_store(out)
    assert check.ok and check.samples == len(bad.good), check.problems


def test_a_run_that_stores_nothing_ends_1_naming_the_cause_and_a_max_length_above_the_context_is_refused(
    layertap_cli, tiny_llama, tmp_path
) -> None:
    # Token ids beyond the tokenizer's vocabulary on every row (as the 300 refused rows were).
    rows = [{"id": f"r{i}", "input_ids": [1, 99_000 + i], "loss_mask": [0, 1]} for i in range(5)]
    data = write_jsonl(tmp_path / "data.jsonl", rows)
    base = ["extract", "--model", tiny_llama, "--data", data, "--layers", "1,2,3", "--max-bad-rows", "100%"]
    cli = layertap_cli(*base, "--out", tmp_path / "out")
    assert cli.returncode == 1, cli.stderr[-3000:]
    stderr = " ".join(cli.stderr.split())
    assert (
        "failed: nothing was stored: none of the 5 rows gave a sample (5 bad); by kind: row 5; most frequent: 5 x row:"
        in stderr
    )
    assert "99000" in stderr  # the first example, as it was
    # The model's context is 4096 tokens (max_position_embeddings): 4097 is refused before any work.
    cli = layertap_cli(*base, "--out", tmp_path / "long", "--max-length", "4097")
    assert cli.returncode == 2 and not (tmp_path / "long").exists(), cli.stderr[-3000:]
    assert "max_length 4097 is above the context length of " in " ".join(cli.stderr.split())
    assert "(4096, max_position_embeddings in config.json): give at most 4096" in " ".join(cli.stderr.split())


@pytest.mark.parametrize("fmt", ["specforge", "speculators"])
def test_a_run_where_every_row_is_refused_finalizes_an_empty_store_the_trainers_read_as_0_rows(
    layertap_cli, tiny_llama, tmp_path, fmt
) -> None:
    rows = [{"id": f"r{i}", "input_ids": [1, 99_000 + i], "loss_mask": [0, 1]} for i in range(3)]
    data = write_jsonl(tmp_path / "data.jsonl", rows)
    out = tmp_path / "out"
    cli = layertap_cli("extract", "--model", tiny_llama, "--data", data, "--layers", "1,2,3", "--format", fmt,
                       "--max-bad-rows", "100%", "--out", out)  # fmt: skip
    assert cli.returncode == 1 and "Traceback" not in cli.stderr, cli.stderr[-3000:]
    assert "nothing was stored: none of the 3 rows gave a sample" in " ".join(cli.stderr.split())
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["complete"] and manifest["samples_committed"] == 0
    assert masked_token_counts(out) == Counter()  # as the trainer reads the folder: no sample, no error
    if fmt == "speculators":
        from datasets import load_from_disk

        arrow = load_from_disk(str(out))
        assert len(arrow) == 0
        assert set(arrow.column_names) == {"sample_id", "dataset_index", "input_ids", "loss_mask", "seq_len"}
    check = verify_store(out)
    assert check.ok and check.samples == 0, check.problems
    assert len(OutputStore.open_existing(out).errors()) == 3


def test_demo_command_runs_end_to_end(layertap_cli, tmp_path) -> None:
    cli = layertap_cli("demo", "--out", tmp_path / "demo")
    assert cli.returncode == 0, cli.stderr[-3000:]
    assert "clean" in cli.stdout and "rows_0-2000/data_0.ckpt" in cli.stdout
    assert verify_store(tmp_path / "demo" / "states-specforge").samples == 24


def test_tokenizer_is_loaded_once_per_process_until_its_files_change(tiny_llama, tmp_path) -> None:
    import shutil

    from layertap.models.folder import ModelFolder

    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    first = ModelFolder.read(model).load_tokenizer()
    assert ModelFolder.read(model).load_tokenizer() is first  # the next shard reuses it
    template = model / "chat_template.jinja"
    template.write_text(template.read_text() + "\n")
    again = ModelFolder.read(model).load_tokenizer()
    assert again is not first and again.chat_template.endswith("\n")


def test_a_run_captures_at_its_switch_interval_and_gives_the_process_back_its_own(tiny_llama, tmp_path) -> None:
    data = write_jsonl(tmp_path / "data.jsonl", conversation_rows(3, seed=5, max_words=20))
    factory, seen = cpu_hf(), []

    def engine_factory(capture, folder):  # the engine's capture notes the interval it runs at
        engine = factory(capture, folder)
        captures = engine.capture
        engine.capture = lambda samples: seen.append(sys.getswitchinterval()) or captures(samples)
        return engine

    before = sys.getswitchinterval()
    report = run_extraction(
        ExtractionSpec(model=tiny_llama, data=data, layers=(1, 2, 3)), tmp_path / "out", engine_factory,
        settings=RunSettings(device="cpu", switch_interval_ms=0.7),
    )  # fmt: skip
    assert len(report.computed) == 3
    assert seen == [pytest.approx(0.0007)]
    assert sys.getswitchinterval() == before
