"""Every dataset format reads the same rows, streams, numbers rows the same way, and fails clearly."""

import gzip
import json
import math
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from layertap.data import iter_rows
from layertap.errors import DatasetError, RowError

MIXED = Path(__file__).parents[2] / "assets" / "datasets" / "mixed.jsonl"


def _json_rows() -> list[dict]:
    """The rows of mixed.jsonl that are JSON objects, parsed here with the standard library."""
    rows = []
    for line in MIXED.read_text().splitlines():
        try:
            value = json.loads(line)
        except ValueError:
            continue
        if isinstance(value, dict):
            rows.append(value)
    return rows


def _columns(rows: list[dict]) -> dict[str, list]:
    """Column lists over the union of keys (``from_pylist`` would take the first row's keys only)."""
    keys = list(dict.fromkeys(k for row in rows for k in row))
    return {k: [row.get(k) for row in rows] for k in keys}


def _drop_nulls(value):
    """Arrow fills keys a row lacks with None; compare rows without them."""
    if isinstance(value, dict):
        return {k: _drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_nulls(v) for v in value]
    return value


def test_jsonl_rows_errors_and_numbering():
    items = list(iter_rows(MIXED))
    numbers = [n for n, _ in items]
    assert numbers == list(range(13))  # 14 lines, one blank: blank lines are not rows
    errors = {n: r for n, r in items if isinstance(r, RowError)}
    assert sorted(errors) == [7, 11]
    assert errors[7].row == 7 and "line 9" in errors[7].reason and "malformed JSON" in errors[7].reason
    assert errors[11].row == 11 and "not a JSON object" in errors[11].reason
    rows = [r for _, r in items if not isinstance(r, RowError)]
    assert rows == _json_rows()


def test_jsonl_gz_and_json_named_jsonl(tmp_path: Path):
    gz = tmp_path / "mixed.jsonl.gz"
    gz.write_bytes(gzip.compress(MIXED.read_bytes()))
    as_json = tmp_path / "mixed.json"  # datasets' to_json writes JSON Lines under a .json name
    as_json.write_bytes(MIXED.read_bytes())
    expected = [(n, r if isinstance(r, dict) else r.reason) for n, r in iter_rows(MIXED)]
    for path in (gz, as_json):
        got = [(n, r if isinstance(r, dict) else r.reason) for n, r in iter_rows(path)]
        assert got == expected


def test_json_array_streams_rows_and_flags_non_objects(tmp_path: Path):
    rows = _json_rows()
    path = tmp_path / "rows.json"
    path.write_text(json.dumps([*rows[:2], 42, *rows[2:]], indent=1))
    items = list(iter_rows(path))
    assert [n for n, _ in items] == list(range(len(rows) + 1))
    assert isinstance(items[2][1], RowError) and "not a JSON object (got int)" in items[2][1].reason
    assert [r for _, r in items if isinstance(r, dict)] == rows


def test_json_array_items_are_parsed_one_by_one(tmp_path: Path):
    """NaN, a lone-surrogate escape, bytes that are not UTF-8, nesting deeper than any parser goes, a
    broken item: each costs its own row, the rows after it still come (and a surrogate is never "?")."""
    deep = b"[" * 100_000 + b"]" * 100_000
    items = [b'{"text": NaN}', b'{"text": "a\\ud800b"}', b'{"text": "caf\xe9"}', b'{"text": ' + deep + b"}",
             b'{"text": "x", }', b'{"text": "last, [with] {brackets}\\" \\\\"}']  # fmt: skip
    path = tmp_path / "rows.json"
    path.write_bytes(b"[\n" + b",\n".join(items) + b"\n]\n")
    got = dict(iter_rows(path))
    assert list(got) == list(range(6))
    assert math.isnan(got[0]["text"]) and got[1] == {"text": "a\ud800b"}
    for n in (2, 3, 4):
        assert isinstance(got[n], RowError) and got[n].row == n and "malformed JSON" in got[n].reason
    assert got[5] == {"text": 'last, [with] {brackets}" \\'}
    assert dict(iter_rows(path, start=4, stop=5)).keys() == {4}


def test_jsonl_line_nested_too_deep_is_one_bad_row(tmp_path: Path):
    path = tmp_path / "deep.jsonl"
    path.write_text('{"messages": ' + "[" * 100_000 + "]" * 100_000 + '}\n{"text": "fine"}\n')
    got = dict(iter_rows(path))
    assert isinstance(got[0], RowError) and "malformed JSON" in got[0].reason and got[1] == {"text": "fine"}


def test_json_malformed_as_a_whole(tmp_path: Path):
    truncated = tmp_path / "truncated.json"
    truncated.write_text('[{"text": "a"}, {"text": "b"')
    with pytest.raises(DatasetError, match=r"truncated\.json is malformed JSON after 1 rows"):
        list(iter_rows(truncated))
    obj = tmp_path / "object.json"
    obj.write_text('{\n  "data": [{"text": "a"}]\n}\n')
    with pytest.raises(DatasetError, match=r"object\.json is not a JSON array"):
        list(iter_rows(obj))


