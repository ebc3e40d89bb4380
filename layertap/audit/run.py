"""``audit_store``: a reproducible random subset of a store's committed samples against an HF reference.

The sample files are read directly (what a trainer reads), not trusted through the index's sha256: a file
rewritten consistently with its index record is judged by its states alone. The report is written under the
store's ``reports/`` as JSON and as a markdown table.
"""

from __future__ import annotations

import hashlib
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from layertap.audit.compare import (
    DECIDE,
    K_BULK,
    K_OUTLIER,
    REACH,
    TIE,
    SampleState,
    StateVerdict,
    Verdict,
    bulk_ok,
    diagnose,
    judge,
    overall,
    shifted_errors,
    token_errors,
    zero_rows,
)
from layertap.audit.memory import BatchShape, check, estimate
from layertap.audit.reference import Point, Progress, Reference
from layertap.device import pick_device
from layertap.diskspace import human_bytes
from layertap.engines.hf import check_has_weights, token_batches
from layertap.errors import SpecError, StoreError
from layertap.models.folder import ModelFolder
from layertap.store.atomic import atomic_write, atomic_write_json
from layertap.store.formats.base import DTYPES
from layertap.store.index import SampleRecord
from layertap.store.manifest import REPORTS_DIR, Manifest
from layertap.store.store import OutputStore
from sglang_patch.sample_files import FP8_SCALES, dequantize_fp8


