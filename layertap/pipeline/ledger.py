"""What a run reports, all through one `Ledger`: each row's outcome goes to the store's logs, the run's report and
its events (a progress bar, or a worker's Redis counters and metrics) at once, so no step holds the three apart.

`RunReport` is what one run did (saved under ``<out>/reports/``), `FailureTally` its bad rows by cause, and
`run_verdict` whether a finished run or job succeeded.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

from layertap.errors import RowError
from layertap.regenerate import Regenerated, retokenization_mismatches
from layertap.sample import TokenizedSample
from layertap.spec import allowed_bad_rows
from layertap.store.index import SampleRecord
from layertap.store.manifest import REPORTS_DIR
from layertap.store.store import OutputStore


class ProgressSink(Protocol):
    """Where a run reports progress (a rich bar in the CLI, metrics in a worker)."""

    def start(self, total: int, already_done: int) -> None: ...

    def advance(self, samples: int, tokens: int) -> None: ...

    def generated(self, tokens: int) -> None:
        """A row was regenerated: ``tokens`` new tokens (before its capture)."""
        ...


@dataclass(frozen=True, slots=True)
class Committed:
    """One sample committed to its target: its ``record``, the ``seconds`` its commit took (checks, write or rename,
    fsync, a stream's put) in its commit thread, and when that ended (``time.perf_counter``)."""

    sample: TokenizedSample
    record: SampleRecord
    seconds: float
    ended: float


class ShardEvents(Protocol):
    """What `Run.rows` reports as it goes; called after the store has recorded each outcome. Timings come here too
    (`committed`): a worker's metrics and a benchmark's clock read them, nothing wraps the store."""

    def start(self, total: int, already_done: int, already_tokens: int) -> None: ...

    def committed(self, done: Committed) -> None: ...

    def failed(self, *, row: int, sample_id: str | None, reason: str, kind: str) -> None: ...

    def generated(self, *, row: int, tokens: int, cut_turns: int) -> None:
        """Row ``row`` (its dataset row number) was regenerated: ``tokens`` new tokens over its turns, ``cut_turns`` of
        them cut at max_new_tokens (finish_reason ``length``); called once per regeneration, before its capture. A row
        regenerated again (a resumed shard) is told again: the latest regeneration of a row is the one that counts."""
        ...

    def retired(self, record: SampleRecord) -> None:
        """A sample counted done at ``start`` that its row no longer gives: no longer done (its row comes next)."""
        ...

    def keep_going(self) -> bool:
        """False once the run should stop at the next sample (job cancelled, shard taken away)."""
        ...


class ProgressEvents:
    """``ShardEvents`` for a progress bar (or nothing): every outcome advances it, nothing stops it."""

    def __init__(self, progress: ProgressSink | None = None) -> None:
        self.progress = progress

    def start(self, total: int, already_done: int, already_tokens: int) -> None:
        if self.progress is not None:
            self.progress.start(total, already_done)

    def committed(self, done: Committed) -> None:
        if self.progress is not None:
            self.progress.advance(1, done.sample.num_tokens)

    def failed(self, *, row: int, sample_id: str | None, reason: str, kind: str) -> None:
        if self.progress is not None:
            self.progress.advance(1, 0)

    def generated(self, *, row: int, tokens: int, cut_turns: int) -> None:
        if self.progress is not None:  # the run report counts cut turns
            self.progress.generated(tokens)

    def retired(self, record: SampleRecord) -> None:
        if self.progress is not None:
            self.progress.advance(-1, 0)

    def keep_going(self) -> bool:
        return True


@dataclass
class FailureTally:
    """Bad rows counted by cause: kind and reason with numbers blanked (row numbers, rids, token counts
    differ between rows of one cause), with the first reason seen for each as its example."""

    counts: dict[str, int] = field(default_factory=dict)
    examples: dict[str, str] = field(default_factory=dict)

    def add(self, kind: str, reason: str) -> None:
        key = f"{kind}: {re.sub(r'[0-9]+', 'N', reason)[:200]}"
        self.counts[key] = self.counts.get(key, 0) + 1
        self.examples.setdefault(key, f"{kind}: {reason[:300]}")

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def summary(self, n: int = 3) -> str:
        """Counts by kind, then the ``n`` most frequent causes as ``"count x example"``."""
        kinds: dict[str, int] = {}
        for key, count in self.counts.items():
            kind = key.split(":", 1)[0]
            kinds[kind] = kinds.get(kind, 0) + count
        by_kind = ", ".join(f"{kind} {count}" for kind, count in sorted(kinds.items(), key=lambda kv: -kv[1]))
        top = sorted(self.counts.items(), key=lambda kv: -kv[1])[:n]
        return f"by kind: {by_kind}; most frequent: " + " | ".join(
            f"{count} x {self.examples[key]}" for key, count in top
        )


def run_verdict(*, rows: int, stored: int, bad: FailureTally, max_bad_rows: str) -> tuple[bool, str]:
    """Whether a finished run (or job) succeeded, and what to say: "" for a clean run, else one line with
    the counts and the most frequent causes. It fails when nothing was stored, or when its bad rows are
    over ``max_bad_rows`` (a count, or a share of ``rows``)."""
    if bad.total == 0 and stored > 0:
        return True, ""
    causes = f"; {bad.summary()}" if bad.total else ""
    if stored == 0:
        return False, f"nothing was stored: none of the {rows} rows gave a sample ({bad.total} bad){causes}"
    allowed = allowed_bad_rows(max_bad_rows, rows)
    counts = f"{bad.total} bad rows of {rows} ({bad.total / max(rows, 1):.2%}), "
    if bad.total > allowed:
        return False, counts + f"over the limit max_bad_rows={max_bad_rows} ({allowed} rows){causes}"
    return True, counts + f"within max_bad_rows={max_bad_rows} ({allowed} rows){causes}"


@dataclass
class RunReport:
    """What one run did; saved under ``<out>/reports/`` so a resumed run can be audited."""

    out: str
    rows: int = 0
    already_done: int = 0
    redone: list[str] = field(default_factory=list)  # committed files that failed their check
    changed: list[str] = field(default_factory=list)  # committed samples their rows no longer give: retired
    computed: list[str] = field(default_factory=list)
    tokens: int = 0
    truncated: int = 0
    generated_tokens: int = 0  # under regenerate: tokens the server generated for the samples captured
    generation_seconds: float = 0.0  # under regenerate: each round's first generation request to its last reply, summed
    turns_cut: int = 0  # regenerated turns cut at max_new_tokens, kept (finish_reason "length")
    retokenization_mismatches: int = 0  # regenerated turns whose generated ids differ from the stored (re-tokenized)
    skipped_overlong: int = 0
    row_errors: int = 0
    failed: int = 0
    bad: FailureTally = field(default_factory=FailureTally)  # row_errors and failed, by cause
    seconds: float = 0.0
    rows_seconds: float = 0.0  # of ``seconds``: the rows (read, plan, capture, commit); the rest starts the run
    finish_seconds: float = 0.0  # of ``seconds``: the finish (the store finalized, the stream's samples acked)
    # Each capture stage's seconds summed over the samples, which overlap (`StageTimes`): commit (into the target, in
    # its commit thread), plan and settle (the run's own thread: the next sample planned, a commit waited for once
    # 2 x commit_threads are pending) and, from an SGLang engine the CLI ran, send (to its thread, placed, sent),
    # prefill (the request's round trip), dump_wait (its reply to its dump folder), validate (the dump read and
    # checked), handover (done, waiting for the run's thread to take it) and refill (its slot waiting for the next)
    stage_seconds: dict[str, float] = field(default_factory=dict)
    shard: tuple[int, int | None] | None = None  # the rows [start, stop) a worker ran; None for a whole run
    stopped: bool = False  # the run was told to stop before its rows were all handled
    engine: dict = field(default_factory=dict)

    def verdict(self, max_bad_rows: str) -> tuple[bool, str]:
        """`run_verdict` of this run: what it stored counts samples committed before it too."""
        stored = self.already_done + len(self.computed)
        return run_verdict(rows=self.rows, stored=stored, bad=self.bad, max_bad_rows=max_bad_rows)

    def save(self) -> Path:
        path = Path(self.out) / REPORTS_DIR / f"run-{time.strftime('%Y%m%dT%H%M%S')}-{time.time_ns() % 10**9}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(self), indent=1))
        return path


class StageTimes:
    """Seconds per capture stage summed over the samples, told by the threads that time them (an engine's
    ``observe``): where a run's time goes, in its report (a worker's go to its metrics instead)."""

    def __init__(self) -> None:
        self.seconds: Counter[str] = Counter()
        self._lock = threading.Lock()

    def observe(self, stage: str, seconds: float) -> None:
        with self._lock:
            self.seconds[stage] += seconds

    def writer(self, stats: dict[str, float]) -> None:
        """A dump's writer stats (`DumpMeta.writer`, an engine's ``on_writer``): the server's own stages, its wait
        for the copies off the device and its write, beside the client's."""
        for stage, key in (("server_ready", "ready_s"), ("server_write", "write_s")):
            if key in stats:
                self.observe(stage, stats[key])


class Ledger:
    """Where a run's steps tell what became of each row: the store's logs (errors, retired samples), the run's report
    and its events, told in that order (events come after the store has recorded the outcome)."""

    def __init__(self, store: OutputStore, report: RunReport, events: ShardEvents) -> None:
        self.store, self.report, self.events = store, report, events
        self.why_changed: list[str] = []  # why each retired sample's row no longer gives it

    def keep_going(self) -> bool:
        return self.events.keep_going()

    def row_failed(self, err: RowError) -> None:
        """Row ``err.row`` gives no sample: recorded as its error (a row skipped as too long is counted apart)."""
        overlong = err.kind == "overlong"
        self.report.skipped_overlong += overlong
        self.report.row_errors += not overlong
        if not overlong:
            self.report.bad.add(err.kind, err.reason)
        self.store.record_error(row=err.row, sample_id=err.sample_id, reason=err.reason, kind=err.kind)
        self.events.failed(row=err.row, sample_id=err.sample_id, reason=err.reason, kind=err.kind)

    def admitted(self, sample: TokenizedSample, regenerated: Regenerated | None) -> None:
        """``sample`` goes on to the capture: counted truncated or not, and for a regenerated row its new tokens, cut
        turns and turns re-tokenized otherwise than generated."""
        self.report.truncated += sample.truncated
        if regenerated is not None:
            self.report.generated_tokens += regenerated.generated_tokens
            self.report.turns_cut += regenerated.cut_turns
            self.report.retokenization_mismatches += len(retokenization_mismatches(regenerated, sample))

    def sample_failed(self, sample: TokenizedSample, reason: str) -> None:
        """``sample`` failed every capture attempt (``reason`` says how many)."""
        self.report.failed += 1
        self.report.bad.add("capture", reason)
        self.store.record_error(row=sample.index, sample_id=sample.sample_id, reason=reason, kind="capture")
        self.events.failed(row=sample.index, sample_id=sample.sample_id, reason=reason, kind="capture")

    def committed(self, done: Committed) -> None:
        """A sample is in its target: counted, told to the events."""
        self.report.computed.append(done.sample.sample_id)
        self.report.tokens += done.sample.num_tokens
        self.timed("commit", done.seconds)
        self.events.committed(done)

    def timed(self, stage: str, seconds: float) -> None:
        """``seconds`` more in ``stage`` of the report's `RunReport.stage_seconds` (told by the run's own thread)."""
        self.report.stage_seconds[stage] = self.report.stage_seconds.get(stage, 0.0) + seconds

    def retired(self, record: SampleRecord, why: str) -> None:
        """A committed sample its row no longer gives (``why``): retired from the store, no longer counted done."""
        self.store.retire(record)
        self.report.changed.append(record.sample_id)
        self.why_changed.append(f"{record.sample_id}: {why}")
        self.report.already_done -= 1
        self.events.retired(record)

    def generated(self, row: int, tokens: int, cut_turns: int) -> None:
        """Row ``row`` was regenerated: ``tokens`` new tokens, ``cut_turns`` turns cut at max_new_tokens."""
        self.events.generated(row=row, tokens=tokens, cut_turns=cut_turns)
