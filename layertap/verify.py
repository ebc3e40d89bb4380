"""``layertap verify``: re-read every sample of a store and report anything a trainer would trip on."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from layertap.store.atomic import TMP_MARK
from layertap.store.guide import write_training_guide
from layertap.store.index import SampleRecord
from layertap.store.store import CheckLevel, OutputStore
from layertap.store.token_freq import read_token_freq, recount, write_token_freq
from layertap.trainers import TOKEN_FREQ_FILE


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
    guide: str | None = None  # TRAIN.md as rewritten (None while the run is incomplete)

    @property
    def ok(self) -> bool:
        return not self.problems


def verify_store(root: Path, level: CheckLevel = "full", *, rewrite_token_freq: bool = False) -> VerifyReport:
    """Check files against the index (size, sha256, keys, shapes, dtypes, ids, finiteness),
    exactly-once (one record per dataset row, no stray sample files), the format's extras and
    ``token_freq.pt`` (recounted from the files; rewritten with ``rewrite_token_freq``), then rewrite
    ``TRAIN.md`` once the run is complete."""
    store = OutputStore.open_existing(root)
    records = sorted(store.records().values(), key=lambda r: r.index)
    report = VerifyReport(root=root, complete=store.manifest.complete)
    unreadable = False
    for rec in records:
        report.samples += 1
        report.tokens += rec.num_tokens
        report.nbytes += rec.nbytes
        problems = store.check(rec, level)
        unreadable |= bool(problems)
        report.problems += [f"{rec.file} ({rec.sample_id}): {p}" for p in problems]
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
        if not unreadable:  # a recount needs every sample file as committed
            report.problems += _token_freq_problems(store, records, rewrite_token_freq)
        report.guide = write_training_guide(root, store.manifest, records)
    else:
        report.warnings.append("the run has not completed yet (manifest complete=false)")
    return report


def _token_freq_problems(store: OutputStore, records: list[SampleRecord], rewrite: bool) -> list[str]:
    """``token_freq.pt`` against counts taken again from every stored sample (rewritten from them if asked)."""
    counts = recount(store.root, records, store.format.ids_key)
    if rewrite:
        write_token_freq(store.root, counts)
    stored = read_token_freq(store.root)
    if stored is None:
        return [f"{TOKEN_FREQ_FILE} is missing (`layertap verify --rewrite-token-freq` derives it from the samples)"]
    if stored != dict(counts):
        wrong = sorted(t for t in set(stored) | set(counts) if stored.get(t, 0) != counts.get(t, 0))
        return [f"{TOKEN_FREQ_FILE} differs from the stored samples' loss-masked tokens at {len(wrong)} token ids "
                f"(first: {wrong[:5]})"]  # fmt: skip
    return []
