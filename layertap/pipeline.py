"""One extraction run: dataset rows -> tokenized samples -> engine -> validated, committed files.

The same pieces serve the CLI (one process, the whole dataset) and a Celery worker (one shard,
``rows[start:stop]``): ``prepare_run`` resolves the spec and opens the store, ``tokenized_samples``
streams what still needs doing, ``commit_all`` commits what the engine returns.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

from transformers import AutoTokenizer

from layertap.data.chat import ChatTokenizer, check_loss_mask
from layertap.data.reader import iter_rows
from layertap.data.rows import parse_row, sample_id_of
from layertap.data.scan import scan_dataset
from layertap.engines.base import Engine
from layertap.errors import OverlongRow, RowError, SampleError
from layertap.models.tiny import model_dims
from layertap.sample import TokenizedSample
from layertap.spec import CaptureSpec, ExtractionSpec
from layertap.store.manifest import build_manifest
from layertap.store.store import CheckLevel, OutputStore

EngineFactory = Callable[[CaptureSpec], Engine]


class ProgressSink(Protocol):
    """Where a run reports progress (a rich bar in the CLI, metrics in a worker)."""

    def start(self, total: int, already_done: int) -> None: ...

    def advance(self, samples: int, tokens: int) -> None: ...


@dataclass
class RunReport:
    """What one run did; saved under ``<out>/reports/`` so a resumed run can be audited."""

    out: str
    rows: int = 0
    already_done: int = 0
    redone: list[str] = field(default_factory=list)
    computed: list[str] = field(default_factory=list)
    tokens: int = 0
    truncated: int = 0
    skipped_overlong: int = 0
    row_errors: int = 0
    failed: int = 0
    seconds: float = 0.0

    def save(self) -> Path:
        path = Path(self.out) / "reports" / f"run-{time.strftime('%Y%m%dT%H%M%S')}-{time.time_ns() % 10**9}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(self), indent=1))
        return path


def verified_done(store: OutputStore, level: CheckLevel, report: RunReport) -> set[str]:
    """Sample ids whose committed files pass ``store.check``; the rest are redone."""
    done = set()
    for rec in store.records().values():
        if store.check(rec, level):
            report.redone.append(rec.sample_id)
        else:
            done.add(rec.sample_id)
    return done


def tokenized_samples(
    spec: ExtractionSpec,
    store: OutputStore,
    done: set[str],
    report: RunReport,
    *,
    start: int = 0,
    stop: int | None = None,
    progress: ProgressSink | None = None,
) -> Iterator[TokenizedSample]:
    """Rows ``[start, stop)`` that still need capturing, tokenized; bad rows are recorded, not raised."""
    chat = ChatTokenizer(AutoTokenizer.from_pretrained(spec.model))
    for number, row in iter_rows(spec.data, start=start, stop=stop):
        try:
            if isinstance(row, RowError):
                raise row
            sample_id = sample_id_of(number, row)
            if sample_id in done:
                continue
            parsed = parse_row(number, row)
            sample = chat.tokenize(number, sample_id, parsed, max_length=spec.max_length, overlong=spec.overlong)
            check_loss_mask(parsed, sample)
        except RowError as err:
            overlong = isinstance(err, OverlongRow)
            report.skipped_overlong += overlong
            report.row_errors += not overlong
            store.record_error(
                row=err.row, sample_id=err.sample_id, reason=err.reason, kind="overlong" if overlong else "row"
            )
            if progress is not None:
                progress.advance(1, 0)
            continue
        report.truncated += sample.truncated
        yield sample


def commit_all(store: OutputStore, captured: Iterable, report: RunReport, progress: ProgressSink | None = None) -> None:
    """Commit each captured sample; a sample that fails validation is recorded as failed."""
    for cap in captured:
        try:
            store.commit(cap)
        except SampleError as err:
            report.failed += 1
            store.record_error(row=cap.sample.index, sample_id=cap.sample.sample_id, reason=str(err), kind="capture")
            continue
        report.computed.append(cap.sample.sample_id)
        report.tokens += cap.sample.num_tokens
        if progress is not None:
            progress.advance(1, cap.sample.num_tokens)


def run_extraction(
    spec: ExtractionSpec,
    out: Path,
    engine_factory: EngineFactory,
    *,
    progress: ProgressSink | None = None,
    check_level: CheckLevel = "full",
) -> RunReport:
    """Run (or resume) a whole extraction in this process and finalize the store."""
    t0 = time.monotonic()
    num_layers, hidden_size = model_dims(spec.model)
    capture = spec.resolve(num_layers)
    scan = scan_dataset(spec.data)
    engine = engine_factory(capture)
    try:
        manifest = build_manifest(
            spec,
            capture,
            hidden_size=hidden_size,
            compute_dtype=str(getattr(engine, "dtype", "unknown")).removeprefix("torch."),
            dataset_rows=scan.num_rows,
            engine=engine.describe(),
        )
        store = OutputStore.create_or_resume(out, manifest)
        store.sweep_temp_files()
        report = RunReport(out=str(out), rows=scan.num_rows)
        done = verified_done(store, check_level, report)
        report.already_done = len(done)
        if progress is not None:
            progress.start(scan.num_rows, len(done))
        commit_all(
            store, engine.capture(tokenized_samples(spec, store, done, report, progress=progress)), report, progress
        )
        store.finalize(complete=True)
        store.close()
    finally:
        engine.close()
    report.seconds = time.monotonic() - t0
    report.save()
    return report
