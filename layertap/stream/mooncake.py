"""The Mooncake Store side of a stream: connecting (the master checked first), putting hard-pinned, and the
manifest of one sample in hs-connectors 0.9.0's layout.

A sample is one raw object: its tensors packed at 64-byte-aligned offsets (hs-connectors' ``packed_layout``), named
by the handle; the manifest ``{handle, version: 1, tensors: {name: {shape, dtype, nbytes, offset}}, metadata}``
says how to unpack it and travels on the Redis stream. The tensors are speculators' sample file's (``token_ids``
int64 [T], ``hidden_states`` [T, k+1, H]: the aux layers in capture-index order, the pre-norm final last; an FP8
store adds ``hidden_states_scales`` float32 [T, k+1, 1]) plus ``loss_mask`` uint8 [T], which hs-connectors' vLLM
producer leaves to the trainer's own preprocessing but a trainer of layertap's samples needs.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

import torch
from hs_connectors.mooncake_store import (
    VERSION,
    MooncakeHiddenStatesStore,
    MooncakeIntegrityError,
    MooncakeStoreConfig,
    packed_layout,
)

from layertap.errors import LayertapError
from layertap.store.index import SampleRecord
from layertap.store.manifest import Manifest
from layertap.stream import segment

# What must be equal between the run that put a sample and the trainer that reads it (`run_identity`).
IDENTITY_FIELDS = ("format", "model_config_sha256", "tokenizer_sha256", "chat_template_sha256", "dataset_sha256",
                   "compute_dtype", "store_dtype", "hidden_size", "capture_indices", "final_pre_norm")  # fmt: skip
LOCAL_BUFFER_BYTES = 16 << 20  # the client's own bounce buffer: hs-connectors registers its staging buffers itself
# Mooncake copies a put into its own client's segment with memcpy only where it finds no transport but TCP; on a host
# with an RDMA NIC (a GPU node) it sends each put to itself over TCP loopback instead, a 40 MB put in 23.3 ms on the CPU
# box against 5.6 ms by memcpy (`benchmarks/results/put_cpu.md`; a CPU's worth of kernel copies besides). A producer
# asks for memcpy unless the user set the variable; Mooncake reads it as each client is set up.
LOCAL_MEMCPY_ENV = "MC_STORE_MEMCPY"
_CLIENT_PID: int | None = None  # the process that made this one's first client (a forked child inherits it: `connect`)


class StreamError(LayertapError):
    """The stream cannot go on as asked: the master or Redis unreachable, a sample that is not the run's."""


def run_identity(manifest: Manifest, server: str | None) -> dict[str, Any]:
    """What a consumer checks every sample against: the store manifest's model, tokenizer, dataset and layout facts,
    and the capture server (its URL; None in process)."""
    facts = manifest.model_dump(mode="json")
    return {**{k: facts[k] for k in IDENTITY_FIELDS}, "server": server}


def fingerprint(identity: dict[str, Any]) -> str:
    """sha256 of the identity's canonical JSON: what each sample's metadata carries."""
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()


def sample_manifest(handle: str, tensors: dict[str, torch.Tensor], record: SampleRecord, run: str) -> dict[str, Any]:
    """hs-connectors' transfer manifest of one sample (its own ``packed_layout``; ``metadata.total_aligned_bytes``
    and ``num_tokens`` as its vLLM connector writes them), with layertap's facts in ``metadata.layertap``: the run's
    fingerprint, the sample's id, dataset row, ``input_ids`` hash (int64 little-endian) and loss-mask runs."""
    # Packed in name order, whatever order the tensors come in (a capture's, a file's): a consumer holding an entry of a
    # dead producer reads the sample's resumed object by that entry's offsets.
    specs, total = packed_layout({name: (tuple(t.shape), t.dtype) for name, t in sorted(tensors.items())})
    layertap = {"run": run, "sample_id": record.sample_id, "row": record.index, "ids_sha256": record.ids_sha256,
                "mask_runs": record.mask_runs, "truncated": record.truncated}  # fmt: skip
    metadata = {"num_tokens": record.num_tokens, "total_aligned_bytes": total, "extract_mode": "prompt_only",
                "layertap": layertap}  # fmt: skip
    return {"handle": handle, "version": VERSION, "tensors": specs, "metadata": metadata}


