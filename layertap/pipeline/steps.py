"""The row's steps and the `Item` that goes through them.

A run is a chain of small steps, each taking and yielding `Item`s (datatrove's shape):

    read -> identify -> parse -> [regenerate] -> tokenize -> capture -> commit

read, identify, parse and tokenize are the row planner's (`rows.RowPlanner`: each row planned ``done``, ``changed``,
``todo`` or ``error`` against the store's records, from one stream of the dataset); regenerate is `generate.py`'s,
capture and commit `capture.py`'s; `run.Run.steps` lists them in order. This module holds the steps the planner and the run
share: `identify` (a row's id), `unrequestable` (an id no capture request can name) and `Tokenize` (the chat template
within the run's input limit).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Literal

from layertap.data.chat import ChatTokenizer, check_loss_mask
from layertap.data.reader import Row
from layertap.data.rows import ParsedRow, sample_id_of
from layertap.errors import RowError
from layertap.models.folder import ModelFolder
from layertap.regenerate import Regenerated, RowJob
from layertap.sample import TokenizedSample
from layertap.spec import ExtractionSpec
from layertap.store.index import SampleRecord
from sglang_patch.contract import DumpError, format_rid

Status = Literal["done", "changed", "todo", "error"]


@dataclass(frozen=True, slots=True)
class Item:
    """One row on its way through the steps (``row``: its number in the dataset, 0-based), as the planner left it:
    ``record`` for ``done`` and ``changed`` (with ``why``), ``sample`` for ``todo`` (``job``, the parsed row to
    regenerate first, under ``regenerate``; once regenerated, its ``sample`` and ``regenerated``), ``error`` for
    ``error``."""

    row: int
    status: Status
    sample: TokenizedSample | None = None
    record: SampleRecord | None = None
    error: RowError | None = None
    job: RowJob | None = None
    why: str = ""
    regenerated: Regenerated | None = None


def identify(row: int, data: Row, duplicates: Mapping[int, int]) -> str:
    """The id of row ``row``; RowError for an id that cannot name a sample, or a repeated one (``duplicates``: the
    scan's rows whose id an earlier row has; the first row keeps it)."""
    sample_id = sample_id_of(row, data)
    if (first := duplicates.get(row)) is not None:
        raise RowError(
            f"duplicate id {sample_id!r}: row {first} has it first and is the one kept",
            row=row,
            sample_id=sample_id,
            kind="duplicate_id",
        )
    return sample_id


# The attempt number in a capture rid counts up from the engine's clock in ms at its start: 13 digits until 2286.
_RID_ATTEMPT = 10**13 - 1


def unrequestable(row: int, sample_id: str, rid: tuple[str, str] | None) -> RowError | None:
    """The error row ``row`` is when no capture request can name its id (``rid``: the engine's prefix and job,
    `EngineFacts.rid`): the rid would be too long for a dump folder's name; None: it can, or the engine sends no
    requests. Checked as the row is planned, so such a row is its own error, never a capture's."""
    if rid is None:
        return None
    try:
        format_rid(rid[1], sample_id, _RID_ATTEMPT, prefix=rid[0])
    except DumpError as exc:
        return RowError(str(exc), row=row, sample_id=sample_id)
    return None


class Tokenize:
    """The tokenize step: a parsed row through the model folder's own chat template (with the spec's variables), as
    a trainer tokenizes it, within ``input_limit`` (the run's: `RunPlan.input_limit`) under the spec's overlong
    policy, and its loss mask checked. The folder's tokenizer is loaded once, here."""

    def __init__(self, folder: ModelFolder, spec: ExtractionSpec, input_limit: int | None) -> None:
        self.chat = ChatTokenizer(
            folder.load_tokenizer(spec.trust_remote_code), template_kwargs=spec.chat_template_kwargs
        )
        self.overlong = spec.overlong
        self.input_limit = input_limit
        self.made_of = (folder, spec, input_limit)  # what another process makes the same step of

    def __call__(
        self,
        row: int,
        sample_id: str,
        parsed: ParsedRow,
        turns: Collection[int] | None = None,
        *,
        cut: Collection[int] = (),
        within: int | None = None,
    ) -> TokenizedSample:
        """Row ``row``'s sample; with ``turns`` (a regenerated conversation) masked on those turns only, the ``cut``
        ones without the end of turn they never produced; ``within`` a stored sample's own length (a truncated one is
        compared at it) instead of the input limit. Raises RowError."""
        sample = self.chat.tokenize(
            row,
            sample_id,
            parsed,
            max_length=self.input_limit if within is None else within,
            overlong=self.overlong,
            turns=turns,
            cut=cut,
        )
        check_loss_mask(parsed, sample)
        return sample
