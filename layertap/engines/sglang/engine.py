"""The SGLang engine: keeps N prefill requests in flight on a capture server and reads their dumps.

For each sample: rid ``<prefix>:<job>:<sample>:<attempt>`` -> ``POST /generate`` with ``input_ids``,
``max_new_tokens: 0`` and a unique ``extra_key`` -> the reply must say ``cached_tokens == 0`` and
``prompt_tokens == T`` -> wait (bounded) for ``<dump_root>/<rid>/`` -> check it against the sample
(token count, input_ids hash, capture indices, finals) -> yield it; the store then validates
(shapes, finiteness) and commits, and the dump folder is removed.

A server launched with a trainer's dump layout (`dump_layout`) writes each sample already in the
store's format, loss mask included (sent with the request): the yielded sample then names that file
and the store commits it by renaming it, no bytes copied when the dump root shares its filesystem.

A run whose target takes samples where the server writes them (`Engine.placer`: a stream's object in its producer's
Mooncake segment) sends that placement with each request: the server writes the sample there and its dump is only
its meta.json, whose tensors the engine then reads as views of the placed bytes (`CapturedSample.placed`).

Attempt numbers start at the engine's creation time in milliseconds, so a dump left by an earlier
process can never be taken for a fresh one. Requests go through the server's `ServerSession` (`session`), which
checks the server before any sample and sends a dropped request again once the server serves (a dead server this
process launched restarted, one given by URL ending the run), as it does a regenerating run's generations
(`layertap.regenerate.client`). One sample's failure is yielded as a FailedCapture.
"""

from __future__ import annotations

import itertools
import logging
import shutil
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import torch

from layertap.engines.base import Engine
from layertap.engines.server_facts import ServerFacts, expectation_for
from layertap.engines.sglang.launch import sglang_compute_dtype
from layertap.engines.sglang.process import SGLangServer
from layertap.engines.sglang.session import ServerDown, ServerSession
from layertap.errors import SampleError, ServerError
from layertap.models.folder import ModelFolder
from layertap.sample import CapturedSample, FailedCapture, SampleFile, TokenizedSample
from layertap.settings import GENERATION_IN_FLIGHT
from layertap.spec import CaptureSpec
from sglang_patch.contract import (
    AUX,
    DEFAULT_RID_PREFIX,
    FINAL_TENSORS,
    FORMAT_FINAL,
    LOSS_MASK_PARAM,
    PLACE_PARAM,
    SCALES,
    SPECULATORS,
    Dump,
    DumpError,
    dump_dir,
    format_rid,
    read_dump,
    sweep_stale_dumps,
)
from sglang_patch.sample_files import ids_sha256, mask_runs, unpack_sample

log = logging.getLogger(__name__)
STALE_DUMP_AGE_S = 3600  # no live client leaves a dump unread this long (it waits dump_timeout_s at most)


