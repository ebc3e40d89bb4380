"""The regenerate step (under ``regenerate`` only): the ``todo`` rows' assistant turns written by the target on the
capture server (`layertap.regenerate.Regenerator`), then each regenerated conversation through the tokenize step,
masked on its regenerated turns; what fails is the row's error, told to the ledger.

Rows go in rounds of ``regenerator.ahead``: a round is regenerated whole, then its rows go through the template, then
its samples are captured. Captured as they ended, every capture was a prefill between two decode steps of the rows
still generating: on one H200 that held generation at 0.76 of SGLang's own rate. Tokenized after the round, not as
each row ends: this thread would hold the GIL just when a decode batch's rows end together (turns cut at one
max_new_tokens) and their threads send the next turns; the template's CPU time (a few ms a row) is small beside a
round's decode.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import replace
from itertools import islice

from layertap.engines.base import Engine
from layertap.errors import RowError, SpecError
from layertap.pipeline.ledger import Ledger
from layertap.pipeline.steps import Item, Tokenize
from layertap.regenerate import Regenerated, Regenerator, RowJob
from layertap.spec import ExtractionSpec

log = logging.getLogger(__name__)


def regenerator_for(
    spec: ExtractionSpec, engine: Engine, tokenize: Tokenize, *, job: str, attempts: int
) -> Regenerator | None:
    """The run's Regenerator on the engine's own server session (None when the run does not regenerate), failing as
    the capture does: ``attempts`` per row, a dropped request recovered by the session (an owned server that died
    restarted); SpecError for an engine that cannot generate (the in-process HF engine)."""
    if (settings := spec.generation) is None:
        return None
    if engine.session is None:
        raise SpecError(
            f"regenerate needs an SGLang capture server to generate on; the {engine.describe().get('name')} engine "
            "cannot (run with --engine sglang)"
        )
    if settings.temperature > 0 and (server := engine.provenance) is not None and not server.deterministic:
        # Without --seed (with it, `RunPlan.on` refused the server): sampling with no promise of reproducibility.
        log.warning(
            "regenerating at temperature %s on a server without --enable-deterministic-inference: SGLang samples with "
            "the turns' seeds only under it, so a row regenerated again (its sample not yet committed when a run "
            "stopped) gets other text; committed text is kept either way", settings.temperature,
        )  # fmt: skip
    return Regenerator(engine.session, tokenize.chat, settings, job=job, attempts=attempts,
                       in_flight=engine.generation_in_flight)  # fmt: skip


def regenerate(
    todo: Iterator[Item], regenerator: Regenerator, tokenize: Tokenize, spec: ExtractionSpec, ledger: Ledger
) -> Iterator[Item]:
    """The ``todo`` items (each with its ``job``) regenerated, round by round, as items with their samples (the
    regenerated row attached, `Regenerated.record`, for the commit); a row refused, failed every generation attempt
    or cut under ``drop_truncated`` is told to ``ledger`` as its error."""
    rows: dict[str, int] = {}

    def jobs() -> Iterator[RowJob]:
        for item in todo:
            assert item.job is not None
            rows[item.job.sample_id] = item.row
            yield item.job

    source = jobs()
    while ledger.keep_going() and (round_jobs := list(islice(source, regenerator.ahead))):
        ended: list[tuple[Regenerated | RowError, int]] = []
        for out in regenerator.regenerate_many(round_jobs):
            ended.append((out, row := rows.pop(out.sample_id or "", -1)))
            if isinstance(out, Regenerated):
                ledger.generated(row, out.generated_tokens, out.cut_turns)
            if not ledger.keep_going():
                break
        items = [_tokenized(out, row, tokenize, spec, ledger) for out, row in ended]
        yield from (item for item in items if item is not None)


def _tokenized(
    out: Regenerated | RowError, row: int, tokenize: Tokenize, spec: ExtractionSpec, ledger: Ledger
) -> Item | None:
    """Row ``row``'s item from its regeneration ``out``, or None once its error is told to ``ledger``."""
    try:
        if isinstance(out, RowError):
            raise out
        if out.cut_turns and spec.drop_truncated:
            reason = f"{out.cut_turns} regenerated turns were cut at max_new_tokens={spec.max_new_tokens} " \
                     "(drop_truncated)"  # fmt: skip
            raise RowError(reason, row=row, sample_id=out.sample_id, kind="generation_truncated")
        sample = tokenize(row, out.sample_id, out.conversation, [t.index for t in out.turns], cut=out.cut)
    except RowError as err:
        ledger.row_failed(err)
        return None
    sample = replace(sample, regenerated=out.record(sample), generated_tokens=out.generated_tokens)
    return Item(row, "todo", sample=sample, regenerated=out)