@dataclass(slots=True)
class AuditReport:
    """The audit's verdict per captured state and overall, and what it covered."""

    root: str
    model: str
    device: str
    seed: int
    samples: list[str]  # audited sample ids
    samples_total: int
    tokens: int
    tokens_total: int
    seconds: float
    states: list[StateVerdict] = field(default_factory=list)
    memory: str = ""  # what the reference needed, and where
    host_estimate: int = 0  # host memory it was estimated to need (Need.on_host)
    reading: str = ""  # what reading the folder cost
    peak_device_bytes: int | None = None  # on a GPU: the most torch held at once
    files: list[str] = field(default_factory=list)  # the report files written

    @property
    def verdict(self) -> Verdict:
        """FAIL when a state fails, INCONCLUSIVE when a state cannot be told from noise, else PASS."""
        return overall([s.verdict for s in self.states])

    @property
    def passed(self) -> bool:
        return self.verdict == "pass"

    @property
    def share(self) -> float:
        """Share of the store's tokens audited."""
        return self.tokens / self.tokens_total if self.tokens_total else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "verdict": self.verdict, "passed": self.passed, "root": self.root, "model": self.model, "device": self.device, "seed": self.seed,
            "samples": self.samples, "samples_total": self.samples_total, "tokens": self.tokens,
            "tokens_total": self.tokens_total, "share": self.share, "seconds": self.seconds, "memory": self.memory,
            "host_estimate": self.host_estimate, "reading": self.reading, "peak_device_bytes": self.peak_device_bytes,
            "states": [s.to_dict() for s in self.states],
            "rules": {"tie": TIE, "k_bulk": K_BULK, "k_outlier": K_OUTLIER, "reach": REACH},
            "to_decide": DECIDE if self.verdict == "inconclusive" else None,
        }  # fmt: skip

    def summary(self) -> str:
        """One line: verdict, coverage, time."""
        return (
            f"audit {self.verdict.upper()}: {len(self.samples)} of {self.samples_total} samples, "
            f"{self.tokens:,} of {self.tokens_total:,} tokens ({self.share:.1%} of the store) in {self.seconds:.1f}s "
            f"({1000 * self.seconds / max(self.tokens, 1):.3f}s per 1,000 tokens)"
        )

    def markdown(self) -> str:
        """The per-state table and each failure's cause, readable as is."""
        lines = [
            f"# Audit of `{self.root}`: {self.verdict.upper()}",
            "",
            f"Model `{self.model}`, device {self.device}, seed {self.seed}. {self.summary()}.",
            "",
            f"Reference: {self.memory}; {self.reading}"
            + (f"; peak {human_bytes(self.peak_device_bytes)} on the GPU" if self.peak_device_bytes else "")
            + ".",
            "",
            "Per-token relative error e_t = ||x_t - r_t|| / ||r_t|| of the stored state against HF float32; the floor "
            "is the same reference at the store's compute dtype, rounded to its store dtype (FP8: quantized and "
            "dequantized as the trainer reads it). A state passes when every "
            f"sample's median e_t <= {K_BULK:g} x its floor's median, and no token is above the threshold "
            f"({K_OUTLIER:g} x the floor's largest error off routing near-ties) unless a router margin before it is "
            f"below {TIE:g} (MoE states; a few allowed), and both controls fail (their median / floor median > "
            f"{K_BULK:g}). A state with a passing control is INCONCLUSIVE; so is a sample above {K_BULK:g} x its floor "
            f"whose error and a control both lie within {K_BULK:g} x its floor's reach (its {REACH:.0%} quantile).",
            "",
            "| state | tokens | median | p99 | max | floor median | floor max | threshold | outliers | at near-ties "
            "| unexplained (allowed) | shift control | layer control | verdict |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for s in self.states:
            explained = "dense only" if s.dense_only else str(s.routing_explained)
            controls = [f"{s.controls[c]:.0f} x" if c in s.controls else "-" for c in ("shift", "layer")]
            lines.append(
                f"| {s.state} | {s.tokens:,} | {s.median:.2e} | {s.p99:.2e} | {s.max:.2e} | {s.floor_median:.2e} "
                f"| {s.floor_max:.2e} | {s.threshold:.2e} | {s.outliers} | {explained} | {s.unexplained} "
                f"({s.allowed_unexplained}) | {controls[0]} | {controls[1]} | {s.verdict.upper()} |"
            )
        failures = [f"- **{s.state}**: {cause}" for s in self.states for cause in s.causes]
        if failures:
            lines += ["", "## Why it failed", "", *failures]
        doubts = [f"- **{s.state}**: {doubt}" for s in self.states if s.verdict == "inconclusive" for doubt in s.doubts]
        if doubts:
            lines += ["", "## Why it cannot tell", "", *doubts, "", f"What would decide it: {DECIDE}."]
        return "\n".join(lines) + "\n"

    def write(self, root: Path) -> list[Path]:
        """Write ``reports/audit-<time>.json`` and ``.md`` under ``root``; returns their paths."""
        stem = root / REPORTS_DIR / f"audit-{time.strftime('%Y%m%d-%H%M%S')}-seed{self.seed}"
        (root / REPORTS_DIR).mkdir(exist_ok=True)
        paths = [stem.with_suffix(".json"), stem.with_suffix(".md")]
        self.files = [str(p) for p in paths]
        atomic_write_json(paths[0], self.to_dict())
        text = self.markdown().encode()
        atomic_write(paths[1], lambda f: f.write(text))
        return paths


def audit_store(
    root: Path,
    *,
    samples: int | None = None,
    fraction: float | None = None,
    seed: int = 0,
    device: str = "auto",
    trust_remote_code: bool = False,
    model: Path | None = None,
    batch_tokens: int = 16384,
    final: bool = True,
    write: bool = True,
    say: Callable[[str], None] | None = None,
    progress: Progress | None = None,
) -> AuditReport:
    """Audit ``samples`` (or ``fraction`` of the) committed samples of the store at ``root`` against its model
    folder (``model``, default the manifest's) run in HF transformers layer by layer on ``device`` (``auto``: the
    first GPU, else the CPU). ``final=False`` leaves the stored final state out and runs the layers up to the
    deepest captured one only. ``say`` hears what the reference needs, before it starts, and what reading cost;
    ``progress(done, total)`` hears the decoder layers run over every audited sample, from 0 (the reference is
    layer-major: every sample is done at the last layer, none before). Writes the report under ``reports/`` unless
    ``write`` is False. Bad input or too little memory -> SpecError/StoreError."""
    started = time.time()
    root = Path(root)
    store = OutputStore.open_existing(root)
    manifest = store.manifest
    records = sorted(store.records().values(), key=lambda r: r.index)
    if not records:
        raise StoreError(f"{root} has no committed samples to audit")
    chosen = choose_samples(records, sample_count(len(records), samples, fraction), seed)
    folder = model_folder(manifest, model, trust_remote_code)
    check_has_weights(folder)
    final_point: Point | None = ("post" if manifest.format == "specforge" else "pre") if final else None
    stored: list[Point] = [*manifest.capture_indices, *([final_point] if final_point else [])]
    points, neighbour = reference_points(manifest.capture_indices, final_point, folder.num_layers)
    target = pick_device(device)
    ref = Reference(folder, points, compute_dtype=getattr(torch, manifest.compute_dtype),
                    store_dtype=DTYPES[manifest.store_dtype], device=target)  # fmt: skip
    batches = list(token_batches(chosen, max_tokens=batch_tokens, max_size=64))  # type: ignore[arg-type]
    loaded = [[read_states(manifest, store.format.load(root / rec.file)) for rec in batch] for batch in batches]
    lengths = [[ids.numel() for ids, _ in b] for b in loaded]
    shapes = [BatchShape(len(rows), max(rows), sum(rows)) for rows in lengths]
    per_token = (len(manifest.capture_indices) + 1) * manifest.hidden_size * DTYPES[manifest.store_dtype].itemsize
    need = estimate(ref.weights, ref.depth, [d.dtype for d in ref.decoders], shapes, per_token, target)
    check(need)
    if say:
        say(need.summary())
    if target.type == "cuda":
        torch.cuda.reset_peak_memory_stats(target)
    errors = PointErrors(loaded, stored, target)
    margins = ref.run([(padded_ids(b), rows) for b, rows in zip(loaded, lengths, strict=True)], errors, progress)
    near_ties = split_margins(margins, lengths)
    per_state: dict[Point, list[SampleState]] = {p: [] for p in stored}
    for b, batch in enumerate(batches):
        for row, rec in enumerate(batch):
            for point in stored:
                moe_before = _near_tie_layers(ref.moe_layers, point)
                near = [near_ties[i][b][row] for i in moe_before]
                per_state[point].append(errors.sample_state(rec.sample_id, b, row, point, neighbour[point], near))
    report = AuditReport(
        root=str(root), model=str(folder.path), device=str(target), seed=seed, samples=[r.sample_id for r in chosen],
        samples_total=len(records), tokens=sum(r.num_tokens for r in chosen),
        tokens_total=sum(r.num_tokens for r in records), seconds=0.0,
        states=[judge(state_name(p), not _near_tie_layers(ref.moe_layers, p), per_state[p]) for p in stored],
        memory=need.summary(), host_estimate=need.on_host, reading=ref.stats.summary(),
        peak_device_bytes=torch.cuda.max_memory_allocated(target) if target.type == "cuda" else None,
    )  # fmt: skip
    report.seconds = time.time() - started
    if say:
        say(report.reading)
    if write:
        report.write(root)
    return report


def padded_ids(loaded: list[tuple[torch.Tensor, dict]]) -> torch.Tensor:
    """One batch's token ids [B, T], right-padded with zeros (the reference never lets a token see a later pad)."""
    ids = torch.zeros(len(loaded), max(i.numel() for i, _ in loaded), dtype=torch.long)
    for row, (sample_ids, _) in enumerate(loaded):
        ids[row, : sample_ids.numel()] = sample_ids
    return ids


def split_margins(margins: dict[int, torch.Tensor], lengths: list[list[int]]) -> dict[int, list[list[torch.Tensor]]]:
    """Per MoE layer, the flat margins of every real token split back into batch -> row -> [T]."""
    out: dict[int, list[list[torch.Tensor]]] = {}
    for layer, flat in margins.items():
        pieces = iter(flat.cpu().split([n for rows in lengths for n in rows]))
        out[layer] = [[next(pieces) for _ in rows] for rows in lengths]
    return out


@dataclass(slots=True)
class OwnPoint:
    """What a stored state's own reference point gives: the floor's errors, the shifted errors, the zero rows."""

    floor: torch.Tensor
    shifted: dict[int, torch.Tensor]
    zeroed: torch.Tensor


class PointErrors:
    """The reference's observer: for each audited sample and stored state, its per-token errors against the
    reference at every point, taken as each point's states appear (the states themselves are then dropped)."""

    def __init__(self, loaded: list[list[tuple[torch.Tensor, dict[Point, torch.Tensor]]]], stored: list[Point],
                 device: torch.device) -> None:  # fmt: skip
        self.loaded, self.stored, self.device = loaded, stored, device
        self.vs: dict[tuple[int, int, Point], dict[Point, torch.Tensor]] = {}  # (batch, row, stored) -> point -> [T]
        self.own: dict[tuple[int, int, Point], OwnPoint] = {}

    def __call__(self, point: Point, b: int, states: torch.Tensor, floor: torch.Tensor) -> None:
        for row, (ids, got_states) in enumerate(self.loaded[b]):
            n = ids.numel()
            ref = states[row, :n]
            for p in self.stored:
                got = got_states[p].to(self.device)
                self.vs.setdefault((b, row, p), {})[point] = token_errors(got, ref).cpu()
                if point == p:
                    shifted = {s: shifted_errors(got, ref, s).cpu() for s in (1, -1)}
                    self.own[b, row, p] = OwnPoint(
                        token_errors(floor[row, :n], ref).cpu(), shifted, zero_rows(got).cpu()
                    )

    def sample_state(
        self, sample_id: str, b: int, row: int, point: Point, neighbour: Point, margins: list[torch.Tensor]
    ) -> SampleState:
        """One sample's verdict inputs at one stored state (diagnosed when it fails)."""
        vs, own = self.vs[b, row, point], self.own[b, row, point]
        errors = vs[point]
        near = torch.stack(margins).min(dim=0).values < TIE if margins else torch.zeros_like(errors, dtype=torch.bool)
        cause = None
        if own.zeroed.any() or not bulk_ok(errors, own.floor):
            alternatives = {swap_cause(point, other): e for other, e in vs.items() if other != point}
            cause = diagnose(errors, own.floor, own.zeroed, own.shifted, alternatives)
        return SampleState(sample_id=sample_id, errors=errors, floor=own.floor, near_tie=near, zeroed=own.zeroed,
                           controls={"shift": own.shifted[1], "layer": vs[neighbour]}, cause=cause)  # fmt: skip


def state_name(point: Point) -> str:
    return {"post": "final (post-norm)", "pre": "final (pre-norm)"}.get(point, f"capture {point}")  # type: ignore[arg-type]


def swap_cause(point: Point, other: Point) -> str:
    """What storing ``other``'s reference in ``point``'s place means, in the user's words."""
    if {point, other} == {"pre", "post"}:
        return f"{other}-norm stored as {point}-norm"
    return f"layer swapped: holds the {state_name(other)} state"


def _near_tie_layers(moe_layers: list[int], point: Point) -> list[int]:
    """The MoE layers a state comes after (every one for a final state)."""
    return [i for i in moe_layers if isinstance(point, str) or i < point]


def reference_points(
    indices: list[int], final: Point | None, num_layers: int
) -> tuple[list[Point], dict[Point, Point]]:
    """The states the reference records (the audited ones, each one's wrong-layer control, the layer after each
    one for the swapped-layer diagnosis, both finals when a final is audited) and each audited state's control."""
    neighbour: dict[Point, Point] = {i: i - 1 if i > 0 else i + 1 for i in indices}
    depth = num_layers if final else max(indices)
    after = [i + 1 for i in indices if i + 1 < num_layers and i + 1 <= depth]
    ints = sorted({*indices, *(n for n in neighbour.values() if isinstance(n, int)), *after})
    if final is None:
        return list(ints), neighbour
    neighbour[final] = num_layers - 1
    return [*ints, num_layers - 1, "pre", "post"] if num_layers - 1 not in ints else [*ints, "pre", "post"], neighbour


def read_states(manifest: Manifest, tensors: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[Point, torch.Tensor]]:
    """(input_ids [T], point -> stored state [T, H]) from one sample file as the trainer reads it."""
    k, hidden = len(manifest.capture_indices), manifest.hidden_size
    if manifest.format == "specforge":
        aux = tensors["aux_hidden_state"][0].unflatten(-1, (k, hidden))
        ids, final = tensors["input_ids"], {"post": tensors["hidden_state"][0]}
    else:
        states = tensors["hidden_states"]
        if FP8_SCALES in tensors:  # what speculators trains on (--hidden-states-backend fp8)
            states = dequantize_fp8(states, tensors[FP8_SCALES])
        aux, ids, final = states[:, :k], tensors["token_ids"], {"pre": states[:, k]}
    return ids, {i: aux[:, j] for j, i in enumerate(manifest.capture_indices)} | final


def sample_count(total: int, samples: int | None, fraction: float | None) -> int:
    """How many samples to audit: ``samples``, or ``fraction`` of ``total`` (at least one)."""
    if (samples is None) == (fraction is None):
        raise SpecError("give exactly one of samples or fraction")
    if fraction is not None:
        if not 0 < fraction <= 1:
            raise SpecError(f"fraction must be in (0, 1], got {fraction}")
        return max(1, math.ceil(fraction * total))
    if samples is None or samples < 1:
        raise SpecError(f"samples must be >= 1, got {samples}")
    return min(samples, total)


def choose_samples(records: list[SampleRecord], n: int, seed: int) -> list[SampleRecord]:
    """``n`` records drawn with ``seed``, half from the shorter half of the store and half from the longer
    (long samples are where position-dependent bugs show, short ones where off-by-one bugs do); sorted by
    length so batches pad little."""
    by_length = sorted(records, key=lambda r: (r.num_tokens, r.index))
    short, long = by_length[: len(by_length) // 2], by_length[len(by_length) // 2 :]
    n_long = min(len(long), n - min(n // 2, len(short)))
    n_short = min(len(short), n - n_long)
    rng = random.Random(seed)
    picked = rng.sample(short, n_short) + rng.sample(long, n_long)
    return sorted(picked, key=lambda r: (r.num_tokens, r.index))


def model_folder(manifest: Manifest, model: Path | None, trust_remote_code: bool) -> ModelFolder:
    """The store's model folder (or ``model``), refused when its config.json is not the one the store was made with."""
    path = Path(model or manifest.model_path)
    if not (path / "config.json").exists():
        raise SpecError(f"model folder {path} (named by the manifest) not found: pass --model where it is now")
    folder = ModelFolder.read(path)
    folder.check_remote_code(trust_remote_code)
    sha = hashlib.sha256((path / "config.json").read_bytes()).hexdigest()
    if sha != manifest.model_config_sha256:
        raise SpecError(f"{path}/config.json is not the one this store was made with (sha256 {sha[:12]}...)")
    return folder