def test_parquet_matches_jsonl_and_seeks_across_row_groups(tmp_path: Path):
    rows = _json_rows()
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.table(_columns(rows)), path, row_group_size=3)
    assert pq.ParquetFile(path).num_row_groups > 2
    got = list(iter_rows(path))
    assert [n for n, _ in got] == list(range(len(rows)))
    assert [_drop_nulls(r) for _, r in got] == _drop_nulls(rows)
    for start, stop in [(0, 1), (2, 7), (4, None), (6, 6), (9, 100)]:
        part = list(iter_rows(path, start=start, stop=stop))
        assert part == got[start:stop]
    only_ids = list(iter_rows(path, columns=("id", "conversation_id", "absent")))
    assert [r for _, r in only_ids] == [{"id": r["id"], "conversation_id": r["conversation_id"]} for _, r in got]
    assert [r for _, r in iter_rows(path, columns=("nothing",))] == [{}] * len(rows)


def test_save_to_disk_folder_matches_jsonl(tmp_path: Path):
    rows = _json_rows()
    folder = tmp_path / "saved"
    datasets.Dataset.from_dict(_columns(rows)).save_to_disk(str(folder))
    got = list(iter_rows(folder))
    assert [n for n, _ in got] == list(range(len(rows)))
    assert [_drop_nulls(r) for _, r in got] == _drop_nulls(rows)
    assert list(iter_rows(folder, start=3, stop=5)) == got[3:5]
    assert [r for _, r in iter_rows(folder, columns=("nothing",))] == [{}] * len(rows)

    one_split = tmp_path / "dict1"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(_columns(rows))}).save_to_disk(str(one_split))
    assert list(iter_rows(one_split)) == got
    two_splits = tmp_path / "dict2"
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_dict(_columns(rows)), "test": datasets.Dataset.from_dict(_columns(rows[:1]))}
    ).save_to_disk(str(two_splits))
    with pytest.raises(DatasetError, match=r"holds splits \['test', 'train'\]"):
        list(iter_rows(two_splits))


def test_jsonl_start_stop_skips_without_parsing(tmp_path: Path):
    all_items = [(n, r if isinstance(r, dict) else r.reason) for n, r in iter_rows(MIXED)]
    for start, stop in [(0, 3), (5, 9), (7, 8), (12, None)]:
        part = [(n, r if isinstance(r, dict) else r.reason) for n, r in iter_rows(MIXED, start=start, stop=stop)]
        assert part == all_items[start:stop]


def test_unusable_paths_name_the_path(tmp_path: Path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(DatasetError, match=r"dataset not found: .*nope\.jsonl"):
        list(iter_rows(missing))
    csv = tmp_path / "rows.csv"
    csv.write_text("a,b\n")
    with pytest.raises(DatasetError, match=r"unknown dataset format for .*rows\.csv"):
        list(iter_rows(csv))
    plain = tmp_path / "plain_folder"
    plain.mkdir()
    with pytest.raises(DatasetError, match=r"plain_folder is a folder but not one written by datasets"):
        list(iter_rows(plain))
    fake = tmp_path / "fake.parquet"
    fake.write_text("not parquet")
    with pytest.raises(DatasetError, match=r"fake\.parquet is not a readable Parquet file"):
        list(iter_rows(fake))
    bad_gz = tmp_path / "bad.jsonl.gz"
    bad_gz.write_bytes(b"not gzip at all")
    with pytest.raises(DatasetError, match=r"cannot read dataset .*bad\.jsonl\.gz"):
        list(iter_rows(bad_gz))
    cut_gz = tmp_path / "cut.jsonl.gz"
    cut_gz.write_bytes(gzip.compress(MIXED.read_bytes())[:-20])
    with pytest.raises(DatasetError, match=r"cannot read dataset .*cut\.jsonl\.gz: EOFError"):
        list(iter_rows(cut_gz))


def test_jsonl_shards_seek_from_checkpoints_and_read_the_same(tmp_path: Path, monkeypatch):
    from layertap.data import reader

    monkeypatch.setattr(reader, "CHECKPOINT_ROWS", 7)
    lines = []
    for i in range(100):
        lines.append("{broken" if i % 23 == 5 else json.dumps({"id": f"r{i}", "text": "é" * (i % 5)}))
        if i % 11 == 0:
            lines.append("   ")  # blank lines are not rows, but count as lines in error messages
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(lines) + "\n")

    def shape(items):
        return [(n, r.reason if isinstance(r, RowError) else r["id"]) for n, r in items]

    whole = shape(iter_rows(path))
    assert len(whole) == 100
    for start, stop in [(0, 10), (10, 20), (40, 61), (63, 64), (90, None), (0, None), (15, 16)]:
        assert shape(iter_rows(path, start=start, stop=stop)) == whole[start:stop], (start, stop)
    marks = next(v for k, v in reader._jsonl_checkpoints.items() if k[0] == str(path.resolve()))
    assert set(marks) == set(range(0, 100, 7))  # learned once; later shards started from them
    path.write_text("\n".join(reversed(lines)) + "\n")  # same size; a changed file is not read through old marks
    assert shape(iter_rows(path, start=40, stop=45)) == shape(iter_rows(path))[40:45]
