"""Which index record describes a sample's file when two writers committed it (a frozen worker whose
lease was taken over keeps going): the one whose bytes are on disk, whatever order the logs are in; a regenerated
sample's text counts only with its record."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from layertap.sample import CapturedSample
from layertap.store.index import INDEX_DIR, REGENERATED_DIR, JsonlLog, count_json_lines, read_json_lines
from layertap.store.store import REGENERATED, OutputStore
from layertap.verify import verify_store
from tests.core.store.test_adopt import H, K, T, _sample, _store


def _capture(seed: int) -> CapturedSample:
    g = torch.Generator().manual_seed(seed)
    return CapturedSample(_sample(), torch.randn(T, K, H, generator=g), torch.randn(T, H, generator=g), None)


def test_the_record_matching_the_file_wins_over_log_order(tmp_path: Path) -> None:
    first = _store(tmp_path / "out", "specforge")
    # Two workers: "b" commits first, "a" (the frozen one, back to life) commits the same sample after.
    worker_b = OutputStore(first.root, first.manifest, writer_id="b")
    worker_a = OutputStore(first.root, first.manifest, writer_id="a")
    early = worker_b.commit(_capture(1))
    late = worker_a.commit(_capture(2))
    assert early.sha256 != late.sha256  # different bytes (batching changes low bits on a GPU)
    for store in (worker_a, worker_b, first):
        store.close()
    # Log order (a.jsonl before b.jsonl) would pick b's record; the file holds a's bytes.
    records = OutputStore.open_existing(tmp_path / "out").records()
    assert records["s0"].sha256 == late.sha256
    assert verify_store(tmp_path / "out").ok


def test_index_reader_parses_appends_torn_lines_and_replaced_logs(tmp_path: Path) -> None:
    from layertap.store.index import IndexReader, SampleRecord

    def line(i: int, sha: str = "a") -> bytes:
        rec = SampleRecord(f"s{i}", i, 3, f"f{i}", 10, sha * 64, "b" * 64, ((0, 3),))
        return rec.to_json().encode() + b"\n"

    folder = tmp_path / "index"
    folder.mkdir()
    log = folder / "w1.jsonl"
    reader = IndexReader(folder)
    assert reader.candidates() == {}
    log.write_bytes(line(0) + line(1))
    assert set(reader.candidates()) == {"s0", "s1"}
    with log.open("ab") as f:
        f.write(line(2) + line(3)[:20])  # a writer killed mid-append
    assert set(reader.candidates()) == {"s0", "s1", "s2"}
    with log.open("ab") as f:
        f.write(line(3)[20:])  # (in a test only: the rest of the line arrives)
    assert set(reader.candidates()) == {"s0", "s1", "s2", "s3"}
    (folder / "w2.jsonl").write_bytes(line(1, sha="c"))
    assert [r.sha256[0] for r in reader.candidates()["s1"]] == ["a", "c"]
    replacement = folder / "w1.new"
    replacement.write_bytes(line(7))
    replacement.replace(log)  # a new file under the old name: read from its start
    assert set(reader.candidates()) == {"s7", "s1"}
    (folder / "w2.jsonl").unlink()
    assert set(reader.candidates()) == {"s7"}


def test_a_regenerated_text_without_its_index_record_never_counts(tmp_path: Path, monkeypatch) -> None:
    """A writer killed between a sample's text (``regenerated/``) and its index record leaves text that neither a
    resume (`OutputStore.regenerated_rows`, what the planner trusts) nor finalize's ``regenerated.jsonl`` takes,
    whether the sample is committed later by another writer or never."""
    made = _store(tmp_path / "out", "specforge")
    manifest = made.manifest.model_copy(update={"generation": {"mode": "all"}})
    made.close()

    def row(sample_id: str, text: str) -> dict:
        return {"id": sample_id, "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": text}]}

    def capture(index: int, seed: int, text: str) -> CapturedSample:
        sample = dataclasses.replace(
            _sample(seed), sample_id=f"s{index}", index=index, regenerated=row(f"s{index}", text)
        )
        g = torch.Generator().manual_seed(seed)
        return CapturedSample(sample, torch.randn(T, K, H, generator=g), torch.randn(T, H, generator=g), None)

    killed = OutputStore(made.root, manifest, writer_id="killed")
    append = JsonlLog.append

    def die_before_the_record(log: JsonlLog, line: str) -> None:
        if log.path.parent.name == INDEX_DIR:
            raise KeyboardInterrupt  # the writer's end, between its text and its record
        append(log, line)

    monkeypatch.setattr(JsonlLog, "append", die_before_the_record)
    for index in (0, 1):
        with pytest.raises(KeyboardInterrupt):
            killed.commit(capture(index, seed=10 + index, text="half-written"))
    monkeypatch.undo()
    killed.close()
    assert count_json_lines(made.root / REGENERATED_DIR / "killed.jsonl") == 2

    resumed = OutputStore(made.root, manifest, writer_id="later")  # sorts after "killed": log order does not decide
    resumed.commit(capture(0, seed=20, text="committed"))
    assert resumed.regenerated_rows(resumed.records()) == {"s0": row("s0", "committed")}
    resumed.finalize(complete=False, target=None)
    resumed.close()
    assert list(read_json_lines(made.root / REGENERATED)) == [row("s0", "committed")]


def test_regenerated_rows_are_counted_by_json_lines_not_by_line_breaks_in_their_text(tmp_path: Path) -> None:
    """Regenerated text may carry U+2028 / U+2029 (kept as is: ``ensure_ascii=False``); ``str.splitlines()`` splits
    there too, so verify once counted 42 rows in a 40-row ``regenerated.jsonl``. Records are counted by ``\\n``."""
    made = _store(tmp_path / "out", "specforge")
    manifest = made.manifest.model_copy(update={"generation": {"mode": "all"}})
    made.close()
    store = OutputStore(made.root, manifest, writer_id="w")
    texts = ["one\u2028two", "three\u2029four\x85five"]
    for index, text in enumerate(texts):
        messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": text}]
        sample = dataclasses.replace(
            _sample(index), sample_id=f"s{index}", index=index, regenerated={"id": f"s{index}", "messages": messages}
        )
        g = torch.Generator().manual_seed(index)
        store.commit(CapturedSample(sample, torch.randn(T, K, H, generator=g), torch.randn(T, H, generator=g), None))
    store.finalize(complete=True, target=None)
    store.close()
    path = made.root / REGENERATED
    assert len(path.read_text(encoding="utf-8").splitlines()) > len(texts)  # what the old count saw
    assert count_json_lines(path) == len(texts)
    assert [row["messages"][1]["content"] for row in read_json_lines(path)] == texts
