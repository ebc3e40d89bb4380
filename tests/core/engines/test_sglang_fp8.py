"""FP8 through a real CPU SGLang server: the plugin quantizes speculators dumps before they leave the device
(``--quantize fp8``), the worker checks and commits them by rename, and the store is speculators' FP8 layout
within FP8's rounding of HF float32, which ``verify`` and the audit accept."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from layertap.audit import audit_store
from layertap.engines.sglang import SGLangEngine
from layertap.engines.sglang.process import SGLangServer
from layertap.models.folder import ModelFolder
from layertap.pipeline import run_extraction
from layertap.sample import CapturedSample
from layertap.spec import ExtractionSpec, resolve_capture
from layertap.store.store import OutputStore
from layertap.verify import verify_store
from sglang_patch.contract import read_dump
from sglang_patch.sample_files import FP8, FP8_SCALES, dequantize_fp8
from tests.core.datasets import conversation_rows, write_jsonl
from tests.core.engines.test_sglang_engine import _samples
from tests.core.store.test_fp8 import _within_fp8
from tests.sglang_fixtures import DEFAULT_LAYERS

pytestmark = pytest.mark.sglang
LAYERS = DEFAULT_LAYERS["llama"]


@pytest.fixture
def fp8_server(sglang_servers, tiny_llama):
    return sglang_servers(tiny_llama, layers=LAYERS, final="pre", layout="speculators", quantize="fp8")


class _Inspecting(SGLangEngine):
    """The SGLang engine, keeping each dump's meta.json as it reads it (before the store moves its file)."""

    metas: list

    def _read_dump(self, rid, path, sample, t1):
        self.metas = [*getattr(self, "metas", []), read_dump(path, load_tensors=False).meta]
        return super()._read_dump(rid, path, sample, t1)


def test_the_server_quantizes_and_its_dumps_are_within_fp8_of_hf(fp8_server, tiny_llama, hf_reference) -> None:
    spec = resolve_capture(list(LAYERS), convention="capture", num_layers=6, final="pre")
    engine = _Inspecting(
        SGLangServer(url=fp8_server.url),
        spec,
        folder=ModelFolder.read(tiny_llama),
        dump_root=fp8_server.dump_root,
        job="fp8",
        in_flight=4,
    )
    samples = _samples(tiny_llama, 12, seed=7)  # 1 to 2000 tokens: prompts over many 64-token passes
    results = list(engine.capture(samples))
    assert all(isinstance(r, CapturedSample) for r in results), results
    assert {m.dtype for m in engine.metas} == {"float8_e4m3fn"} and {m.layout for m in engine.metas} == {"speculators"}
    ref = hf_reference(tiny_llama)
    for r in results:
        assert r.aux.dtype == FP8 and r.final_pre.dtype == FP8 and r.source is not None
        t = r.sample.num_tokens
        assert r.scales is not None and r.scales.shape == (t, len(LAYERS) + 1, 1)
        hidden, pre = ref.states(r.sample.input_ids)
        want = torch.stack([*(hidden[i] for i in LAYERS), pre], dim=1)
        got = dequantize_fp8(torch.cat([r.aux, r.final_pre[:, None]], dim=1), r.scales)
        # SGLang float32 and HF float32 differ by ~1e-5 relative: FP8's rounding (2^-4) is what bounds them.
        assert _within_fp8(got, want, r.scales, ref_rounding=1e-3), r.sample.sample_id
        engine.release(r)


def test_an_fp8_store_made_through_the_server_verifies_and_passes_the_audit(fp8_server, tiny_llama, tmp_path) -> None:
    data = write_jsonl(tmp_path / "data.jsonl", conversation_rows(12, seed=8))
    spec = ExtractionSpec(model=tiny_llama, data=data, layers=LAYERS, format="speculators", store_dtype="fp8")
    capture = spec.resolve(6)

    def engine(_capture, folder):
        return SGLangEngine(SGLangServer(url=fp8_server.url), capture, folder=folder, dump_root=fp8_server.dump_root,
                            job="fp8s", in_flight=4)  # fmt: skip

    report = run_extraction(spec, tmp_path / "out", engine)
    assert len(report.computed) == 12 and report.failed == 0
    store = OutputStore.open_existing(tmp_path / "out")
    for rec in store.records().values():  # speculators' FP8 layout, as the plugin wrote it
        tensors = store.format.load(tmp_path / "out" / rec.file)
        assert tensors["hidden_states"].dtype == FP8 and tensors[FP8_SCALES].shape == (rec.num_tokens, 4, 1)
    assert verify_store(tmp_path / "out").ok
    audit = audit_store(tmp_path / "out", samples=6, seed=2, write=False)
    assert audit.passed, audit.markdown()
    assert all(s.unexplained == 0 and min(s.controls.values()) > 10 for s in audit.states), audit.markdown()


def test_an_fp8_store_quantizes_what_a_server_dumps_unquantized(sglang_llama, tiny_llama, tmp_path: Path) -> None:
    """A server given by URL may dump every state in float32 ("states" layout, as the session's llama server): the
    FP8 store quantizes them as it writes, as it does the HF engine's. (The reverse, FP8 dumps into a bf16 store, is
    refused per sample: tests/core/store/test_fp8.py.)"""
    data = write_jsonl(tmp_path / "data.jsonl", conversation_rows(3, seed=9))
    spec = ExtractionSpec(model=tiny_llama, data=data, layers=LAYERS, format="speculators", final="both",
                          store_dtype="fp8")  # fmt: skip
    capture = spec.resolve(6)
    make = lambda _c, folder: SGLangEngine(SGLangServer(url=sglang_llama.url), capture, folder=folder,  # noqa: E731
                                           dump_root=sglang_llama.dump_root, job="fp8-states", in_flight=4)  # fmt: skip
    report = run_extraction(spec, tmp_path / "out", make)
    assert len(report.computed) == 3 and verify_store(tmp_path / "out").ok
    store = OutputStore.open_existing(tmp_path / "out")
    assert {store.format.load(tmp_path / "out" / r.file)["hidden_states"].dtype for r in store.records().values()} == {
        FP8
    }
