"""The dump contract between the capture plugin (inside SGLang) and its client (the layertap worker).

Standard library only: both the plugin and the `layertap` core import this module.

Request ids. Every captured request carries the rid ``<prefix>:<job>:<sample>:<attempt>``. Each
component is percent-quoted (`urllib.parse.quote` with no safe characters), so a ``:`` inside a
sample id cannot shift the fields; `attempt` is a non-negative integer. The plugin captures exactly
the rids that start with ``quote(prefix) + ":"``; SGLang's warmup (uuid rids), ``HEALTH_CHECK_*``
probes, internal passes and generation requests (`generation_rid`: no ``:`` at all) never match.

Dump folders. A finished request appears, atomically (temp folder, fsync, rename), as::

    <dump_root>/<quote(rid)>/meta.json             DumpMeta as JSON, always present
    <dump_root>/<quote(rid)>/states.safetensors    when status == "ok" and layout == "states":
        input_ids   int64 [T]       the token ids the server ran (little-endian in the file)
        aux         dtype [T, k, H] the capture indices `meta.layers`, in that order
        final_post  dtype [T, H]    if "post" in meta.finals: after the final norm
        final_pre   dtype [T, H]    if "pre" in meta.finals: before the final norm

or, with layout "specforge" / "speculators", the sample already in that trainer's format
(`sglang_patch.sample_files`) as ``sample.ckpt`` / ``sample.safetensors``: the client then commits
it by renaming the file, copying no bytes. A speculators dump may be FP8 (``meta.dtype`` float8_e4m3fn:
``hidden_states`` float8_e4m3fn [T, k+1, H] and ``hidden_states_scales`` float32 [T, k+1, 1]), quantized
on the device before the copy to the host. A specforge file holds the loss mask, which the client
sends with the request as ``sampling_params.custom_params[LOSS_MASK_PARAM]``: [start, end) runs.

A *placed* speculators dump has no tensors file: the client reserved the sample's bytes in a file of its own under
the dump root (a stream producer's Mooncake segment) and sent where as ``custom_params[PLACE_PARAM]`` (`Placement`);
the server wrote each tensor (``token_ids``, ``hidden_states``, and ``loss_mask`` uint8 [T] from the mask's runs) at
its span there, and ``meta.placed`` says so. A placement the sample does not fit gets an error dump, no byte written.
A placement with ``file`` set (a run that keeps sample files and streams them) gets the dump's tensors file as well.

Temp folders live under ``<dump_root>/.tmp/`` on the same filesystem, so the rename is atomic and
a reader never sees a half-written dump.

Capture index convention: index ``i`` is the input of decoder layer ``i`` (0-based) = the output of
layer ``i-1`` = HF transformers ``output_hidden_states[i]`` (residual stream before that layer's
norm). In a post-forward hook on layer ``i-1`` that is ``output[0] + output[1]``. The post-norm final
state is the ``hidden_states`` argument of SGLang's ``logits_processor``; the pre-norm one is
``output[0] + output[1]`` of the last decoder layer.

An error dump (status "error", no tensors file) tells the client quickly that an attempt is
useless, e.g. a prefix-cache hit (the first pass of the rid started past token 0) or missing rows.

What a client should know (measured on sglang 0.5.10.post1):
- The HTTP reply can come before the dump is renamed into place: wait for the folder (bounded).
- An aborted request (``POST /abort_request`` or a client disconnect) still has its remaining
  prefill chunks run and so may leave a complete "ok" dump: trust a dump only with a reply whose
  ``finish_reason`` is not "abort", ``cached_tokens == 0`` and ``prompt_tokens`` equal to the sent length.
- SGLang aborts by rid *prefix* (``rid.startswith``): aborting attempt 1 of a sample also aborts its
  attempts 10-19, so keep one attempt per sample in flight.
- A dump folder is never replaced: a retry must use a new attempt number.
"""

from __future__ import annotations

import hashlib
import json
import math
import mmap
import pickle
import struct
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import quote, unquote

if TYPE_CHECKING:
    import torch

FORMAT_VERSION = 4  # 3: no file_sha256 (the client hashes the file as it commits it); 4: placed dumps
DEFAULT_RID_PREFIX = "hscap"
LAYER_CONVENTION = "capture"

