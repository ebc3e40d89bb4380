"""What the capture plugin captures and where it writes: one stdlib dataclass, built once.

The launcher builds it from its own flags (falling back to ``LAYERTAP_*`` environment variables) and
passes it to every hook as the `config` of SGLang's ``--forward-hooks`` spec; the hooks rebuild it with
`CaptureSettings.from_config`. Nothing deeper reads the environment.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from sglang_patch.contract import DEFAULT_RID_PREFIX, FINAL_TENSORS, FORMAT_FINAL, LAYOUT_FILES, SPECULATORS

ENV_PREFIX = "LAYERTAP_"
# An 8-GPU node runs up to 8 servers on its ~100+ cores, and the workers validate and commit beside
# them: 4 threads write ~6 GB/s to tmpfs on an H200 host (1.7 GB/s each), more than one GPU's share
# of a node's NVMe array. 4 GiB holds ~18 Kimi-sized samples of 4000 tokens: the writers always have
# work queued while the node's RAM (1-2 TB) hardly notices 8 x 4 GiB locked. See the README.
DEFAULT_WRITER_THREADS = 4
DEFAULT_PINNED_CAP_BYTES = 4 << 30
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
FUSION_CHOICES = ("off", "sglang")
QUANTIZE_CHOICES = ("none", "fp8")
FINAL_CHOICES: dict[str, tuple[str, ...]] = {"post": ("post",), "pre": ("pre",), "both": ("post", "pre")}


@dataclass(frozen=True, slots=True)
class CaptureSettings:
    """Capture indices, final states and dump location of one capture server.

    `layers`: capture indices (index i = input of decoder layer i = HF output_hidden_states[i]),
    in the order the dump's ``aux`` tensor stores them. `finals`: subset of ("post", "pre").
    `writer_threads`: threads that serialise, hash, write and fsync dumps in parallel.
    `pinned_cap_bytes`: host (pinned, on a GPU) memory that captured rows may hold, from their
    request's first rows until its dump is written; a request that would pass it makes the forward
    pass wait for the writers (backpressure: the disk is slower than prefill). `max_idle_passes`: passes with captured rows that a half-captured request may go
    without rows of its own before its state is dropped (an aborted request; SGLang otherwise
    continues a chunked prompt in the very next prefill pass). `layout`: "states" (everything
    captured, any store format can be made from it) or a trainer format ("specforge" needs the
    "post" final, "speculators" the "pre" one) written so that the client's commit is a rename.
    `allreduce_fusion`: "off" (the launcher forces SGLang's FlashInfer all-reduce fusion off: the safe
    setting) or "sglang" (left at SGLang's own choice, to measure what fusion does to captures: a
    decoder layer's output may then be a per-rank partial sum, which the hooks capture as it is and
    log, instead of stopping the server). `quantize`: "none" (states as computed) or "fp8" (speculators
    layout only: quantized on the device before the copy to the host, `sample_files.quantize_fp8`, so
    device-to-host bytes, pinned memory and written bytes halve).
    """

    dump_root: str
    layers: tuple[int, ...]
    finals: tuple[str, ...]
    rid_prefix: str = DEFAULT_RID_PREFIX
    writer_threads: int = DEFAULT_WRITER_THREADS
    pinned_cap_bytes: int = DEFAULT_PINNED_CAP_BYTES
    max_idle_passes: int = 256
    layout: str = "states"
    allreduce_fusion: str = "off"
    quantize: str = "none"

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
        if self.writer_threads < 1 or self.pinned_cap_bytes < 1 or self.max_idle_passes < 1:
            raise ValueError("writer_threads, pinned_cap_bytes and max_idle_passes must be >= 1")
        if self.allreduce_fusion not in FUSION_CHOICES:
            raise ValueError(f"allreduce_fusion must be one of {FUSION_CHOICES}, got {self.allreduce_fusion!r}")
        if self.quantize not in QUANTIZE_CHOICES or (self.quantize != "none" and self.layout != SPECULATORS):
            raise ValueError(
                f"quantize must be one of {QUANTIZE_CHOICES}, and fp8 needs the speculators layout (the only trainer "
                f"that reads FP8), got {self.quantize!r} with layout {self.layout!r}"
            )

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


def parse_bytes(text: str) -> int:
    """``"4G"``, ``"512MiB"``, ``"1048576"`` -> bytes (binary units: K = 1024)."""
    match = re.fullmatch(r"\s*(\d+)\s*([kmgt]?)(?:i?b)?\s*", text.lower())
    if match is None:
        raise ValueError(f"expected a byte count like 4G, 512M or 1048576, got {text!r}")
    return int(match[1]) * _UNITS[match[2]]
