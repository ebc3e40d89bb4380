"""Tiny model folders: deterministic, loadable by HF, well-scaled hidden states, Kimi-K2 structure."""

import hashlib
import itertools
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3Attention,
    DeepseekV3MLP,
    DeepseekV3MoE,
)

from layertap.models.folder import model_dims
from layertap.tiny import KIMI_K2_EXTRA_CONFIG, TINY_ARCHS, build_tiny_model


def _file_hashes(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    with safe_open(folder / "model.safetensors", "pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (safe_open is not a dict)


@pytest.fixture
def model_dir(request: pytest.FixtureRequest) -> Path:
    return request.getfixturevalue({"llama": "tiny_llama", "kimi-k2": "tiny_kimi"}[request.param])


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_same_seed_same_bytes_other_seed_other_weights(arch: str, tmp_path: Path) -> None:
    first = _file_hashes(build_tiny_model(arch, tmp_path / "a", seed=3))
    assert first == _file_hashes(build_tiny_model(arch, tmp_path / "b", seed=3))
    other = _file_hashes(build_tiny_model(arch, tmp_path / "c", seed=4))
    assert other["model.safetensors"] != first["model.safetensors"]
    tokenizer = "tiktoken.model" if arch == "kimi-k2.5" else "tokenizer.json"
    assert other[tokenizer] == first[tokenizer]


def test_build_leaves_the_callers_rng_alone(tmp_path: Path) -> None:
    torch.manual_seed(11)
    expected = torch.rand(4)
    torch.manual_seed(11)
    build_tiny_model("llama", tmp_path, num_hidden_layers=1)
    assert torch.equal(torch.rand(4), expected)


@pytest.mark.parametrize("model_dir", ["llama", "kimi-k2"], indirect=True)  # kimi-k2.5: test_kimi_k25.py
def test_loads_with_auto_classes_and_gives_distinct_finite_hidden_states(model_dir: Path) -> None:
    layers, hidden = model_dims(model_dir)
    config = AutoConfig.from_pretrained(model_dir)
    assert (config.num_hidden_layers, config.hidden_size) == (layers, hidden)
    assert json.loads((model_dir / "config.json").read_text())["dtype"] == "float32"

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    assert model.config.vocab_size == len(tokenizer)
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the weather like in Rome in April?"}],
        add_generation_prompt=True,
        return_dict=False,
    )
    random_ids = torch.randint(0, len(tokenizer), (300,), generator=torch.Generator().manual_seed(0))
    input_ids = torch.cat([torch.tensor(ids), random_ids])[None]
    with torch.no_grad():
        out = model(input_ids, output_hidden_states=True)

    states = out.hidden_states
    assert len(states) == layers + 1
    for state in states:
        assert state.shape == (1, input_ids.shape[1], hidden) and state.dtype == torch.float32
        assert torch.isfinite(state).all()
        rms = state.pow(2).mean().sqrt().item()
        assert 0.3 < rms < 10.0
    # Every layer moves the residual stream a lot: a capture one layer off must not pass as correct.
    for before, after in itertools.pairwise(states):
        assert ((after - before).norm() / before.norm()).item() > 0.2
    assert torch.isfinite(out.logits).all()


def test_kimi_config_carries_the_fields_sglang_reads(tiny_kimi: Path) -> None:
    config = json.loads((tiny_kimi / "config.json").read_text())
    assert config["architectures"] == ["DeepseekV3ForCausalLM"]
    for key, value in KIMI_K2_EXTRA_CONFIG.items():
        assert config[key] == value
    assert config["first_k_dense_replace"] == 1
    assert config["n_routed_experts"] % config["n_group"] == 0
    assert config["topk_group"] <= config["n_group"]
    assert config["num_experts_per_tok"] <= config["topk_group"] * config["n_routed_experts"] // config["n_group"]
    rope = config["rope_parameters"]
    assert rope["rope_type"] == "yarn"
    for key in ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim"):
        assert key in rope


def test_kimi_has_mla_and_moe_with_a_dense_first_layer(tiny_kimi: Path) -> None:
    config = json.loads((tiny_kimi / "config.json").read_text())
    weights = _weights(tiny_kimi)
    model = AutoModelForCausalLM.from_pretrained(tiny_kimi)
    layers = model.model.layers
    assert all(isinstance(layer.self_attn, DeepseekV3Attention) for layer in layers)
    assert type(layers[0].mlp) is DeepseekV3MLP
    assert all(isinstance(layer.mlp, DeepseekV3MoE) for layer in layers[1:])

    for i in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{i}."
        for mla in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "kv_a_layernorm", "q_a_layernorm"):
            assert f"{prefix}self_attn.{mla}.weight" in weights
        expert_names = [n for n in weights if n.startswith(f"{prefix}mlp.experts.")]
        if i == 0:
            assert f"{prefix}mlp.gate_proj.weight" in weights and not expert_names
            continue
        assert len(expert_names) == 3 * config["n_routed_experts"]
        assert f"{prefix}mlp.shared_experts.gate_proj.weight" in weights
        bias = weights[f"{prefix}mlp.gate.e_score_correction_bias"]
        assert bias.dtype == torch.float32 and bias.shape == (config["n_routed_experts"],)
        assert bias.abs().min() > 0
        # Loading must keep the checkpoint's bias (not re-initialise it to zeros).
        assert torch.equal(layers[i].mlp.gate.e_score_correction_bias, bias)

    kv_a = weights["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"]
    assert kv_a.shape == (config["kv_lora_rank"] + config["qk_rope_head_dim"], config["hidden_size"])


def test_overrides_and_dtype(tmp_path: Path) -> None:
    folder = build_tiny_model("kimi-k2", tmp_path, dtype=torch.bfloat16, num_hidden_layers=2, hidden_size=32)
    assert model_dims(folder) == (2, 32)
    config = json.loads((folder / "config.json").read_text())
    assert config["dtype"] == "bfloat16"
    for name, tensor in _weights(folder).items():
        expected = torch.float32 if name.endswith("e_score_correction_bias") else torch.bfloat16
        assert tensor.dtype == expected, name
