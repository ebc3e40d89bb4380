"""The row planner (read -> identify -> parse -> tokenize): what a run does with each row of ``[start, stop)``, from
one stream of the dataset.

A shard's run, its resume and ``layertap verify --data`` ask the same question of every row: does the store
hold a sample this row still gives? `RowPlanner.plan` answers it in one pass over the rows (after the
dataset's hash scan, the only other read), with one `Item` per row, preceded by one per record the
row no longer gives:

- ``done``: a committed record its row still gives (the same id, ``input_ids`` and loss mask);
- ``changed``: a committed record its row no longer gives, with why (the row was edited, fails now, or is
  gone); a run retires it (`OutputStore.retire`), then handles the row's own item, so the row is stored
  anew or becomes its error;
- ``todo``: the row's sample, tokenized, to capture; under ``regenerate``, the row to regenerate first (``job``:
  the run regenerates it, then its tokenize step (`steps.Tokenize`) gives its sample);
- ``error``: the row's `RowError` (unreadable, a repeated id, no chat template fits, too long...).

A row becomes a sample through the steps composed in one place, `RowPlanner.outcome`: its id (`steps.identify`),
``parse_row``, then the tokenize step (`steps.Tokenize`: the chat template within the run's input limit, the
loss-mask check). A step that rewrites a conversation (e.g. regenerated assistant turns) goes between parse and
tokenize: under ``regenerate``, `RowPlanner.outcome` stops after parse (and the check that the row has turns to
regenerate) with a `RowJob`; the run's regenerate step gives the regenerated conversation to the same tokenize step,
masked on its regenerated turns only. A committed sample's text is never regenerated: under ``regenerate``, a
record is ``done`` when its stored regenerated row (``regenerated``) answers the row's given turns as they are now
and still tokenizes to the record. The tokenize step (and the tokenizer it loads) is made once per run, by the
caller, and passed in.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from typing import Any

from layertap.data.reader import Row, iter_rows
from layertap.data.rows import Conversation, parse_row
from layertap.errors import LayertapError, RowError
from layertap.models.folder import ModelFolder
from layertap.pipeline.lookahead import Lookahead
from layertap.pipeline.steps import Item, Tokenize, identify, unrequestable
from layertap.regenerate import RowJob, stored_conversation, turns_to_regenerate
from layertap.sample import TokenizedSample
from layertap.spec import ExtractionSpec
from layertap.store.index import SampleRecord

log = logging.getLogger(__name__)
Outcome = TokenizedSample | RowJob | RowError  # a row's, as `RowPlanner.outcome` plans it
LOOKAHEAD_ROWS = 32  # rows planned ahead per planning process: a few hundred ms of a GPU run's captures


class RowPlanner:
    """Plans the rows of ``spec.data`` as ``tokenize`` tokenizes them (within the run's input limit).

    ``duplicates`` maps a row to the earlier row that has its id (the scan's, `load_duplicates`): such a row is
    an error of kind ``duplicate_id``; a new row whose id no capture request can name (``rid``: the engine's,
    `steps.unrequestable`) is an error too. Only a dataset-wide problem (a chat template that cannot mask any
    conversation, no template at all) raises; whatever one row does costs that row only. ``regenerated`` maps a
    sample id to its stored regenerated row (`Regenerated.record`), for the ``done`` check under ``spec.regenerate``.
    """

    def __init__(
        self,
        spec: ExtractionSpec,
        tokenize: Tokenize,
        *,
        duplicates: Mapping[int, int] | None = None,
        regenerated: Mapping[str, dict[str, Any]] | None = None,
        rid: tuple[str, str] | None = None,
        processes: int = 0,
    ) -> None:
        self.spec = spec
        self.tokenize = tokenize
        self.duplicates = duplicates or {}
        self.regenerated = regenerated or {}
        self.rid = rid
        self.processes = processes

    def plan(
        self,
        records: Mapping[str, SampleRecord],
        *,
        start: int = 0,
        stop: int | None = None,
        unrecorded: bool = True,
    ) -> Iterator[Item]:
        """The plan of rows ``[start, stop)`` against ``records`` (sample id -> committed record; those of other
        rows are ignored), streaming the dataset once; rows with no record are planned too unless not
        ``unrecorded`` (verify asks only about what is stored). A record whose row is past the dataset's end is
        ``changed`` once the stream ends."""
        by_row: dict[int, list[SampleRecord]] = {}
        for rec in records.values():
            if rec.index >= start and (stop is None or rec.index < stop):
                by_row.setdefault(rec.index, []).append(rec)
        wanted = ((row, data) for row, data in iter_rows(self.spec.data, start=start, stop=stop)
                  if unrecorded or row in by_row)  # fmt: skip
        for row, data, outcome in self._outcomes(wanted):
            yield from self._plan_row(row, data, by_row.pop(row, []), outcome)
        for rec in (rec for _, recs in sorted(by_row.items()) for rec in recs):  # in row order, as the stream
            yield Item(rec.index, "changed", record=rec, why=f"row {rec.index} is not in {self.spec.data}")

    def _outcomes(self, rows: Iterator[tuple[int, Row | RowError]]) -> Iterator[tuple[int, Row | RowError, Outcome]]:
        """Each row with its `outcome`: planned here, or with ``processes`` ahead in processes of their own
        (`Lookahead`)."""
        if not self.processes:
            yield from ((row, data, self.outcome(row, data)) for row, data in rows)
            return
        make = (_planner, (*self.tokenize.made_of, self.duplicates, self.rid))
        ahead = Lookahead(self.outcome, make, processes=self.processes, ahead=LOOKAHEAD_ROWS * self.processes)
        try:
            yield from ahead.outcomes(rows)
        finally:
            ahead.close()
            log.info("rows planned ahead in %d processes: %d, in this one: %d", self.processes,
                     ahead.planned["ahead"], ahead.planned["here"])  # fmt: skip

    def _plan_row(self, row: int, data: Row | RowError, recs: list[SampleRecord], outcome: Outcome) -> Iterator[Item]:
        kept = None
        for rec in recs:
            if (why := self._why_changed(row, data, rec, outcome)) is None:
                kept = rec
            else:
                yield Item(row, "changed", record=rec, why=why)
        if kept is not None:
            yield Item(row, "done", record=kept)
            return
        if not isinstance(outcome, RowError) and (error := unrequestable(row, outcome.sample_id, self.rid)):
            outcome = error
        if isinstance(outcome, RowError):
            yield Item(row, "error", error=outcome)
        elif isinstance(outcome, RowJob):
            yield Item(row, "todo", job=outcome)
        else:
            yield Item(row, "todo", sample=outcome)

    def outcome(self, row: int, data: Row | RowError, within: int | None = None) -> Outcome:
        """Row ``row`` (its ``data`` as read) identified, parsed and tokenized (``within`` a stored sample's own length
        instead of the run's input limit); under ``regenerate``: the `RowJob` of the parsed row, refused when it has no
        turn to regenerate; or the RowError that row is: a bug met on one row is that row's error (kind
        ``internal``); a dataset-wide `LayertapError` raises."""
        if isinstance(data, RowError):  # unreadable
            return data
        try:
            sample_id = identify(row, data, self.duplicates)
            parsed = parse_row(row, data)
            if self.spec.regenerate is not None:
                turns_to_regenerate(parsed, self.spec.regenerate, row=row, sample_id=sample_id)
                return RowJob(row, sample_id, parsed)
            return self.tokenize(row, sample_id, parsed, within=within)
        except RowError as err:
            return err
        except LayertapError:
            raise
        except Exception as exc:
            log.exception("row %d: unexpected error while preparing it", row)
            return RowError(f"unexpected {type(exc).__name__}: {exc}", row=row, kind="internal")

    def _why_changed(
        self, row: int, data: Row | RowError, rec: SampleRecord, outcome: TokenizedSample | RowJob | RowError
    ) -> str | None:
        """Why row ``row`` no longer gives ``rec`` (None: it does), given the row's ``outcome`` under the run's
        limit; a truncated record is compared with its row truncated at the record's length (stored under another
        limit, by a server with another input limit, it is still what its row gives). Under ``regenerate`` the
        record is compared with its stored regenerated row (`_stored_sample`)."""
        where = f"row {row} of {self.spec.data}"
        at = outcome
        if isinstance(outcome, RowJob):
            at = self._stored_sample(outcome, rec)
            if isinstance(at, str):
                return f"{where}: {at}"
        elif rec.truncated and not (isinstance(outcome, TokenizedSample) and outcome.num_tokens == rec.num_tokens):
            at = self.outcome(row, data, within=rec.num_tokens)
        if isinstance(at, RowError):
            return (
                f"{where} fails: {at.reason}"
                if at.kind == "internal"
                else f"{where} no longer gives a sample: {at.reason}"
            )
        if at.sample_id != rec.sample_id:
            return f"{where} has the id {at.sample_id!r} now"
        if not rec.describes(at):
            return f"{where} gives other tokens or another loss mask than the stored sample"
        return None

    def _stored_sample(self, job: RowJob, rec: SampleRecord) -> TokenizedSample | RowError | str:
        """The sample of ``rec``'s stored regenerated row, re-tokenized (at the record's length when it was
        truncated), or why that row no longer answers ``job``'s row (a str): none stored, or the row's given turns
        or the turns to regenerate differ from those the stored row kept and regenerated."""
        stored = self.regenerated.get(rec.sample_id)
        if stored is None:
            return "no regenerated row is stored for its sample"
        conversation, turns, cut = stored_conversation(stored)
        assert isinstance(job.parsed, Conversation) and self.spec.regenerate is not None  # the job's row was checked
        wanted = turns_to_regenerate(job.parsed, self.spec.regenerate, row=job.row, sample_id=job.sample_id)
        kept = [m for i, m in enumerate(job.parsed.messages) if i not in turns]
        if (turns, job.parsed.tools) != (wanted, conversation.tools) or kept != [
            m for i, m in enumerate(conversation.messages) if i not in turns
        ]:
            return "its given turns (or the turns to regenerate) differ from those its stored regenerated row answered"
        try:
            return self.tokenize(job.row, job.sample_id, conversation, turns, cut=cut,
                                 within=rec.num_tokens if rec.truncated else None)  # fmt: skip
        except RowError as err:
            return err


def _planner(folder: ModelFolder, spec: ExtractionSpec, input_limit: int | None, duplicates: Mapping[int, int],
             rid: tuple[str, str] | None) -> RowPlanner:  # fmt: skip
    """A planning process's `RowPlanner` (`Lookahead`): the run's, its own tokenizer loaded."""
    return RowPlanner(spec, Tokenize(folder, spec, input_limit), duplicates=duplicates, rid=rid)
