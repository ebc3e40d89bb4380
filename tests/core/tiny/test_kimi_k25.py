"""The tiny Kimi-K2.5 folder: laid out as the real one, read by the folder-facts module, its tokenizer code
refused without trust_remote_code, and the Kimi template's loss mask exactly on the assistant's tokens."""

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from layertap.data.chat import ChatTokenizer
from layertap.data.reader import iter_rows
from layertap.data.rows import parse_row, sample_id_of
from layertap.errors import SpecError
from layertap.models import ModelFolder
from layertap.tiny import SHAPES, build_tiny_model
from layertap.tiny.kimi_k25 import deepseek_v3_shapes

ASSETS = Path(__file__).resolve().parents[2] / "assets" / "datasets"


def test_folder_is_a_wrapper_with_text_config_vision_config_and_prefixed_weights(tiny_kimi25) -> None:
    config = json.loads((tiny_kimi25 / "config.json").read_text())
    assert config["architectures"] == ["KimiK25ForConditionalGeneration"] and config["model_type"] == "kimi_k25"
    assert "num_hidden_layers" not in config  # the language model's fields are under text_config only
    assert config["text_config"]["model_type"] == "deepseek_v3" and config["vision_config"]["hidden_size"] == 32
    with safe_open(tiny_kimi25 / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert "language_model.model.layers.0.self_attn.kv_a_proj_with_mqa.weight" in names
    assert "vision_tower.encoder.blocks.0.wqkv.weight" in names and "mm_projector.proj.2.weight" in names
    assert not [n for n in names if n.startswith("model.")]
    tok_config = json.loads((tiny_kimi25 / "tokenizer_config.json").read_text())
    assert tok_config["auto_map"]["AutoTokenizer"][0] == "tokenization_tiny_kimi.TinyKimiTokenizer"
    assert (tiny_kimi25 / "tiktoken.model").is_file() and not (tiny_kimi25 / "tokenizer.json").exists()
    proc_config = json.loads((tiny_kimi25 / "preprocessor_config.json").read_text())
    assert proc_config["auto_map"]["AutoProcessor"] == "processing_tiny_kimi.TinyKimiProcessor"
    assert json.loads((tiny_kimi25 / "generation_config.json").read_text())["eos_token_id"]


def test_folder_facts(tiny_kimi25, tiny_kimi) -> None:
    wrapped, plain = ModelFolder.read(tiny_kimi25), ModelFolder.read(tiny_kimi)
    assert (wrapped.num_layers, wrapped.hidden_size, wrapped.prefix) == (5, 64, "language_model.")
    assert wrapped.remote_code == ("tokenization_tiny_kimi.py", "processing_tiny_kimi.py")
    assert wrapped.dtype == "float32"
    assert (plain.num_layers, plain.prefix, plain.remote_code) == (5, "", ())


def test_tokenizer_code_needs_trust_remote_code(tiny_kimi25) -> None:
    folder = ModelFolder.read(tiny_kimi25)
    with pytest.raises(SpecError, match=r"--trust-remote-code.*") as err:
        folder.load_tokenizer()
    assert str(tiny_kimi25 / "tokenization_tiny_kimi.py") in str(err.value)
    tok = folder.load_tokenizer(trust_remote_code=True)
    assert type(tok).__name__ == "TinyKimiTokenizer" and not tok.is_fast
    text = "Déjà vu 😀 <|im_end|>x"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.convert_tokens_to_ids("<|im_end|>") in ids and tok.decode(ids) == text


def test_weight_names_and_shapes_are_what_transformers_saves(tiny_kimi) -> None:
    """The per-tensor writer uses the checkpoint layout HF's own save_pretrained gives a DeepseekV3."""
    config = json.loads((tiny_kimi / "config.json").read_text())
    with safe_open(tiny_kimi / "model.safetensors", "pt") as f:
        saved = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118 (safe_open is not a dict)
    assert dict(deepseek_v3_shapes(config)) == saved


def test_mla_gpu_shape_has_kimis_head_sizes(tmp_path) -> None:
    folder = ModelFolder.read(build_tiny_model("kimi-k2.5", tmp_path / "m", shape="mla-gpu", num_hidden_layers=2))
    text = folder.text_config
    assert (text["kv_lora_rank"], text["qk_rope_head_dim"], text["qk_nope_head_dim"], text["v_head_dim"]) == (
        512, 64, 128, 128,
    )  # fmt: skip
    assert SHAPES["kimi-k2-width"]["hidden_size"] == 7168 and folder.num_layers == 2


# The assistant turns a row's sample holds only as context: Kimi-K2.5's template drops the reasoning of k-think's
# first answer once the second follows, so the sample ends with the second as generated, the first as shown.
CONTEXT = {"k-think": [1]}


def _assistant_turns(row: dict) -> list[str]:
    """What each trained assistant turn produced after its generation prompt (which opens the thinking block), written
    out from the row's fields (Kimi's layout)."""
    turns = []
    for k, m in enumerate(row["messages"]):
        if m["role"] != "assistant" or k in CONTEXT.get(row["id"], ()):
            continue
        text = f"{m.get('reasoning_content') or ''}</think>{m['content']}"
        if m.get("tool_calls"):
            text += "<|tool_calls_section_begin|>"
            for i, call in enumerate(m["tool_calls"]):
                fn = call["function"]
                args = fn["arguments"] if isinstance(fn["arguments"], str) else json.dumps(fn["arguments"])
                call_id = call.get("id") or "functions.{}:{}".format(fn["name"], i)
                text += f"<|tool_call_begin|>{call_id}"
                text += f"<|tool_call_argument_begin|>{args}<|tool_call_end|>"
            text += "<|tool_calls_section_end|>"
        turns.append(text + "<|im_end|>")
    return turns


def test_loss_mask_is_exactly_the_assistant_turns(tiny_kimi25) -> None:
    tok = ModelFolder.read(tiny_kimi25).load_tokenizer(trust_remote_code=True)
    chat = ChatTokenizer(tok)
    rows = [(n, r) for n, r in iter_rows(ASSETS / "kimi_chats.jsonl") if "messages" in r]
    assert len(rows) >= 4
    for number, row in rows:
        sample = chat.tokenize(number, sample_id_of(number, row), parse_row(number, row), max_length=None,
                               overlong="truncate")  # fmt: skip
        ids, mask = sample.input_ids.tolist(), sample.loss_mask.tolist()
        runs, current = [], None
        for i, m in zip(ids, mask, strict=True):
            if m and current is None:
                current = []
            if not m and current is not None:
                runs.append(current)
                current = None
            if m:
                current.append(i)
        runs += [current] if current else []
        assert [tok.decode(r) for r in runs] == _assistant_turns(row), row["id"]
        assert ids[-1] == tok.convert_tokens_to_ids("<|im_end|>") and mask[-1] == 1
        assert torch.equal(sample.loss_mask, sample.loss_mask.bool().to(torch.uint8))


def test_tiny_model_command_builds_the_wrapper_in_a_named_shape(layertap_cli, tmp_path) -> None:
    out = tmp_path / "k25"
    cli = layertap_cli(
        "tiny-model", "--arch", "kimi-k2.5", "--shape", "mla-gpu", "--dtype", "bfloat16", out, timeout=300
    )
    assert cli.returncode == 0, cli.stderr
    folder = ModelFolder.read(out)
    assert (folder.hidden_size, folder.text_config["kv_lora_rank"], folder.dtype) == (1024, 512, "bfloat16")
    bad = layertap_cli("tiny-model", "--arch", "llama", "--shape", "mla-gpu", tmp_path / "x", timeout=300)
    assert bad.returncode == 2 and "DeepseekV3" in bad.stderr


def test_config_class_is_folder_code_whose_text_config_is_deepseek_v3(tiny_kimi25) -> None:
    """As the real folder: its own class (auto_map) loads with remote code, on transformers without a `kimi_k25`
    type (the trainers' 5.8.1: the interop tests) and over one that has it."""
    from transformers import AutoConfig, DeepseekV3Config

    config = AutoConfig.from_pretrained(tiny_kimi25, trust_remote_code=True)
    assert type(config).__name__ == "KimiK25Config" and isinstance(config.text_config, DeepseekV3Config)
    text = ModelFolder.read(tiny_kimi25).text_config
    assert (config.text_config.num_hidden_layers, config.text_config.vocab_size) == (5, text["vocab_size"])
    assert (config.hidden_size, config.vision_config.vt_hidden_size) == (64, 32)


def test_text_view_is_text_config_and_the_wrappers_shards_by_reference(tiny_kimi25, tiny_kimi, tmp_path) -> None:
    from transformers import AutoConfig

    from layertap.models.text_view import INDEX, write_text_view

    view = write_text_view(tiny_kimi25, tmp_path / "view")
    assert (view / "model.safetensors").resolve() == (tiny_kimi25 / "model.safetensors").resolve()
    assert not [p for p in view.iterdir() if p.suffix == ".safetensors" and not p.is_symlink()]
    config = AutoConfig.from_pretrained(view)  # no remote code: a type transformers knows
    assert config.model_type == "deepseek_v3" and config.num_hidden_layers == 5
    weights = json.loads((view / INDEX).read_text())["weight_map"]
    with safe_open(tiny_kimi25 / "model.safetensors", "pt") as f:
        assert set(weights) == {n for n in f.keys() if n.startswith("language_model.")}  # noqa: SIM118
    assert not (view / "preprocessor_config.json").exists()
    with pytest.raises(SpecError, match="not an empty folder"):
        write_text_view(tiny_kimi25, view)
    with pytest.raises(SpecError, match="plain causal LM"):
        write_text_view(tiny_kimi, tmp_path / "plain")
    assert not (tmp_path / "plain").exists() and [p.name for p in tmp_path.iterdir()] == ["view"]
