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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from layertap.audit.compare import (
    K_BULK,
    K_OUTLIER,
    TIE,
    SampleState,
    StateVerdict,
    bulk_ok,
    diagnose,
    judge,
    shifted_errors,
    token_errors,
    zero_rows,
)
from layertap.audit.reference import Point, Reference, RefRun
from layertap.engines.hf import token_batches
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
    files: list[str] = field(default_factory=list)  # the report files written

    @property
    def passed(self) -> bool:
        return bool(self.states) and all(s.passed for s in self.states)

    @property
    def share(self) -> float:
        """Share of the store's tokens audited."""
        return self.tokens / self.tokens_total if self.tokens_total else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "passed": self.passed, "root": self.root, "model": self.model, "device": self.device, "seed": self.seed,
            "samples": self.samples, "samples_total": self.samples_total, "tokens": self.tokens,
            "tokens_total": self.tokens_total, "share": self.share, "seconds": self.seconds,
            "states": [s.to_dict() for s in self.states],
            "rules": {"tie": TIE, "k_bulk": K_BULK, "k_outlier": K_OUTLIER},
        }  # fmt: skip

    def summary(self) -> str:
        """One line: verdict, coverage, time."""
        return (
            f"audit {'PASS' if self.passed else 'FAIL'}: {len(self.samples)} of {self.samples_total} samples, "
            f"{self.tokens:,} of {self.tokens_total:,} tokens ({self.share:.1%} of the store) in {self.seconds:.1f}s "
            f"({1000 * self.seconds / max(self.tokens, 1):.3f}s per 1,000 tokens)"
        )

    def markdown(self) -> str:
        """The per-state table and each failure's cause, readable as is."""
        lines = [
            f"# Audit of `{self.root}`: {'PASS' if self.passed else 'FAIL'}",
            "",
            f"Model `{self.model}`, device {self.device}, seed {self.seed}. {self.summary()}.",
            "",
            "Per-token relative error e_t = ||x_t - r_t|| / ||r_t|| of the stored state against HF float32; the floor "
            "is the same reference at the store's compute dtype, rounded to its store dtype (FP8: quantized and "
            "dequantized as the trainer reads it). A state passes when every "
            f"sample's median e_t <= {K_BULK:g} x its floor's median, and no token is above the threshold "
            f"({K_OUTLIER:g} x the floor's largest error off routing near-ties) unless a router margin before it is "
            f"below {TIE:g} (MoE states; a few allowed), and both controls fail (their median / floor median > "
            f"{K_BULK:g}).",
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
                f"({s.allowed_unexplained}) | {controls[0]} | {controls[1]} | {'PASS' if s.passed else 'FAIL'} |"
            )
        failures = [f"- **{s.state}**: {cause}" for s in self.states for cause in s.causes]
        if failures:
            lines += ["", "## Why it failed", "", *failures]
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
    device: str = "cpu",
    trust_remote_code: bool = False,
    model: Path | None = None,
    batch_tokens: int = 16384,
    final: bool = True,
    write: bool = True,
) -> AuditReport:
    """Audit ``samples`` (or ``fraction`` of the) committed samples of the store at ``root`` against its model
        folder (``model``, default the manifest's) run in HF transformers on ``device`` (``"auto"``: spread over the
        GPUs). ``final=False`` leaves the stored final state out and runs the layers up to the deepest captured one
    only. Writes the report under ``reports/`` unless ``write`` is False. Bad input -> SpecError/StoreError."""
    started = time.time()
    root = Path(root)
    store = OutputStore.open_existing(root)
    manifest = store.manifest
    records = sorted(store.records().values(), key=lambda r: r.index)
    if not records:
        raise StoreError(f"{root} has no committed samples to audit")
    chosen = choose_samples(records, sample_count(len(records), samples, fraction), seed)
    folder = model_folder(manifest, model, trust_remote_code)
    final_point: Point | None = ("post" if manifest.format == "specforge" else "pre") if final else None
    stored: list[Point] = [*manifest.capture_indices, *([final_point] if final_point else [])]
    points, neighbour = reference_points(manifest.capture_indices, final_point, folder.num_layers)
    ref = Reference(folder, points, compute_dtype=getattr(torch, manifest.compute_dtype),
                    store_dtype=DTYPES[manifest.store_dtype], device=device)  # fmt: skip
    per_state: dict[Point, list[SampleState]] = {p: [] for p in stored}
    for batch in token_batches(chosen, max_tokens=batch_tokens, max_size=64):  # type: ignore[arg-type]
        loaded = [read_states(manifest, store.format.load(root / rec.file)) for rec in batch]
        longest = max(ids.numel() for ids, _ in loaded)
        ids = torch.zeros(len(batch), longest, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, (sample_ids, _) in enumerate(loaded):
            ids[row, : sample_ids.numel()], mask[row, : sample_ids.numel()] = sample_ids, 1
        run = ref.run(ids, mask)
        for row, (rec, (sample_ids, states)) in enumerate(zip(batch, loaded, strict=True)):
            for point in stored:
                got = states[point]
                per_state[point].append(
                    sample_state(
                        rec.sample_id,
                        got.to(ref.device),
                        run,
                        row,
                        sample_ids.numel(),
                        point,
                        neighbour[point],
                        _near_tie_layers(ref.moe_layers, point),
                    )
                )
    report = AuditReport(
        root=str(root), model=str(folder.path), device=device, seed=seed, samples=[r.sample_id for r in chosen],
        samples_total=len(records), tokens=sum(r.num_tokens for r in chosen),
        tokens_total=sum(r.num_tokens for r in records), seconds=0.0,
        states=[judge(state_name(p), not _near_tie_layers(ref.moe_layers, p), per_state[p]) for p in stored],
    )  # fmt: skip
    report.seconds = time.time() - started
    if write:
        report.write(root)
    return report


def sample_state(
    sample_id: str, got: torch.Tensor, run: RefRun, row: int, length: int, point: Point, neighbour: Point,
    moe_before: list[int],
) -> SampleState:  # fmt: skip
    """One sample's errors at one state against its reference row (diagnosed when it fails)."""
    ref, floor_ref = run.states[point][row, :length], run.floor[point][row, :length]
    errors, floor = token_errors(got, ref), token_errors(floor_ref, ref)
    margins = [run.margins[i][row, :length] for i in moe_before]
    near = torch.stack(margins).min(dim=0).values < TIE if margins else torch.zeros(length, dtype=torch.bool)
    zeroed = zero_rows(got)
    controls = {"shift": shifted_errors(got, ref, 1), "layer": token_errors(got, run.states[neighbour][row, :length])}
    cause = None
    if zeroed.any() or not bulk_ok(errors, floor):
        alternatives = {
            swap_cause(point, other): states[row, :length] for other, states in run.states.items() if other != point
        }
        cause = diagnose(got, ref, floor, alternatives)
    return SampleState(sample_id=sample_id, errors=errors.cpu(), floor=floor.cpu(), near_tie=near.cpu(),
                       zeroed=zeroed.cpu(), controls={k: v.cpu() for k, v in controls.items()}, cause=cause)  # fmt: skip


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