class PinnedPuts:
    """A Mooncake client whose puts (``put_from``, ``put_parts``) hard-pin the object (never evicted before its
    consumer removes it) in this process's own segment; everything else is the client's own. hs-connectors'
    ``put_sample`` calls ``put_from`` with Mooncake's default replica config, which an eviction may take under memory
    pressure and which places an object in any mounted segment: in another producer's, which goes when that one ends, or in a killed
    producer's, which the master keeps for its ``-client_ttl`` and every put into fails (status -800)."""

    def __init__(self, client: Any, prefaulting: segment.Prefault, mapped: segment.MappedFile | None = None) -> None:
        from mooncake.store import ReplicateConfig

        self._client, self.prefaulting, self.mapped = client, prefaulting, mapped
        self.sizes: dict[str, int] = {}  # key -> bytes, of the objects put and not yet settled
        self._config = ReplicateConfig()
        self._config.with_hard_pin = True
        self._config.preferred_segment = client.get_hostname()  # the segment's name: this client's host:port

    def put_from(self, key: str, buffer_ptr: int, size: int) -> int:
        self._putting(key, size)
        return self._put(key, self._client.put_from(key, buffer_ptr, size, self._config))

    def put_parts(self, key: str, pointers: list[int], sizes: list[int]) -> int:
        """One object made of the bytes at ``pointers``, in order: Mooncake copies them into the segment in one call."""
        self._putting(key, sum(sizes))
        return self._put(key, self._client.batch_put_from_multi_buffers([key], [pointers], [sizes], self._config)[0])

    def reserve(self, key: str, size: int) -> int:
        """An object of ``size`` bytes made in this client's segment file, hard-pinned, nothing copied (a put session
        begun and ended at once), for another process to write (`MooncakeSink.place`): its offset in the file."""
        if self.mapped is None:
            raise RuntimeError("this client's segment is not a file")
        self._putting(key, size)
        if (status := self._client.batch_put_session_start([key], [size], self._config)) != [0]:
            self.settled([key])
            raise RuntimeError(f"reserving {key} returned {status}")
        if (status := self._client.batch_put_session_end([key])) not in ([0], None):
            self._client.remove(key, True)
            self.settled([key])
            raise RuntimeError(f"ending the reservation of {key} returned {status}")
        [replica] = self._client.get_replica_desc(key)
        return self.mapped.offset(replica.get_memory_descriptor().buffer_descriptor.buffer_address)

    def settled(self, keys: list[str]) -> None:
        """The objects of ``keys`` are removed (or about to be: their consumers are done with them)."""
        self.prefaulting.retire(sum(self.sizes.pop(key, 0) for key in keys))

    def _putting(self, key: str, size: int) -> None:
        self.sizes[key] = size
        self.prefaulting.advance(size)

    def _put(self, key: str, status: int) -> int:
        if status != 0:
            self.settled([key])
        return status

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


_GAP = torch.zeros(64, dtype=torch.uint8)  # what fills the packed layout's alignment gaps (each under 64 bytes)


def put_packed(store: MooncakeHiddenStatesStore, manifest: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    """Put a sample's object, packed as ``manifest`` says, straight from its tensors' memory (a capture's dump views):
    the tensors and the gaps between them are the object's parts, so each byte is copied once, by Mooncake, and the
    put gives up the GIL once. hs-connectors' ``put_sample`` first copies every tensor into its staging buffer, and
    each of its torch calls gives up the GIL and waits to take it back behind the capture's threads. Over TCP the
    parts need not be registered memory."""
    parts: list[torch.Tensor] = []  # kept until the put returns: a part may be a contiguous copy
    end = 0
    for name, spec in sorted(manifest["tensors"].items(), key=lambda item: item[1]["offset"]):
        tensor = tensors[name].contiguous()
        if tensor.nbytes != spec["nbytes"]:
            raise StreamError(f"{name} of {manifest['handle']} is not the {spec['nbytes']} bytes its manifest says")
        parts += [_GAP[: spec["offset"] - end], tensor]
        end = spec["offset"] + spec["nbytes"]
    parts = [t for t in [*parts, _GAP[: manifest["metadata"]["total_aligned_bytes"] - end]] if t.nbytes]
    status = store._store.put_parts(manifest["handle"], [t.data_ptr() for t in parts], [t.nbytes for t in parts])
    if status != 0:
        raise RuntimeError(f"Mooncake put of {manifest['handle']} returned {status}")


_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)  # how many hold a storage (tensors, views, the caller's)
_BUFFER_ROUND = 16 << 20  # a kept buffer's size rounds up to this, so samples a little longer still fit it


