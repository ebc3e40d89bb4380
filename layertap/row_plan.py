"""The row planner: what a run does with each row of ``[start, stop)``, from one stream of the dataset.

A shard's run, its resume and ``layertap verify --data`` ask the same question of every row: does the store
hold a sample this row still gives? `RowPlanner.plan` answers it in one pass over the rows (after the
dataset's hash scan, the only other read), with one planned item per row, preceded by one per record the
row no longer gives:

- ``done``: a committed record its row still gives (the same id, ``input_ids`` and loss mask);
- ``changed``: a committed record its row no longer gives, with why (the row was edited, fails now, or is
  gone); a run retires it (`OutputStore.retire`), then handles the row's own item, so the row is stored
  anew or becomes its error;
- ``todo``: the row's sample, tokenized, to capture; under ``regenerate``, the row to regenerate first (``job``:
  the caller regenerates it, then `RowPlanner.tokenized` gives its sample);
- ``error``: the row's `RowError` (unreadable, a repeated id, no chat template fits, too long...).

A row becomes a sample through small stages composed in one place, `RowPlanner.outcome`: its id
(`RowPlanner.sample_id`), then `RowPlanner.sample`: ``parse_row``, then `RowPlanner.tokenized`: the chat template (``ChatTokenizer.tokenize``),
the loss-mask check. A stage that rewrites a conversation (e.g. regenerated assistant turns) goes between parse and
the chat template there: under ``regenerate``, `RowPlanner.outcome` stops after parse (and the check that the row has
turns to regenerate) with a `RowJob`; the regenerated conversation goes through the template in
`RowPlanner.tokenized`, masked on its regenerated turns only. A committed sample's text is never regenerated:
under ``regenerate``, a record is ``done`` when its stored regenerated row (``regenerated``) answers the row's given
turns as they are now and still tokenizes to the record. The model folder's facts and its tokenizer are read once
per run, by the caller, and passed in.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from layertap.data.chat import ChatTokenizer, check_loss_mask
from layertap.data.reader import Row, iter_rows
from layertap.data.rows import Conversation, ParsedRow, parse_row, sample_id_of
from layertap.errors import LayertapError, RowError
from layertap.models.folder import ModelFolder
from layertap.regenerate import RowJob, stored_conversation, turns_to_regenerate
from layertap.sample import TokenizedSample
from layertap.spec import ExtractionSpec
from layertap.store.index import SampleRecord

log = logging.getLogger(__name__)
Status = Literal["done", "changed", "todo", "error"]


@dataclass(frozen=True, slots=True)
class PlannedRow:
    """One row's plan: ``record`` for ``done`` and ``changed`` (with ``why``), ``sample`` for ``todo`` (``job``
    instead under ``regenerate``), ``error`` for ``error``."""

    row: int
    status: Status
    sample: TokenizedSample | None = None
    record: SampleRecord | None = None
    error: RowError | None = None
    job: RowJob | None = None
    why: str = ""


class RowPlanner:
    """Plans the rows of ``spec.data`` as ``spec`` tokenizes them (its ``max_length`` is the effective one, the
    engine's limit applied), with the tokenizer of ``folder`` and the spec's chat template variables.

    ``duplicates`` maps a row to the earlier row that has its id (the scan's, `load_duplicates`): such a row is
    an error of kind ``duplicate_id``. A new sample longer than ``server_limit`` (a job's ``max_length`` above its
    server's limit, accepted before a worker told it) is an error of kind ``server_limit``. Only a dataset-wide
    problem (a chat template that cannot mask any conversation, no template at all) raises; whatever one row does
    costs that row only. ``regenerated`` maps a sample id to its stored regenerated row (`Regenerated.record`), for
    the ``done`` check under ``spec.regenerate``.
    """

    def __init__(
        self,
        spec: ExtractionSpec,
        folder: ModelFolder,
        *,
        duplicates: Mapping[int, int] | None = None,
        server_limit: int | None = None,
        regenerated: Mapping[str, dict[str, Any]] | None = None,
    ) -> None:
        self.spec = spec
        self.chat = ChatTokenizer(
            folder.load_tokenizer(spec.trust_remote_code), template_kwargs=spec.chat_template_kwargs
        )
        self.duplicates = duplicates or {}
        self.server_limit = server_limit
        self.regenerated = regenerated or {}

    def plan(
        self,
        records: Mapping[str, SampleRecord],
        *,
        start: int = 0,
        stop: int | None = None,
        unrecorded: bool = True,
    ) -> Iterator[PlannedRow]:
        """The plan of rows ``[start, stop)`` against ``records`` (sample id -> committed record; those of other
        rows are ignored), streaming the dataset once; rows with no record are planned too unless not
        ``unrecorded`` (verify asks only about what is stored). A record whose row is past the dataset's end is
        ``changed`` once the stream ends."""
        by_row: dict[int, list[SampleRecord]] = {}
        for rec in records.values():
            if rec.index >= start and (stop is None or rec.index < stop):
                by_row.setdefault(rec.index, []).append(rec)
        for number, row in iter_rows(self.spec.data, start=start, stop=stop):
            recs = by_row.pop(number, [])
            if recs or unrecorded:
                yield from self._plan_row(number, row, recs)
        for rec in (rec for _, recs in sorted(by_row.items()) for rec in recs):  # in row order, as the stream
            yield PlannedRow(rec.index, "changed", record=rec, why=f"row {rec.index} is not in {self.spec.data}")

    def _plan_row(self, number: int, row: Row | RowError, recs: list[SampleRecord]) -> Iterator[PlannedRow]:
        outcome = self.outcome(number, row, self.spec.max_length)
        kept = None
        for rec in recs:
            if (why := self._why_changed(number, row, rec, outcome)) is None:
                kept = rec
            else:
                yield PlannedRow(number, "changed", record=rec, why=why)
        if kept is not None:
            yield PlannedRow(number, "done", record=kept)
            return
        if isinstance(outcome, TokenizedSample):
            outcome = self.within_server_limit(outcome)
        if isinstance(outcome, RowError):
            yield PlannedRow(number, "error", error=outcome)
        elif isinstance(outcome, RowJob):
            yield PlannedRow(number, "todo", job=outcome)
        else:
            yield PlannedRow(number, "todo", sample=outcome)

    def sample(self, number: int, row: Row, sample_id: str, max_length: int | None) -> TokenizedSample:
        """Row ``number`` (id ``sample_id``) -> its sample within ``max_length``: parsed, then `tokenized`; raises
        RowError."""
        return self.tokenized(number, sample_id, parse_row(number, row), max_length)

    def tokenized(
        self,
        number: int,
        sample_id: str,
        parsed: ParsedRow,
        max_length: int | None,
        turns: Collection[int] | None = None,
    ) -> TokenizedSample:
        """The sample of row ``number``'s ``parsed`` form: the folder's chat template applied to it, as a trainer
        tokenizes it, and the loss mask checked; with ``turns`` (a regenerated conversation) the mask on those turns
        only. Raises RowError. A new sample is then held to the server's limit by the caller."""
        sample = self.chat.tokenize(
            number, sample_id, parsed, max_length=max_length, overlong=self.spec.overlong, turns=turns
        )
        check_loss_mask(parsed, sample)
        return sample

    def sample_id(self, number: int, row: Row) -> str:
        """The id of row ``number``; raises RowError for a repeated id (the first row keeps it)."""
        sample_id = sample_id_of(number, row)
        if (first := self.duplicates.get(number)) is not None:
            raise RowError(
                f"duplicate id {sample_id!r}: row {first} has it first and is the one kept",
                row=number,
                sample_id=sample_id,
                kind="duplicate_id",
            )
        return sample_id

    def outcome(self, number: int, row: Row | RowError, max_length: int | None) -> TokenizedSample | RowJob | RowError:
        """`sample` (under ``regenerate``: the `RowJob` of the parsed row, refused when it has no turn to
        regenerate), or the RowError that row ``number`` is: a bug met on one row is that row's error (kind
        ``internal``); a dataset-wide `LayertapError` raises."""
        if isinstance(row, RowError):  # unreadable
            return row
        try:
            sample_id = self.sample_id(number, row)
            if self.spec.regenerate is not None:
                parsed = parse_row(number, row)
                turns_to_regenerate(parsed, self.spec.regenerate, row_number=number, sample_id=sample_id)
                return RowJob(number, sample_id, parsed)
            return self.sample(number, row, sample_id, max_length)
        except RowError as err:
            return err
        except LayertapError:
            raise
        except Exception as exc:
            log.exception("row %d: unexpected error while preparing it", number)
            return RowError(f"unexpected {type(exc).__name__}: {exc}", row=number, kind="internal")

    def _why_changed(
        self, number: int, row: Row | RowError, rec: SampleRecord, outcome: TokenizedSample | RowJob | RowError
    ) -> str | None:
        """Why row ``number`` no longer gives ``rec`` (None: it does), given the row's ``outcome`` under the run's
        limit; a truncated record is compared with its row truncated at the record's length (stored under another
        limit, by a server with another input limit, it is still what its row gives). Under ``regenerate`` the
        record is compared with its stored regenerated row (`_stored_sample`)."""
        where = f"row {number} of {self.spec.data}"
        at = outcome
        if isinstance(outcome, RowJob):
            at = self._stored_sample(outcome, rec)
            if isinstance(at, str):
                return f"{where}: {at}"
        elif rec.truncated and not (isinstance(outcome, TokenizedSample) and outcome.num_tokens == rec.num_tokens):
            at = self.outcome(number, row, rec.num_tokens)
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
        conversation, turns = stored_conversation(stored)
        assert isinstance(job.row, Conversation) and self.spec.regenerate is not None  # the job's row was checked
        wanted = turns_to_regenerate(job.row, self.spec.regenerate, row_number=job.row_number, sample_id=job.sample_id)
        kept = [m for i, m in enumerate(job.row.messages) if i not in turns]
        if (turns, job.row.tools) != (wanted, conversation.tools) or kept != [
            m for i, m in enumerate(conversation.messages) if i not in turns
        ]:
            return "its given turns (or the turns to regenerate) differ from those its stored regenerated row answered"
        max_length = rec.num_tokens if rec.truncated else self.spec.max_length
        try:
            return self.tokenized(job.row_number, job.sample_id, conversation, max_length, turns)
        except RowError as err:
            return err

    def within_server_limit(self, sample: TokenizedSample) -> TokenizedSample | RowError:
        """``sample``, or the error it is when the server would refuse it (only a new sample: one stored before is
        what its server took)."""
        if self.server_limit is None or sample.num_tokens <= self.server_limit:
            return sample
        return RowError(
            f"{sample.num_tokens} tokens, more than the {self.server_limit} the SGLang server accepts (the job's "
            f"max_length {self.spec.max_length} is above its limit: submit with max_length at most {self.server_limit})",
            row=sample.index, sample_id=sample.sample_id, kind="server_limit",
        )  # fmt: skip
