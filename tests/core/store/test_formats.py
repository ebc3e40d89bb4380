"""Files are readable exactly the way the trainers read them, and hold the reference states."""

import json
from pathlib import Path

import pytest
import torch
from datasets import load_from_disk
from safetensors.torch import load_file
from transformers import AutoTokenizer

from layertap.pipeline import run_extraction
from layertap.spec import ExtractionSpec
from tests.core.datasets import conversation_rows, write_jsonl
from tests.hf_engines import cpu_hf

LAYERS = (1, 3, 5)
BF16 = {"rtol": 1.6e-2, "atol": 1e-2}


def _extract(model: Path, tmp_path: Path, fmt: str):
    rows = conversation_rows(12, seed=3)
    # Row 4 is unusable (no assistant turn), so the stored rows have a gap the format must handle.
    rows[4] = {"id": "no-assistant", "messages": [{"role": "user", "content": "hello"}]}
    data = write_jsonl(tmp_path / "data.jsonl", rows)
    spec = ExtractionSpec(model=model, data=data, layers=LAYERS, format=fmt)
    out = tmp_path / fmt
    report = run_extraction(spec, out, cpu_hf(batch_tokens=2048))
    assert report.row_errors == 1 and len(report.computed) == 11
    tok = AutoTokenizer.from_pretrained(model)
    expected_ids = {
        r["id"]: tok.apply_chat_template(r["messages"], tokenize=True, return_dict=False)
        for r in rows
        if r["id"] != "no-assistant"
    }
    return out, expected_ids


def test_specforge_files_read_like_specforge(tiny_llama, tmp_path, hf_reference) -> None:
    out, expected_ids = _extract(tiny_llama, tmp_path, "specforge")
    files = sorted(out.rglob("data_*.ckpt"))
    assert len(files) == 11 and all(f.parent.name == "rows_0-2000" for f in files)
    index = {json.loads(line)["file"]: json.loads(line) for f in (out / "index").glob("*.jsonl") for line in f.open()}
    ref = hf_reference(tiny_llama)
    for path in files:
        obj = torch.load(path, mmap=True, weights_only=False)  # exactly SpecForge's reader call
        assert set(obj) == {"input_ids", "loss_mask", "hidden_state", "aux_hidden_state"}
        assert all(isinstance(v, torch.Tensor) for v in obj.values())
        t = obj["input_ids"].shape[0]
        assert obj["input_ids"].dtype == torch.long
        assert obj["loss_mask"].shape == (t,)
        assert obj["hidden_state"].shape == (1, t, 64) and obj["hidden_state"].dtype == torch.bfloat16
        assert obj["aux_hidden_state"].shape == (1, t, 3 * 64) and obj["aux_hidden_state"].dtype == torch.bfloat16
        rec = index[path.relative_to(out).as_posix()]
        assert obj["input_ids"].tolist() == expected_ids[rec["sample_id"]]
        hidden, _ = ref.states(obj["input_ids"])
        torch.testing.assert_close(obj["hidden_state"][0].float(), hidden[6], **BF16)
        aux = obj["aux_hidden_state"][0].float()
        for j, layer in enumerate(LAYERS):  # concatenated in layer order, H columns each
            torch.testing.assert_close(aux[:, j * 64 : (j + 1) * 64], hidden[layer], **BF16)
        assert 0 < int(obj["loss_mask"].sum()) < t


def test_speculators_arrow_rows_line_up_with_safetensors(tiny_llama, tmp_path, hf_reference) -> None:
    out, expected_ids = _extract(tiny_llama, tmp_path, "speculators")
    ds = load_from_disk(str(out))
    assert len(ds) == 11
    ref = hf_reference(tiny_llama)
    for row in range(len(ds)):
        item = ds[row]
        hs = load_file(out / "hidden_states" / f"hs_{row}.safetensors")  # speculators: file index = Arrow row
        assert set(hs) == {"token_ids", "hidden_states"}
        assert torch.equal(hs["token_ids"], item["input_ids"])  # the trainer drops the sample otherwise
        assert item["input_ids"].tolist() == expected_ids[item["sample_id"]]
        t = int(item["seq_len"])
        assert hs["hidden_states"].shape == (t, 4, 64) and hs["hidden_states"].dtype == torch.bfloat16
        assert item["loss_mask"].shape == (t,)
        hidden, pre = ref.states(hs["token_ids"])
        for j, layer in enumerate(LAYERS):
            torch.testing.assert_close(hs["hidden_states"][:, j].float(), hidden[layer], **BF16)
        torch.testing.assert_close(hs["hidden_states"][:, 3].float(), pre, **BF16)  # last slot: PRE-norm
    assert "no-assistant" not in set(ds["sample_id"])


@pytest.mark.parametrize("fmt", ["specforge", "speculators"])
def test_manifest_records_conventions_and_hashes(tiny_llama, tmp_path, fmt) -> None:
    out, _ = _extract(tiny_llama, tmp_path, fmt)
    m = json.loads((out / "manifest.json").read_text())
    assert m["capture_indices"] == list(LAYERS) and m["layer_convention"] == "capture"
    assert "input of decoder layer i" in m["capture_convention"]
    assert (m["final_post_norm"], m["final_pre_norm"]) == ((True, False) if fmt == "specforge" else (False, True))
    assert m["hidden_size"] == 64 and m["num_layers"] == 6 and m["store_dtype"] == "bfloat16"
    for key in ("model_config_sha256", "tokenizer_sha256", "chat_template_sha256"):
        assert len(m[key]) == 64
    assert m["complete"] is True and m["samples_committed"] == 11 and m["format_version"] == 1
