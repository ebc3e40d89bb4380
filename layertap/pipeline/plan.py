"""A run's facts, resolved once before its first row: the `RunPlan`, and `plan_run`, which builds it.

The CLI (`run.run_extraction`), the coordinator (`state.plan.plan_job`) and a worker's shard attempt each call
`plan_run` once: it reads the model folder (its facts, then the checks a run would otherwise meet late), resolves the
layer ids to capture indices, and takes the dataset's row count and hash (a scan, or the store's manifest). The plan
is then bound to the engine that runs the rows (`RunPlan.on`): what it computes in and the longest sample it takes.
Everything after reads the plan; the manifest is its serialization (`RunPlan.manifest`).

The input length has two names: ``spec.max_length``, what the user asked, and ``input_limit``, what the run uses
(rows are tokenized within it: max_length, or the engine's limit below it). A job is planned before its workers'
servers are known: a worker's plan keeps the job's max_length even above its server's limit, and each row longer
than the server takes is that row's error (`capture.admit`).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field, replace
from typing import Any

from layertap.data.scan import DatasetScan, scan_dataset
from layertap.engines.base import Engine
from layertap.errors import ServerError, SpecError
from layertap.models.folder import ModelFolder
from layertap.regenerate import RULES
from layertap.settings import Target
from layertap.spec import CaptureSpec, ExtractionSpec
from layertap.store.manifest import Manifest, model_facts

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EngineFacts:
    """What the engine that runs the rows says of itself: ``describe`` (the manifest's ``engine``), the dtype it
    computes in, the longest sample it takes (None: no limit below the model's context, an in-process engine) and
    what its requests' ids begin with (``rid``: prefix and job; None: it sends none). A job planned before its
    workers: the folder's dtype, no limit, no requests."""

    describe: dict[str, Any]
    compute_dtype: str
    input_limit: int | None = None
    rid: tuple[str, str] | None = None

    @classmethod
    def of(cls, engine: Engine) -> EngineFacts:
        rid = None if engine.rid_prefix is None or engine.job is None else (engine.rid_prefix, engine.job)
        return cls(engine.describe(), engine.compute_dtype, engine.input_limit, rid)


@dataclass(frozen=True, slots=True)
class RunPlan:
    """One run's facts: the user's ``spec``, its layers resolved against ``folder`` (``capture``), the dataset's row
    count and hash, the engine's facts, the ``input_limit`` rows are tokenized within and where its samples go
    (``target``: files, stream or both). ``scan`` is the dataset's
    scan when this plan made one (its repeated ids are saved beside the store); ``stored``: the plan was read back
    from a store's manifest (a job's shard), whose max_length stands whatever the engine's limit."""

    spec: ExtractionSpec
    capture: CaptureSpec
    folder: ModelFolder
    dataset_rows: int
    dataset_sha256: str | None
    engine: EngineFacts
    input_limit: int | None
    target: Target = "files"
    stored: bool = False
    scan: DatasetScan | None = field(default=None, compare=False)

    def on(self, engine: Engine) -> RunPlan:
        """This plan run by ``engine``: its dtype and describe, and rows kept within its limit. A CLI run's max_length
        above that limit is refused (SpecError naming it) before any work, as is seeded sampling on a server that
        cannot reproduce it (`_check_reproducible`); without a max_length, rows longer than the limit
        are truncated or skipped at it (``overlong``), instead of the server refusing each. A stored plan computes in
        its manifest's dtype (ServerError for an engine that would not) and keeps its max_length: each longer row
        is its error (`capture.admit`)."""
        facts = EngineFacts.of(engine)
        _check_reproducible(self.spec, engine)
        if self.stored and facts.compute_dtype != self.engine.compute_dtype:
            raise ServerError(
                f"this worker's {facts.describe.get('name')} engine computes in {facts.compute_dtype}, the job's "
                f"manifest says {self.engine.compute_dtype}; fix the worker's engine settings"
            )
        limit, asked = facts.input_limit, self.spec.max_length
        if self.stored and asked is not None and limit is not None and asked > limit:
            # a job accepted before any worker told its server's limit: its longer rows fail alone
            log.warning("the job's max_length %d is above this server's limit of %d tokens; longer rows fail one by "
                        "one", asked, limit)  # fmt: skip
            return replace(self, engine=facts, input_limit=asked)
        return replace(self, engine=facts, input_limit=input_limit_of(self.spec, limit))

    def manifest(self) -> Manifest:
        """The manifest of this plan: what a trainer and a resumed run need to trust the store's files."""
        spec, capture = self.spec, self.capture
        return Manifest(
            format=spec.format,
            store_dtype=spec.store_dtype,
            compute_dtype=self.engine.compute_dtype,
            model_path=os.path.realpath(spec.model),
            **model_facts(self.folder),
            hidden_size=self.folder.hidden_size,
            num_layers=capture.num_layers,
            layer_convention=capture.convention,
            layer_ids_given=list(capture.given_ids),
            capture_indices=list(capture.layers),
            final_post_norm=capture.final_post,
            final_pre_norm=capture.final_pre,
            engine=self.engine.describe,
            generation=None if (gen := spec.generation) is None else {**gen.model_dump(), "rules": RULES,
                                                                      "drop_truncated": spec.drop_truncated},
            max_length=spec.max_length,
            input_limit=self.input_limit,
            overlong=spec.overlong,
            chat_template_kwargs=spec.chat_template_kwargs,
            dataset_path=os.path.realpath(spec.data),
            dataset_rows=self.dataset_rows,
            dataset_sha256=self.dataset_sha256,
            target=self.target,
        )  # fmt: skip


def _check_reproducible(spec: ExtractionSpec, engine: Engine) -> None:
    """SpecError when ``spec`` regenerates at a temperature above 0 with a seed (reproducible sampling asked for) on a
    server that samples without the requests' seeds: SGLang (0.5.10 to 0.5.14) builds them only under
    ``--enable-deterministic-inference`` (`sampling_batch_info.py`), so a rerun of a row would sample other text."""
    gen = spec.generation
    if gen is None or gen.temperature == 0 or gen.seed is None:
        return
    if (server := engine.provenance) is not None and not server.deterministic:
        raise SpecError(
            f"--seed {gen.seed} at --temperature {gen.temperature} asks for reproducible sampling, which the SGLang "
            f"server at {server.url} cannot give: started without --enable-deterministic-inference, it samples "
            "without the requests' sampling_seed. Start it with that flag (--sglang-args for a server layertap "
            "launches; it needs --attention-backend fa3, triton or flashinfer, so the CPU server cannot), leave out "
            "--seed to sample without that promise, or regenerate greedily (--temperature 0)"
        )


def input_limit_of(spec: ExtractionSpec, limit: int | None) -> int | None:
    """The length ``spec``'s rows are kept within on an engine that takes at most ``limit`` tokens (None: no limit
    below the model's context): its max_length, refused (SpecError naming the limit) when above ``limit``; without
    one, ``limit``, at which longer rows are truncated or skipped (``overlong``) instead of the server refusing each."""
    asked = spec.max_length
    if limit is None or (asked is not None and asked <= limit):
        return asked
    if asked is not None:
        raise SpecError(
            f"max_length {asked} is above the longest prompt the SGLang server accepts ({limit} tokens, "
            f"below the model's context length): give at most {limit}"
        )
    log.info("rows are kept within the server's limit of %d tokens (overlong rows: %s)", limit, spec.overlong)
    return limit


def plan_run(
    spec: ExtractionSpec,
    *,
    target: Target = "files",
    stored: Manifest | None = None,
    engine: dict[str, Any] | None = None,
) -> RunPlan:
    """The plan of ``spec``: its model folder read once (SpecError when it cannot be read as one), checked
    (`ModelFolder.preflight`) and its layer ids resolved; the dataset scanned (`scan_dataset`) unless ``stored``, the
    store's manifest (a job's shard), gives its rows and hash. Until bound to an engine (`RunPlan.on`) it computes in
    the folder's dtype (``stored``: the manifest's) under ``engine``'s describe (a job's: its workers' engines are in
    their reports) and keeps rows within max_length. Its samples go to ``target`` (``stored``: the manifest's)."""
    try:
        folder = ModelFolder.read(spec.model)
    except (OSError, ValueError) as exc:  # a name the filesystem refuses (too long, NUL, not UTF-8), a file
        raise SpecError(f"model {spec.model} cannot be read as a model folder: {exc}") from exc
    folder.preflight(trust_remote_code=spec.trust_remote_code, max_length=spec.max_length)  # before any work
    capture = spec.resolve(folder.num_layers)
    if stored is not None:
        facts = EngineFacts(stored.engine, stored.compute_dtype)
        return RunPlan(spec, capture, folder, stored.dataset_rows, stored.dataset_sha256, facts, spec.max_length,
                       stored.target, stored=True)  # fmt: skip
    scan = scan_dataset(spec.data)
    log.info("dataset %s: %d rows, sha256 %s", spec.data, scan.num_rows, scan.sha256)
    facts = EngineFacts(engine or {}, folder.dtype)
    return RunPlan(spec, capture, folder, scan.num_rows, scan.sha256, facts, spec.max_length, target, scan=scan)
