"""What the streamed reference needs, and where, said before it starts: the audit refuses what cannot fit.

On the device: the largest layer's weights (a MoE layer's shared part plus one routed expert dequantized; or the
embedding table while the tokens are embedded), the audited tokens' residual streams in every dtype computed, and
one step's working set (a batch's attention and dense MLP, or a MoE layer's MLP over every token). In host memory:
two layers as stored (the one computed and the one read ahead) and the audited samples' stored states. On the
device nothing grows with the depth; it is read from the shards' headers, before any weight is.

On the CPU the process keeps native memory that no live tensor holds (`benchmarks/results/audit_memory.md`): oneDNN,
which runs PyTorch's CPU matmuls in bf16, keeps ~9-11 MiB per decoder layer run at hidden 1024, about half of that
layer's dense weights in bf16 (the growth is gone with ``torch.backends.mkldnn`` off; halved with
``ONEDNN_PRIMITIVE_CACHE_CAPACITY=0``), and glibc's heap fragments around the per-layer tensors (gone with a fixed
``MALLOC_MMAP_THRESHOLD_``). Both are counted: each run layer's dense weights in every non-float32 dtype computed,
and a quarter of the activations as allocator slack.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from layertap.audit.layers import EXPERTS, top_names
from layertap.diskspace import human_bytes
from layertap.errors import SpecError
from layertap.models.weights import FolderWeights


@dataclass(frozen=True, slots=True)
class BatchShape:
    rows: int
    longest: int
    tokens: int  # real (unpadded) tokens


@dataclass(frozen=True, slots=True)
class Need:
    """Bytes the audit's reference needs on its device and in host memory, and what it reads."""

    device: torch.device
    weights: int  # the largest layer's (or the embeddings') on the device
    activations: int  # residual streams of the audited tokens + the largest step's working set
    host: int  # two layers as stored + the audited samples' stored states (+ `native` on the CPU)
    native: int  # CPU only: what oneDNN keeps per layer run, and the heap's fragmentation (see the module docstring)
    read: int  # bytes read from the folder: one read of the layers run
    layers: int
    tokens: int

    @property
    def on_device(self) -> int:
        return self.weights + self.activations

    @property
    def on_host(self) -> int:
        """Host memory in all: on the CPU the device's part is host memory too."""
        return self.host + (self.on_device if self.device.type == "cpu" else 0)

    def summary(self) -> str:
        return (
            f"streamed reference on {self.device}: ~{human_bytes(self.on_device)} there (largest layer "
            f"{human_bytes(self.weights)} + activations of {self.tokens:,} tokens {human_bytes(self.activations)}), "
            f"~{human_bytes(self.host)} of host memory"
            + (f" ({human_bytes(self.native)} of it kept by CPU kernels and the allocator)" if self.native else "")
            + f"; reads {human_bytes(self.read)} ({self.layers} layers)"
        )


def estimate(
    weights: FolderWeights,
    depth: int,
    dtypes: Sequence[torch.dtype],
    batches: Sequence[BatchShape],
    stored_bytes_per_token: int,
    device: torch.device,
) -> Need:
    """The reference's need for ``batches`` through ``depth`` layers computed in ``dtypes``."""
    cfg = weights.folder.text_config
    hidden, widest = weights.folder.hidden_size, max(d.itemsize for d in dtypes)
    top = top_names(weights)
    peak_weights = sum(weights.numel(n) for n in top) * widest
    peak_stored = sum(weights.stored_bytes(n) for n in top)
    read, dense = peak_stored, 0
    for index in range(depth):
        names = weights.layer(index)
        shared = [n for n in names if EXPERTS not in n]
        expert = [n for n in names if f"{EXPERTS}0." in n]
        one = sum(weights.numel(n) for n in expert)
        dequant = 12 * max((weights.numel(n) for n in expert), default=0)  # the unpacking's int64 and float32 steps
        dense += sum(weights.numel(n) for n in shared)
        peak_weights = max(peak_weights, sum(weights.numel(n) for n in shared) * widest + one * (4 + widest) + dequant)
        stored = sum(weights.stored_bytes(n) for n in names)
        peak_stored, read = max(peak_stored, 2 * stored), read + stored
    tokens = sum(b.tokens for b in batches)
    padded = sum(b.rows * b.longest for b in batches)
    streams = padded * hidden * sum(d.itemsize for d in dtypes)
    masks = len(dtypes) * sum(b.rows * b.longest**2 for b in batches if b.rows > 1)  # sdpa's boolean padding masks
    heads = int(cfg.get("num_attention_heads") or 1)
    head = int(cfg.get("head_dim") or hidden // heads)
    qk, v = (
        int(cfg.get("qk_nope_head_dim", head)) + int(cfg.get("qk_rope_head_dim", 0)),
        int(cfg.get("v_head_dim", head)),
    )
    largest = max(batches, key=lambda b: b.rows * b.longest)
    step = (
        largest.rows
        * largest.longest
        * (heads * (2 * qk + 2 * v) + 4 * hidden + 3 * int(cfg.get("intermediate_size", 0)))
    )
    if device.type == "cpu":  # sdpa's math path holds the scores and the softmax
        step += 2 * largest.rows * heads * largest.longest**2
    experts, shared = int(cfg.get("n_routed_experts") or 0), int(cfg.get("n_shared_experts") or 0)
    if experts:  # a MoE layer's MLP over every token: its input, output, the experts' sums, router scores
        inner = int(cfg.get("moe_intermediate_size", 0))
        moe = tokens * (6 * hidden + 3 * shared * inner + 4 * experts)
        k = int(cfg.get("num_experts_per_tok") or 1)
        routed = min(tokens, 2 * tokens * k // experts)  # one expert's tokens, twice the mean for imbalance
        moe += routed * (5 * hidden + 3 * inner)  # its gathered inputs, projections, output and weighted sum
        step = max(step, moe + padded * hidden)  # + the layer's inputs kept while its attention runs
    activations = streams + masks + 4 * step
    native = 0
    if device.type == "cpu":
        native = dense * sum(d.itemsize for d in dtypes if d != torch.float32) + activations // 4
    return Need(device=device, weights=peak_weights, activations=activations, native=native,
                host=peak_stored + tokens * stored_bytes_per_token + native, read=read, layers=depth,
                tokens=tokens)  # fmt: skip


def check(need: Need) -> None:
    """SpecError naming both sides when the device or the host cannot hold what the reference needs."""
    host_free = available_host_memory()
    if need.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(need.device)
        if need.on_device > free:
            raise SpecError(f"{need.summary()}; {human_bytes(free)} is free on {need.device}: {_FEWER}")
    if need.on_host > host_free:
        raise SpecError(f"{need.summary()}; {human_bytes(host_free)} of host memory is available: {_FEWER}")


_FEWER = "audit fewer samples (--samples, --fraction) or shorter batches (--batch-tokens)"


def available_host_memory(meminfo: Path = Path("/proc/meminfo")) -> int:
    """MemAvailable in bytes (the kernel's estimate of what can be allocated without swapping)."""
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise SpecError(f"{meminfo} states no MemAvailable")
