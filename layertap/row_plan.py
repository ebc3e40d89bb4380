"""The row planner: what a run does with each row of ``[start, stop)``, from one stream of the dataset.

A shard's run, its resume and ``layertap verify --data`` ask the same question of every row: does the store
hold a sample this row still gives? `RowPlanner.plan` answers it in one pass over the rows (after the
dataset's hash scan, the only other read), with one planned item per row, preceded by one per record the
row no longer gives:

- ``done``: a committed record its row still gives (the same id, ``input_ids`` and loss mask);
- ``changed``: a committed record its row no longer gives, with why (the row was edited, fails now, or is
  gone); a run retires it (`OutputStore.retire`), then handles the row's own item, so the row is stored
  anew or becomes its error;
- ``todo``: the row's sample, tokenized, to capture;
- ``error``: the row's `RowError` (unreadable, a repeated id, no chat template fits, too long...).

A row becomes a sample through small stages composed in one place, `RowPlanner.outcome`: its id
(`RowPlanner.sample_id`), then `RowPlanner.sample`: ``parse_row``, the chat template (``ChatTokenizer.tokenize``),
the loss-mask check. A stage that rewrites a conversation (e.g. regenerated assistant turns) goes between parse and
the chat template there. The model folder's facts and its tokenizer are read once per run, by the caller, and passed
in.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Literal

from layertap.data.chat import ChatTokenizer, check_loss_mask
from layertap.data.reader import Row, iter_rows
from layertap.data.rows import parse_row, sample_id_of
from layertap.errors import LayertapError, RowError
from layertap.models.folder import ModelFolder
from layertap.sample import TokenizedSample
from layertap.spec import ExtractionSpec
from layertap.store.index import SampleRecord

log = logging.getLogger(__name__)
Status = Literal["done", "changed", "todo", "error"]


@dataclass(frozen=True, slots=True)
class PlannedRow:
    """One row's plan: ``record`` for ``done`` and ``changed`` (with ``why``), ``sample`` for ``todo``,
    ``error`` for ``error``."""

    row: int
    status: Status
    sample: TokenizedSample | None = None
    record: SampleRecord | None = None
    error: RowError | None = None
    why: str = ""


class RowPlanner:
    """Plans the rows of ``spec.data`` as ``spec`` tokenizes them (its ``max_length`` is the effective one, the
    engine's limit applied), with the tokenizer of ``folder``.

    ``duplicates`` maps a row to the earlier row that has its id (the scan's, `load_duplicates`): such a row is
    an error of kind ``duplicate_id``. A new sample longer than ``server_limit`` (a job's ``max_length`` above its
    server's limit, accepted before a worker told it) is an error of kind ``server_limit``. Only a dataset-wide
    problem (a chat template that cannot mask any conversation, no template at all) raises; whatever one row does
    costs that row only.
    """

    def __init__(
        self,
        spec: ExtractionSpec,
        folder: ModelFolder,
        *,
        duplicates: Mapping[int, int] | None = None,
        server_limit: int | None = None,
    ) -> None:
        self.spec = spec
        self.chat = ChatTokenizer(folder.load_tokenizer(spec.trust_remote_code))
        self.duplicates = duplicates or {}
        self.server_limit = server_limit

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
        for rec in (rec for recs in by_row.values() for rec in recs):
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
            outcome = self._within_server_limit(outcome)
        if isinstance(outcome, RowError):
            yield PlannedRow(number, "error", error=outcome)
        else:
            yield PlannedRow(number, "todo", sample=outcome)

    def sample(self, number: int, row: Row, sample_id: str, max_length: int | None) -> TokenizedSample:
        """Row ``number`` (id ``sample_id``) -> its sample within ``max_length``: the stages, in order; raises
        RowError."""
        parsed = parse_row(number, row)
        sample = self.chat.tokenize(number, sample_id, parsed, max_length=max_length, overlong=self.spec.overlong)
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

    def outcome(self, number: int, row: Row | RowError, max_length: int | None) -> TokenizedSample | RowError:
        """`sample`, or the RowError that row ``number`` is: a bug met on one row is that row's error (kind
        ``internal``); a dataset-wide `LayertapError` raises."""
        if isinstance(row, RowError):  # unreadable
            return row
        try:
            return self.sample(number, row, self.sample_id(number, row), max_length)
        except RowError as err:
            return err
        except LayertapError:
            raise
        except Exception as exc:
            log.exception("row %d: unexpected error while preparing it", number)
            return RowError(f"unexpected {type(exc).__name__}: {exc}", row=number, kind="internal")

    def _why_changed(
        self, number: int, row: Row | RowError, rec: SampleRecord, outcome: TokenizedSample | RowError
    ) -> str | None:
        """Why row ``number`` no longer gives ``rec`` (None: it does), given the row's ``outcome`` under the run's
        limit; a truncated record is compared with its row truncated at the record's length (stored under another
        limit, by a server with another input limit, it is still what its row gives)."""
        at = outcome
        if rec.truncated and not (isinstance(outcome, TokenizedSample) and outcome.num_tokens == rec.num_tokens):
            at = self.outcome(number, row, rec.num_tokens)
        where = f"row {number} of {self.spec.data}"
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

    def _within_server_limit(self, sample: TokenizedSample) -> TokenizedSample | RowError:
        """``sample``, or the error it is when the server would refuse it (only a new sample: one stored before is
        what its server took)."""
        if self.server_limit is None or sample.num_tokens <= self.server_limit:
            return sample
        return RowError(
            f"{sample.num_tokens} tokens, more than the {self.server_limit} the SGLang server accepts (the job's "
            f"max_length {self.spec.max_length} is above its limit: submit with max_length at most {self.server_limit})",
            row=sample.index, sample_id=sample.sample_id, kind="server_limit",
        )  # fmt: skip
