"""Crash-resume: SIGKILL mid-run, restart with the same command, nothing lost or duplicated.

The extraction runs as a real ``python -m layertap extract`` subprocess, killed with SIGKILL.
"""

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from layertap.errors import StoreError
from layertap.pipeline import run_extraction
from layertap.spec import ExtractionSpec
from layertap.store.store import OutputStore
from layertap.verify import verify_store
from tests.core.datasets import conversation_rows, write_jsonl
from tests.core.trainer_reads import masked_token_counts
from tests.hf_engines import cpu_hf


def _cmd(cli, model: Path, data: Path, out: Path) -> list[str]:
    # --batch-tokens 1: one sample per forward, so states do not depend on batch composition and an
    # interrupted run can be compared byte for byte with an uninterrupted one.
    return [*cli.argv, "extract", "--model", str(model), "--data", str(data),
            "--layers", "1,3,5", "--out", str(out), "--batch-tokens", "1"]  # fmt: skip


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def _last_report(out: Path) -> dict:
    return json.loads(max((out / "reports").glob("run-*.json"), key=os.path.getmtime).read_text())


def _index_lines(out: Path) -> int:
    return sum(f.read_bytes().count(b"\n") for f in (out / "index").glob("*.jsonl")) if (out / "index").is_dir() else 0


