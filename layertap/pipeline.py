"""One extraction run: dataset rows -> tokenized samples -> engine -> validated, committed files.

The same function serves the CLI (one process, the whole dataset) and a Celery worker (one shard,
``rows[start:stop]``): ``run_shard`` follows the row planner (`layertap.row_plan`, one stream of the dataset):
it skips what the store verifiably holds and its rows still give, retires what they no longer give, under
``regenerate`` regenerates the rest's responses on the capture server (`layertap.regenerate`, many rows in flight in
threads while the engine captures the rows regenerated before), streams them through the engine, retries failing
samples alone a bounded number of times, and reports each outcome to a ``ShardEvents`` (a progress bar, or Redis
counters). ``run_extraction`` is the CLI's whole run.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections import Counter, deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from itertools import islice
from pathlib import Path
from typing import Protocol

from layertap.data.scan import load_duplicates, save_duplicates, scan_dataset
from layertap.engines.base import Engine
from layertap.engines.factory import EngineFactory
from layertap.errors import LayertapError, RowError, SampleError, ServerError, SpecError
from layertap.models.folder import ModelFolder
from layertap.regenerate import Regenerated, Regenerator, RowJob, retokenization_mismatches
from layertap.row_plan import PlannedRow, RowPlanner
from layertap.sample import CapturedSample, FailedCapture, TokenizedSample
from layertap.settings import COMMIT_THREADS
from layertap.spec import ExtractionSpec, allowed_bad_rows
from layertap.store.index import SampleRecord
from layertap.store.manifest import REPORTS_DIR, build_manifest
from layertap.store.store import CheckLevel, OutputStore

log = logging.getLogger(__name__)


class ProgressSink(Protocol):
    """Where a run reports progress (a rich bar in the CLI, metrics in a worker)."""

    def start(self, total: int, already_done: int) -> None: ...

    def advance(self, samples: int, tokens: int) -> None: ...

    def generated(self, tokens: int) -> None:
        """A row was regenerated: ``tokens`` new tokens (before its capture)."""
        ...


class ShardEvents(Protocol):
    """What ``run_shard`` reports as it goes; called after the store has recorded each outcome."""

    def start(self, total: int, already_done: int, already_tokens: int) -> None: ...

    def committed(self, sample: TokenizedSample) -> None: ...

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

    def committed(self, sample: TokenizedSample) -> None:
        if self.progress is not None:
            self.progress.advance(1, sample.num_tokens)

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
        commit_threads: int,
    ) -> None:
        self.store, self.engine, self.report, self.events = store, engine, report, events
        self.attempts = attempts
        self.tries: Counter[str] = Counter()
        self.alone: list[TokenizedSample] = []
        # Commits (check finiteness, hash, write or rename, fsync) release the GIL, so threads keep the
        # disk busy while the engine runs; at most 2 x threads captured samples wait in memory.
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
    commit_threads: int = COMMIT_THREADS,
    folder: ModelFolder | None = None,
) -> RunReport:
    """Capture rows ``[start, stop)`` of ``spec.data`` into ``store`` with ``engine``, as the row planner plans them
    (`RowPlanner.plan`, one stream of the dataset; ``folder`` is the model folder as the caller read it, else read
    here).

    Committed samples whose files re-check clean at ``check_level`` and whose rows still give them are skipped;
    those their rows no longer give are retired (their rows done again); bad rows (duplicate ids as the planner's
    scan recorded them in the store) and samples that failed ``attempts`` times are recorded in the store's error
    log (and told to ``events``). Stops early when ``events.keep_going()`` turns False (``report.stopped``). Rows
    are kept within the engine's limit (`within_engine_limit`); under a ``max_length`` above it, each longer row
    is its own error. Does not finalize.
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
    report.already_done = len(done)  # less what the planner finds changed, as it goes
    log.info("rows %d-%d: %d samples already done and checked (%s)", start, end, len(done), check_level)
    events.start(end - start, len(done), sum(r.num_tokens for r in done.values()))
    regenerated = store.regenerated_rows(done) if spec.regenerate is not None else None
    planner = RowPlanner(spec, folder or ModelFolder.read(spec.model), duplicates=load_duplicates(store.root),
                         server_limit=server_limit, regenerated=regenerated)  # fmt: skip
    why: list[str] = []
    todo = _todo(planner.plan(done, start=start, stop=stop), store, report, events, why)
    regenerator = _regenerator(spec, engine, planner, store.writer_id, attempts)
    try:
        samples = _given(todo, report) if regenerator is None else _regenerated(todo, regenerator, planner, store,
                                                                                report, events)  # fmt: skip
        _Capture(store, engine, report, events, attempts, commit_threads).run(samples)
    finally:
        if regenerator is not None:
            report.generation_seconds = regenerator.seconds
            regenerator.close()
    report.stopped = not events.keep_going()
    if report.retokenization_mismatches:
        log.warning(
            "%d regenerated turns were generated as other ids than their text tokenizes to; the store holds the text "
            "re-tokenized, as a trainer reads it", report.retokenization_mismatches,
        )  # fmt: skip
    if report.changed:
        log.warning(
            "%d committed samples no longer match their rows (tokens, loss mask or the row itself changed since they "
            "were stored): retired them and did their rows again, e.g. %s",
            len(report.changed), "; ".join(why[:3]),
        )  # fmt: skip
    return report


