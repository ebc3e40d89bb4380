"""``manifest.json``: everything a trainer (or a resumed run) needs to trust the files beside it."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, model_validator

from layertap import __version__
from layertap.errors import StoreError
from layertap.models.folder import ModelFolder
from layertap.spec import CaptureSpec, Convention
from sglang_patch.contract import FP8_DTYPE, SampleLayout

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
REPORTS_DIR = "reports"  # what each run and each audit did, beside the manifest
CONVENTION_TEXT = (
    "capture index i = input of decoder layer i (0-based) = output of layer i-1 = "
    "HF output_hidden_states[i] (residual stream before that layer's norm)"
)
# Fields that may legitimately differ between the run that created a store and one resuming it.
# The dataset's content hash is one of them: a resume re-tokenizes every row and recomputes the samples whose
# tokens or loss mask changed (`pipeline.rows.RowPlanner`), so the manifest names the dataset the store now holds. So
# is the input limit: a resume on a server with another limit re-plans every row under its own.
_RUNTIME_FIELDS = {
    "engine", "layertap_version", "complete", "samples_committed", "dataset_sha256", "servers", "input_limit", "target"
}  # fmt: skip
_OLD_INPUT_LIMIT = "effective_max_length"  # the input limit's key in manifests written before it was renamed


class Manifest(BaseModel):
    """The run's identity. Two runs may write into one store only if these agree (but runtime fields)."""

    model_config = ConfigDict(extra="forbid")

    format_version: int = FORMAT_VERSION
    layertap_version: str = __version__
    format: str
    model_path: str
    model_config_sha256: str
    model_revision: str | None
    tokenizer_sha256: str
    chat_template_sha256: str | None
    # The template's variables every row was rendered with (`ExtractionSpec.chat_template_kwargs`): part of the
    # identity, as the template is, so a resume under others is refused instead of mixing samples of both.
    chat_template_kwargs: dict[str, Any] = {}
    compute_dtype: str
    quantization: dict[str, Any] | None = None  # the folder's packed weights (models/quantization.py), None if plain
    store_dtype: str
    hidden_size: int
    num_layers: int
    layer_ids_given: list[int]
    layer_convention: Convention
    capture_indices: list[int]
    capture_convention: str = CONVENTION_TEXT
    final_post_norm: bool
    final_pre_norm: bool
    max_length: int | None
    # The length rows were kept within (`RunPlan.input_limit`): max_length, or the engine's limit below it (an SGLang
    # server's, a few tokens below its context length); None with neither. A store made before it was recorded has
    # max_length's value here. A job is planned before its workers' servers are known: a worker keeps a job without
    # max_length within its own server's limit, and the job's finalize records the servers' limit
    # (`store.servers_input_limit`).
    input_limit: int | None = None
    overlong: str
    dataset_path: str
    dataset_rows: int
    dataset_sha256: str | None = None  # None in stores made before it was recorded
    engine: dict[str, Any]
    # A regenerated run's generation settings (`GenerationSettings`, with drop_truncated) and ``rules`` (what it
    # regenerates and keeps, what a cut turn is: `layertap.regenerate.RULES`); None: rows captured as given.
    # The servers that generated are the capturing ones (``servers``).
    generation: dict[str, Any] | None = None
    # Which server made which rows: each writer's record (`OutputStore.note_server`: its rows, the server's facts),
    # gathered when the store is finalized; a job's shards each name their worker's server here.
    servers: list[dict[str, Any]] = []
    # Where the run's samples go (`layertap.settings.Target`): files, both (files, also streamed) or stream (no
    # sample files: a sample is done once a consumer acked it, its record then in ``index/``).
    target: Literal["files", "stream", "both"] = "files"
    complete: bool = False
    samples_committed: int = 0

    @model_validator(mode="before")
    @classmethod
    def _input_limit_of_old_stores(cls, data: Any) -> Any:
        """A manifest written before ``input_limit`` had its name: its old key's value; before it was recorded at
        all: its ``max_length``."""
        if isinstance(data, dict) and "input_limit" not in data:
            data = dict(data)
            data["input_limit"] = data.pop(_OLD_INPUT_LIMIT, data.get("max_length"))
        return data

    def identity(self) -> dict[str, Any]:
        return self.model_dump(exclude=_RUNTIME_FIELDS)

    def capture(self) -> CaptureSpec:
        """The capture this store was made with, as its run resolved it."""
        return CaptureSpec(layers=tuple(self.capture_indices), final_post=self.final_post_norm,
                           final_pre=self.final_pre_norm, convention=self.layer_convention,
                           given_ids=tuple(self.layer_ids_given), num_layers=self.num_layers)  # fmt: skip

    def sample_layout(self) -> SampleLayout:
        """What each sample file of this store holds: the layout the plugin's dumps are checked against too."""
        dtype = FP8_DTYPE if self.store_dtype == "fp8" else self.store_dtype
        return SampleLayout(self.format, tuple(self.capture_indices), self.capture().finals, dtype, self.hidden_size)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def files_sha256(root: Path, names: Iterable[str]) -> str:
    """One sha256 over the named files of ``root``: each name, its size and its bytes, in the given order."""
    digest = hashlib.sha256()
    for name in names:
        data = (root / name).read_bytes()
        digest.update(f"{name}\0{len(data)}\0".encode())
        digest.update(data)
    return digest.hexdigest()