META_FILE = "meta.json"
STATES_FILE = "states.safetensors"
# The trainers' formats (`sglang_patch.sample_files`), and the final state each stores (docs/formats.md,
# "Output formats"): "post" = after the final norm, "pre" = before it.
SPECFORGE = "specforge"
SPECULATORS = "speculators"
FORMAT_FINAL: dict[str, str] = {SPECFORGE: "post", SPECULATORS: "pre"}
# Dump layout -> the file holding its tensors.
LAYOUT_FILES: dict[str, str] = {"states": STATES_FILE, SPECFORGE: "sample.ckpt", SPECULATORS: "sample.safetensors"}
LOSS_MASK_PARAM = "layertap_loss_mask_runs"
PLACE_PARAM = "layertap_place"
PLACED_MASK = "loss_mask"  # a placed sample's mask (uint8 [T]), beside the speculators file's tensors
SEGMENT_PREFIX = ".segment-"  # a stream producer's segment file under the dump root: the only files placed into
TMP_DIR = ".tmp"

INPUT_IDS = "input_ids"
AUX = "aux"
# The speculators layout's [T, k+1, H]: the aux states, then the pre-norm final, stacked on the device so that
# the writer saves the file's ``hidden_states`` as it is, with no host-side copy.
AUX_FINAL_PRE = "aux_final_pre"
# Beside an FP8 ``aux_final_pre`` (quantized on the device, `sample_files.quantize_fp8`): its float32 scales.
SCALES = "scales"
FP8_DTYPE = "float8_e4m3fn"
FP8_SCALES = "hidden_states_scales"  # an FP8 speculators file's scales (hs-connectors' SCALES_KEY)
FINAL_TENSORS: dict[str, str] = {"post": "final_post", "pre": "final_pre"}

# Room for the temp suffix within the usual 255-byte file name limit.
MAX_DIR_NAME_BYTES = 200

_SAFETENSORS_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "int64": "I64", FP8_DTYPE: "F8_E4M3"}

Status = Literal["ok", "error"]


class DumpError(ValueError):
    """A dump folder or rid does not follow this contract."""


def _quote(component: str) -> str:
    return quote(component, safe="")


@dataclass(frozen=True, slots=True)
class RequestId:
    """The parts of a capture rid; `str()` gives the rid itself."""

    prefix: str
    job: str
    sample: str
    attempt: int

    def __post_init__(self) -> None:
        if not self.prefix:
            raise DumpError("the rid prefix must not be empty")
        if self.attempt < 0:
            raise DumpError(f"attempt must be >= 0, got {self.attempt}")

    def __str__(self) -> str:
        parts = (self.prefix, self.job, self.sample, str(self.attempt))
        return ":".join(_quote(p) for p in parts)


def format_rid(job: str, sample: str, attempt: int, *, prefix: str = DEFAULT_RID_PREFIX) -> str:
    """Build the rid ``<prefix>:<job>:<sample>:<attempt>`` with every component quoted.

    Raises DumpError when the dump folder name of the rid would be too long for a file name.
    """
    rid = str(RequestId(prefix=prefix, job=job, sample=sample, attempt=attempt))
    if len(dump_dir_name(rid).encode()) > MAX_DIR_NAME_BYTES:
        raise DumpError(
            f"rid for job {job!r}, sample {sample!r} is too long for a dump folder name "
            f"(> {MAX_DIR_NAME_BYTES} bytes once quoted); use a shorter sample or job id"
        )
    return rid


def parse_rid(rid: str) -> RequestId:
    """Split a rid made by `format_rid` back into its parts; DumpError if it is not one.

    Only the canonical spelling is accepted (``format_rid(*parse_rid(r)) == r``), so one sample
    attempt has exactly one rid and one dump folder.
    """
    parts = rid.split(":")
    if len(parts) != 4:
        raise DumpError(f"rid {rid!r} does not have the form <prefix>:<job>:<sample>:<attempt>")
    prefix, job, sample, attempt = (unquote(p) for p in parts)
    if not attempt.isdigit():
        raise DumpError(f"rid {rid!r}: attempt {attempt!r} is not a non-negative integer")
    parsed = RequestId(prefix=prefix, job=job, sample=sample, attempt=int(attempt))
    if str(parsed) != rid:
        raise DumpError(f"rid {rid!r} is not in canonical form (expected {str(parsed)!r})")
    return parsed


