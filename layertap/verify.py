"""``layertap verify``: re-read every sample of a store and report anything a trainer would trip on."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from layertap.store.atomic import TMP_MARK
from layertap.store.store import CheckLevel, OutputStore


@dataclass
class VerifyReport:
    """What verify saw; ``ok`` means a trainer can read every committed sample as recorded."""

    root: Path
    samples: int = 0
    tokens: int = 0
    nbytes: int = 0
    complete: bool = False
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def verify_store(root: Path, level: CheckLevel = "full") -> VerifyReport:
    """Check files against the index (size, sha256, keys, shapes, dtypes, ids, finiteness),
    exactly-once (one record per dataset row, no stray sample files) and the format's extras."""
    store = OutputStore.open_existing(root)
    records = sorted(store.records().values(), key=lambda r: r.index)
    report = VerifyReport(root=root, complete=store.manifest.complete)
    for rec in records:
        report.samples += 1
        report.tokens += rec.num_tokens
        report.nbytes += rec.nbytes
        report.problems += [f"{rec.file} ({rec.sample_id}): {p}" for p in store.check(rec, level)]
    for index, n in Counter(r.index for r in records).items():
        if n > 1:
            report.problems.append(f"dataset row {index} is recorded under {n} sample ids")
    recorded = {r.file for r in records}
    for path in sorted(root.glob(store.format.sample_glob)):
        rel = path.relative_to(root).as_posix()
        if rel not in recorded:
            report.problems.append(f"{rel}: sample file with no index record (not committed)")
    report.warnings += [
        f"{p.relative_to(root)}: temp file of an interrupted writer" for p in root.rglob(f"{TMP_MARK}*") if p.is_file()
    ]
    if store.manifest.complete:
        report.problems += store.format.finalized_problems(root, records)
    else:
        report.warnings.append("the run has not completed yet (manifest complete=false)")
    return report