def model_facts(folder: ModelFolder) -> dict[str, Any]:
    """Hashes that pin the exact model, tokenizer (every file it loads: `ModelFolder.tokenizer_files`) and chat
    template a store was made with, and how the model's weights are quantized."""
    model_dir, config = folder.path, folder.config
    tok_cfg_path = model_dir / "tokenizer_config.json"
    tok_cfg = json.loads(tok_cfg_path.read_text()) if tok_cfg_path.exists() else {}
    template = tok_cfg.get("chat_template")
    jinja = model_dir / "chat_template.jinja"
    if template is None and jinja.exists():
        template = jinja.read_text()
    return {
        "model_config_sha256": _sha256(model_dir / "config.json"),
        "model_revision": config.get("_commit_hash") or config.get("revision"),
        "tokenizer_sha256": files_sha256(model_dir, folder.tokenizer_files),
        "chat_template_sha256": hashlib.sha256(str(template).encode()).hexdigest() if template else None,
        "quantization": folder.quantization.describe() if folder.quantization else None,
    }


def read_manifest(root: Path) -> Manifest:
    path = root / MANIFEST
    try:
        return Manifest.model_validate_json(path.read_bytes())
    except FileNotFoundError as exc:
        raise StoreError(f"{root} has no {MANIFEST}: not a layertap output folder") from exc
    except ValueError as exc:
        raise StoreError(f"{path} is not a valid layertap manifest: {exc}") from exc


def check_compatible(existing: Manifest, new: Manifest) -> None:
    """Refuse to resume into a store made with another model, template, layers or format, or regenerated under other
    settings or rules (a store of an older layertap whose regeneration rules changed: its samples are not what this
    run makes, and its rules are named, not printed whole)."""
    a, b = existing.identity(), new.identity()
    diffs = [f"{k}: store has {a[k]!r}, this run has {b[k]!r}" for k in a if a[k] != b[k] and k != "generation"]
    gen_a, gen_b = a.get("generation"), b.get("generation")
    if gen_a != gen_b:
        if gen_a is None or gen_b is None:
            diffs.append(f"generation: store has {gen_a!r}, this run has {gen_b!r}")
        else:
            diffs += [f"generation.{k}: store has {gen_a.get(k)!r}, this run has {gen_b.get(k)!r}"
                      for k in sorted(gen_a.keys() | gen_b.keys()) if k != "rules" and gen_a.get(k) != gen_b.get(k)]  # fmt: skip
            rules_a, rules_b = gen_a.get("rules") or {}, gen_b.get("rules") or {}
            if changed := sorted(k for k in rules_a.keys() | rules_b.keys() if rules_a.get(k) != rules_b.get(k)):
                diffs.append(
                    f"generation.rules: the store was regenerated under other rules ({', '.join(changed)}: another "
                    "layertap's, see the manifest's generation.rules), so its samples are not what this run makes; "
                    "write to a new --out"
                )
    if (existing.target == "stream") != (new.target == "stream"):
        diffs.append(
            f"target: the store's samples went to {existing.target!r}, this run's go to {new.target!r} (a stream-only "
            "run's record holds acked samples, a files run's sample files: one cannot resume the other)"
        )
    if diffs:
        raise StoreError("output folder belongs to a different run; " + "; ".join(diffs))