def generation_rid(job: str, sample: str, turn: int, nonce: str) -> str:
    """The rid of a generation request (a regenerated assistant turn): ``gen.<job>.<sample>.<turn>.<nonce>``, each
    component quoted. It holds no ``:``, so no capture prefix ever matches it: the plugin captures nothing of it.
    `nonce` keeps two requests for the same turn (a retry) apart, as SGLang wants rids unique."""
    return ".".join(_quote(p) for p in ("gen", job, sample, str(turn), nonce))


def rid_matches(rid: str | None, prefix: str) -> bool:
    """Whether SGLang request id `rid` belongs to the capture namespace `prefix` (cheap test)."""
    return rid is not None and rid.startswith(_quote(prefix) + ":")


def dump_dir_name(rid: str) -> str:
    """File-system name of the dump folder of `rid` (the rid, percent-quoted)."""
    return _quote(rid)


def dump_dir(dump_root: Path | str, rid: str) -> Path:
    """``<dump_root>/<quote(rid)>``: where the finished dump of `rid` appears."""
    return Path(dump_root) / dump_dir_name(rid)


def temp_dir(dump_root: Path | str, rid: str, tag: str) -> Path:
    """``<dump_root>/.tmp/<quote(rid)>.<tag>``: where a dump is written before its rename.

    `tag` (e.g. ``<pid>-<sequence>``) keeps concurrent writers of the same rid apart.
    """
    return Path(dump_root) / TMP_DIR / f"{dump_dir_name(rid)}.{tag}"


def iter_dump_rids(dump_root: Path | str) -> Iterator[str]:
    """Rids of the finished dump folders under `dump_root` (temp folders excluded), unordered."""
    for entry in Path(dump_root).iterdir():
        if entry.name != TMP_DIR and entry.is_dir():
            yield unquote(entry.name)


def sweep_stale_dumps(dump_root: Path | str, max_age_s: float) -> int:
    """Remove dump folders and temp folders not modified for `max_age_s` seconds; returns how many.

    A client reads a dump within seconds of its reply, so an old one was left by a client that died
    (or a server killed mid-write, for temp folders); on a dump root on the output volume they would
    otherwise hold disk space for good. Age is the only safe test when several servers share a root.
    """
    import shutil
    import time

    root = Path(dump_root)
    cutoff = time.time() - max_age_s
    stale = [p for p in (*root.glob("*"), *root.glob(f"{TMP_DIR}/*")) if p.name != TMP_DIR and p.is_dir()]
    removed = 0
    for path in stale:
        try:
            if path.stat().st_mtime < cutoff:
                shutil.rmtree(path)
                removed += 1
        except FileNotFoundError:  # another client took or swept it meanwhile
            continue
    return removed


