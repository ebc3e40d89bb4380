"""Kimi-K2.5 as it ships (INT4 compressed-tensors routed experts) through the tiny builder, the HF engine, the
manifest and the text view: the released layout exactly; states equal (float32) to an HF float32 run of the same
model with the experts dequantized independently (`tests/conftest.py`); a scheme layertap cannot read is refused
in one line before any work; a folder missing a packed tensor is refused instead of loading random experts."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from layertap.engines.hf import load_language_model
from layertap.errors import SpecError
from layertap.models.folder import ModelFolder
from layertap.models.quantization import dequantize, quantize
from layertap.store.store import OutputStore
from layertap.verify import verify_store
from tests.conftest import dequantized_int4
from tests.core.test_kimi_k25_run import check_states_equal_hf, extract

RELEASED_IGNORE = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"]


def test_quantize_rounds_to_nearest_and_dequantize_is_exact() -> None:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 256, generator=gen).to(torch.bfloat16)
    packed = quantize(weight, 32)
    assert packed["weight_packed"].dtype == torch.int32 and packed["weight_packed"].shape == (48, 32)
    assert packed["weight_scale"].dtype == torch.bfloat16 and packed["weight_scale"].shape == (48, 8)
    assert packed["weight_shape"].tolist() == [48, 256]
    ours = dequantize(packed["weight_packed"], packed["weight_scale"], packed["weight_shape"])
    assert torch.equal(ours, dequantized_int4(packed["weight_packed"], packed["weight_scale"], [48, 256]))
    step = packed["weight_scale"].float().repeat_interleave(32, dim=1)
    q, error = ours / step, (ours - weight.float()).abs() / step
    assert torch.equal(q, q.round()) and q.min() >= -8 and q.max() <= 7
    assert (error[q.abs() < 7] <= 0.5 + 1e-6).all()  # round to nearest
    assert (error <= 0.6).all()  # a group's amax sits at 7.5 steps (a bf16 scale: a little above), clamped to 7
    assert (q == 7).any() and (q == -7).any()  # the whole range is used


def test_the_tiny_int4_folder_has_the_released_layout(tiny_kimi25_int4: Path) -> None:
    config = json.loads((tiny_kimi25_int4 / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "bfloat16"
    qc = config["text_config"]["quantization_config"]
    assert (qc["quant_method"], qc["format"], qc["quantization_status"]) == (
        "compressed-tensors", "pack-quantized", "compressed")  # fmt: skip
    assert qc["ignore"] == RELEASED_IGNORE and qc["kv_cache_scheme"] is None
    weights = qc["config_groups"]["group_0"]["weights"]
    assert {k: weights[k] for k in ("num_bits", "type", "symmetric", "strategy", "group_size")} == {
        "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}  # fmt: skip
    index = json.loads((tiny_kimi25_int4 / "model.safetensors.index.json").read_text())["weight_map"]
    text = config["text_config"]
    assert len(set(index.values())) == text["num_hidden_layers"]  # one shard per decoder layer
    seen: dict[str, tuple[str, list[int]]] = {}
    for shard in sorted(set(index.values())):
        with safe_open(str(tiny_kimi25_int4 / shard), "pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                assert index[name] == shard
                seen[name] = (f.get_slice(name).get_dtype(), f.get_slice(name).get_shape())
    h, inter = text["hidden_size"], text["moe_intermediate_size"]
    for layer in range(text["first_k_dense_replace"], text["num_hidden_layers"]):
        for e in range(text["n_routed_experts"]):
            p = f"language_model.model.layers.{layer}.mlp.experts.{e}."
            for proj, (out, inp) in {"gate_proj": (inter, h), "up_proj": (inter, h), "down_proj": (h, inter)}.items():
                assert seen.pop(p + proj + ".weight_packed") == ("I32", [out, inp // 8])
                assert seen.pop(p + proj + ".weight_scale") == ("BF16", [out, inp // 32])
                assert seen.pop(p + proj + ".weight_shape") == ("I32", [2])
                assert p + proj + ".weight" not in seen
    rest = {name: dtype for name, (dtype, _) in seen.items()}
    assert {n for n, d in rest.items() if d != "BF16"} == {n for n in rest if n.endswith("e_score_correction_bias")}
    assert all(d == "F32" for n, d in rest.items() if n.endswith("e_score_correction_bias"))
    assert (
        any(n.startswith("vision_tower.") for n in rest)
        and "language_model.model.layers.0.mlp.gate_proj.weight" in rest
    )


def test_the_folder_reads_its_quantization(tiny_kimi25_int4: Path, tiny_kimi25: Path) -> None:
    quant = ModelFolder.read(tiny_kimi25_int4).quantization
    assert quant is not None and (quant.bits, quant.group_size, quant.where) == (4, 32, "text_config")
    assert quant.quantizes("model.layers.1.mlp.experts.0.gate_proj")
    for module in ("lm_head", "model.layers.1.self_attn.q_a_proj", "model.layers.1.mlp.shared_experts.up_proj",
                   "model.layers.0.mlp.down_proj"):  # fmt: skip
        assert not quant.quantizes(module), module
    assert ModelFolder.read(tiny_kimi25).quantization is None


@pytest.mark.parametrize("fmt", ["specforge", "speculators"])
def test_hf_engine_stores_the_int4_folder_equal_to_hf_float32_of_its_dequantized_experts(
    layertap_cli, tiny_kimi25_int4: Path, tmp_path: Path, hf_reference, fmt: str
) -> None:
    out = tmp_path / "out"
    cli = extract(layertap_cli, tiny_kimi25_int4, out, "--format", fmt, "--trust-remote-code", "--dtype", "float32")
    assert cli.returncode == 0, cli.stderr[-3000:]
    check = verify_store(out)
    assert check.ok, check.problems
    assert check_states_equal_hf(out, tiny_kimi25_int4, hf_reference) == 6
    manifest = OutputStore.open_existing(out).manifest
    assert manifest.compute_dtype == "float32"
    assert manifest.quantization is not None
    assert {k: manifest.quantization[k] for k in ("method", "format", "bits", "group_size", "ignore")} == {
        "method": "compressed-tensors", "format": "pack-quantized", "bits": 4, "group_size": 32,
        "ignore": RELEASED_IGNORE}  # fmt: skip


def test_experts_load_as_their_dequantized_values_in_the_folders_dtype(tiny_kimi25_int4: Path) -> None:
    folder = ModelFolder.read(tiny_kimi25_int4)
    model = load_language_model(folder)  # the folder's own dtype, bf16
    experts = model.model.layers[2].mlp.experts
    assert experts.gate_up_proj.dtype == torch.bfloat16
    shard = json.loads((tiny_kimi25_int4 / "model.safetensors.index.json").read_text())["weight_map"]
    p = "language_model.model.layers.2.mlp.experts.5.down_proj."
    raw = load_file(tiny_kimi25_int4 / shard[p + "weight_packed"])
    expected = dequantized_int4(raw[p + "weight_packed"], raw[p + "weight_scale"], raw[p + "weight_shape"].tolist())
    assert torch.equal(experts.down_proj[5], expected.to(torch.bfloat16))
    assert model.model.layers[2].mlp.gate.e_score_correction_bias.dtype == torch.float32


def _copy_with_config(folder: Path, dest: Path, change) -> Path:
    shutil.copytree(folder, dest, symlinks=True)
    config = json.loads((dest / "config.json").read_text())
    change(config["text_config"]["quantization_config"])
    (dest / "config.json").write_text(json.dumps(config))
    return dest


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (lambda qc: qc.update(format="float-quantized"), "format 'float-quantized'"),
        (lambda qc: qc["config_groups"]["group_0"]["weights"].update(num_bits=8), "'num_bits': 8"),
        (lambda qc: qc.update(quant_method="awq"), "quant_method 'awq'"),
    ],
)
def test_an_unknown_scheme_is_refused_in_one_line_before_any_work(
    layertap_cli, tiny_kimi25_int4: Path, tmp_path: Path, change, named: str
) -> None:
    model = _copy_with_config(tiny_kimi25_int4, tmp_path / "model", change)
    out = tmp_path / "out"
    cli = extract(layertap_cli, model, out, "--trust-remote-code")
    assert cli.returncode == 2
    message = cli.stderr.strip()
    assert message.startswith("error:") and message.count("error") == 1 and "Traceback" not in message, message
    assert named in " ".join(message.split()) and "layertap reads only" in " ".join(message.split())
    assert not out.exists()


def test_a_missing_packed_tensor_is_refused_not_loaded_at_random(tiny_kimi25_int4: Path, tmp_path: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_kimi25_int4, model)
    index_path = model / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    gone = "language_model.model.layers.3.mlp.experts.1.up_proj."
    shard = index["weight_map"][gone + "weight_packed"]
    tensors = {k: v for k, v in load_file(model / shard).items() if not k.startswith(gone)}
    save_file(tensors, model / shard, metadata={"format": "pt"})
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if not k.startswith(gone)}
    index_path.write_text(json.dumps(index))
    with pytest.raises(SpecError, match="missing keys"):
        load_language_model(ModelFolder.read(model), torch.float32)


def test_the_text_view_of_the_int4_folder(layertap_cli, tiny_kimi25_int4: Path, tmp_path: Path) -> None:
    view = tmp_path / "view"
    cli = layertap_cli("text-view", tiny_kimi25_int4, view, timeout=300)
    assert cli.returncode == 0, cli.stderr
    config = json.loads((view / "config.json").read_text())
    assert config["model_type"] == "deepseek_v3"
    # The view says what its weights are (packed); speculators reads only its config and the bf16 embedding and LM
    # head, and trains against it (tests/trainers).
    assert config["quantization_config"]["format"] == "pack-quantized"
    index = json.loads((view / "model.safetensors.index.json").read_text())
    assert all(name.startswith("language_model.") for name in index["weight_map"])
    assert index["metadata"]["text_view_of"] == str(tiny_kimi25_int4.resolve())


CT_UNPACK = """
import sys, torch
from safetensors.torch import load_file, save_file
from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
raw = load_file(sys.argv[1])
out = {}
for name in [n for n in raw if n.endswith(".weight_packed")]:
    p = name.removesuffix("weight_packed")
    shape = torch.Size(raw[p + "weight_shape"].tolist())
    q = unpack_from_int32(raw[name], 4, shape)
    group = shape[1] // raw[p + "weight_scale"].shape[1]
    out[p + "weight"] = q.float() * raw[p + "weight_scale"].float().repeat_interleave(group, dim=1)
save_file(out, sys.argv[2])
"""


def test_compressed_tensors_unpacks_the_folder_as_layertap_dequantizes(
    tiny_kimi25_int4: Path, tmp_path: Path, sglang_python: Path
) -> None:
    """compressed-tensors' own unpacking (0.15, in the SGLang venv: what servers load the folder with) reads every
    packed weight of a shard as the values layertap's dequantizer gives."""
    shard = tiny_kimi25_int4 / "model-00002-of-00005.safetensors"
    theirs_path = tmp_path / "theirs.safetensors"
    run = subprocess.run([str(sglang_python), "-c", CT_UNPACK, str(shard), str(theirs_path)],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    theirs = load_file(theirs_path)
    raw = load_file(shard)
    assert len(theirs) == 3 * 8  # every routed expert's three projections of layer 1
    for name, weight in theirs.items():
        p = name.removesuffix("weight")
        assert torch.equal(dequantize(raw[p + "weight_packed"], raw[p + "weight_scale"], raw[p + "weight_shape"]),
                           weight), name  # fmt: skip