class SGLangEngine(Engine):
    """Captures through a running (or owned) SGLang capture server."""

    def __init__(
        self,
        server: SGLangServer,
        spec: CaptureSpec,
        *,
        folder: ModelFolder,
        dump_root: Path,
        job: str,
        in_flight: int,
        generation_in_flight: int = GENERATION_IN_FLIGHT,
        allow_dummy_weights: bool = False,
        rid_prefix: str = DEFAULT_RID_PREFIX,
        dump_timeout_s: float = 120.0,
        request_timeout_s: float = 3600.0,
        max_server_restarts: int = 3,
        observe: Callable[[str, float], None] | None = None,
        on_writer: Callable[[dict[str, float]], None] | None = None,
    ) -> None:
        """``folder`` is the model folder (as the run read it) the server must serve (`server_facts`: checked here, before any sample, and
        after every restart; ``allow_dummy_weights`` lets a benchmark's random-weight server through).
        ``observe(stage, seconds)`` is told each request's send (from the caller's handing it over to its first POST:
        a request thread free, the sample's placement, its body), prefill, dump_wait and validate times, its
        handover (from its end to the caller taking it: the caller's own work, e.g. its commits, holding the next
        requests) and the refill of the slot it left (from then to the caller sending the next request): together a
        slot's whole cycle;
        ``on_writer(stats)`` the server's writer stats each dump carries (`DumpMeta.writer`: how long
        the forward pass waited for the writers, queue depth, host memory held), since the plugin
        runs in the server's process and has no metrics endpoint of its own."""
        self.spec = spec
        self.dump_root = dump_root
        self.job = job
        self.rid_prefix = rid_prefix
        self.in_flight = in_flight
        self.generation_in_flight = generation_in_flight
        self.dump_timeout_s = dump_timeout_s
        self.observe = observe
        self.on_writer = on_writer
        self._attempts = itertools.count(time.time_ns() // 1_000_000)
        self.folder = folder
        self._sent: set[str] = set()  # rids whose dumps may still exist on disk, not yet yielded
        self._yielded: dict[str, str] = {}  # sample id -> rid of a yielded dump the consumer has not released
        dump_root.mkdir(parents=True, exist_ok=True)
        swept = sweep_stale_dumps(dump_root, STALE_DUMP_AGE_S)
        if swept:
            log.warning(
                "removed %d dumps left in %s over %d s ago by clients that died", swept, dump_root, STALE_DUMP_AGE_S
            )
        expected = expectation_for(folder, spec, rid_prefix=rid_prefix, dump_root=dump_root,
                                   allow_dummy_weights=allow_dummy_weights)  # fmt: skip
        try:
            self.session = ServerSession(server, expected=expected, request_timeout_s=request_timeout_s,
                                         max_restarts=max_server_restarts)  # fmt: skip
        except ServerError:  # nothing was sent: an owned server goes with the refused engine
            server.stop()
            raise

    @property
    def server(self) -> SGLangServer:
        return self.session.server

    @property
    def provenance(self) -> ServerFacts:
        """The server's facts as read and checked on attach (a restart must keep its settings: `ServerSession`)."""
        return self.session.facts

    @property
    def compute_dtype(self) -> str:
        """The dtype the server computes in (for the manifest): its ``--dtype``, or for ``auto`` what SGLang
        makes of the model folder's own dtype (the server serves ``folder``: checked)."""
        return sglang_compute_dtype(self.provenance.dtype, self.folder.dtype)

    @property
    def input_limit(self) -> int | None:
        """The longest prompt the server accepts (its scheduler's limit, below the model's context length)."""
        return self.provenance.input_limit

    def describe(self) -> dict[str, Any]:
        return {"name": "sglang", "url": self.server.url, "in_flight": self.in_flight,
                "server": self.provenance.record()}  # fmt: skip

    # -- one request ------------------------------------------------------------------------------

    def _request(self, sample: TokenizedSample, submitted: float) -> tuple[list[CapturedSample], str, float]:
        """Prefill one sample and read back its dump, sent again while the server drops it
        (`ServerSession.until_served`): the capture in a list of one, which `capture` empties as it yields it (a
        finished future keeps its result: the dump's mapping stays alive only where its consumer holds it), the rid and
        when it ended (perf_counter); SampleError if this attempt is unusable. ``submitted``: when the caller handed it
        to this thread (perf_counter), for its first try's ``send`` stage."""
        since: list[float | None] = [submitted]  # taken by the first try: a resend's is not timed as a send

        def one_try() -> tuple[CapturedSample, str]:
            first, since[0] = since[0], None
            return self._try(sample, first)

        captured, rid = self.session.until_served(one_try)
        return [captured], rid, time.perf_counter()

    def _try(self, sample: TokenizedSample, submitted: float | None) -> tuple[CapturedSample, str]:
        """One request for ``sample`` under a fresh rid (``submitted``: when the first try was handed to its thread;
        None for a resend); ServerDown when the server dropped it."""
        rid = format_rid(self.job, sample.sample_id, next(self._attempts), prefix=self.rid_prefix)
        self._sent.add(rid)
        restarts = self.server.restarts
        body = {
            "input_ids": sample.input_ids.tolist(),
            "rid": rid,
            # The prefill still samples one token, thrown away: greedy, so that a batch it shares with regenerating
            # requests stays on SGLang's argmax path (one request at temperature 1 sends the whole batch through
            # FlashInfer's sampling kernels, which a fresh GPU node first builds: 87-131 s with the server stalled).
            "sampling_params": {
                "max_new_tokens": 0,
                "temperature": 0.0,
                "custom_params": self._params(sample),
            },
            "extra_key": uuid.uuid4().hex,  # defeats the radix cache on servers that honour it
        }
        # this thread taking the request, its placement, its body
        t0 = time.perf_counter() if submitted is None else self._observe("send", submitted)
        reply = self.session.post("/generate", body)
        self._observe("prefill", t0)
        if reply.status_code != 200:
            raise SampleError(f"server refused {rid}: HTTP {reply.status_code}: {reply.text[:300]}")
        meta = reply.json()["meta_info"]
        finish = meta.get("finish_reason") or {}
        if isinstance(finish, dict) and finish.get("type") == "abort":
            # SGLang finishes an aborted prompt's remaining chunks: its dump can look complete.
            raise SampleError(f"server aborted {rid}: {finish.get('message', finish)}")
        if meta.get("cached_tokens", 0) != 0:
            raise SampleError(f"prefix-cache hit on {rid}: {meta['cached_tokens']} tokens came from the cache")
        if meta.get("prompt_tokens") != sample.num_tokens:
            raise SampleError(f"server saw {meta.get('prompt_tokens')} prompt tokens, sent {sample.num_tokens}")
        t0 = time.perf_counter()
        path = self._wait_for_dump(rid, restarts)
        return self._read_dump(rid, path, sample, self._observe("dump_wait", t0))

    def _params(self, sample: TokenizedSample) -> dict[str, Any]:
        """The request's custom params: the sample's loss mask, and where the server is to write it when the run's
        target places samples (`Engine.placer`)."""
        capture = self.provenance.capture or {}
        places = self.placer is not None and capture.get("layout") == SPECULATORS and capture.get("quantize") == "none"
        place = self.placer.place(sample) if places else None  # a server writing its samples so, unquantized
        return {LOSS_MASK_PARAM: mask_runs(sample.loss_mask)} | ({} if place is None else {PLACE_PARAM: place})

    def _wait_for_dump(self, rid: str, restarts: int) -> Path:
        """Wait (bounded) for the dump folder of a request the server has answered; returns it.

        The reply comes when the forward pass ends and the dump is written after it, so a server that
        dies in between answers and never writes: that is the server's fault (ServerDown, resent),
        not the sample's, and is noticed within a second instead of at the timeout.
        """
        path = dump_dir(self.dump_root, rid)
        deadline = time.monotonic() + self.dump_timeout_s
        next_check = time.monotonic() + 1.0
        while not path.exists():
            now = time.monotonic()
            if now > deadline:
                raise SampleError(f"no dump for {rid} within {self.dump_timeout_s:.0f} s of the reply")
            if now > next_check:
                if self.server.restarts != restarts or not self.server.alive(probe=False):
                    raise ServerDown(f"the server went down after answering {rid}, before writing its dump")
                next_check = now + 1.0
            time.sleep(0.002)
        return path

    def _read_dump(self, rid: str, path: Path, sample: TokenizedSample, t1: float) -> tuple[CapturedSample, str]:
        """Read and check the dump of `rid` at `path` (found at perf_counter `t1`) against the sample."""
        try:
            dump = read_dump(path)
            if dump.meta.writer is not None and self.on_writer is not None:
                self.on_writer(dump.meta.writer)
            captured = captured_from_dump(dump, sample, self.spec)
        except (DumpError, SampleError) as exc:
            self._discard(rid)
            raise SampleError(f"{rid}: {exc}") from exc
        self._observe("validate", t1)
        return captured, rid

    def _observe(self, stage: str, since: float) -> float:
        """Report the time since ``since`` (perf_counter) as ``stage``; returns now."""
        now = time.perf_counter()
        if self.observe is not None:
            self.observe(stage, now - since)
        return now

    def _discard(self, rid: str) -> None:
        """Remove a dump (used or useless) and forget its rid."""
        shutil.rmtree(dump_dir(self.dump_root, rid), ignore_errors=True)
        self._sent.discard(rid)

    # -- many requests ----------------------------------------------------------------------------

    def capture(self, samples: Iterable[TokenizedSample]) -> Iterator[CapturedSample | FailedCapture]:
        if not self.server.owned:  # someone else's server may have been restarted with another model meanwhile
            self.session.check()
        source = iter(samples)
        pending: dict[Future, TokenizedSample] = {}
        freed: deque[float] = deque()  # when each slot a finished request left was freed (perf_counter)
        with ThreadPoolExecutor(self.in_flight, thread_name_prefix="sglang-req") as pool:
            try:
                while True:
                    while len(pending) < self.in_flight and (nxt := next(source, None)) is not None:
                        if freed:  # a free slot waiting for the caller: its commits, the next sample's planning
                            self._observe("refill", freed.popleft())
                        pending[pool.submit(self._request, nxt, time.perf_counter())] = nxt
                    if not pending:
                        return
                    done, _ = wait(pending, return_when=FIRST_COMPLETED)
                    for fut in done:
                        sample = pending.pop(fut)
                        try:
                            handed, rid, ended = fut.result()
                        except SampleError as exc:
                            freed.append(time.perf_counter())  # its slot free too
                            yield FailedCapture(sample, str(exc))
                            continue
                        freed.append(self._observe("handover", ended))  # a finished request waiting for the caller
                        self._sent.discard(rid)
                        self._yielded[sample.sample_id] = rid
                        yield handed.pop()  # held by no name here: the consumer's reference is the last
            finally:
                for fut in pending:
                    fut.cancel()
                pool.shutdown(wait=True)
                for rid in list(self._sent):  # dumps of requests abandoned mid-flight
                    self._discard(rid)

    def release(self, captured: CapturedSample) -> None:
        rid = self._yielded.pop(captured.sample.sample_id, None)
        if rid is not None:
            self._discard(rid)

    def close(self) -> None:
        for rid in self._yielded.values():
            self._discard(rid)
        self._yielded.clear()
        self.session.close()
        self.server.stop()


def captured_from_dump(dump: Dump, sample: TokenizedSample, spec: CaptureSpec) -> CapturedSample:
    """The capture of ``sample`` in a dump `read_dump` read and checked against its meta.json; SampleError unless
    the dump is "ok" and is this sample's (token count, input_ids hash) with the spec's layers and finals. A dump in
    a trainer's layout is handed over as its file (`SampleFile`: its bytes as read, so the store hashes and renames
    it without reading it again), the tensors being views of those bytes; a placed one as the key of the object it
    was written into (`CapturedSample.placed`), its loss mask checked against the sample's (and as its file too, where
    the placement asked for one)."""
    meta = dump.meta
    finals = meta.finals if meta.layout == "states" else (FORMAT_FINAL[meta.layout],)
    wanted = spec.finals
    if meta.status != "ok":
        raise SampleError(meta.error or "error dump")
    if meta.num_tokens != sample.num_tokens or meta.input_ids_sha256 != ids_sha256(sample.input_ids):
        raise SampleError(f"dump holds {meta.num_tokens} tokens with another input_ids hash than the sample")
    if meta.layers != spec.layers or not set(wanted) <= set(finals):
        raise SampleError(f"dump has layers {meta.layers} finals {finals}; wanted {spec.layers} {wanted}")
    t = dump.tensors or {}
    source = placed = None
    if meta.layout != "states":
        t = unpack_sample(meta.layout, t, len(meta.layers))
    if meta.placed is not None:
        placed = meta.placed["key"]
        if not torch.equal(t["loss_mask"], sample.loss_mask.to(torch.uint8)):
            raise SampleError("the loss mask the server placed is not the sample's")
    if meta.layout != "states" and dump.data is not None:  # a placed one with its file too: both
        source = SampleFile(dump.path / meta.file, meta.layout, dump.data, t.get("loss_mask"))
    return CapturedSample(
        sample=sample,
        aux=t[AUX],
        final_post=t.get(FINAL_TENSORS["post"]) if spec.final_post else None,
        final_pre=t.get(FINAL_TENSORS["pre"]) if spec.final_pre else None,
        source=source,
        scales=t.get(SCALES),
        placed=placed,
    )
