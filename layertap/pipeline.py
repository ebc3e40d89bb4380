"""One extraction run: dataset rows -> tokenized samples -> engine -> validated, committed files.

The same function serves the CLI (one process, the whole dataset) and a Celery worker (one shard,
``rows[start:stop]``): ``run_shard`` skips what the store verifiably holds and its rows still give
(re-tokenized: `stale_samples`; the others are retired), streams the rest through the engine, retries failing samples alone a
bounded number of times, and reports each outcome to a ``ShardEvents`` (a progress bar, or Redis counters). ``run_extraction`` is the CLI's whole run.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections import Counter, deque
from collections.abc import Callable, Container, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

from layertap.data.chat import ChatTokenizer, check_loss_mask
from layertap.data.reader import Row, iter_rows
from layertap.data.rows import ParsedRow, parse_row, sample_id_of
from layertap.data.scan import load_duplicates, save_duplicates, scan_dataset
from layertap.engines.base import Engine
from layertap.errors import LayertapError, RowError, SampleError, ServerError, SpecError
from layertap.models.folder import ModelFolder
from layertap.sample import CapturedSample, FailedCapture, TokenizedSample
from layertap.spec import CaptureSpec, ExtractionSpec, allowed_bad_rows
from layertap.store.index import SampleRecord
from layertap.store.manifest import REPORTS_DIR, build_manifest
from layertap.store.store import CheckLevel, OutputStore

EngineFactory = Callable[[CaptureSpec], Engine]
log = logging.getLogger(__name__)


class ProgressSink(Protocol):
    """Where a run reports progress (a rich bar in the CLI, metrics in a worker)."""

    def start(self, total: int, already_done: int) -> None: ...

    def advance(self, samples: int, tokens: int) -> None: ...


class ShardEvents(Protocol):
    """What ``run_shard`` reports as it goes; called after the store has recorded each outcome."""

    def start(self, total: int, already_done: int, already_tokens: int) -> None: ...

    def committed(self, sample: TokenizedSample) -> None: ...

    def failed(self, *, row: int, sample_id: str | None, reason: str, kind: str) -> None: ...

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

    def committed(self, sample: TokenizedSample) -> None:
        if self.progress is not None:
            self.progress.advance(1, sample.num_tokens)

    def failed(self, *, row: int, sample_id: str | None, reason: str, kind: str) -> None:
        if self.progress is not None:
            self.progress.advance(1, 0)

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
    skipped_overlong: int = 0
    row_errors: int = 0
    failed: int = 0
    bad: FailureTally = field(default_factory=FailureTally)  # row_errors and failed, by cause
    seconds: float = 0.0
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


def verified_done(
    store: OutputStore, level: CheckLevel, report: RunReport, *, start: int = 0, stop: int | None = None
) -> dict[str, SampleRecord]:
    """Sample id -> record for rows ``[start, stop)`` whose committed files pass ``store.check``; the rest are redone."""
    done = {}
    for rec in store.records().values():
        if rec.index < start or (stop is not None and rec.index >= stop):
            continue
        if store.check(rec, level):
            report.redone.append(rec.sample_id)
        else:
            done[rec.sample_id] = rec
    return done


def chat_tokenizer(spec: ExtractionSpec) -> ChatTokenizer:
    """The folder's tokenizer and chat template, as every row of ``spec``'s run is tokenized."""
    return ChatTokenizer(ModelFolder.read(spec.model).load_tokenizer(spec.trust_remote_code))


def tokenized_samples(
    spec: ExtractionSpec,
    store: OutputStore,
    done: Container[str],
    report: RunReport,
    *,
    start: int = 0,
    stop: int | None = None,
    events: ShardEvents | None = None,
    duplicates: Mapping[int, int] | None = None,
    server_limit: int | None = None,
) -> Iterator[TokenizedSample]:
    """Rows ``[start, stop)`` that still need capturing, tokenized; bad rows are recorded, not raised.

    ``duplicates`` maps a row to the earlier row that has its id (see ``scan_dataset``): such a row is
    an error of kind ``duplicate_id``. A sample longer than ``server_limit`` (a ``max_length`` above the
    server's limit, in a job accepted before a worker told it) is an error of kind ``server_limit``. Only a
    dataset-wide problem (a chat template that cannot mask any conversation, no template at all) raises;
    whatever one row does costs that row only.
    """
    events = events or ProgressEvents()
    duplicates = duplicates or {}
    chat = chat_tokenizer(spec)
    for number, row in iter_rows(spec.data, start=start, stop=stop):
        try:
            sample_id = row_sample_id(number, row, duplicates)
            if sample_id in done:
                continue
            sample = tokenize_row(chat, spec, number, row, sample_id)
            if server_limit is not None and sample.num_tokens > server_limit:
                raise RowError(
                    f"{sample.num_tokens} tokens, more than the {server_limit} the SGLang server accepts (the job's "
                    f"max_length {spec.max_length} is above its limit: submit with max_length at most {server_limit})",
                    row=number, sample_id=sample_id, kind="server_limit",
                )  # fmt: skip
        except RowError as err:
            _row_failed(store, report, events, err)
            continue
        except LayertapError:
            raise
        except Exception as exc:  # a bug met on one row: reported as such, and the run goes on
            log.exception("row %d: unexpected error while preparing it", number)
            reason = f"unexpected {type(exc).__name__}: {exc}"
            _row_failed(store, report, events, RowError(reason, row=number, kind="internal"))
            continue
        report.truncated += sample.truncated
        yield sample


def stale_samples(
    spec: ExtractionSpec,
    records: Mapping[str, SampleRecord],
    *,
    start: int = 0,
    stop: int | None = None,
    duplicates: Mapping[int, int] | None = None,
) -> Iterator[tuple[SampleRecord, str]]:
    """Each of ``records`` of rows ``[start, stop)`` that its row no longer gives, with why: the row re-tokenized as
    ``spec`` tokenizes it (a truncated sample at its stored length), compared with the record (id, ``input_ids``
    hash, loss-mask runs). A dataset regenerated with the same row count (an edited turn, a new system prompt, a
    template fix) changes exactly these; a row that now fails (unreadable, a repeated or other id, no longer
    tokenizes, over ``max_length``) no longer gives its sample either. The one test of what resume retires and
    redoes (`run_shard`) and of what ``verify --data`` reports."""
    by_row: dict[int, list[SampleRecord]] = {}
    for rec in records.values():
        if rec.index >= start and (stop is None or rec.index < stop):
            by_row.setdefault(rec.index, []).append(rec)
    if not by_row:
        return
    duplicates = duplicates or {}
    chat = chat_tokenizer(spec)
    for number, row in iter_rows(spec.data, start=start, stop=stop):
        for rec in by_row.pop(number, []):
            if (why := _why_stale(chat, spec, number, row, rec, duplicates)) is not None:
                yield rec, why
    for rec in (rec for recs in by_row.values() for rec in recs):
        yield rec, f"row {rec.index} is not in {spec.data}"


def _why_stale(
    chat: ChatTokenizer, spec: ExtractionSpec, number: int, row: Row, rec: SampleRecord, duplicates: Mapping[int, int]
) -> str | None:
    """Why row ``number`` no longer gives ``rec`` (None: it does)."""
    at = spec.model_copy(update={"max_length": rec.num_tokens}) if rec.truncated else spec
    try:
        sample_id = row_sample_id(number, row, duplicates)
        sample = tokenize_row(chat, at, number, row, sample_id)
    except RowError as err:
        return f"row {number} of {spec.data} no longer gives a sample: {err.reason}"
    except LayertapError:
        raise
    except Exception as exc:  # a bug met on this row: reported as its error when the run tokenizes it again
        return f"row {number} of {spec.data} fails: unexpected {type(exc).__name__}: {exc}"
    if sample_id != rec.sample_id:
        return f"row {number} of {spec.data} has the id {sample_id!r} now"
    if not rec.describes(sample):
        return f"row {number} of {spec.data} gives other tokens or another loss mask than the stored sample"
    return None


def row_sample_id(number: int, row: Row | RowError, duplicates: Mapping[int, int]) -> str:
    """The id of row ``number``; raises RowError for an unreadable row or a repeated id (the first row keeps it)."""
    if isinstance(row, RowError):
        raise row
    sample_id = sample_id_of(number, row)
    if (first := duplicates.get(number)) is not None:
        raise RowError(
            f"duplicate id {sample_id!r}: row {first} has it first and is the one kept",
            row=number,
            sample_id=sample_id,
            kind="duplicate_id",
        )
    return sample_id


def tokenize_row(chat: ChatTokenizer, spec: ExtractionSpec, number: int, row: Row, sample_id: str) -> TokenizedSample:
    """One row -> its sample under ``spec``'s length limit; raises RowError."""
    parsed: ParsedRow = parse_row(number, row)
    sample = chat.tokenize(number, sample_id, parsed, max_length=spec.max_length, overlong=spec.overlong)
    check_loss_mask(parsed, sample)
    return sample


def _row_failed(store: OutputStore, report: RunReport, events: ShardEvents, err: RowError) -> None:
    overlong = err.kind == "overlong"
    report.skipped_overlong += overlong
    report.row_errors += not overlong
    if not overlong:
        report.bad.add(err.kind, err.reason)
    store.record_error(row=err.row, sample_id=err.sample_id, reason=err.reason, kind=err.kind)
    events.failed(row=err.row, sample_id=err.sample_id, reason=err.reason, kind=err.kind)


class _Capture:
    """Engine -> store for one stream of samples, with poison samples isolated and retried alone.

    When the engine raises (anything but a ``LayertapError`` other than ``SampleError``), every
    sample it was holding becomes a suspect and is captured again on its own, so one bad sample
    never fails its batch-mates. A capture that fails on its own, or whose commit is refused
    (``SampleError``: non-finite values, wrong shapes), costs that sample one attempt; after
    ``attempts`` it is recorded as failed and the run goes on.
    """

    def __init__(
        self,
        store: OutputStore,
        engine: Engine,
        report: RunReport,
        events: ShardEvents,
        attempts: int,
        commit_threads: int = 8,
    ) -> None:
        self.store, self.engine, self.report, self.events = store, engine, report, events
        self.attempts = attempts
        self.tries: Counter[str] = Counter()
        self.alone: list[TokenizedSample] = []
        # Commits (check finiteness, hash, write or rename, fsync) release the GIL, so threads keep the
        # disk busy while the engine runs; at most 2 x threads captured samples wait in memory. 8
        # validate ~10 GB/s of native dumps on an H200 host (sha256 ~1.5 GB/s per thread).
        self.commits = ThreadPoolExecutor(commit_threads, thread_name_prefix="commit")
        self.max_pending = 2 * commit_threads

    def run(self, samples: Iterator[TokenizedSample]) -> None:
        try:
            while (failure := self._stream(samples)) is not None:
                self.alone.extend(failure[0])  # suspects: captured again alone, not blamed yet
            while self.alone and self.events.keep_going():
                sample = self.alone.pop(0)
                if (failure := self._stream(iter([sample]))) is not None:
                    self._attempt_failed(sample, failure[1])
        finally:
            self.commits.shutdown(wait=True)

    def _stream(self, samples: Iterator[TokenizedSample]) -> tuple[list[TokenizedSample], str] | None:
        """Capture and commit until ``samples`` runs out (None) or the engine raises: (held samples, reason)."""
        held: dict[str, TokenizedSample] = {}
        source_error: BaseException | None = None

        def feed() -> Iterator[TokenizedSample]:
            nonlocal source_error
            while self.events.keep_going():
                try:
                    sample = next(samples)
                except StopIteration:
                    return
                except BaseException as exc:  # the dataset or the store, not the engine: never a suspect
                    source_error = exc
                    raise
                held[sample.sample_id] = sample
                yield sample

        captured = self.engine.capture(feed())
        pending: deque[tuple[Future, CapturedSample]] = deque()
        try:
            while True:
                try:
                    cap = next(captured)
                except StopIteration:
                    return None
                except Exception as exc:
                    if source_error is not None or (
                        isinstance(exc, LayertapError) and not isinstance(exc, SampleError)
                    ):
                        raise
                    log.warning("engine failed with %d samples in flight: %s: %s", len(held), type(exc).__name__, exc)
                    return list(held.values()), f"{type(exc).__name__}: {exc}"
                held.pop(cap.sample.sample_id, None)
                if isinstance(cap, FailedCapture):
                    self._attempt_failed(cap.sample, cap.reason)
                    continue
                pending.append((self.commits.submit(self.store.commit, cap), cap))
                while len(pending) > self.max_pending or (pending and pending[0][0].done()):
                    self._settle(*pending.popleft())
        finally:
            while pending:
                self._settle(*pending.popleft())

    def _settle(self, commit: Future, captured: CapturedSample) -> None:
        """Account for one finished commit (in the calling thread, so reports and events need no lock)."""
        sample = captured.sample
        try:
            commit.result()
        except SampleError as err:
            self._attempt_failed(sample, str(err))
            return
        finally:
            self.engine.release(captured)
        self.report.computed.append(sample.sample_id)
        self.report.tokens += sample.num_tokens
        self.events.committed(sample)

    def _attempt_failed(self, sample: TokenizedSample, reason: str) -> None:
        self.tries[sample.sample_id] += 1
        n = self.tries[sample.sample_id]
        log.warning(
            "sample %s (row %d, %d tokens): attempt %d/%d failed: %s",
            sample.sample_id, sample.index, sample.num_tokens, n, self.attempts, reason,
        )  # fmt: skip
        if n < self.attempts:
            self.alone.append(sample)
            return
        self.report.failed += 1
        self.report.bad.add("capture", reason)
        reason = f"{reason} (failed all {n} attempts)"
        self.store.record_error(row=sample.index, sample_id=sample.sample_id, reason=reason, kind="capture")
        self.events.failed(row=sample.index, sample_id=sample.sample_id, reason=reason, kind="capture")


def within_engine_limit(spec: ExtractionSpec, limit: int | None) -> ExtractionSpec:
    """``spec`` with its rows kept within ``limit``, the longest sample the engine takes (an SGLang server's own
    limit, a few tokens below the model's context length): a ``max_length`` above it is refused (SpecError naming
    the limit) before any work; without one, rows longer than the limit are truncated or skipped (``overlong``)
    at it, instead of the server refusing each of them."""
    if limit is None or (spec.max_length is not None and spec.max_length <= limit):
        return spec
    if spec.max_length is not None:
        raise SpecError(
            f"max_length {spec.max_length} is above the longest prompt the SGLang server accepts ({limit} tokens, "
            f"below the model's context length): give at most {limit}"
        )
    log.info("rows are kept within the server's limit of %d tokens (overlong rows: %s)", limit, spec.overlong)
    return spec.model_copy(update={"max_length": limit})


def run_shard(
    spec: ExtractionSpec,
    store: OutputStore,
    engine: Engine,
    *,
    start: int = 0,
    stop: int | None = None,
    events: ShardEvents | None = None,
    attempts: int = 1,
    check_level: CheckLevel = "full",
    commit_threads: int = 8,
) -> RunReport:
    """Capture rows ``[start, stop)`` of ``spec.data`` into ``store`` with ``engine``.

    Committed samples whose files re-check clean at ``check_level`` are skipped; bad rows (duplicate ids
    as the planner's scan recorded them in the store) and samples that failed ``attempts`` times are recorded in the store's error log (and told to ``events``).
    Stops early when ``events.keep_going()`` turns False (``report.stopped``). Rows are kept within the engine's
    limit (`within_engine_limit`); under a ``max_length`` above it, each longer row is its own error. Does not
    finalize.
    """
    server_limit = None
    try:
        spec = within_engine_limit(spec, engine.max_input_tokens)
    except SpecError as exc:  # a job accepted before any worker told its server's limit: its longer rows fail alone
        log.warning("%s; rows longer than that fail one by one", exc)
        server_limit = engine.max_input_tokens
    events = events or ProgressEvents()
    end = store.manifest.dataset_rows if stop is None else min(stop, store.manifest.dataset_rows)
    shard = None if (start, stop) == (0, None) else (start, stop)
    report = RunReport(out=str(store.root), rows=end - start, shard=shard, engine=engine.describe())
    if (server := engine.provenance) is not None and (differ := store.note_server(server, (start, end))):
        raise ServerError(f"refusing the SGLang server at {server.url}: " + "; ".join(differ))
    done = verified_done(store, check_level, report, start=start, stop=stop)
    duplicates = load_duplicates(store.root)
    stale = list(stale_samples(spec, done, start=start, stop=stop, duplicates=duplicates))
    if stale:
        log.warning(
            "%d committed samples no longer match their rows (tokens, loss mask or the row itself changed since they "
            "were stored): retiring them and doing their rows again, e.g. %s",
            len(stale), "; ".join(f"{rec.sample_id}: {why}" for rec, why in stale[:3]),
        )  # fmt: skip
    for rec, _ in stale:
        store.retire(rec)
        del done[rec.sample_id]
    report.changed = [rec.sample_id for rec, _ in stale]
    report.already_done = len(done)
    log.info("rows %d-%d: %d samples already done and checked (%s), %d retired", start, end, len(done), check_level,
             len(stale))  # fmt: skip
    events.start(end - start, len(done), sum(r.num_tokens for r in done.values()))
    samples = tokenized_samples(spec, store, done, report, start=start, stop=stop, events=events, duplicates=duplicates,
                                server_limit=server_limit)  # fmt: skip
    _Capture(store, engine, report, events, attempts, commit_threads).run(samples)
    report.stopped = not events.keep_going()
    return report


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
    folder = ModelFolder.read(spec.model)
    folder.preflight(trust_remote_code=spec.trust_remote_code, max_length=spec.max_length)  # before any work
    capture = spec.resolve(folder.num_layers)
    scan = scan_dataset(spec.data)
    log.info("dataset %s: %d rows, sha256 %s", spec.data, scan.num_rows, scan.sha256)
    engine = engine_factory(capture)
    try:
        within_engine_limit(spec, engine.max_input_tokens)  # a max_length the server refuses: before the store
        manifest = build_manifest(
            spec,
            capture,
            hidden_size=folder.hidden_size,
            compute_dtype=engine.compute_dtype,
            dataset_rows=scan.num_rows,
            dataset_sha256=scan.sha256,
            engine=engine.describe(),
        )
        store = OutputStore.create_or_resume(out, manifest)
        save_duplicates(out, scan)
        store.sweep_temp_files()
        report = run_shard(spec, store, engine, events=ProgressEvents(progress), check_level=check_level)
        store.finalize(complete=True)
        store.close()
    finally:
        engine.close()
    report.seconds = time.monotonic() - t0
    report.save()
    return report
