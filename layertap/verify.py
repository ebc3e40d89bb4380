"""``layertap verify``: re-read every sample of a store and report anything a trainer would trip on."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from layertap.data.scan import scan_dataset
from layertap.errors import RowError
from layertap.models.folder import ModelFolder
from layertap.pipeline.rows import RowPlanner
from layertap.pipeline.steps import Tokenize
from layertap.regenerate import stored_conversation
from layertap.spec import ExtractionSpec
from layertap.store.atomic import TMP_MARK
from layertap.store.guide import target_folder, write_training_guide
from layertap.store.index import SampleRecord, count_json_lines
from layertap.store.manifest import Manifest, model_facts
from layertap.store.store import REGENERATED, CheckLevel, OutputStore
from layertap.store.token_freq import read_token_freq, recount, write_token_freq
from layertap.trainers import TOKEN_FREQ_FILE


@dataclass
class VerifyReport:
    """What verify saw (``stream-verify`` too: `layertap.stream.verify`); ``ok`` means a trainer can read every
    committed sample as recorded."""

    what: str  # the store's folder, or ``stream NAME``
    samples: int = 0
    tokens: int = 0
    nbytes: int = 0
    complete: bool = False
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    guide: str | None = None  # TRAIN.md as rewritten (None while the run is incomplete)

    @property
    def ok(self) -> bool:
        return not self.problems


def verify_store(
    root: Path,
    level: CheckLevel = "full",
    *,
    rewrite_token_freq: bool = False,
    data: Path | None = None,
    trust_remote_code: bool = False,
) -> VerifyReport:
    """Check files against the index (size, sha256, keys, shapes, dtypes, ids, finiteness),
    exactly-once (one record per dataset row, no stray sample files), the format's extras and
    ``token_freq.pt`` (recounted from the files; rewritten with ``rewrite_token_freq``), with ``data``
    the samples against that dataset (`data_problems`), then rewrite ``TRAIN.md`` once the run is complete."""
    store = OutputStore.open_existing(root)
    records = sorted(store.records().values(), key=lambda r: r.index)
    report = VerifyReport(what=str(root), complete=store.manifest.complete)
    if store.manifest.target == "stream":
        return _stream_only(store, records, report)
    unreadable = False
    for rec in records:
        report.samples += 1
        report.tokens += rec.num_tokens
        report.nbytes += rec.nbytes
        problems = store.check(rec, level)
        unreadable |= bool(problems)
        report.problems += [f"{rec.file} ({rec.sample_id}): {p}" for p in problems]
    for index, n in Counter(r.index for r in records).items():
        if n > 1:
            report.problems.append(f"dataset row {index} is recorded under {n} sample ids")
    recorded = {r.file for r in records}
    for path in sorted(root.glob(store.format.sample_glob)):
        rel = path.relative_to(root).as_posix()
        if rel not in recorded:
            report.problems.append(f"{rel}: sample file with no index record (not committed)")
    report.warnings += [
        f"{p.relative_to(root)}: temp file of an interrupted writer" for p in root.rglob(f"{TMP_MARK}*") if p.is_file()
    ]
    if store.manifest.generation is not None:
        report.problems += regenerated_problems(store, records, trust_remote_code=trust_remote_code)
    if data is not None:
        data_problems(store, data, report, trust_remote_code=trust_remote_code)
    if store.manifest.complete:
        report.problems += store.format.finalized_problems(root, records)
        if not unreadable:  # a recount needs every sample file as committed
            report.problems += _token_freq_problems(store, records, rewrite_token_freq)
        report.guide = write_training_guide(root, store.manifest, records, target_folder(store.manifest))
    else:
        report.warnings.append("the run has not completed yet (manifest complete=false)")
    return report


def _stream_only(store: OutputStore, records: list[SampleRecord], report: VerifyReport) -> VerifyReport:
    """A stream-only run's folder holds no sample files: what can be checked here is its record, the samples
    consumers acked (one per dataset row, within the dataset) and, once complete, that the manifest counts them."""
    report.samples, report.tokens = len(records), sum(r.num_tokens for r in records)
    report.nbytes = sum(r.nbytes for r in records)
    for index, n in Counter(r.index for r in records).items():
        if n > 1:
            report.problems.append(f"dataset row {index} is recorded under {n} sample ids")
    if stray := [r.sample_id for r in records if r.index >= store.manifest.dataset_rows]:
        report.problems.append(f"{len(stray)} acked samples name rows past the dataset's {store.manifest.dataset_rows}")
    if store.manifest.complete and store.manifest.samples_committed != len(records):
        report.problems.append(f"the manifest counts {store.manifest.samples_committed} samples, its index "
                               f"{len(records)} acked")  # fmt: skip
    report.warnings.append(
        "a stream-only run (--stream-only) wrote no sample files: its samples went to the stream's consumers, and "
        "this checked the run's record of what they acked; `layertap stream-verify` checks the samples themselves "
        "as they arrive"
    )
    if not store.manifest.complete:
        report.warnings.append("the run has not completed yet (manifest complete=false)")
    return report


def _token_freq_problems(store: OutputStore, records: list[SampleRecord], rewrite: bool) -> list[str]:
    """``token_freq.pt`` against counts taken again from every stored sample (rewritten from them if asked)."""
    counts = recount(store.root, records, store.layout.ids_key)
    if rewrite:
        write_token_freq(store.root, counts)
    stored = read_token_freq(store.root)
    if stored is None:
        return [f"{TOKEN_FREQ_FILE} is missing (`layertap verify --rewrite-token-freq` derives it from the samples)"]
    if stored != dict(counts):
        wrong = sorted(t for t in set(stored) | set(counts) if stored.get(t, 0) != counts.get(t, 0))
        return [f"{TOKEN_FREQ_FILE} differs from the stored samples' loss-masked tokens at {len(wrong)} token ids "
                f"(first: {wrong[:5]})"]  # fmt: skip
    return []


def _store_spec(manifest: Manifest, data: Path, trust_remote_code: bool) -> ExtractionSpec:
    """The spec a store's run tokenized rows of ``data`` with, as its manifest records it (its input limit,
    overlong policy, chat template variables and, for a regenerated store, its generation settings)."""
    generation = {k: v for k, v in (manifest.generation or {}).items() if k != "rules"}  # the rules are not options
    regenerate = {"regenerate": generation.pop("mode"), **generation} if generation else {}
    return ExtractionSpec(model=Path(manifest.model_path), data=data, layers=tuple(manifest.capture_indices),
                          format=manifest.format, max_length=manifest.input_limit, overlong=manifest.overlong,
                          chat_template_kwargs=manifest.chat_template_kwargs, trust_remote_code=trust_remote_code,
                          **regenerate)  # fmt: skip


def regenerated_problems(store: OutputStore, records: list[SampleRecord], *, trust_remote_code: bool) -> list[str]:
    """Each committed sample of a regenerated store against its regenerated row: one is stored, and the folder's
    chat template applied to it gives the sample's ids and loss mask (at its stored length when truncated)."""
    spec = _store_spec(store.manifest, Path(store.manifest.dataset_path), trust_remote_code)
    tokenize = Tokenize(ModelFolder.read(spec.model), spec, spec.max_length)
    rows = store.regenerated_rows({r.sample_id: r for r in records})
    problems = []
    for rec in records:
        where = f"{rec.file} ({rec.sample_id})"
        if (row := rows.get(rec.sample_id)) is None:
            problems.append(f"{where}: no regenerated row is stored with it")
            continue
        conversation, turns, cut = stored_conversation(row)
        try:
            sample = tokenize(rec.index, rec.sample_id, conversation, turns, cut=cut,
                              within=rec.num_tokens if rec.truncated else None)  # fmt: skip
        except RowError as err:
            problems.append(f"{where}: its regenerated row no longer tokenizes: {err.reason}")
            continue
        if not rec.describes(sample):
            problems.append(f"{where}: its ids or loss mask are not its regenerated row through the chat template")
    path = store.root / REGENERATED
    if store.manifest.complete and (n := count_json_lines(path)) != len(rows):
        problems.append(f"{REGENERATED} holds {n} rows, the store {len(rows)} regenerated samples")
    return problems


