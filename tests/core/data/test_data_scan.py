"""The pre-scan counts rows, keeps ids in order (None for unreadable rows) and maps each duplicate to its first row."""

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
        None,  # malformed JSON: counted, no id
        "no-assistant",
        "empty-text",
        "bad-role",
        None,  # not an object
        "sharegpt-tools",
    ]
    assert scan.unreadable_rows == [7, 11]
    assert scan.duplicates == {}


def test_each_duplicate_points_at_the_first_row_with_its_id():
    scan = scan_dataset(DATASETS / "duplicate_ids.jsonl")
    assert scan.num_rows == 7 and scan.sample_ids == ["a", "b", "a", "3", "3", "b", "a"]
    assert scan.duplicates == {2: 0, 4: 3, 5: 1, 6: 0}  # row 4's id 3 is row 3's row-number id


def test_rows_with_unusable_ids_take_no_part_in_duplicates(tmp_path: Path):
    path = tmp_path / "ids.jsonl"
    rows = [{"id": "x"}, {"id": ["x"]}, {"id": "\ud800"}, {"id": True}, {"id": "x"}, {"id": "\ud800"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "[1]\n")
    scan = scan_dataset(path)
    assert scan.sample_ids == ["x", None, None, None, "x", None, None]
    assert scan.duplicates == {4: 0} and scan.unreadable_rows == [6]


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
