"""The pre-scan counts rows, keeps ids in order (unreadable rows too) and refuses duplicate ids."""

import json
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from layertap.data import scan_dataset
from layertap.errors import DatasetError

DATASETS = Path(__file__).parents[2] / "assets" / "datasets"


def test_scan_counts_every_row_and_keeps_ids_in_order():
    scan = scan_dataset(DATASETS / "mixed.jsonl")
    assert scan.num_rows == 13
    assert scan.sample_ids == [
        "openai-1",
        "17",  # conversation_id, stringified
        "2",  # no id: the row number
        "text-1",
        "tok-1",
        "tok-2",
        "tools-1",
        "7",  # malformed JSON: counted, named by its row number
        "no-assistant",
        "empty-text",
        "bad-role",
        "11",  # not an object
        "sharegpt-tools",
    ]
    assert scan.unreadable_rows == [7, 11]


def test_duplicate_ids_are_named_with_their_counts():
    with pytest.raises(DatasetError) as info:
        scan_dataset(DATASETS / "duplicate_ids.jsonl")
    message = str(info.value)
    assert "3 duplicate sample ids: 'a' (x3), 'b' (x2), '3' (x2)" in message
    assert "duplicate_ids.jsonl" in message


def test_many_duplicates_are_summarised(tmp_path: Path):
    path = tmp_path / "dups.jsonl"
    path.write_text("".join(json.dumps({"id": f"d{i % 8}", "text": "x"}) + "\n" for i in range(16)))
    with pytest.raises(DatasetError, match=r"8 duplicate sample ids: 'd0' \(x2\), .*'d4' \(x2\) and 3 more"):
        scan_dataset(path)


def test_columnar_scans_read_ids_only_and_agree_with_jsonl(tmp_path: Path):
    rows = [{"id": f"r{i}", "text": "t" * i} for i in range(1, 600)] + [{"id": None, "text": "last"}]
    parquet = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist(rows), parquet, row_group_size=100)
    folder = tmp_path / "saved"
    datasets.Dataset.from_list(rows).save_to_disk(str(folder))
    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    expected = [f"r{i}" for i in range(1, 600)] + ["599"]
    for path in (parquet, folder, jsonl):
        scan = scan_dataset(path)
        assert scan.sample_ids == expected and scan.num_rows == 600 and scan.unreadable_rows == []
    no_ids = tmp_path / "no_ids.parquet"
    pq.write_table(pa.Table.from_pylist([{"text": "a"}, {"text": "b"}]), no_ids)
    assert scan_dataset(no_ids).sample_ids == ["0", "1"]


def test_empty_dataset_is_refused(tmp_path: Path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(DatasetError, match=r"empty\.jsonl has no rows"):
        scan_dataset(empty)