def _todo(
    planned: Iterator[PlannedRow], store: OutputStore, report: RunReport, events: ShardEvents, why: list[str]
) -> Iterator[PlannedRow]:
    """The ``todo`` items of ``planned``; a changed record is retired (why it changed added to ``why``), a row's
    error recorded, as met."""
    for item in planned:
        if item.status == "changed":
            assert item.record is not None
            store.retire(item.record)
            report.changed.append(item.record.sample_id)
            why.append(f"{item.record.sample_id}: {item.why}")
            report.already_done -= 1
            events.retired(item.record)
        elif item.status == "error":
            assert item.error is not None
            _row_failed(store, report, events, item.error)
        elif item.status == "todo":
            yield item


def _given(todo: Iterator[PlannedRow], report: RunReport) -> Iterator[TokenizedSample]:
    """The samples of rows captured as given."""
    for item in todo:
        assert item.sample is not None
        report.truncated += item.sample.truncated
        yield item.sample


def _regenerator(
    spec: ExtractionSpec, engine: Engine, planner: RowPlanner, job: str, attempts: int
) -> Regenerator | None:
    """The run's Regenerator on the engine's own server (None when the run does not regenerate), failing as the
    capture does: ``attempts`` per row, a dropped request recovered by the capture's own `ServerSession` (an owned
    server that died restarted); SpecError for an engine that cannot generate (the in-process HF engine)."""
    if (settings := spec.generation) is None:
        return None
    if engine.session is None:
        raise SpecError(
            f"regenerate needs an SGLang capture server to generate on; the {engine.describe().get('name')} engine "
            "cannot (run with --engine sglang)"
        )
    if settings.temperature > 0 and (server := engine.provenance) is not None and not server.deterministic:
        log.warning(
            "regenerating at temperature %s on a server without --enable-deterministic-inference: SGLang samples with "
            "the turns' seeds only under it, so a row regenerated again (its sample not yet committed when a run "
            "stopped) gets other text; committed text is kept either way", settings.temperature,
        )  # fmt: skip
    return Regenerator(engine.session, planner.chat, settings, job=job, attempts=attempts,
                       in_flight=engine.generation_in_flight)  # fmt: skip


