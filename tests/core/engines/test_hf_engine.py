"""The HF engine's states equal an independent batch-of-one float32 reference, padding never leaks."""

import pytest
import torch

from layertap.engines.hf import token_batches
from layertap.models.folder import model_dims
from layertap.sample import TokenizedSample
from layertap.spec import resolve_capture
from tests.hf_engines import hf_engine

LENGTHS = [1, 7, 64, 3, 129, 40, 2, 300]


def _samples(lengths: list[int], vocab: int, seed: int = 0) -> list[TokenizedSample]:
    g = torch.Generator().manual_seed(seed)
    return [
        TokenizedSample(
            sample_id=f"s{i}",
            index=i,
            input_ids=torch.randint(0, vocab, (n,), generator=g),
            loss_mask=torch.ones(n, dtype=torch.uint8),
        )
        for i, n in enumerate(lengths)
    ]


def max_rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest absolute difference over the reference's largest magnitude, in float32."""
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_kimi", "tiny_kimi25"])
def test_every_layer_and_both_finals_match_reference_in_mixed_batches(arch, request, hf_reference) -> None:
    model_dir = request.getfixturevalue(arch)
    num_layers, _ = model_dims(model_dir)
    spec = resolve_capture(list(range(1, num_layers)), convention="capture", num_layers=num_layers, final="both")
    # max_batch_tokens 1200 forces batches of several mixed-length samples (300-token one pads others).
    engine = hf_engine(model_dir, spec, batch_tokens=1200, batch_size=8)
    samples = _samples(LENGTHS, vocab=500)
    assert max(len(b) for b in token_batches(samples, max_tokens=1200, max_size=8)) > 1
    ref = hf_reference(model_dir)
    results = {c.sample.sample_id: c for c in engine.capture(samples)}
    assert sorted(results) == sorted(s.sample_id for s in samples)
    for s in samples:
        got = results[s.sample_id]
        hidden, pre = ref.states(s.input_ids)
        assert got.aux.shape == (s.num_tokens, num_layers - 1, hidden[0].shape[-1])
        for j, layer in enumerate(spec.layers):
            assert max_rel_err(got.aux[:, j], hidden[layer]) < 1e-5, (s.sample_id, layer)
        assert max_rel_err(got.final_post, hidden[num_layers]) < 1e-5
        assert max_rel_err(got.final_pre, pre) < 1e-5
        # The states really differ between layers, so an off-by-one could not pass.
        assert max_rel_err(got.aux[:, 0], hidden[2]) > 1e-2


def test_batching_does_not_change_states(tiny_llama) -> None:
    num_layers, _ = model_dims(tiny_llama)
    spec = resolve_capture([1, 3, 5], convention="capture", num_layers=num_layers, final="post")
    samples = _samples(LENGTHS, vocab=500, seed=1)
    alone = {c.sample.sample_id: c for c in hf_engine(tiny_llama, spec, batch_size=1).capture(samples)}
    batched = {c.sample.sample_id: c for c in hf_engine(tiny_llama, spec, batch_tokens=4096).capture(samples)}
    for sid, a in alone.items():
        b = batched[sid]
        assert b.aux.shape == a.aux.shape  # no padded rows kept
        torch.testing.assert_close(b.aux, a.aux, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(b.final_post, a.final_post, rtol=1e-5, atol=1e-5)


def test_token_batches_respects_budget() -> None:
    samples = _samples([10, 10, 50, 5, 100], vocab=10)
    batches = list(token_batches(samples, max_tokens=100, max_size=3))
    assert [s.sample_id for b in batches for s in b] == [s.sample_id for s in samples]
    assert all(len(b) * max(s.num_tokens for s in b) <= 100 or len(b) == 1 for b in batches)
    assert all(len(b) <= 3 for b in batches)
