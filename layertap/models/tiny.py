"""Tiny random-weight models for the demo, the tests and the CPU SGLang server.

Two architectures stand in for the real targets: `llama` (dense, GQA) and `kimi-k2` (DeepseekV3: MLA,
MoE with routed + shared experts and noaux_tc routing, first layer dense, yarn rope). Weights come from
an explicit seeded CPU generator, so a seed always gives the same bytes, and they are scaled so that
every decoder layer changes the residual stream by a sizeable fraction: a capture taken one layer off
then differs clearly from the reference instead of hiding inside float tolerance.
"""

import json
import math
from pathlib import Path
from typing import Any, Literal

import torch
from transformers import (
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerFast,
)

from layertap.models.tokenizer import build_tokenizer

TinyArch = Literal["llama", "kimi-k2"]
TINY_ARCHS: tuple[TinyArch, ...] = ("llama", "kimi-k2")

_LLAMA: dict[str, Any] = {
    "hidden_size": 64,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}

# Kimi-K2's shape scaled down: head dims keep its nope = 2 * rope and v = nope ratios; 8 routed experts in
# 4 groups (DeepSeek-V3 style group-limited routing, top-2 of 2 groups) plus one shared expert.
_KIMI_K2: dict[str, Any] = {
    "hidden_size": 64,
    "num_hidden_layers": 5,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "q_lora_rank": 32,
    "kv_lora_rank": 32,
    "qk_rope_head_dim": 16,
    "qk_nope_head_dim": 32,
    "v_head_dim": 32,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "n_group": 4,
    "topk_group": 2,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.827,
    "first_k_dense_replace": 1,
    "num_nextn_predict_layers": 0,
    "max_position_embeddings": 4096,
    "rope_scaling": {
        "type": "yarn",
        "rope_theta": 50000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 1024,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    "tie_word_embeddings": False,
}

# Fields real Kimi-K2 / DeepSeek-V3 config.json files carry that DeepseekV3Config does not save; SGLang
# reads them (moe_layer_freq at least), so they are written into config.json after save_pretrained.
KIMI_K2_EXTRA_CONFIG: dict[str, Any] = {
    "moe_layer_freq": 1,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "num_nextn_predict_layers": 0,
    "ep_size": 1,
}


def _make_model(arch: TinyArch, tokenizer: PreTrainedTokenizerFast, overrides: dict[str, Any]) -> PreTrainedModel:
    special = {
        "vocab_size": len(tokenizer),
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    if arch == "llama":
        return LlamaForCausalLM(LlamaConfig(**{**_LLAMA, **special, **overrides}))
    if arch == "kimi-k2":
        return DeepseekV3ForCausalLM(DeepseekV3Config(**{**_KIMI_K2, **special, **overrides}))
    raise ValueError(f"unknown tiny arch {arch!r}; expected one of {TINY_ARCHS}")


@torch.no_grad()
def _init_weights(model: PreTrainedModel, generator: torch.Generator) -> None:
    """Draw every weight from `generator` in name order, scaled to keep activations O(1).

    Matrices get std 1/sqrt(fan_in) (the last dim, also for the stacked [E, out, in] expert tensors);
    embeddings std 1 so the residual stream starts at unit scale; norm gains 1 +- 0.1 so that a norm
    applied with the wrong weights, or not at all, shows. The noaux_tc correction bias is drawn too (std
    0.1, sigmoid scores spread about that much) so that routing that ignores it picks other experts.
    """
    tensors = dict(model.named_parameters())
    tensors.update((n, b) for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))
    for name in sorted(tensors):
        t = tensors[name]
        if name.endswith("e_score_correction_bias"):
            value = 0.1 * torch.randn(t.shape, generator=generator)
        elif t.ndim == 1:
            value = 1.0 + 0.1 * torch.randn(t.shape, generator=generator)
        elif "embed_tokens" in name:
            value = torch.randn(t.shape, generator=generator)
        else:
            value = torch.randn(t.shape, generator=generator) / math.sqrt(t.shape[-1])
        t.copy_(value.to(t.dtype))


def build_tiny_model(
    arch: TinyArch,
    out_dir: Path,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    **overrides: Any,
) -> Path:
    """Write a tiny random-weight model folder loadable by `AutoModelForCausalLM` and `AutoTokenizer`.

    The folder holds config.json (with `architectures` and `dtype`), model.safetensors, the tokenizer
    files with the chat template, and generation_config.json. Same arch, seed, dtype and overrides ->
    byte-identical files. `overrides` replace config fields (e.g. `num_hidden_layers=2`). The caller's
    torch RNG state is left untouched. Returns `out_dir`.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = _make_model(arch, tokenizer, overrides)
    _init_weights(model, torch.Generator(device="cpu").manual_seed(seed))
    model = model.to(dtype).eval()
    for name, buffer in model.named_buffers():
        # Real checkpoints keep the routing bias in float32 whatever the model dtype; so do loaders.
        if name.endswith("e_score_correction_bias"):
            buffer.data = buffer.data.float()
    model.config.dtype = dtype
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    if arch == "kimi-k2":
        config_path = out_dir / "config.json"
        config = json.loads(config_path.read_text())
        config.update(KIMI_K2_EXTRA_CONFIG)
        config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out_dir


def model_dims(model_dir: Path) -> tuple[int, int]:
    """(number of decoder layers, hidden size) read from `model_dir/config.json`, without loading weights."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return int(config["num_hidden_layers"]), int(config["hidden_size"])
