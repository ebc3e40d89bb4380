"""One extraction run: the `Run` that the CLI, a Celery worker and every benchmark drive.

A run's parts are assembled once: its plan (`plan.plan_run`: the facts resolved before the first row), the engine it
is bound to (`RunPlan.on`), its store (the run folder: manifest, errors, the ledger of what is done) and its target
(`targets`: where committed samples go: files, a stream, or both). `Run.create` assembles a whole run (the CLI's,
a benchmark's); a worker builds one per shard attempt from its job's stored plan and store. Then `Run.rows` chains
the steps over rows ``[start, stop)`` (`Run.steps`, in the order they run):

    read -> identify -> parse -> tokenize (`rows.RowPlanner`) -> todo -> [regenerate] -> admit -> capture -> commit

each outcome told to one `ledger.Ledger` (the store's logs, the report, and ``ShardEvents``: a progress bar, Redis
counters, a benchmark's clock), and `Run.finish` ends a whole run: the target delivered, the store finalized.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial, reduce
from pathlib import Path

from layertap.data.scan import load_duplicates
from layertap.engines.base import Engine
from layertap.engines.factory import EngineFactory
from layertap.errors import ServerError, SpecError
from layertap.pipeline import lookahead
from layertap.pipeline.capture import Capture, admit, switch_interval
from layertap.pipeline.generate import regenerate, regenerator_for
from layertap.pipeline.ledger import Ledger, ProgressEvents, ProgressSink, RunReport, ShardEvents
from layertap.pipeline.plan import RunPlan, plan_run
from layertap.pipeline.rows import RowPlanner
from layertap.pipeline.steps import Item, Tokenize
from layertap.pipeline.targets import FilesTarget, StreamSink, StreamTarget, Target
from layertap.regenerate.client import Regenerator
from layertap.settings import COMMIT_THREADS, SWITCH_INTERVAL_MS, RunSettings, stream_format_problem
from layertap.spec import ExtractionSpec
from layertap.store.store import CheckLevel, OutputStore

log = logging.getLogger(__name__)

Step = Callable[[Iterator[Item]], Iterator[Item]]  # rows in, items out


def target_for(store: OutputStore, sink: StreamSink | None) -> Target:
    """Where ``store``'s run puts its samples: its files, or through ``sink`` too (the both target), or only through
    it (a stream-only store: manifest ``target`` stream)."""
    if sink is None:
        return FilesTarget(store)
    return StreamTarget(store, sink, files=store.manifest.target != "stream")


@dataclass
class Run:
    """One run (or a job's shard of it): ``plan`` bound to ``engine``, its ``store`` and ``target``; ``attempts``
    per sample (the spec's), committed samples re-checked at ``check_level`` on resume, ``commit_threads`` commits
    at once. ``duplicates``: the rows whose id an earlier row has (the plan's scan, else the store's record of it).
    ``plan_processes``: rows planned ahead in processes of their own (`lookahead`); ``switch_interval_ms``: the
    interpreter's while the rows run (`capture.switch_interval`)."""

    plan: RunPlan
    engine: Engine
    store: OutputStore
    target: Target
    check_level: CheckLevel = "full"
    commit_threads: int = COMMIT_THREADS
    duplicates: dict[int, int] = field(default_factory=dict)
    plan_processes: int = 0
    switch_interval_ms: float = SWITCH_INTERVAL_MS

    @classmethod
    def create(
        cls,
        spec: ExtractionSpec,
        out: Path,
        engine_factory: EngineFactory,
        settings: RunSettings | None = None,
        sink: StreamSink | None = None,
    ) -> Run:
        """A whole run of ``spec`` into ``out`` (created, or resumed): planned once, the engine made by
        ``engine_factory`` and bound to the plan (a max_length the server refuses: before the store), the store
        opened and swept of a killed run's temp files, its target ``settings.target`` (a stream's: through ``sink``,
        opened by the caller before this, so that a master or Redis it cannot reach is refused before a server
        takes minutes to start). Close it with `close` (which closes the engine and the sink too)."""
        settings = settings or RunSettings()
        engine = None
        if settings.plan_processes:
            lookahead.prepare()  # its imports made while the run starts
        try:
            if problem := stream_format_problem(settings.stream, spec.format):
                raise SpecError(problem)
            if (sink is None) != (settings.stream is None):
                raise SpecError(
                    "a run streams exactly when it is given the stream's sink (`layertap.stream.open_sink`)"
                )
            plan = plan_run(spec, target=settings.target)
            engine = engine_factory(plan.capture, plan.folder)
            plan = plan.on(engine)
            store = OutputStore.create_or_resume(out, plan.manifest())
            store.sweep_temp_files()
        except BaseException:
            if engine is not None:
                engine.close()
            if sink is not None:
                sink.close()
            raise
        assert plan.scan is not None  # a plan of its own, not a store's: its scan's repeated ids go to the planner
        run = cls(plan, engine, store, target_for(store, sink), settings.resume_check, settings.commit_threads,
                  plan.scan.duplicates, settings.plan_processes, settings.switch_interval_ms)  # fmt: skip
        try:
            run.target.open(None if engine.provenance is None else engine.provenance.url, 0, None)
        except BaseException:
            run.close()
            raise
        return run

    def rows(self, start: int = 0, stop: int | None = None, events: ShardEvents | None = None) -> RunReport:
        """Capture rows ``[start, stop)`` of the plan's dataset into the target, as the row planner plans them (one
        stream of the dataset).

        Samples the target already holds (files that re-check clean, acked samples) whose rows still give them are
        skipped; those their rows no longer give are retired (their rows done again); bad rows and samples that
        failed their attempts are recorded in the store's error log (and told to ``events``). Stops early when
        ``events.keep_going()`` turns False (``report.stopped``). Does not finalize."""
        started = time.monotonic()
        plan, store, engine = self.plan, self.store, self.engine
        events = events or ProgressEvents()
        end = plan.dataset_rows if stop is None else min(stop, plan.dataset_rows)
        shard = None if (start, stop) == (0, None) else (start, stop)
        report = RunReport(out=str(store.root), rows=end - start, shard=shard, engine=engine.describe())
        if (server := engine.provenance) is not None and (differ := store.note_server(server, (start, end))):
            raise ServerError(f"refusing the SGLang server at {server.url}: " + "; ".join(differ))
        done = self.target.done(report, self.check_level, start, stop)
        report.already_done = len(done)  # less what the planner finds changed, as it goes
        log.info("rows %d-%d: %d samples already done and checked (%s)", start, end, len(done), self.check_level)
        events.start(end - start, len(done), sum(r.num_tokens for r in done.values()))
        ledger = Ledger(store, report, events)
        engine.placer = self.target.placer()
        steps, regenerator = self.steps(ledger, done, start, stop)
        try:
            items = reduce(lambda items, step: step(items), steps, iter(()))
            capture = Capture(engine, self.target, ledger, attempts=self.attempts, commit_threads=self.commit_threads)
            with switch_interval(self.switch_interval_ms):  # the steps run lazily, inside the capture
                capture.run(items)
        finally:
            if regenerator is not None:
                report.generation_seconds = regenerator.seconds
                regenerator.close()
        report.stopped = not events.keep_going()
        report.rows_seconds = time.monotonic() - started
        _warn_changes(report, ledger)
        return report

    def steps(self, ledger: Ledger, done: dict, start: int, stop: int | None) -> tuple[list[Step], Regenerator | None]:
        """The steps before the capture, in the order they run: the row planner's (read, identify, parse, tokenize:
        each row ``done``, ``changed``, ``todo`` or ``error``), what is left to do, the regeneration (under
        ``regenerate``: its generator comes back too, for the run to close) and the admission to the engine."""
        spec = self.plan.spec
        tokenize = Tokenize(self.plan.folder, spec, self.plan.input_limit)
        regenerated = self.store.regenerated_rows(done) if spec.regenerate is not None else None
        planner = RowPlanner(spec, tokenize, duplicates=self.duplicates or load_duplicates(self.store.root),
                             regenerated=regenerated, rid=self.plan.engine.rid, processes=self.plan_processes)  # fmt: skip
        regenerator = regenerator_for(spec, self.engine, tokenize, job=self.store.writer_id, attempts=self.attempts)
        steps: list[Step] = [
            lambda _: planner.plan(done, start=start, stop=stop),
            partial(_todo, ledger=ledger),
            *([] if regenerator is None else [lambda items: regenerate(items, regenerator, tokenize, spec, ledger)]),
            lambda items: admit(items, self.plan, ledger),
        ]
        return steps, regenerator

    @property
    def attempts(self) -> int:
        return self.plan.spec.sample_attempts

    def finish(self, report: RunReport, *, started: float) -> RunReport:
        """End a whole run after its rows: the engine closed (waiting on trainers needs no server), the store
        finalized and the target's samples delivered (a stream's acked), in that order where the run has files (its
        TRAIN.md there while trainers read), the other way round for a stream-only run (its record of what is done is
        the acks); the report saved with the run's seconds since ``started`` (`time.monotonic`)."""
        finishing = time.monotonic()
        self.engine.close()
        if self.plan.target == "stream":
            self._delivered(report)
        self.store.finalize(complete=True, target=self.plan.folder)
        if self.plan.target != "stream":
            self._delivered(report)
        now = time.monotonic()
        report.seconds, report.finish_seconds = now - started, now - finishing
        report.save()
        return report

    def _delivered(self, report: RunReport) -> None:
        """Until the target's samples are delivered; what no consumer could use counted against the run, as a failed
        capture is."""
        report.stopped = report.stopped or not self.target.delivered(last=True)
        for _ in range(self.target.undelivered()):
            report.failed += 1
            report.bad.add("dead_letter", "a consumer could not use the sample and dead-lettered it (layertap "
                           "stream-verify names each, with why)")  # fmt: skip

    def close(self) -> None:
        """Release what the run holds: the store's logs, the target's stream and the engine."""
        self.store.close()
        self.target.close()
        self.engine.close()


def run_extraction(
    spec: ExtractionSpec,
    out: Path,
    engine_factory: EngineFactory,
    *,
    settings: RunSettings | None = None,
    sink: StreamSink | None = None,
    progress: ProgressSink | None = None,
) -> RunReport:
    """Run (or resume) a whole extraction in this process: `Run.create`, its rows, `Run.finish`."""
    started = time.monotonic()
    run = Run.create(spec, out, engine_factory, settings, sink)
    try:
        return run.finish(run.rows(events=ProgressEvents(progress)), started=started)
    finally:
        run.close()


def _todo(planned: Iterator[Item], ledger: Ledger) -> Iterator[Item]:
    """The ``todo`` items of ``planned``; a changed record is retired, a row's error recorded, as met."""
    for item in planned:
        if item.status == "changed":
            assert item.record is not None
            ledger.retired(item.record, item.why)
        elif item.status == "error":
            assert item.error is not None
            ledger.row_failed(item.error)
        elif item.status == "todo":
            yield item


def _warn_changes(report: RunReport, ledger: Ledger) -> None:
    if report.retokenization_mismatches:
        log.warning(
            "%d regenerated turns were generated as other ids than their text tokenizes to; the store holds the text "
            "re-tokenized, as a trainer reads it", report.retokenization_mismatches,
        )  # fmt: skip
    if report.changed:
        log.warning(
            "%d committed samples no longer match their rows (tokens, loss mask or the row itself changed since they "
            "were stored): retired them and did their rows again, e.g. %s",
            len(report.changed), "; ".join(ledger.why_changed[:3]),
        )  # fmt: skip
