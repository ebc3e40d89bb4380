"""The audit's streamed reference (one decoder layer at a time, routed experts one by one, INT4 dequantized on the fly)
equals the whole model run by HF transformers itself on the same weights (`HFReference`: `from_pretrained` of a plain
folder, experts dequantized by the test's own reader), at every layer, on every folder layout layertap reads.

Float32 against float32: equal to float32 rounding. The compute-dtype stream (the audit's floor) against the whole
model loaded in bf16: one bf16 rounding apart before any MoE layer, the same error against float32 after. Batches pad
rows of different lengths, so padding cannot leak into real tokens unseen.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from layertap.audit.layers import EXPERTS, Decoder
from layertap.audit.memory import BatchShape, check, estimate
from layertap.audit.reference import Reference
from layertap.audit.run import padded_ids
from layertap.diskspace import human_bytes
from layertap.errors import SpecError
from layertap.models.folder import ModelFolder
from layertap.models.weights import FolderWeights
from layertap.tiny import build_tiny_model

LENGTHS = ((37, 9, 64), (101,))  # two batches, the first padded


def token_ids(folder: ModelFolder) -> list[list[torch.Tensor]]:
    vocab = int(folder.text_config["vocab_size"])
    gen = torch.Generator().manual_seed(7)
    return [[torch.randint(0, vocab, (n,), generator=gen) for n in batch] for batch in LENGTHS]


def streamed(folder: ModelFolder, dtype: torch.dtype) -> tuple[dict, dict, Reference]:
    """point -> per sample float32 states, and point -> per sample floor states, of the streamed reference."""
    points = [*range(folder.num_layers), "pre", "post"]
    ref = Reference(folder, points, compute_dtype=dtype, store_dtype=torch.float32, device=torch.device("cpu"))
    ids = token_ids(folder)
    states: dict = {p: [] for p in points}
    floor: dict = {p: [] for p in points}

    def observe(point, b, got, low) -> None:
        states[point] += [got[row, : t.numel()] for row, t in enumerate(ids[b])]
        floor[point] += [low[row, : t.numel()] for row, t in enumerate(ids[b])]

    batches = [(padded_ids([(t, {}) for t in batch]), [t.numel() for t in batch]) for batch in ids]
    ref.margins = ref.run(batches, observe)
    assert sorted(ref.margins) == ref.moe_layers
    assert all(m.numel() == sum(map(sum, LENGTHS)) for m in ref.margins.values())
    return states, floor, ref


def whole(reference, folder: ModelFolder) -> dict:
    """point -> per sample states of the whole model (HF's output_hidden_states; pre-norm from a norm-less copy)."""
    out: dict = {}
    for t in (t for batch in token_ids(folder) for t in batch):
        normed, pre = reference.states(t)
        for i in range(folder.num_layers):
            out.setdefault(i, []).append(normed[i].float())
        out.setdefault("pre", []).append(pre.float())
        out.setdefault("post", []).append(normed[-1].float())
    return out


def relative(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.float() - b.float()).norm(dim=-1) / b.float().norm(dim=-1)


@pytest.fixture(scope="module")
def tiny_kimi25_bf16(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Kimi-K2.5 wrapper with bf16 weights (computes in bf16: its floor stream is a second dtype)."""
    return build_tiny_model("kimi-k2.5", tmp_path_factory.mktemp("tiny-kimi25-bf16"), dtype=torch.bfloat16)


@pytest.mark.parametrize("name", ["tiny_llama", "tiny_kimi", "tiny_kimi25", "tiny_kimi25_bf16", "tiny_kimi25_int4"])
def test_streamed_reference_equals_the_whole_model(name: str, request: pytest.FixtureRequest, hf_reference) -> None:
    path = request.getfixturevalue(name)
    folder = ModelFolder.read(path)
    dtype = getattr(torch, folder.dtype)
    states, floor, ref = streamed(folder, dtype)
    assert ref.stats.bytes > 0 and ref.moe_layers == ([] if name == "tiny_llama" else [1, 2, 3, 4])
    exact = whole(hf_reference(path), folder)
    for point, samples in exact.items():
        for got, want in zip(states[point], samples, strict=True):
            assert relative(got, want).max() < 1e-5, (name, point)  # float32 rounding, after at most 6 layers
    if dtype == torch.float32:
        return
    low = whole(hf_reference(path, dtype), folder)
    for point, samples in low.items():
        streamed_floor = torch.cat([relative(got, ex) for got, ex in zip(floor[point], exact[point], strict=True)])
        whole_floor = torch.cat([relative(want, ex) for want, ex in zip(samples, exact[point], strict=True)])
        if point in (0, 1):  # before any MoE layer: the same bf16 arithmetic, at most one bf16 rounding apart
            assert max(relative(g, w).max() for g, w in zip(floor[point], samples, strict=True)) <= 2**-7, point
            continue
        # Further on, bf16 sums the routed experts in another order than the fused whole-model kernel (a few
        # roundings of 2^-8 per token) and flips near-tied routes: the floor is a noise level, and the streamed one
        # must be the whole model's, token for token in distribution.
        assert abs(streamed_floor.median() / whole_floor.median() - 1) < 0.15, (name, point)
        assert abs(streamed_floor.quantile(0.9) / whole_floor.quantile(0.9) - 1) < 0.25, (name, point)


def test_a_model_type_not_proven_equal_is_refused(tmp_path: Path, tiny_llama: Path) -> None:
    config = ModelFolder.read(tiny_llama).config | {"model_type": "mistral", "architectures": ["MistralForCausalLM"]}
    (tmp_path / "config.json").write_text(__import__("json").dumps(config))
    with pytest.raises(SpecError, match="not 'mistral'"):
        Decoder(ModelFolder.read(tmp_path), 2, torch.float32, torch.device("cpu"))


def test_a_missing_expert_tensor_is_refused(tiny_kimi: Path) -> None:
    folder = ModelFolder.read(tiny_kimi)
    decoder = Decoder(folder, folder.num_layers, torch.float32, torch.device("cpu"))
    ref = Reference(folder, [1, 2], compute_dtype=torch.float32, store_dtype=torch.float32, device=torch.device("cpu"))
    prefix = "model.layers.2."
    tensors = {k.removeprefix(prefix): v for k, v in ref.weights.read_stored(ref.weights.layer(2)).items()}
    del tensors["mlp.experts.3.up_proj.weight"]
    with pytest.raises(SpecError, match=r"experts\.3: has \['down_proj', 'gate_proj'\]"):
        decoder.layer(2, tensors)
    dense = {k.removeprefix("model.layers.0."): v for k, v in ref.weights.read_stored(ref.weights.layer(0)).items()}
    with pytest.raises(SpecError, match=r"missing \['mlp.down_proj.weight'\]"):
        decoder.layer(0, {k: v for k, v in dense.items() if k != "mlp.down_proj.weight"})
    with pytest.raises(SpecError, match=r"unexpected \['mlp.extra'\]"):
        decoder.layer(0, dense | {"mlp.extra": dense["mlp.down_proj.weight"]})


def test_the_need_is_said_before_it_starts_and_does_not_grow_with_depth(tiny_kimi: Path) -> None:
    folder = ModelFolder.read(tiny_kimi)
    weights = FolderWeights(folder)
    batches = [BatchShape(rows=4, longest=100, tokens=300)]
    cpu = torch.device("cpu")
    shallow, deep = (estimate(weights, depth, [torch.float32], batches, 1024, cpu) for depth in (2, folder.num_layers))
    assert deep.read > shallow.read and deep.layers == folder.num_layers
    one_layer = sum(weights.numel(n) for n in weights.layer(2)) * 4
    assert shallow.on_device <= deep.on_device <= shallow.on_device + one_layer
    assert f"reads {human_bytes(deep.read)} ({folder.num_layers} layers)" in deep.summary()
    check(shallow)  # a tiny model fits here


def test_the_cpu_host_estimate_counts_what_onednn_keeps_per_layer_and_the_heap_slack(tiny_kimi: Path) -> None:
    """On the CPU the host term grows by each run layer's dense weights in bf16 (what oneDNN keeps after a bf16
    layer, measured in audit_memory.md), plus a quarter of the activations (heap fragmentation); not on a GPU."""
    weights = FolderWeights(ModelFolder.read(tiny_kimi))
    batches = [BatchShape(rows=4, longest=100, tokens=300)]
    mixed = [torch.float32, torch.bfloat16]
    need = lambda depth, dtypes, device="cpu": estimate(weights, depth, dtypes, batches, 1024, torch.device(device))  # noqa: E731
    dense_bf16 = sum(weights.numel(n) for n in weights.layer(3) if EXPERTS not in n) * 2
    assert need(4, mixed).native - need(3, mixed).native == dense_bf16 > 0
    assert need(4, [torch.float32]).native == need(4, [torch.float32]).activations // 4 > 0
    gpu = need(4, mixed, "cuda")
    assert gpu.native == 0 and need(4, mixed).host == gpu.host + need(4, mixed).native
    assert "kept by CPU kernels and the allocator" in need(4, mixed).summary()


def test_what_cannot_fit_is_refused_naming_both_sides(tiny_kimi: Path) -> None:
    folder = ModelFolder.read(tiny_kimi)
    huge = [BatchShape(rows=64, longest=2**20, tokens=64 * 2**20)]  # 67M tokens: activations far above this machine
    need = estimate(FolderWeights(folder), folder.num_layers, [torch.float32], huge, 1024, torch.device("cpu"))
    with pytest.raises(SpecError, match=r"streamed reference on cpu: .* of host memory is available: audit fewer"):
        check(need)


def test_a_layer_routing_to_every_expert_has_no_near_tie(tmp_path: Path, hf_reference) -> None:
    """Top-k of k experts (the seed-depth shape: 8 of 8) makes no routing choice: no margin to measure, and the
    streamed reference still equals the whole model."""
    path = build_tiny_model("kimi-k2", tmp_path / "all", n_routed_experts=4, num_experts_per_tok=4, n_group=1,
                            topk_group=1)  # fmt: skip
    folder = ModelFolder.read(path)
    states, _, ref = streamed(folder, torch.float32)
    assert all(bool(torch.isinf(m).all()) for m in ref.margins.values())
    exact = whole(hf_reference(path), folder)
    assert all(relative(g, w).max() < 1e-5 for p in exact for g, w in zip(states[p], exact[p], strict=True))
