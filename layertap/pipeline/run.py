"""One extraction run: the steps chained, from the dataset's rows to committed files.

The same function serves the CLI (one process, the whole dataset: `run_extraction`) and a Celery worker (one shard,
``rows[start:stop]``: `run_shard`). A run's facts are resolved once, before its first row (`plan.plan_run`); then
`run_shard` chains the steps (`steps`):

    read -> identify -> parse -> [regenerate] -> tokenize -> capture -> commit

the row planner (`rows.RowPlanner`: read, identify, parse, tokenize; what the store verifiably holds and its rows
still give is skipped, what they no longer give retired), the regenerate step under ``regenerate``
(`generate.regenerate`), and the admit, capture and commit steps (`capture.admit`: a sample held to the engine's
limit; `capture.Capture`: several requests in flight, failing samples retried alone a bounded number of times). Each
outcome goes to one `ledger.Ledger` (the store's logs, the report, and a ``ShardEvents``: a progress bar, or Redis
counters).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path

from layertap.data.scan import load_duplicates, save_duplicates
from layertap.engines.base import Engine
from layertap.engines.factory import EngineFactory
from layertap.errors import ServerError
from layertap.pipeline.capture import Capture, admit
from layertap.pipeline.generate import regenerate, regenerator_for
from layertap.pipeline.ledger import Ledger, ProgressEvents, ProgressSink, RunReport, SampleSink, ShardEvents
from layertap.pipeline.plan import RunPlan, plan_run
from layertap.pipeline.rows import RowPlanner
from layertap.pipeline.steps import Item, Tokenize
from layertap.settings import COMMIT_THREADS
from layertap.spec import ExtractionSpec
from layertap.store.index import SampleRecord
from layertap.store.store import CheckLevel, OutputStore

log = logging.getLogger(__name__)


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


def run_shard(
    plan: RunPlan,
    store: OutputStore,
    engine: Engine,
    *,
    start: int = 0,
    stop: int | None = None,
    events: ShardEvents | None = None,
    attempts: int = 1,
    check_level: CheckLevel = "full",
    commit_threads: int = COMMIT_THREADS,
    sink: SampleSink | None = None,
) -> RunReport:
    """Capture rows ``[start, stop)`` of the plan's dataset into ``store`` with ``engine`` (the plan bound to it:
    `RunPlan.on`), as the row planner plans them (`RowPlanner.plan`, one stream of the dataset).

    Committed samples whose files re-check clean at ``check_level`` and whose rows still give them are skipped;
    those their rows no longer give are retired (their rows done again); bad rows (duplicate ids as the plan's scan
    recorded them in the store) and samples that failed ``attempts`` times are recorded in the store's error log
    (and told to ``events``). Stops early when ``events.keep_going()`` turns False (``report.stopped``). Rows are
    tokenized within the plan's input limit; a new sample the engine would refuse is its row's error. Each sample
    committed is also put to ``sink`` (opened by the caller). Does not finalize.
    """
    spec, events = plan.spec, events or ProgressEvents()
    end = store.manifest.dataset_rows if stop is None else min(stop, store.manifest.dataset_rows)
    shard = None if (start, stop) == (0, None) else (start, stop)
    report = RunReport(out=str(store.root), rows=end - start, shard=shard, engine=engine.describe())
    if (server := engine.provenance) is not None and (differ := store.note_server(server, (start, end))):
        raise ServerError(f"refusing the SGLang server at {server.url}: " + "; ".join(differ))
    done = verified_done(store, check_level, report, start=start, stop=stop)
    report.already_done = len(done)  # less what the planner finds changed, as it goes
    log.info("rows %d-%d: %d samples already done and checked (%s)", start, end, len(done), check_level)
    events.start(end - start, len(done), sum(r.num_tokens for r in done.values()))
    ledger = Ledger(store, report, events, sink)
    tokenize = Tokenize(plan.folder, spec, plan.input_limit)
    regenerated = store.regenerated_rows(done) if spec.regenerate is not None else None
    planner = RowPlanner(spec, tokenize, duplicates=load_duplicates(store.root), regenerated=regenerated,
                         rid=plan.engine.rid)  # fmt: skip
    todo = _todo(planner.plan(done, start=start, stop=stop), ledger)
    regenerator = regenerator_for(spec, engine, tokenize, job=store.writer_id, attempts=attempts)
    try:
        items = todo if regenerator is None else regenerate(todo, regenerator, tokenize, spec, ledger)
        capture = Capture(engine, ledger, attempts=attempts, commit_threads=commit_threads)
        capture.run(admit(items, plan, ledger))
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
            len(report.changed), "; ".join(ledger.why_changed[:3]),
        )  # fmt: skip
    return report


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


def run_extraction(
    spec: ExtractionSpec,
    out: Path,
    engine_factory: EngineFactory,
    *,
    progress: ProgressSink | None = None,
    check_level: CheckLevel = "full",
    commit_threads: int = COMMIT_THREADS,
    sink: SampleSink | None = None,
) -> RunReport:
    """Run (or resume) a whole extraction in this process and finalize the store: the run planned once
    (`plan_run`: the model folder read, the layers resolved, the dataset scanned), bound to its engine, then its
    rows streamed once. With a ``sink``, each sample committed is also put there, and the run returns once the
    sink is drained (`SampleSink.drain`)."""
    t0 = time.monotonic()
    plan = plan_run(spec)
    engine = engine_factory(plan.capture, plan.folder)
    try:
        plan = plan.on(engine)  # a max_length the server refuses: before the store
        store = OutputStore.create_or_resume(out, plan.manifest())
        assert plan.scan is not None  # a plan of its own, not a store's
        save_duplicates(out, plan.scan)
        store.sweep_temp_files()
        if sink is not None:
            sink.open(store, None if engine.provenance is None else engine.provenance.url)
        report = run_shard(plan, store, engine, events=ProgressEvents(progress), check_level=check_level,
                           commit_threads=commit_threads, sink=sink)  # fmt: skip
        store.finalize(complete=True, target=plan.folder)
        store.close()
    finally:
        engine.close()
    if sink is not None:  # the engine freed first: waiting on trainers needs no server
        sink.drain()
    report.seconds = time.monotonic() - t0
    report.save()
    return report