def _kill_when(proc: subprocess.Popen, out: Path, committed: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while _index_lines(out) < committed:
        assert proc.poll() is None, f"extract ended before it could be killed: {proc.stderr.read()[-2000:]}"
        assert time.monotonic() < deadline, "extract made no progress"
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def test_sigkill_halfway_then_resume_gives_every_sample_once(layertap_cli, tiny_llama, tmp_path) -> None:
    rows = conversation_rows(150, seed=7)
    data = write_jsonl(tmp_path / "data.jsonl", rows)
    out = tmp_path / "out"
    proc = subprocess.Popen(_cmd(layertap_cli, tiny_llama, data, out), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)  # fmt: skip
    _kill_when(proc, out, committed=60)

    before = OutputStore.open_existing(out).records()
    assert 0 < len(before) < len(rows), "the kill must land mid-run"
    stamps = {sid: (out / r.file).stat() for sid, r in before.items()}

    _run(_cmd(layertap_cli, tiny_llama, data, out))

    report = _last_report(out)
    all_ids = {r["id"] for r in rows}
    assert report["already_done"] == len(before) and report["redone"] == []
    assert set(report["computed"]) == all_ids - set(before)  # only unfinished samples were recomputed
    assert len(report["computed"]) == len(set(report["computed"]))
    after = OutputStore.open_existing(out).records()
    assert set(after) == all_ids
    for sid, st in stamps.items():  # files committed before the kill were not rewritten
        now = (out / after[sid].file).stat()
        assert (now.st_ino, now.st_mtime_ns) == (st.st_ino, st.st_mtime_ns)
    check = verify_store(out)
    assert check.ok, check.problems
    assert check.samples == len(rows)

    # Byte for byte the same as a run that was never interrupted.
    clean = tmp_path / "clean"
    _run(_cmd(layertap_cli, tiny_llama, data, clean))
    reference = OutputStore.open_existing(clean).records()
    assert {sid: r.sha256 for sid, r in after.items()} == {sid: r.sha256 for sid, r in reference.items()}


@pytest.fixture
def finished_run(layertap_cli, tiny_llama, tmp_path):
    data = write_jsonl(tmp_path / "data.jsonl", conversation_rows(30, seed=11))
    out = tmp_path / "out"
    cmd = _cmd(layertap_cli, tiny_llama, data, out)
    _run(cmd)
    return cmd, out


def test_truncated_corrupted_and_missing_files_are_found_and_redone(layertap_cli, finished_run) -> None:
    cmd, out = finished_run
    index = OutputStore.open_existing(out).records()
    truncated, flipped, deleted = (index[f"conv-{i}"] for i in (3, 14, 27))
    original = {r.sample_id: r.sha256 for r in index.values()}

    path = out / truncated.file
    path.write_bytes(path.read_bytes()[: truncated.nbytes // 2])
    path = out / flipped.file
    blob = bytearray(path.read_bytes())
    blob[len(blob) // 2] ^= 0xFF  # same size, one byte of a hidden state changed
    path.write_bytes(bytes(blob))
    (out / deleted.file).unlink()

    found = verify_store(out)
    assert not found.ok
    assert any(truncated.file in p and "size" in p for p in found.problems)
    assert any(flipped.file in p and "sha256" in p for p in found.problems)
    assert any(deleted.file in p and "missing" in p for p in found.problems)
    cli = layertap_cli("verify", out)
    assert cli.returncode == 1 and "3 problems" in cli.stderr

    _run(cmd)
    report = _last_report(out)
    assert sorted(report["redone"]) == sorted(["conv-3", "conv-14", "conv-27"])
    assert sorted(report["computed"]) == sorted(report["redone"])
    assert verify_store(out).ok
    assert {r.sample_id: r.sha256 for r in OutputStore.open_existing(out).records().values()} == original


def _edit_assistant_turn(data: Path, row: int) -> None:
    """Append a word to row ``row``'s last assistant turn, in place: the dataset keeps its row count."""
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    rows[row]["messages"][-1]["content"] += " edited"
    write_jsonl(data, rows)


def _verify_data(cli, out: Path, data: Path) -> subprocess.CompletedProcess:
    return cli("verify", out, "--data", data)


def test_resume_after_editing_one_row_recomputes_that_sample_only_and_says_so(layertap_cli, finished_run) -> None:
    cmd, out = finished_run
    data = Path(cmd[cmd.index("--data") + 1])
    before = OutputStore.open_existing(out).records()
    hash_before = json.loads((out / "manifest.json").read_text())["dataset_sha256"]
    _edit_assistant_turn(data, 4)

    # The files are what their records say, so plain verify passes; against the dataset, the edited row does not.
    assert verify_store(out).ok
    checked = _verify_data(layertap_cli, out, data)
    assert checked.returncode == 1 and "1 problems" in checked.stderr, checked.stderr[-3000:]
    assert "(conv-4): row 4 of" in checked.stderr and "other tokens or another loss mask" in checked.stderr

    resumed = _run(cmd)
    report = _last_report(out)
    assert report["changed"] == ["conv-4"] and report["computed"] == ["conv-4"]
    assert report["already_done"] == len(before) - 1 and report["redone"] == []
    said = " ".join(resumed.stderr.split())  # as one line: the console wraps
    assert (
        "1 committed samples no longer match their rows" in said and "1 recomputed because their rows changed" in said
    )
    after = OutputStore.open_existing(out).records()
    assert after["conv-4"].ids_sha256 != before["conv-4"].ids_sha256
    assert {s: r.sha256 for s, r in after.items() if s != "conv-4"} == {
        s: r.sha256 for s, r in before.items() if s != "conv-4"
    }
    assert json.loads((out / "manifest.json").read_text())["dataset_sha256"] not in (None, hash_before)
    assert verify_store(out).ok and _verify_data(layertap_cli, out, data).returncode == 0


def test_a_changed_tiktoken_ranks_file_refuses_the_resume(tiny_kimi25, tmp_path) -> None:
    model = tmp_path / "kimi25"
    shutil.copytree(tiny_kimi25, model)
    data = Path(__file__).resolve().parents[2] / "assets" / "datasets" / "kimi_chats.jsonl"
    spec = ExtractionSpec(model=model, data=data, layers=(1, 2, 4), trust_remote_code=True)
    out = tmp_path / "out"
    run_extraction(spec, out, cpu_hf())
    ranks = model / "tiktoken.model"
    lines = ranks.read_text().splitlines()
    ranks.write_text("\n".join([*lines[:-2], lines[-1], lines[-2]]) + "\n")  # two tokens' ranks swapped

    with pytest.raises(StoreError, match="output folder belongs to a different run; tokenizer_sha256: store has"):
        run_extraction(spec, out, cpu_hf())


@pytest.mark.parametrize("fmt", ["specforge", "speculators"])
def test_a_row_that_no_longer_tokenizes_on_resume_becomes_its_error_and_its_old_sample_leaves_the_store(
    layertap_cli, tiny_llama, tmp_path, fmt
) -> None:
    rows = conversation_rows(12, seed=13, max_words=20)
    data = write_jsonl(tmp_path / "data.jsonl", rows)
    out = tmp_path / "out"
    cmd = [*_cmd(layertap_cli, tiny_llama, data, out), "--format", fmt, "--max-length", "300", "--overlong", "skip",
           "--max-bad-rows", "1"]  # fmt: skip
    _run(cmd)
    before = OutputStore.open_existing(out).records()
    assert set(before) == {r["id"] for r in rows}, "every row fits --max-length at first"
    # Row 3 made malformed (the file keeps its row count), row 7 grown past --max-length.
    rows[7]["messages"][-1]["content"] += " state" * 400
    write_jsonl(data, rows[:3] + rows[4:], raw_lines={3: '{"id": "conv-3", "messages": [ '})
    stale = {"conv-3": before["conv-3"], "conv-7": before["conv-7"]}

    checked = _verify_data(layertap_cli, out, data)  # what the resume will retire, in verify's words
    assert checked.returncode == 1 and "2 problems" in checked.stderr, checked.stderr[-3000:]
    said = " ".join(checked.stderr.split())
    assert f"{stale['conv-3'].file} (conv-3): row 3 of" in said and f"{stale['conv-7'].file} (conv-7): row 7 of" in said
    assert said.count("no longer gives a sample") == 2

    _run(cmd)
    report = _last_report(out)
    assert sorted(report["changed"]) == ["conv-3", "conv-7"] and report["computed"] == []
    assert report["row_errors"] == 1 and report["skipped_overlong"] == 1
    store = OutputStore.open_existing(out)
    errors = {e["row"]: e for e in store.errors()}
    assert {row: e["kind"] for row, e in errors.items()} == {3: "row", 7: "overlong"}
    assert "JSON" in errors[3]["reason"] and "300" in errors[7]["reason"]
    after = store.records()
    assert set(after) == set(before) - set(stale)
    assert {s: r.sha256 for s, r in after.items()} == {s: r.sha256 for s, r in before.items() if s not in stale}
    assert not any((out / r.file).exists() for r in stale.values())
    assert json.loads((out / "manifest.json").read_text())["samples_committed"] == len(rows) - 2
    # As the trainers read the folder: the kept samples' loss-masked tokens, no more.
    assert sum(masked_token_counts(out).values()) == sum(int(r.loss_mask().sum()) for r in after.values())
    if fmt == "speculators":
        from datasets import load_from_disk

        assert sorted(load_from_disk(str(out))["sample_id"]) == sorted(after)
    check = verify_store(out)
    assert check.ok and check.samples == len(rows) - 2, check.problems
    assert _verify_data(layertap_cli, out, data).returncode == 0

    # The row restored: the next resume stores it again (the same bytes), and the retirement no longer counts.
    write_jsonl(data, conversation_rows(12, seed=13, max_words=20))
    _run(cmd)
    assert sorted(_last_report(out)["computed"]) == ["conv-3", "conv-7"]
    again = OutputStore.open_existing(out).records()
    assert {s: r.sha256 for s, r in again.items()} == {s: r.sha256 for s, r in before.items()}
    assert verify_store(out).ok and _verify_data(layertap_cli, out, data).returncode == 0
