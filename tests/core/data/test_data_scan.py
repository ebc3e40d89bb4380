"""The pre-scan counts rows and maps each duplicate to its first row; it keeps nothing per row."""

import dataclasses
import hashlib
import json
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from layertap.data import DatasetScan, scan_dataset
from layertap.errors import DatasetError

DATASETS = Path(__file__).parents[2] / "assets" / "datasets"


def test_the_scan_keeps_only_what_the_planner_needs():
    assert {f.name for f in dataclasses.fields(DatasetScan)} == {"path", "num_rows", "sha256", "duplicates"}


def test_the_content_hash_names_the_bytes_of_a_file_or_a_folder(tmp_path: Path) -> None:
    rows = [{"id": f"r{i}", "text": f"row {i}"} for i in range(5)]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    first = scan_dataset(path)
    rows[2]["text"] = "row 2, edited"  # as many rows as before
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    again = scan_dataset(path)
    assert again.num_rows == first.num_rows and again.sha256 != first.sha256
    assert again.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    folder = tmp_path / "arrow"
    datasets.Dataset.from_list(rows).save_to_disk(str(folder))
    before = scan_dataset(folder).sha256
    datasets.Dataset.from_list([*rows[:2], {"id": "r2", "text": "row 2, edited twice"}, *rows[3:]]).save_to_disk(
        str(tmp_path / "arrow2")
    )
    assert scan_dataset(tmp_path / "arrow2").sha256 not in (before, again.sha256)


def test_scan_counts_every_row_unreadable_ones_too():
    scan = scan_dataset(DATASETS / "mixed.jsonl")
    assert scan.num_rows == 13  # rows 7 (malformed JSON) and 11 (not an object) included
    assert scan.duplicates == {}


def test_each_duplicate_points_at_the_first_row_with_its_id():
    scan = scan_dataset(DATASETS / "duplicate_ids.jsonl")  # ids a, b, a, 3, 3, b, a
    assert scan.num_rows == 7
    assert scan.duplicates == {2: 0, 4: 3, 5: 1, 6: 0}  # row 4's id 3 is row 3's row-number id


def test_rows_with_unusable_ids_take_no_part_in_duplicates(tmp_path: Path):
    path = tmp_path / "ids.jsonl"
    rows = [{"id": "x"}, {"id": ["x"]}, {"id": "\ud800"}, {"id": True}, {"id": "x"}, {"id": "\ud800"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "[1]\n")
    scan = scan_dataset(path)
    assert scan.num_rows == 7 and scan.duplicates == {4: 0}


def test_columnar_scans_read_ids_only_and_agree_with_jsonl(tmp_path: Path):
    # ids repeat every 250 rows; the last row has none, so its id is its row number "599", which row 10 also has
    rows = [{"id": f"r{i % 250}", "text": "t" * i} for i in range(599)] + [{"id": None, "text": "last"}]
    rows[10]["id"] = "599"  # the last row's row-number id: the last row is row 10's duplicate
    parquet = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist(rows), parquet, row_group_size=100)
    folder = tmp_path / "saved"
    datasets.Dataset.from_list(rows).save_to_disk(str(folder))
    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    expected = {i: i % 250 for i in range(250, 599) if i % 250 != 10} | {
        510: 260,
        599: 10,
    }  # row 260 is now first "r10"
    for path in (parquet, folder, jsonl):
        scan = scan_dataset(path)
        assert scan.num_rows == 600 and scan.duplicates == expected, path
    no_ids = tmp_path / "no_ids.parquet"
    pq.write_table(pa.Table.from_pylist([{"text": "a"}, {"text": "a"}]), no_ids)
    assert scan_dataset(no_ids).duplicates == {}  # row numbers as ids never repeat


def test_empty_dataset_is_refused(tmp_path: Path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(DatasetError, match=r"empty\.jsonl has no rows"):
        scan_dataset(empty)
