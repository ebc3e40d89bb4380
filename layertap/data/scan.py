"""One streaming pass over a dataset before any work is planned: count rows and find duplicate ids.

Sample ids name state records and index entries, so two rows with one id would overwrite each other's
captures or be skipped as "already done" on resume. The first row with an id keeps it; every later
row with the same id becomes a per-row error naming the first's row, and the run goes on. Shards
read only their own rows, so the scan (which sees every id) records the duplicates in the output
folder (``DUPLICATES_FILE``) before any shard runs, and every shard reads them from there.
"""

from __future__ import annotations

import json
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path

from layertap.data.reader import iter_rows
from layertap.data.rows import ID_FIELDS, sample_id_of
from layertap.errors import DatasetError, RowError
from layertap.store.atomic import atomic_write_json

DUPLICATES_FILE = "duplicate_ids.json"


@dataclass(frozen=True, slots=True)
class DatasetScan:
    """What the planner needs and nothing more (a 37K-row scan keeps no per-row list): the row count, and
    ``duplicates``, each row whose id an earlier row has mapped to that earlier (first) row. Unreadable rows
    and unusable ids are counted as rows and reported when their shard processes them."""

    path: Path
    num_rows: int
    duplicates: dict[int, int] = field(default_factory=dict)


def scan_dataset(path: Path) -> DatasetScan:
    """Stream the dataset once (columnar formats read only the id columns) and find repeated ids.

    Raises DatasetError when the dataset cannot be read or has no rows; nothing about one row stops it.
    """
    first_row: dict[str, int] = {}  # the one per-id table duplicates need; dropped when the scan returns
    duplicates: dict[int, int] = {}
    num_rows = 0
    for number, row in iter_rows(path, columns=ID_FIELDS):
        num_rows += 1
        if isinstance(row, RowError):
            continue
        with suppress(RowError):  # an unusable id: reported when the row is processed
            first = first_row.setdefault(sample_id_of(number, row), number)
            if first != number:
                duplicates[number] = first
    if not num_rows:
        raise DatasetError(f"dataset {path} has no rows")
    return DatasetScan(Path(path), num_rows, duplicates)


def save_duplicates(out: Path, scan: DatasetScan) -> None:
    """Record the scan's duplicate rows in the output folder ``out`` (atomically), for every shard to read."""
    atomic_write_json(out / DUPLICATES_FILE, {"duplicates": {str(k): v for k, v in scan.duplicates.items()}})


def load_duplicates(out: Path) -> dict[int, int]:
    """Row -> first row with its id, as ``save_duplicates`` recorded it in ``out`` (empty if it did not)."""
    try:
        doc = json.loads((out / DUPLICATES_FILE).read_text())
    except FileNotFoundError:
        return {}
    return {int(k): int(v) for k, v in doc["duplicates"].items()}