@dataclass(frozen=True, slots=True)
class DumpMeta:
    """Contents of ``meta.json``. For an error dump only rid, status, error, layers and writer are meaningful."""

    rid: str
    status: Status
    error: str | None
    num_tokens: int
    input_ids_sha256: str | None
    layers: tuple[int, ...]
    finals: tuple[str, ...]
    dtype: str | None
    hidden_size: int | None
    layout: str = "states"
    format_version: int = FORMAT_VERSION
    layer_convention: str = LAYER_CONVENTION
    # The server's writer when this dump was queued: "wait_s" (seconds the forward pass waited for
    # host memory since the previous dump was queued), "queued" (dumps queued or being written),
    # "pinned_bytes" (host memory held by captured rows), "pinned_cap_bytes", "threads"; and as it
    # wrote it: "ready_s" (its wait for the device-to-host copies), "write_s" (serialise, write,
    # fsync), on a GPU "pinned_held_bytes" and "pinned_alloc_s" (torch's pinned allocator: bytes
    # held, cache included; seconds spent growing it).
    writer: dict[str, float] | None = None
    placed: dict[str, Any] | None = None  # a placed dump: where its tensors are (`Placement.param`)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> DumpMeta:
        raw: dict[str, Any] = json.loads(text)
        if raw.get("format_version") != FORMAT_VERSION:
            raise DumpError(f"dump format_version {raw.get('format_version')!r}, expected {FORMAT_VERSION}")
        try:
            meta = cls(**{**raw, "layers": tuple(raw["layers"]), "finals": tuple(raw["finals"])})
        except (KeyError, TypeError) as exc:
            raise DumpError(f"meta.json does not match DumpMeta: {exc}") from exc
        if meta.status not in ("ok", "error"):
            raise DumpError(f"unknown dump status {meta.status!r}")
        if any(f not in FINAL_TENSORS for f in meta.finals):
            raise DumpError(f"unknown final kinds {meta.finals!r}")
        if meta.layout not in LAYOUT_FILES:
            raise DumpError(f"unknown dump layout {meta.layout!r}")
        return meta

    @property
    def file(self) -> str:
        """Name of the file holding this dump's tensors."""
        return LAYOUT_FILES[self.layout]

    def sample_layout(self) -> SampleLayout:
        """The layout of this "ok" dump's file; DumpError when meta.json leaves it undefined."""
        if self.dtype not in _SAFETENSORS_DTYPES or self.hidden_size is None:
            raise DumpError(f"dump of {self.rid!r} has no usable dtype/hidden_size: {self.dtype!r}")
        return SampleLayout(self.layout, self.layers, self.finals, self.dtype, self.hidden_size)


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a client asks the server to write one speculators sample (see the module docstring): the object ``key``
    (Mooncake's), bytes ``[offset, offset + size)`` of the file at ``path``, each tensor ``name -> (start, nbytes)``
    within them; with ``file``, the dump's tensors file too."""

    key: str
    path: str
    offset: int
    size: int
    tensors: dict[str, tuple[int, int]]
    file: bool = False

    @property
    def sizes(self) -> dict[str, int]:
        """name -> bytes of each tensor placed."""
        return {name: nbytes for name, (_, nbytes) in self.tensors.items()}

    def param(self) -> dict[str, Any]:
        """As sent in ``custom_params`` and kept in ``meta.placed`` (JSON)."""
        return {**asdict(self), "tensors": {k: list(v) for k, v in self.tensors.items()}}

    @classmethod
    def from_param(cls, raw: object) -> Placement:
        """The placement a request (or a meta.json) carries; DumpError when it is not one whose spans lie within it
        and apart."""
        wrong = DumpError(f"{PLACE_PARAM} must be {{key, path, offset, size, tensors}}, got {raw!r:.300}")
        if not isinstance(raw, dict) or not isinstance(raw.get("tensors"), dict):
            raise wrong
        try:
            spans = {str(k): (int(v[0]), int(v[1])) for k, v in raw["tensors"].items()}
            place = cls(str(raw["key"]), str(raw["path"]), int(raw["offset"]), int(raw["size"]), spans,
                        raw.get("file", False) is True)  # fmt: skip
        except (KeyError, TypeError, ValueError, IndexError):
            raise wrong from None
        end = 0
        for name, (start, nbytes) in sorted(spans.items(), key=lambda item: item[1]):
            if start < end or nbytes < 0:
                raise DumpError(f"{PLACE_PARAM}: {name} overlaps the tensor before it")
            end = start + nbytes
        if place.offset < 0 or end > place.size:
            raise DumpError(f"{PLACE_PARAM}: the tensors lie past the {place.size} bytes placed")
        return place


@dataclass(frozen=True, slots=True)
class SampleLayout:
    """What one sample file holds, defined once for the plugin's dumps and the layertap store: its layout
    ("states" or a trainer format), capture indices, final states, states dtype (torch's name; FP8 adds float32
    scales) and width. A dump's comes from its meta.json, a store's from its manifest."""

    layout: str
    layers: tuple[int, ...]
    finals: tuple[str, ...]
    dtype: str
    hidden_size: int

    @property
    def file(self) -> str:
        """Name of a dump's file in this layout."""
        return LAYOUT_FILES[self.layout]

    @property
    def ids_key(self) -> str:
        """The tensor holding the token ids [T]."""
        return "token_ids" if self.layout == SPECULATORS else INPUT_IDS

    def tensors(self, num_tokens: int) -> dict[str, tuple[str, tuple[int, ...]]]:
        """{tensor name: (dtype, shape)} of a file of `num_tokens` tokens in this layout."""
        t, h, k, dtype = num_tokens, self.hidden_size, len(self.layers), self.dtype
        if self.layout == SPECULATORS:
            out = {"token_ids": ("int64", (t,)), "hidden_states": (dtype, (t, k + 1, h))}
            if dtype == FP8_DTYPE:  # one scale per token and state (sample_files.quantize_fp8)
                out[FP8_SCALES] = ("float32", (t, k + 1, 1))
            return out
        if self.layout == SPECFORGE:
            return {INPUT_IDS: ("int64", (t,)), "loss_mask": ("int64", (t,)), "hidden_state": (dtype, (1, t, h)),
                    "aux_hidden_state": (dtype, (1, t, k * h))}  # fmt: skip
        return {INPUT_IDS: ("int64", (t,)), AUX: (dtype, (t, k, h))} | {
            FINAL_TENSORS[f]: (dtype, (t, h)) for f in self.finals
        }

    def problems(self, found: dict[str, tuple[str, tuple[int, ...]]], num_tokens: int) -> list[str]:
        """Each way `found` ({name: (dtype, shape)} of a file) differs from this layout (empty: it matches)."""
        expected = self.tensors(num_tokens)
        if set(found) != set(expected):
            return [f"keys {sorted(found)} != expected {sorted(expected)}"]
        out = []
        for name, (dtype, shape) in expected.items():
            if tuple(found[name][1]) != shape:
                out.append(f"{name}: shape {tuple(found[name][1])} != expected {shape}")
            if found[name][0] != dtype:
                out.append(f"{name}: dtype {found[name][0]} != expected {dtype}")
        return out


@dataclass(frozen=True, slots=True)
class Dump:
    """A dump folder read back. `tensors` is None for error dumps or when not loaded; `data` is the tensors file
    as read (mapped once, its tensors views of it), for the client to hash and commit without reading it again."""

    path: Path
    meta: DumpMeta
    tensors: dict[str, torch.Tensor] | None
    data: mmap.mmap | None = None


def _safetensors_entries(data: mmap.mmap) -> dict[str, tuple[str, tuple[int, ...], int, int]]:
    """{name: (dtype, shape, start, end)} of a safetensors file's bytes, offsets absolute; ValueError (or KeyError,
    struct.error) when they are not a whole safetensors file."""
    (length,) = struct.unpack_from("<Q", data, 0)
    header = json.loads(data[8 : 8 + length])
    header.pop("__metadata__", None)
    names = {code: name for name, code in _SAFETENSORS_DTYPES.items()}
    out = {}
    for name, info in header.items():
        start, end = (8 + length + offset for offset in info["data_offsets"])
        if not start <= end <= len(data):
            raise ValueError(f"{name} lies past the file's end (truncated)")
        out[name] = (names.get(info["dtype"], info["dtype"]), tuple(info["shape"]), start, end)
    return out


def _map(path: Path) -> mmap.mmap:
    """The file's bytes, mapped (copy-on-write, so tensors may be views of them); one open."""
    try:
        with path.open("rb") as f:
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    except FileNotFoundError:
        raise DumpError(f"{path} is missing") from None
    except ValueError as exc:  # an empty file cannot be mapped
        raise DumpError(f"{path}: {exc}") from None


def _read_states_file(path: Path, meta: DumpMeta, load_tensors: bool) -> Dump:
    """Check the file against `meta` (names, shapes, dtypes, the input_ids hash); with `load_tensors` its tensors
    are views of its mapped bytes. Specforge's zip is mapped by torch itself (``mmap=True``): read through a Python
    file object, torch copied every tensor out with the GIL held, ~65 ms a 30 MB dump on an H200 host, which held a
    run's captures to ~15 a second whatever the threads (py-spy, 2026-12-02); `data` maps it once more for the hash
    a commit takes (`Dump.data`)."""
    import torch

    layout = meta.sample_layout()
    data = _map(path)
    try:
        if meta.layout == SPECFORGE:
            tensors = torch.load(path, weights_only=True, mmap=True)
            if not isinstance(tensors, dict):
                raise ValueError(f"it holds a {type(tensors).__name__}, not a dict of tensors")
            found = {k: (str(v.dtype).removeprefix("torch."), tuple(v.shape)) for k, v in tensors.items()}
        else:
            entries = _safetensors_entries(data)
            found = {k: (dtype, shape) for k, (dtype, shape, _, _) in entries.items()}
    except (ValueError, KeyError, RuntimeError, struct.error, pickle.UnpicklingError) as exc:
        raise DumpError(f"{path} is unreadable: {exc}") from exc
    if problems := layout.problems(found, meta.num_tokens):
        raise DumpError(f"{path}: tensors do not match meta.json: " + "; ".join(problems))
    if meta.layout == SPECFORGE:
        ids_bytes = tensors[INPUT_IDS].contiguous().numpy().tobytes()
    else:
        start, end = entries[layout.ids_key][2:]
        ids_bytes = data[start:end]
        tensors = _views(data, entries) if load_tensors else None
    if (digest := hashlib.sha256(ids_bytes).hexdigest()) != meta.input_ids_sha256:
        raise DumpError(f"{path}: input_ids hash {digest} differs from meta.json {meta.input_ids_sha256}")
    return Dump(path=path.parent, meta=meta, tensors=tensors if load_tensors else None, data=data)


def _views(data: mmap.mmap, entries: dict[str, tuple[str, tuple[int, ...], int, int]]) -> dict[str, torch.Tensor]:
    """A checked safetensors file's tensors as views of its mapped bytes (little-endian, as this host)."""
    import torch

    out = {}
    for name, (dtype, shape, start, end) in entries.items():
        kind = getattr(torch, dtype)
        count = (end - start) // kind.itemsize
        flat = torch.frombuffer(data, dtype=kind, count=count, offset=start) if count else torch.empty(0, dtype=kind)
        out[name] = flat.view(shape)
    return out


def read_dump(path: Path | str, *, load_tensors: bool = True) -> Dump:
    """Read and check one dump folder; DumpError if it breaks the contract.

    An "ok" dump's file is opened once: checked against meta.json (tensor names, shapes, dtypes,
    input_ids hash) from its mapped bytes, and with `load_tensors` its tensors are views of them, named
    as the layout names them. torch is imported here, not at module import, so the module itself stays
    stdlib-only.
    """
    path = Path(path)
    meta = DumpMeta.from_json((path / META_FILE).read_text())
    if meta.rid != unquote(path.name):
        raise DumpError(f"{path}: meta.json is for rid {meta.rid!r}")
    if meta.status == "error":
        return Dump(path=path, meta=meta, tensors=None)
    if meta.placed is None:
        return _read_states_file(path / meta.file, meta, load_tensors)
    placed = _read_placed(path, meta, load_tensors)
    if not Placement.from_param(meta.placed).file:
        return placed
    dump = _read_states_file(path / meta.file, meta, load_tensors)  # its tensors from the file, the mask as placed
    return replace(dump, tensors={**dump.tensors, PLACED_MASK: placed.tensors[PLACED_MASK]}) if load_tensors else dump


def placed_tensors(layout: SampleLayout, num_tokens: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{name: (dtype, shape)} of a placed sample: its speculators file's tensors and its loss mask."""
    return {**layout.tensors(num_tokens), PLACED_MASK: ("uint8", (num_tokens,))}


def _read_placed(path: Path, meta: DumpMeta, load_tensors: bool) -> Dump:
    """A placed dump's tensors checked (spans, the input_ids hash) and, with `load_tensors`, as views of the
    placement's bytes, mapped copy-on-write from its file."""
    import torch

    place = Placement.from_param(meta.placed)
    expected = placed_tensors(meta.sample_layout(), meta.num_tokens)
    sizes = {name: getattr(torch, dtype).itemsize * math.prod(shape) for name, (dtype, shape) in expected.items()}
    if place.sizes != sizes:
        raise DumpError(f"{path}: placed tensors {place.tensors} are not those of meta.json ({sizes} bytes)")
    skip = place.offset % mmap.ALLOCATIONGRANULARITY
    try:
        with open(place.path, "rb") as f:
            data = mmap.mmap(f.fileno(), skip + place.size, access=mmap.ACCESS_COPY, offset=place.offset - skip)
    except (OSError, ValueError) as exc:
        raise DumpError(f"{path}: its placement in {place.path} cannot be read: {exc}") from None
    entries = {name: (dtype, shape, skip + place.tensors[name][0], skip + place.tensors[name][0] + sizes[name])
               for name, (dtype, shape) in expected.items()}  # fmt: skip
    start, end = entries[meta.sample_layout().ids_key][2:]
    if (digest := hashlib.sha256(data[start:end]).hexdigest()) != meta.input_ids_sha256:
        raise DumpError(f"{path}: placed input_ids hash {digest} differs from meta.json {meta.input_ids_sha256}")
    return Dump(path=path, meta=meta, tensors=_views(data, entries) if load_tensors else None)
