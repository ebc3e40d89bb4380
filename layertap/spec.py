"""What to extract: layer ids (converted to capture indices at this edge), final states, format.

Convention used everywhere inside layertap: a *capture index* ``i`` is the input of decoder layer
``i`` (0-based) = the output of layer ``i-1`` = HF ``output_hidden_states[i]`` (residual stream,
before that layer's norm). Other conventions are accepted here and converted once:

- ``sglang-eagle3``: SGLang 0.5.10's ``eagle_aux_hidden_state_layer_ids`` (it adds 1: id ``j`` is
  the input of layer ``j+1``).
- ``vllm``: vLLM's ``--target-layer-ids``: already capture indices; id ``num_layers`` means the
  final state before the norm.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from layertap.errors import SpecError
from layertap.trainers import check_trainer_takes
from sglang_patch.contract import FORMAT_FINAL, SPECULATORS

Convention = Literal["capture", "sglang-eagle3", "vllm"]
FinalKind = Literal["post", "pre", "both"]
Format = Literal["specforge", "speculators"]
StoreDtype = Literal["bfloat16", "float32", "fp8"]
OverlongPolicy = Literal["truncate", "skip"]
RegenerateMode = Literal["last", "all"]
TemplateValue = str | int | float | bool | None  # a JSON scalar: what a template switch takes
# Names the chat template renderer passes itself (transformers' `render_jinja_template`), so not a template variable.
RENDERER_VARIABLES = frozenset(
    {"messages", "conversations", "tools", "documents", "chat_template", "add_generation_prompt",
     "continue_final_message", "return_assistant_tokens_mask"}
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class Flag:
    """How a field reads on the command line where its name and type do not say it all (``Annotated`` metadata,
    which pydantic ignores): another flag name, a path that must exist (a folder when ``folder``)."""

    name: str | None = None
    exists: bool = False
    folder: bool = False


def allowed_bad_rows(limit: str, rows: int) -> int:
    """The most bad rows a run over ``rows`` rows may have under ``limit``: a count ("100") or a share of the
    rows ("5%", rounded down). SpecError when ``limit`` is neither."""
    text = limit.strip()
    try:
        if text.endswith("%"):
            share = float(text[:-1])
            if 0 <= share <= 100:
                return int(rows * share / 100)
        elif (count := int(text)) >= 0:
            return count
    except ValueError:
        pass
    raise SpecError(f"max_bad_rows must be a count (e.g. 100) or a share of the rows (e.g. 5%), got {limit!r}")


class GenerationSettings(BaseModel):
    """How responses are regenerated (`layertap.regenerate`): which turns, the sampling settings, and the run's seed
    (a turn's own seed derives from it, the sample id and the turn: `turn_seed`). Its fields are also
    `ExtractionSpec`'s, so they are defined here once."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    mode: RegenerateMode = Field(
        description="last: the final assistant turn that answers in text; all: every assistant turn after the first "
        "user turn that answers in text, in order (turns that call tools are kept, with their tool results)."
    )
    max_new_tokens: int = Field(
        default=2048, gt=0, description="Longest regenerated response per turn; a longer one is cut (finish: length)."
    )
    temperature: float = Field(default=0.0, ge=0.0, description="Regeneration's sampling temperature; 0 is greedy.")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="Regeneration's nucleus sampling share.")
    seed: int | None = Field(
        default=None,
        ge=0,
        description="Regeneration's seed: a sample's turns sample with seeds derived from it and its id. Given with "
        "a temperature above 0 it asks for reproducible sampling (a row regenerates the same text on a rerun), "
        "refused on a server that cannot give it (one without --enable-deterministic-inference); left out, turns "
        "sample with seeds derived from 0 and no such promise.",
    )


_GENERATION = GenerationSettings.model_fields


