"""What the capture plugin captures and where it writes: one stdlib dataclass, built once.

The launcher builds it from its own flags (falling back to ``LAYERTAP_*`` environment variables) and
passes it to every hook as the `config` of SGLang's ``--forward-hooks`` spec; the hooks rebuild it with
`CaptureSettings.from_config`. Nothing deeper reads the environment.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from sglang_patch.contract import DEFAULT_RID_PREFIX, FINAL_TENSORS, FORMAT_FINAL, LAYOUT_FILES

ENV_PREFIX = "LAYERTAP_"
FINAL_CHOICES: dict[str, tuple[str, ...]] = {"post": ("post",), "pre": ("pre",), "both": ("post", "pre")}


@dataclass(frozen=True, slots=True)
class CaptureSettings:
    """Capture indices, final states and dump location of one capture server.

    `layers`: capture indices (index i = input of decoder layer i = HF output_hidden_states[i]),
    in the order the dump's ``aux`` tensor stores them. `finals`: subset of ("post", "pre").
    `max_pending_writes`: dumps queued for the writer thread before the forward pass blocks
    (backpressure). `max_idle_passes`: passes with captured rows that a half-captured request may go
    without rows of its own before its state is dropped (an aborted request; SGLang otherwise
    continues a chunked prompt in the very next prefill pass). `layout`: "states" (everything
    captured, any store format can be made from it) or a trainer format ("specforge" needs the
    "post" final, "speculators" the "pre" one) written so that the client's commit is a rename.
    """

    dump_root: str
    layers: tuple[int, ...]
    finals: tuple[str, ...]
    rid_prefix: str = DEFAULT_RID_PREFIX
    max_pending_writes: int = 16
    max_idle_passes: int = 256
    layout: str = "states"

    def __post_init__(self) -> None:
        if not self.dump_root:
            raise ValueError("dump_root is required")
        if not self.layers:
            raise ValueError("at least one capture layer is required")
        if any(i < 1 for i in self.layers) or len(set(self.layers)) != len(self.layers):
            raise ValueError(f"capture layers must be distinct indices >= 1, got {self.layers}")
        if not self.finals or any(f not in FINAL_TENSORS for f in self.finals):
            raise ValueError(f"finals must be a non-empty subset of {tuple(FINAL_TENSORS)}, got {self.finals}")
        if not self.rid_prefix or ":" in self.rid_prefix:
            raise ValueError(f"rid_prefix must be non-empty and free of ':', got {self.rid_prefix!r}")
        needs = FORMAT_FINAL.get(self.layout)
        if self.layout not in LAYOUT_FILES or (needs is not None and needs not in self.finals):
            raise ValueError(
                f"layout must be one of {sorted(LAYOUT_FILES)} (specforge needs the post-norm final, "
                f"speculators the pre-norm one), got {self.layout!r} with finals {self.finals}"
            )
        if self.max_pending_writes < 1 or self.max_idle_passes < 1:
            raise ValueError("max_pending_writes and max_idle_passes must be >= 1")

    def roles(self) -> list[str]:
        """Hook roles a pass needs: ``aux:<i>`` per capture index (hooked on decoder layer ``i-1``),
        then the final tensors' names (``final_post`` on logits_processor, ``final_pre`` on the last layer).
        """
        return [aux_role(i) for i in self.layers] + [FINAL_TENSORS[f] for f in self.finals]

    def to_config(self) -> dict[str, Any]:
        """JSON-ready dict for the ``config`` field of a ``--forward-hooks`` spec."""
        return {**asdict(self), "layers": list(self.layers), "finals": list(self.finals)}

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> CaptureSettings:
        known = {f.name for f in fields(cls)}
        unknown = set(config) - known
        if unknown:
            raise ValueError(f"unknown capture settings: {sorted(unknown)}")
        return cls(
            **{**config, "layers": tuple(config["layers"]), "finals": tuple(config["finals"])},
        )


def aux_role(index: int) -> str:
    """Role name of capture index `index`."""
    return f"aux:{index}"


def parse_layers(text: str) -> tuple[int, ...]:
    """``"3,31,59"`` -> ``(3, 31, 59)``."""
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError as exc:
        raise ValueError(f"capture layers must be comma-separated integers, got {text!r}") from exc


def parse_finals(text: str) -> tuple[str, ...]:
    """``"post"``, ``"pre"`` or ``"both"`` -> the final kinds, in dump order."""
    if text not in FINAL_CHOICES:
        raise ValueError(f"final must be one of {sorted(FINAL_CHOICES)}, got {text!r}")
    return FINAL_CHOICES[text]


def env_default(environ: Mapping[str, str], name: str) -> str | None:
    """Value of ``LAYERTAP_<NAME>`` (e.g. name "dump_root" -> LAYERTAP_DUMP_ROOT), or None."""
    return environ.get(ENV_PREFIX + name.upper())
