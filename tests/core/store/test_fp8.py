"""FP8 stores (``--store-dtype fp8``, speculators only): the quantization, what the files hold and weigh beside a
bf16 store of the same run, and the checks before commit and in ``verify``."""

from __future__ import annotations

import dataclasses
import json
import os
import struct
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from layertap.audit.compare import token_errors
from layertap.pipeline import run_extraction
from layertap.sample import CapturedSample, TokenizedSample
from layertap.spec import ExtractionSpec
from layertap.store.store import OutputStore
from layertap.store.validate import all_finite, state_problems
from layertap.verify import verify_store
from sglang_patch.contract import FP8_DTYPE
from sglang_patch.sample_files import FP8, FP8_SCALES, dequantize_fp8, quantize_fp8
from tests.core.datasets import conversation_rows, write_jsonl
from tests.hf_engines import cpu_hf

LAYERS = (1, 3, 5)


def _within_fp8(got: torch.Tensor, ref: torch.Tensor, scales: torch.Tensor, ref_rounding: float = 0.0) -> bool:
    """Every element within e4m3's rounding (half a step: 2^-4 relative, 2^-10 x scale among subnormals) plus
    bf16's rounding of the scale and the product (2^-9 each) and the reference's own (``ref_rounding``, relative)."""
    bound = ref.abs() * (2**-4 + 2**-7 + ref_rounding) + scales * 2**-9
    return bool(((got.float() - ref).abs() <= bound).all())


def test_quantize_fp8_round_trips_within_fp8_precision_with_a_scale_per_token_and_state() -> None:
    g = torch.Generator().manual_seed(0)
    states = torch.randn(50, 4, 256, generator=g) * torch.tensor([1.0, 30.0, 0.01, 500.0]).view(1, 4, 1)
    states[7] = 0  # an all-zero token: a finite scale, zeros back
    fp8, scales = quantize_fp8(states.bfloat16())
    assert fp8.dtype == FP8 and fp8.shape == states.shape
    assert scales.dtype == torch.float32 and scales.shape == (50, 4, 1)
    assert torch.equal(scales[7], torch.full((4, 1), 1e-12))
    back = dequantize_fp8(fp8, scales)
    assert back.dtype == torch.bfloat16 and torch.equal(back[7], torch.zeros(4, 256, dtype=torch.bfloat16))
    assert _within_fp8(back, states.bfloat16().float(), scales)
    # Quantized in blocks of tokens (the device's temporary stays small): the same as all at once.
    long = torch.randn(2500, 2, 8, generator=g)
    q = quantize_fp8(long)[0]
    q_parts = [quantize_fp8(long[i : i + 100])[0] for i in range(0, 2500, 100)]
    assert torch.equal(q.view(torch.uint8), torch.cat(q_parts).view(torch.uint8))


def test_one_scale_per_token_pushes_a_small_state_into_subnormals_and_per_state_scales_do_not() -> None:
    """Why the store keeps a scale per token and state: with one per token (hs-connectors' [T, 1, 1]) a state
    10^4 x smaller than the token's largest one nearly doubles its error; per state it is unchanged."""
    g = torch.Generator().manual_seed(1)
    states = torch.randn(400, 2, 1024, generator=g)
    states[:, 1] *= 1e4
    errors = {}
    for per_state in (False, True):
        fp8, scales = quantize_fp8(states, per_state=per_state)
        errors[per_state] = float(token_errors(dequantize_fp8(fp8, scales), states)[:, 0].median())
    assert errors[True] < 0.03 and errors[False] > 1.5 * errors[True], errors