class CaptureSpec(BaseModel):
    """Resolved capture request: capture indices only, plus what the user originally wrote."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    layers: tuple[int, ...]
    final_post: bool
    final_pre: bool
    convention: Convention
    given_ids: tuple[int, ...]
    num_layers: int

    @property
    def final_kind(self) -> str:
        return "both" if self.final_post and self.final_pre else ("post" if self.final_post else "pre")

    @property
    def finals(self) -> tuple[str, ...]:
        """The final states captured, ``post`` before ``pre``: the names dumps, layouts and servers use."""
        return tuple(k for k, on in (("post", self.final_post), ("pre", self.final_pre)) if on)


def resolve_capture(
    ids: list[int] | tuple[int, ...],
    *,
    convention: Convention,
    num_layers: int,
    final: FinalKind,
) -> CaptureSpec:
    """Turn user layer ids into sorted, unique capture indices in [1, num_layers - 1].

    Index 0 (the embedding output) is refused: SGLang cannot hook it the same way and drafters
    never use it. vLLM's id ``num_layers`` is folded into ``final_pre``.
    """
    if not ids:
        raise SpecError("at least one layer id is required")
    final_pre = final in ("pre", "both")
    layers: list[int] = []
    for raw in ids:
        idx = raw + 1 if convention == "sglang-eagle3" else raw
        if convention == "vllm" and raw == num_layers:
            final_pre = True
            continue
        if not 1 <= idx <= num_layers - 1:
            raise SpecError(
                f"layer id {raw} ({convention} convention) is capture index {idx}, outside "
                f"[1, {num_layers - 1}] for a model with {num_layers} decoder layers"
            )
        layers.append(idx)
    if len(set(layers)) != len(layers):
        raise SpecError(f"duplicate layer ids after conversion to capture indices: {layers}")
    if not layers:
        raise SpecError("no auxiliary layer left after conversion; give at least one intermediate layer")
    return CaptureSpec(
        layers=tuple(sorted(layers)),
        final_post=final in ("post", "both"),
        final_pre=final_pre,
        convention=convention,
        given_ids=tuple(ids),
        num_layers=num_layers,
    )


def parse_template_variables(text: str) -> dict[str, TemplateValue]:
    """Parse ``'{"thinking": false}'`` into a dict, with a clear error unless it is a JSON object of scalars (its
    names are the spec's to check)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SpecError(f"not JSON ({exc}); give a JSON object, e.g. '{{\"thinking\": false}}'") from exc
    if not isinstance(value, dict):
        raise SpecError(f"a JSON object is needed, e.g. '{{\"thinking\": false}}', not {text!r}")
    if nested := [name for name, v in value.items() if isinstance(v, dict | list)]:
        raise SpecError(f"template variables are JSON scalars (string, number, true/false, null); {nested} are not")
    return value


def parse_layer_list(text: str) -> list[int]:
    """Parse ``"3,31,59"`` into ``[3, 31, 59]`` with a clear error."""
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError as exc:
        raise SpecError(f"--layers must be comma-separated integers, got {text!r}") from exc


class ExtractionSpec(BaseModel):
    """One extraction run as the user asks for it (CLI flags or ``POST /jobs`` body)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: Annotated[Path, Flag(exists=True, folder=True)] = Field(
        description="Folder of the HF model (config.json, tokenizer, weights)."
    )
    data: Annotated[Path, Flag(exists=True)] = Field(
        description="Dataset: JSONL, JSON, Parquet or a `save_to_disk` folder."
    )
    layers: tuple[int, ...] = Field(min_length=1, description="Layer ids in layer_convention, e.g. 3,31,59.")
    layer_convention: Convention = Field(
        default="capture",
        description="capture: id i = input of layer i (HF output_hidden_states[i]); sglang-eagle3: SGLang's "
        "EAGLE-3 draft-config ids (i = input of layer i+1); vllm: --target-layer-ids.",
    )
    final: FinalKind | None = Field(
        default=None, description="Final state(s) to keep: post-norm, pre-norm or both; default: what the format needs."
    )
    format: Format = Field(default="specforge", description="The trainer's format the store is written in.")
    store_dtype: StoreDtype = Field(
        default="bfloat16",
        description="The stored states' dtype. fp8 (speculators only): float8_e4m3fn states with one float32 scale "
        "per token and state, half of bfloat16's bytes; speculators trains on it with --hidden-states-backend fp8.",
    )
    max_length: int | None = Field(
        default=None, gt=0, description="Tokens per row at most; not above the model's context (or server's limit)."
    )
    overlong: OverlongPolicy = Field(default="truncate", description="What a row over max_length becomes.")
    chat_template_kwargs: dict[str, TemplateValue] = Field(
        default={},
        max_length=64,
        description="Variables for the chat template, as SGLang and vLLM take them: a JSON object of scalars, e.g. "
        "'{\"thinking\": false}' (Kimi-K2.5 without thinking). Every row is rendered with them, a regenerated "
        "turn's generation prompt included; the manifest records them and a resume must give the same.",
    )
    trust_remote_code: bool = Field(
        default=False,
        description="Run the Python code a model folder ships (Kimi-K2.5's tokenizer is code); read it first. A "
        "coordinator and its workers accept it only when their operator allowed it (LAYERTAP_ALLOW_REMOTE_CODE=1).",
    )
    allow_any_aux_layers: bool = Field(
        default=False,
        description="Skip the check that the format's stock trainer takes this many aux layers (for a modified "
        "trainer).",
    )
    sample_attempts: Annotated[int, Flag(name="--attempts")] = Field(
        default=3, ge=1, le=20, description="Captures tried per sample before it is recorded as failed."
    )
    max_bad_rows: str = Field(
        default="1%",
        max_length=32,
        description="Bad rows (unusable rows and failed captures; rows skipped as too long do not count) a run may "
        "have and still succeed: a count (100) or a share of the dataset's rows (5%). Above it, or when nothing is "
        "stored, the run ends non-zero (a job: failed).",
    )

    regenerate: RegenerateMode | None = Field(
        default=None,
        description="Regenerate the assistant responses with the target on the capture server first, then capture "
        "the regenerated conversations: last (the final assistant turn that answers in text) or all (every one after "
        "the first user turn, in order); turns that call tools are kept as given, with their tool results. SGLang "
        "only.",
    )
    max_new_tokens: int = _GENERATION["max_new_tokens"]
    temperature: float = _GENERATION["temperature"]
    top_p: float = _GENERATION["top_p"]
    seed: int | None = _GENERATION["seed"]
    drop_truncated: bool = Field(
        default=False,
        description="With regenerate: a sample with a turn cut at max_new_tokens is a bad row (kind "
        "generation_truncated) instead of being captured.",
    )

    @field_validator("max_bad_rows", mode="before")
    @classmethod
    def _bad_rows_limit(cls, v: object) -> object:
        if isinstance(v, int) and not isinstance(v, bool):
            v = str(v)  # a JSON count
        if isinstance(v, str):
            try:
                allowed_bad_rows(v, 0)
            except SpecError as exc:
                raise ValueError(str(exc)) from None
        return v

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_variables(cls, v: dict[str, TemplateValue]) -> dict[str, TemplateValue]:
        """Each name a template can read as a variable (an identifier), none the renderer passes itself."""
        if bad := [name for name in v if not name.isidentifier()]:
            raise ValueError(f"chat template variable names must be identifiers, got {bad}")
        if taken := sorted(RENDERER_VARIABLES.intersection(v)):
            raise ValueError(f"{taken} are set by the chat template renderer itself, not template variables")
        return v

    @field_validator("layers")
    @classmethod
    def _ids_non_negative(cls, v: tuple[int, ...]) -> tuple[int, ...]:
        if any(i < 0 for i in v):
            raise ValueError("layer ids must be >= 0")
        return v

    @model_validator(mode="after")
    def _final_fits_format(self) -> ExtractionSpec:
        needed = FORMAT_FINAL[self.format]
        if self.final is not None and self.final not in (needed, "both"):
            raise ValueError(f"format {self.format!r} stores the {needed}-norm final state; final={self.final!r}")
        return self

    @model_validator(mode="after")
    def _dtype_fits_format(self) -> ExtractionSpec:
        if self.store_dtype == "fp8" and self.format != SPECULATORS:
            raise ValueError(
                f"store_dtype 'fp8' is for format 'speculators' (it reads FP8 with --hidden-states-backend fp8); "
                f"SpecForge 0.2.0 reads no FP8 hidden states: use bfloat16 for format {self.format!r}"
            )
        return self

    @property
    def generation(self) -> GenerationSettings | None:
        """The regeneration settings, or None when the run captures its rows as given."""
        if self.regenerate is None:
            return None
        return GenerationSettings(mode=self.regenerate, max_new_tokens=self.max_new_tokens,
                                  temperature=self.temperature, top_p=self.top_p, seed=self.seed)  # fmt: skip

    @property
    def final_kind(self) -> FinalKind:
        return self.final or FORMAT_FINAL[self.format]  # type: ignore[return-value]

    def resolve(self, num_layers: int) -> CaptureSpec:
        """Resolve layer ids against the model's depth; refuse an aux-layer count the format's trainer cannot
        train on (unless ``allow_any_aux_layers``), before any work is done."""
        capture = resolve_capture(
            self.layers, convention=self.layer_convention, num_layers=num_layers, final=self.final_kind
        )
        if not self.allow_any_aux_layers:
            check_trainer_takes(self.format, capture.layers)
        return capture
