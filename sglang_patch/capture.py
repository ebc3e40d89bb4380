"""Pure capture logic: which rows of an EXTEND pass belong to which request, and when a request is whole.

SGLang packs one pass's rows request by request in ``rids`` order: request ``j`` owns rows
``[sum(extend_seq_lens[:j]), +extend_seq_lens[j])`` at prompt positions ``extend_prefix_lens[j] + k``.
A long prompt is spread over several passes (chunked prefill) and a pass holds several requests, so
capture is keyed on the rid, never on a pass counter. A request is complete when its rows cover
``[0, prompt_len)``; a first pass that starts past 0 is a prefix-cache hit (its first rows were never
computed) and is reported as a failure.

Nothing here knows about SGLang or devices: `plan_pass` takes plain lists and `Accumulator` copies
tensor slices into host buffers that its caller allocates, so both are tested with plain tensors.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from sglang_patch.contract import rid_matches

# ForwardMode names whose rows are prompt tokens. MIXED (``--enable-mixed-chunk``) adds running decode
# requests as 1-row extends; their rows lie past the prompt and are clipped away by `plan_pass`.
CAPTURED_MODES = frozenset({"EXTEND", "MIXED"})

Allocator = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]


@dataclass(frozen=True, slots=True)
class Piece:
    """Rows ``[row_start, row_start + num_rows)`` of a pass: prompt positions ``[position, +num_rows)`` of `rid`."""

    rid: str
    row_start: int
    num_rows: int
    position: int
    prompt_len: int


class Prompts(Mapping[str, int]):
    """Full prompt length of each captured rid (and the custom params its client sent, if any),
    recorded when SGLang builds a pass from its requests; the mapping gives the lengths.

    A forward batch says where each request's rows sit but not where its prompt ends, and sglang
    0.5.14 copies the batch into static buffers (dropping any attribute added to it), so lengths are
    kept here, keyed by rid. Only rids in the `rid_prefix` namespace are kept, at most `capacity`
    (the oldest go first: a request that keeps generating after its prompt may be recorded again
    and is never looked up).
    """

    def __init__(self, rid_prefix: str, capacity: int = 4096) -> None:
        self._rid_prefix = rid_prefix
        self._capacity = capacity
        self._lengths: OrderedDict[str, int] = OrderedDict()
        self._params: dict[str, dict[str, object]] = {}

    def record(self, rid: str | None, prompt_len: int, params: dict[str, object] | None = None) -> None:
        if rid is None or not rid_matches(rid, self._rid_prefix):
            return
        self._lengths[rid] = prompt_len
        self._lengths.move_to_end(rid)
        if params:
            self._params[rid] = params
        while len(self._lengths) > self._capacity:
            self._params.pop(self._lengths.popitem(last=False)[0], None)

    def params(self, rid: str) -> dict[str, object]:
        """The custom params the client sent with `rid` (unchecked: its loss mask, its placement), or none."""
        return self._params.get(rid, {})

    def forget(self, rid: str) -> None:
        self._lengths.pop(rid, None)
        self._params.pop(rid, None)

    def __getitem__(self, rid: str) -> int:
        return self._lengths[rid]

    def __iter__(self) -> Iterator[str]:
        return iter(self._lengths)

    def __len__(self) -> int:
        return len(self._lengths)


def plan_pass(
    mode: str,
    rids: Sequence[str] | None,
    extend_seq_lens: Sequence[int] | None,
    extend_prefix_lens: Sequence[int] | None,
    prompt_lens: Mapping[str, int],
    *,
    rid_prefix: str,
) -> list[Piece]:
    """Pieces of one forward pass that belong to captured requests (rids in the `rid_prefix` namespace).

    Empty for passes that are not EXTEND/MIXED (decode), for passes SGLang builds itself
    (``rids is None``: graph capture, dummy runs) and when no rid matches (warmup, health checks).
    Rows past a request's prompt (generated tokens) are dropped. `prompt_lens[rid]` is the full
    prompt length of a captured rid; a captured rid without one is a wiring error (ValueError).
    """
    if mode not in CAPTURED_MODES or rids is None:
        return []
    wanted = [j for j, rid in enumerate(rids) if rid_matches(rid, rid_prefix)]
    if not wanted:
        return []
    if extend_seq_lens is None or extend_prefix_lens is None:
        raise ValueError(f"a {mode} pass with captured rids has no extend_seq_lens_cpu/extend_prefix_lens_cpu")
    if not len(rids) == len(extend_seq_lens) == len(extend_prefix_lens):
        raise ValueError(
            f"pass lists disagree in length: {len(rids)} rids, {len(extend_seq_lens)} extend lengths, "
            f"{len(extend_prefix_lens)} prefix lengths"
        )
    unknown = [rids[j] for j in wanted if rids[j] not in prompt_lens]
    if unknown:
        raise ValueError(f"no prompt length recorded for captured rids {unknown}")
    starts = [0]
    for n in extend_seq_lens[:-1]:
        starts.append(starts[-1] + n)
    pieces = []
    for j in wanted:
        position, prompt_len = extend_prefix_lens[j], prompt_lens[rids[j]]
        num_rows = min(extend_seq_lens[j], prompt_len - position)
        if num_rows > 0:
            pieces.append(Piece(rids[j], starts[j], num_rows, position, prompt_len))
    return pieces


@dataclass(frozen=True, slots=True)
class Completed:
    """All prompt rows of `rid` captured: `tensors[name]` is [prompt_len, ...] (host buffers)."""

    rid: str
    tensors: dict[str, torch.Tensor]


@dataclass(frozen=True, slots=True)
class Failed:
    """This attempt of `rid` cannot give a valid dump; `reason` says why (written as an error dump)."""

    rid: str
    reason: str


Outcome = Completed | Failed


@dataclass(slots=True)
class _Request:
    prompt_len: int
    last_pass: int
    filled: int = 0
    # None once the request has failed: its remaining rows are skipped until its prompt ends.
    buffers: dict[str, torch.Tensor] | None = field(default=None)


class Accumulator:
    """Places each request's pieces at their prompt positions in host buffers and reports outcomes.

    One instance per capturing process; not thread-safe (SGLang runs forward passes, and so the hooks,
    on one thread). Memory stays bounded: completed and failed requests are dropped at once, and a
    request that gets no rows for `max_idle_passes` calls of `add_pass` (aborted by its client) is
    dropped too.
    """

    def __init__(self, *, alloc: Allocator, max_idle_passes: int) -> None:
        self._alloc = alloc
        self._max_idle = max_idle_passes
        self._requests: dict[str, _Request] = {}
        self._pass = 0

    @property
    def in_progress(self) -> int:
        """Requests with some rows captured and more to come."""
        return sum(r.buffers is not None for r in self._requests.values())

    def add_pass(self, pieces: Sequence[Piece], rows: Mapping[str, torch.Tensor]) -> list[Outcome]:
        """Take one pass's pieces; `rows[name]` is that pass's [N, ...] tensor (any device).

        Copies are issued with ``non_blocking=True``: from a GPU into pinned buffers they are
        asynchronous, so the caller must record an event after this call and have the consumer of a
        `Completed` wait on it. Each call counts towards idle eviction.
        """
        self._pass += 1
        needed = max((p.row_start + p.num_rows for p in pieces), default=0)
        short = {name: t.shape[0] for name, t in rows.items() if t.shape[0] < needed}
        if short:
            raise ValueError(f"pass has {needed} captured rows but tensors hold only {short}")
        outcomes: list[Outcome] = []
        for piece in pieces:
            outcome = self._place(piece, rows)
            if outcome is not None:
                outcomes.append(outcome)
        outcomes.extend(self._evict_idle())
        return outcomes

    def _place(self, piece: Piece, rows: Mapping[str, torch.Tensor]) -> Outcome | None:
        req = self._requests.get(piece.rid)
        end = piece.position + piece.num_rows
        if req is None:
            if piece.position != 0:
                self._fail_until_end(piece)
                return Failed(
                    piece.rid,
                    f"prefix-cache hit: the first rows computed for this request start at position "
                    f"{piece.position} of {piece.prompt_len} (send a unique extra_key or disable the "
                    "radix cache)",
                )
            req = _Request(piece.prompt_len, self._pass, buffers=self._allocate(piece.prompt_len, rows))
            self._requests[piece.rid] = req
        req.last_pass = self._pass
        if req.buffers is None:
            if end >= req.prompt_len:
                del self._requests[piece.rid]
            return None
        if piece.position != req.filled or piece.prompt_len != req.prompt_len:
            self._fail_until_end(piece)
            return Failed(
                piece.rid,
                f"rows out of sequence: got positions [{piece.position}, {end}) of {piece.prompt_len} "
                f"after [0, {req.filled}) of {req.prompt_len} (a pass was not seen by the hooks?)",
            )
        for name, buffer in req.buffers.items():
            src = rows[name][piece.row_start : piece.row_start + piece.num_rows]
            buffer[piece.position : end].copy_(src, non_blocking=True)
        req.filled = end
        if end < req.prompt_len:
            return None
        del self._requests[piece.rid]
        return Completed(piece.rid, req.buffers)

    def _allocate(self, prompt_len: int, rows: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {name: self._alloc((prompt_len, *t.shape[1:]), t.dtype) for name, t in rows.items()}

    def _fail_until_end(self, piece: Piece) -> None:
        """Forget `piece.rid`'s rows but remember it failed until its last rows have gone by."""
        if piece.position + piece.num_rows < piece.prompt_len:
            self._requests[piece.rid] = _Request(piece.prompt_len, self._pass)
        else:
            self._requests.pop(piece.rid, None)

    def _evict_idle(self) -> list[Outcome]:
        idle = [rid for rid, r in self._requests.items() if self._pass - r.last_pass > self._max_idle]
        outcomes: list[Outcome] = []
        for rid in idle:
            req = self._requests.pop(rid)
            if req.buffers is not None:
                outcomes.append(
                    Failed(
                        rid,
                        f"abandoned: positions [0, {req.filled}) of {req.prompt_len} captured, then no rows "
                        f"for {self._max_idle} passes (request aborted?)",
                    )
                )
        return outcomes