@pytest.fixture(scope="module")
def stores(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One run, stored as bfloat16 and as FP8 (speculators, HF engine on the CPU)."""
    tmp = tmp_path_factory.mktemp("fp8")
    data = write_jsonl(tmp / "data.jsonl", conversation_rows(10, seed=5))
    out = {}
    for dtype in ("bfloat16", "fp8"):
        spec = ExtractionSpec(model=tiny_llama, data=data, layers=LAYERS, format="speculators", store_dtype=dtype)
        run_extraction(spec, tmp / dtype, cpu_hf(batch_tokens=4096))
        out[dtype] = tmp / dtype
    return out


def _header(path: Path) -> dict:
    with path.open("rb") as f:
        return json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))


def test_an_fp8_store_holds_speculators_fp8_layout_at_half_the_bytes(stores: dict[str, Path]) -> None:
    fp8, bf16 = OutputStore.open_existing(stores["fp8"]), OutputStore.open_existing(stores["bfloat16"])
    assert verify_store(stores["fp8"]).ok and verify_store(stores["bfloat16"]).ok
    k1, h = len(LAYERS) + 1, fp8.manifest.hidden_size
    state_bytes = {"fp8": 0, "bfloat16": 0}
    tokens = 0
    for sid, rec in fp8.records().items():
        header = _header(stores["fp8"] / rec.file)
        t = rec.num_tokens
        assert {k: (v["dtype"], v["shape"]) for k, v in header.items()} == {
            "token_ids": ("I64", [t]), "hidden_states": ("F8_E4M3", [t, k1, h]), FP8_SCALES: ("F32", [t, k1, 1])
        }  # fmt: skip
        other = _header(stores["bfloat16"] / bf16.records()[sid].file)
        for dtype, hdr in (("fp8", header), ("bfloat16", other)):
            state_bytes[dtype] += sum(e - b for name, v in hdr.items() if name != "token_ids"
                                      for b, e in [v["data_offsets"]])  # fmt: skip
        tokens += t
        # The same states: the FP8 file dequantizes within FP8 precision of the bf16 one.
        a, b = fp8.format.load(stores["fp8"] / rec.file), bf16.format.load(stores["bfloat16"] / rec.file)
        assert _within_fp8(dequantize_fp8(a["hidden_states"], a[FP8_SCALES]), b["hidden_states"].float(),
                           a[FP8_SCALES], ref_rounding=2**-8)  # fmt: skip
    # Per token: (k+1) x H bytes of FP8 and (k+1) float32 scales, against (k+1) x 2H of bf16.
    assert state_bytes["fp8"] == tokens * k1 * (h + 4) and state_bytes["bfloat16"] == tokens * k1 * 2 * h
    sizes = {d: sum(p.stat().st_size for p in (stores[d] / "samples").iterdir()) for d in stores}
    assert sizes["fp8"] / sizes["bfloat16"] < 0.5 + (4 + 256) / (2 * h), sizes  # scales and headers, no more
    guide = (stores["fp8"] / "TRAIN.md").read_text()
    assert "--hidden-states-backend fp8" in guide and "--hidden-states-dtype bfloat16" in guide
    assert "--hidden-states-backend" not in (stores["bfloat16"] / "TRAIN.md").read_text()


def test_fp8_captures_are_checked_before_commit(stores: dict[str, Path]) -> None:
    store = OutputStore.open_existing(stores["fp8"])
    rec = next(iter(store.records().values()))
    views = store.format.load(stores["fp8"] / rec.file)
    t, k = rec.num_tokens, len(LAYERS)
    sample = TokenizedSample(rec.sample_id, rec.index, views["token_ids"], rec.loss_mask())
    states, scales = views["hidden_states"], views[FP8_SCALES]

    def problems(layout_dtype: str, **change: torch.Tensor | None) -> list[str]:
        fields = {"aux": states[:, :k], "final_pre": states[:, k], "scales": scales} | change
        captured = CapturedSample(sample=sample, final_post=None, **fields)  # type: ignore[arg-type]
        return state_problems(captured, dataclasses.replace(store.layout, dtype=layout_dtype))

    assert problems(FP8_DTYPE) == []
    assert "keeps bfloat16" in " ".join(problems("bfloat16"))
    assert "FP8 scales None" in " ".join(problems(FP8_DTYPE, scales=None))
    assert f"({t}, 1, 1)" in " ".join(problems(FP8_DTYPE, scales=scales[:, :1]))
    bad = scales.clone()
    bad[t // 2, 1] = float("inf")
    assert problems(FP8_DTYPE, scales=bad) == ["FP8 scales have non-finite values"]
    nan = states[:, k].clone()
    nan.view(torch.uint8)[t - 1, 3] = 0xFF  # e4m3fn's NaN
    assert problems(FP8_DTYPE, final_pre=nan) == ["final_pre has non-finite values"]
    assert all_finite(states) and not all_finite(nan)


def test_fp8_is_refused_for_specforge_before_any_work(layertap_cli, tiny_llama: Path, tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "data.jsonl", conversation_rows(2, seed=1))
    with pytest.raises(ValidationError, match=r"SpecForge 0\.2\.0 reads no FP8"):
        ExtractionSpec(model=tiny_llama, data=data, layers=LAYERS, format="specforge", store_dtype="fp8")
    out = tmp_path / "out"
    cli = layertap_cli("extract", "--model", tiny_llama, "--data", data, "--layers", "1,3,5", "--out", out,
                       "--store-dtype", "fp8", timeout=120, env={**os.environ, "COLUMNS": "1000"})  # fmt: skip
    assert cli.returncode == 2 and not out.exists(), cli.stderr
    [line] = cli.stderr.strip().splitlines()
    assert line.startswith("error: store_dtype 'fp8' is for format 'speculators'") and "SpecForge 0.2.0" in line