def data_problems(store: OutputStore, data: Path, report: VerifyReport, *, trust_remote_code: bool = False) -> None:
    """Add to ``report`` what differs between the store and dataset ``data`` tokenized as the store's run
    tokenized it (the manifest's model folder, input limit and overlong policy; a truncated sample at its
    stored length): a stored sample its row no longer gives (``changed`` in `RowPlanner.plan`, as a resume retires
    them), a tokenizer or chat template other than the store's; rows with no sample are counted in a warning (bad
    rows, or not done yet)."""
    manifest = store.manifest
    model = Path(manifest.model_path)
    folder = ModelFolder.read(model)
    now = model_facts(folder)
    for key in ("tokenizer_sha256", "chat_template_sha256"):
        if now[key] != getattr(manifest, key):
            report.problems.append(f"{model}: {key} is {now[key]}, the store was made with {getattr(manifest, key)}")
    spec = _store_spec(manifest, data, trust_remote_code)
    scan = scan_dataset(data)
    if scan.sha256 != manifest.dataset_sha256:
        report.warnings.append(f"{data} (sha256 {scan.sha256[:12]}) is not the dataset the manifest names "
                               f"({manifest.dataset_path}, sha256 {str(manifest.dataset_sha256)[:12]})")  # fmt: skip
    records = store.records()
    regenerated = store.regenerated_rows(records) if manifest.generation is not None else None
    tokenize = Tokenize(folder, spec, spec.max_length)
    planner = RowPlanner(spec, tokenize, duplicates=scan.duplicates, regenerated=regenerated)
    planned = planner.plan(records, unrecorded=False)
    report.problems += [
        f"{p.record.file} ({p.record.sample_id}): {p.why}" for p in planned if p.status == "changed" and p.record
    ]
    unstored = scan.num_rows - len({r.index for r in records.values() if r.index < scan.num_rows})
    if unstored:
        report.warnings.append(f"{unstored} rows of {data} have no stored sample (bad rows, or not done yet)")