class ReadBuffers:
    """Host memory a consumer reads unpinned samples into, a buffer read into again once nothing holds a view of it.
    Each fresh buffer faults its pages in as the read lands (glibc maps every block over 32 MB anew): a CPU consumer
    received at 1.4 GB/s on the H100 host against 2.6 pinned (gpu_stream_stages.md); a 40 MB read took 61.9 ms into
    fresh memory and 23.3 ms into a kept buffer on the CPU box (`benchmarks/results/put_cpu.md`). A buffer whose
    storage went to shared memory (a DataLoader worker pickling a sample moves it there in place, and the main process
    reads it from there) is never read into again. Without torch's use count of a storage, every read gets fresh
    memory."""

    def __init__(self, keep: int = 4) -> None:
        self.keep = keep
        self.buffers: list[torch.Tensor] = []

    def take(self, size: int) -> torch.Tensor:
        """``size`` bytes to read a sample into: a kept buffer that nothing else holds, else a new one, kept while
        fewer than ``keep`` are (one too small of those free is replaced)."""
        if _USE_COUNT is None:
            return torch.empty(size, dtype=torch.uint8)
        self.buffers = [b for b in self.buffers if not b.untyped_storage().is_shared()]
        free = [b for b in self.buffers if _USE_COUNT(b.untyped_storage()._cdata) <= 2]  # this list's and the call's
        if fits := [b for b in free if b.numel() >= size]:
            return fits[0][:size]
        if free:  # by identity: a tensor's == is elementwise
            self.buffers = [b for b in self.buffers if b is not free[0]]
        buffer = torch.empty(-(-size // _BUFFER_ROUND) * _BUFFER_ROUND, dtype=torch.uint8)
        if len(self.buffers) < self.keep:
            self.buffers.append(buffer)
        return buffer[:size]


def get_packed(
    store: MooncakeHiddenStatesStore,
    manifest: dict[str, Any],
    *,
    timeout: float,
    pin: bool = False,
    buffers: ReadBuffers | None = None,
) -> dict[str, torch.Tensor]:
    """A sample's tensors, as ``manifest`` packs them, read straight into one buffer of their own (pinned with
    ``pin``, so a trainer's copy onto its GPU runs at full speed; else one of ``buffers`` when given) and returned as
    views of it: no staging buffer and no copy out of it, as hs-connectors' ``get_sample`` makes (with the fresh pages
    each copy faults in, the copy cost as much as the read). TimeoutError when the object is not there within
    ``timeout`` seconds, MooncakeIntegrityError (a RuntimeError) when it is not what the manifest says."""
    handle, size = manifest["handle"], manifest["metadata"]["total_aligned_bytes"]
    if manifest.get("version") != VERSION:
        raise MooncakeIntegrityError(f"{handle}: manifest version {manifest.get('version')}, not {VERSION}")
    deadline = time.monotonic() + timeout
    while (found := store._store.get_size(handle)) < 0:
        if time.monotonic() >= deadline:
            raise TimeoutError(f"Mooncake Store has no object {handle}")
        time.sleep(0.01)
    if found != size:
        raise MooncakeIntegrityError(f"{handle} holds {found} bytes, its manifest says {size}")
    buffer = torch.empty(size, dtype=torch.uint8, pin_memory=pin) if pin or buffers is None else buffers.take(size)
    if (got := store._store.get_into(handle, buffer.data_ptr(), size)) != size:
        raise MooncakeIntegrityError(f"reading {handle} gave {got} of its {size} bytes")
    return {name: _view(buffer, handle, name, spec) for name, spec in manifest["tensors"].items()}


def _view(buffer: torch.Tensor, handle: str, name: str, spec: dict[str, Any]) -> torch.Tensor:
    dtype = getattr(torch, str(spec["dtype"]).removeprefix("torch."), None)
    shape, offset, nbytes = tuple(spec["shape"]), int(spec["offset"]), int(spec["nbytes"])
    if not isinstance(dtype, torch.dtype) or nbytes != torch.Size(shape).numel() * dtype.itemsize:
        raise MooncakeIntegrityError(f"{handle}: {name} is {spec['dtype']} {shape}, not {nbytes} bytes")
    if offset < 0 or offset + nbytes > buffer.numel():
        raise MooncakeIntegrityError(f"{handle}: {name} lies past the object's end")
    return buffer[offset : offset + nbytes].view(dtype).view(shape)


def objects_present(store: MooncakeHiddenStatesStore, handles: list[str]) -> list[bool]:
    """Which of ``handles`` Mooncake Store holds, in order (hs-connectors' store asks its client; it has no call of
    its own)."""
    return [found == 1 for found in store._store.batch_is_exist(handles)]


def settled(store: MooncakeHiddenStatesStore, handles: list[str]) -> None:
    """Tell a producer's store that the objects of ``handles`` are done with (acked or dead-lettered: their consumers
    remove them), so its segment's faulting in follows what it holds (`segment.Prefault`)."""
    if isinstance(store._store, PinnedPuts):
        store._store.settled(handles)


def segment_file(store: MooncakeHiddenStatesStore) -> Path | None:
    """The file a producer's segment is mounted from (`connect`'s ``segment_dir``), None for anonymous memory."""
    client = store._store
    return client.mapped.path if isinstance(client, PinnedPuts) and client.mapped is not None else None


def disconnect(store: MooncakeHiddenStatesStore) -> None:
    """Close the store's client, unmounting its segment (the objects in it go, and the file it was mounted from):
    hs-connectors' store has no close."""
    if isinstance(store._store, PinnedPuts):
        store._store.prefaulting.stop()
    store._store.close()
    if (path := segment_file(store)) is not None:
        path.unlink(missing_ok=True)


def check_master(address: str) -> None:
    """Refuse a master that does not answer on ``host:port`` (Mooncake's own client retries for minutes)."""
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=3).close()
    except (OSError, ValueError) as exc:
        raise StreamError(
            f"no Mooncake master at {address} ({exc}): start one (`mooncake_master -rpc_port={port or 50051}`) or "
            "name it with --mooncake-master"
        ) from None


def connect(
    address: str, *, segment_bytes: int, pin: bool = False, prefault: bool = True, segment_dir: Path | None = None
) -> MooncakeHiddenStatesStore:
    """hs-connectors' store, set up against the master at ``address`` over TCP. A producer mounts a segment of
    ``segment_bytes`` (its objects live there, and vanish with this process); a consumer mounts none (0), so no
    producer's object lands in a trainer's memory. ``pin``: puts are hard-pinned (`PinnedPuts`), and with
    ``prefault`` the segment's pages are faulted in ahead of the puts by threads of their own (`segment.Prefault`;
    without, by the puts that first touch them: `benchmarks/put_bench.py` compares), and its puts are memcpys into its
    own segment (`LOCAL_MEMCPY_ENV`), not sends to itself over TCP. With ``segment_dir`` (a pinned producer's: a
    capture server's dump root) the segment is a file there (`segment.MappedFile`), which a capture server writes
    samples into itself (`PinnedPuts.reserve`); its pages fault in as they are written.

    The client is set up as hs-connectors' ``setup`` does, less its ``ensure_accelerator_context``: on a GPU host that
    makes a CUDA context on the current device (GPU 0 for a worker that never chose one) in every process that
    connects, ~0.5 s and hundreds of MB of the GPU its server uses, which a TCP transport does not need.

    StreamError in a process forked from one that had made a client (a DataLoader worker forked after the trainer
    read in its own process): its setup would hang there (tests/stream/test_stream.py found it)."""
    from mooncake.store import MooncakeDistributedStore

    global _CLIENT_PID
    if _CLIENT_PID not in (None, os.getpid()):
        raise StreamError(
            "this process was forked from one that had made a Mooncake client, and a client set up after such a fork "
            "hangs: start it otherwise (DataLoader(..., multiprocessing_context='forkserver'), or 'spawn')"
        )
    check_master(address)
    if pin:
        os.environ.setdefault(LOCAL_MEMCPY_ENV, "1")
    host = address.rpartition(":")[0]
    local = "127.0.0.1" if host in ("127.0.0.1", "localhost") else socket.gethostbyname(socket.gethostname())
    config = MooncakeStoreConfig(local_hostname=local, master_server_address=address,
                                 global_segment_size=segment_bytes, local_buffer_size=LOCAL_BUFFER_BYTES)  # fmt: skip
    client = MooncakeDistributedStore()
    in_file = pin and segment_dir is not None
    mapped = segment.anonymous_regions() if pin and prefault and not in_file else set()  # a consumer's reads no maps
    status = client.setup(config.local_hostname, config.metadata_server, 0 if in_file else config.global_segment_size,
                          config.local_buffer_size, config.protocol, config.device_name, config.master_server_address)  # fmt: skip
    if status != 0:
        raise StreamError(f"setting up a Mooncake client against the master at {address} failed (status {status})")
    _CLIENT_PID = os.getpid()
    store = MooncakeHiddenStatesStore(config)
    if in_file:
        assert segment_dir is not None
        try:
            mounted = segment.MappedFile.mount(client, segment_dir, segment_bytes)
        except (RuntimeError, OSError) as exc:
            client.close()
            raise StreamError(f"mounting a Mooncake segment file in {segment_dir} failed: {exc}") from None
        client = PinnedPuts(client, segment.Prefault([]), mounted)
    elif pin:
        faults = (
            segment.prefault(segment.anonymous_regions() - mapped, segment_bytes) if prefault else segment.Prefault([])
        )
        client = PinnedPuts(client, faults)
    store._store = client  # the one client the store keeps
    return store