def _regenerated(
    todo: Iterator[PlannedRow],
    regenerator: Regenerator,
    planner: RowPlanner,
    store: OutputStore,
    report: RunReport,
    events: ShardEvents,
) -> Iterator[TokenizedSample]:
    """The samples of the ``todo`` rows regenerated, each through the template with its regenerated row attached; a
    row refused, failed every generation attempt, cut under ``drop_truncated`` or over the server's limit is
    recorded as its error.

    Rows go in rounds of ``regenerator.ahead``: a round is regenerated whole, then its rows go through the template,
    then its samples are captured. Captured as they ended, every capture was a prefill between two decode steps of
    the rows still generating: on one H200 that held generation at 0.76 of SGLang's own rate. Tokenized after the
    round, not as each row ends: this thread would hold the GIL just when a decode batch's rows end together (turns
    cut at one max_new_tokens) and their threads send the next turns; the template's CPU time (a few ms a row) is
    small beside a round's decode."""
    rows: dict[str, int] = {}

    def jobs() -> Iterator[RowJob]:
        for item in todo:
            assert item.job is not None
            rows[item.job.sample_id] = item.row
            yield item.job

    source = jobs()
    while events.keep_going() and (round_jobs := list(islice(source, regenerator.ahead))):
        ended: list[tuple[Regenerated | RowError, int]] = []
        for out in regenerator.regenerate_many(round_jobs):
            ended.append((out, number := rows.pop(out.sample_id or "", -1)))
            if isinstance(out, Regenerated):
                events.generated(row=number, tokens=out.generated_tokens, cut_turns=out.cut_turns)
            if not events.keep_going():
                break
        samples = [_regenerated_sample(out, number, planner, store, report, events) for out, number in ended]
        yield from (s for s in samples if s is not None)


def _regenerated_sample(
    out: Regenerated | RowError,
    number: int,
    planner: RowPlanner,
    store: OutputStore,
    report: RunReport,
    events: ShardEvents,
) -> TokenizedSample | None:
    """Row ``number``'s sample from its regeneration ``out``, or None once its error is recorded."""
    if isinstance(out, RowError):
        _row_failed(store, report, events, out)
        return None
    cut = out.cut_turns
    try:
        if cut and planner.spec.drop_truncated:
            reason = (
                f"{cut} regenerated turns were cut at max_new_tokens={planner.spec.max_new_tokens} (drop_truncated)"
            )
            raise RowError(reason, row=number, sample_id=out.sample_id, kind="generation_truncated")
        turns = [t.index for t in out.turns]
        sample = planner.tokenized(number, out.sample_id, out.conversation, planner.spec.max_length, turns)
    except RowError as err:
        _row_failed(store, report, events, err)
        return None
    if isinstance(sample := planner.within_server_limit(sample), RowError):
        _row_failed(store, report, events, sample)
        return None
    report.generated_tokens += out.generated_tokens
    report.turns_cut += cut
    report.retokenization_mismatches += len(retokenization_mismatches(planner.chat, out))
    report.truncated += sample.truncated
    return replace(sample, regenerated=out.record(), generated_tokens=out.generated_tokens)


def run_extraction(
    spec: ExtractionSpec,
    out: Path,
    engine_factory: EngineFactory,
    *,
    progress: ProgressSink | None = None,
    check_level: CheckLevel = "full",
    commit_threads: int = COMMIT_THREADS,
) -> RunReport:
    """Run (or resume) a whole extraction in this process and finalize the store; the model folder is read once, and
    after the dataset's scan (`scan_dataset`: row count, duplicate ids, content hash) its rows are streamed once."""
    t0 = time.monotonic()
    folder = ModelFolder.read(spec.model)
    folder.preflight(trust_remote_code=spec.trust_remote_code, max_length=spec.max_length)  # before any work
    capture = spec.resolve(folder.num_layers)
    scan = scan_dataset(spec.data)
    log.info("dataset %s: %d rows, sha256 %s", spec.data, scan.num_rows, scan.sha256)
    engine = engine_factory(capture, folder)
    try:
        kept = within_engine_limit(spec, engine.max_input_tokens)  # a max_length the server refuses: before the store
        manifest = build_manifest(
            spec,
            capture,
            folder=folder,
            effective_max_length=kept.max_length,
            compute_dtype=engine.compute_dtype,
            dataset_rows=scan.num_rows,
            dataset_sha256=scan.sha256,
            engine=engine.describe(),
        )
        store = OutputStore.create_or_resume(out, manifest)
        save_duplicates(out, scan)
        store.sweep_temp_files()
        report = run_shard(spec, store, engine, events=ProgressEvents(progress), check_level=check_level,
                           commit_threads=commit_threads, folder=folder)  # fmt: skip
        store.finalize(complete=True, target=folder)
        store.close()
    finally:
        engine.close()
    report.seconds = time.monotonic() - t0
    report.save()
    return report
