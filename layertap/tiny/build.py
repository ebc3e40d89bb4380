"""Tiny random-weight models for the demo, the tests and the CPU SGLang server.

Three architectures stand in for the real targets: `llama` (dense, GQA), `kimi-k2` (DeepseekV3: MLA,
MoE with routed + shared experts and noaux_tc routing, first layer dense, yarn rope) and `kimi-k2.5` (the
same language model inside Kimi-K2.5's multimodal wrapper folder, tokenizer as code: `kimi_k25.py`).
The DeepseekV3 ones come in named shapes (`SHAPES`): `tiny` (CPU tests), `mla-gpu` (Kimi's own MLA head
sizes, which SGLang's GPU MLA kernels need, still small) and `kimi-k2-width` (hidden 7168). Weights come from
an explicit seeded CPU generator, so a seed always gives the same bytes, and they are scaled so that
every decoder layer changes the residual stream by a sizeable fraction: a capture taken one layer off
then differs clearly from the reference instead of hiding inside float tolerance.
"""

import json
import math
import os
import zlib
from concurrent.futures import ThreadPoolExecutor
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

from layertap.tiny.kimi_k25 import Quantize, build_kimi_k25
from layertap.tiny.tokenizer import build_tokenizer

TinyArch = Literal["llama", "kimi-k2", "kimi-k2.5"]
TINY_ARCHS: tuple[TinyArch, ...] = ("llama", "kimi-k2", "kimi-k2.5")

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

# Kimi-K2's MLA as it is (q_lora 1536, kv_lora 512, rope 64, nope 128, v 128): SGLang's GPU MLA kernels
# accept these head sizes and not the tiny ones. Routing as Kimi-K2's (one group).
_KIMI_MLA: dict[str, Any] = {
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "n_group": 1,
    "topk_group": 1,
    "num_hidden_layers": 4,
    "first_k_dense_replace": 1,
    "n_shared_experts": 1,
}
Shape = Literal["tiny", "mla-gpu", "kimi-k2-width", "seed-depth"]
SHAPES: dict[str, dict[str, Any]] = {
    "tiny": {},
    # Small enough for the CPU server (hidden 1024, 8 experts top-2), runnable on the GPU.
    "mla-gpu": {**_KIMI_MLA, "hidden_size": 1024, "num_attention_heads": 16, "num_key_value_heads": 16,
                "intermediate_size": 2048, "moe_intermediate_size": 256, "n_routed_experts": 8,
                "num_experts_per_tok": 2},
    # Kimi-K2's width with 4 layers and 16 routed experts top-8 + 1 shared: ~3B parameters (~6 GB bf16).
    "kimi-k2-width": {**_KIMI_MLA, "hidden_size": 7168, "num_attention_heads": 64, "num_key_value_heads": 64,
                      "intermediate_size": 18432, "moe_intermediate_size": 2048, "n_routed_experts": 16,
                      "num_experts_per_tok": 8, "vocab_size": 4096},
    # Kimi-K2.5's depth and width (61 layers, first dense) with 8 routed experts top-8 + 1 shared: Kimi's work per
    # token with 1/48 of its experts, ~30B parameters (61 GB bf16). Built config-only, served with dummy weights.
    "seed-depth": {**_KIMI_MLA, "hidden_size": 7168, "num_attention_heads": 64, "num_key_value_heads": 64,
                   "intermediate_size": 18432, "moe_intermediate_size": 2048, "n_routed_experts": 8,
                   "num_experts_per_tok": 8, "n_group": 1, "topk_group": 1, "num_hidden_layers": 61,
                   "first_k_dense_replace": 1, "vocab_size": 4096},
}  # fmt: skip
# The tiny Kimi-K2.5 tokenizer has ~1.6K tokens and reserved ones up to its language model's vocabulary.
_KIMI_K25_VOCAB = 2048

# Fields real Kimi-K2 / DeepSeek-V3 config.json files carry that DeepseekV3Config does not save; SGLang
# reads them (moe_layer_freq at least), so they are written into config.json after save_pretrained.
KIMI_K2_EXTRA_CONFIG: dict[str, Any] = {
    "moe_layer_freq": 1,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "num_nextn_predict_layers": 0,
    "ep_size": 1,
}


def deepseek_v3_config(shape: Shape, overrides: dict[str, Any]) -> dict[str, Any]:
    """The config.json fields of a kimi-k2-like DeepseekV3 language model of `shape`, with `overrides`."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; expected one of {tuple(SHAPES)}")
    config = DeepseekV3Config(**{**_KIMI_K2, "vocab_size": _KIMI_K25_VOCAB, **SHAPES[shape], **overrides})
    return {**config.to_diff_dict(), **KIMI_K2_EXTRA_CONFIG}


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
def _init_weights(model: PreTrainedModel, seed: int) -> None:
    """Draw every weight from its own generator (seeded by `seed` and the tensor's name, so tensors are
    drawn in parallel threads and still reproducibly), scaled to keep activations O(1).

    Matrices get std 1/sqrt(fan_in) (the last dim, also for the stacked [E, out, in] expert tensors);
    embeddings std 1 so the residual stream starts at unit scale; norm gains 1 +- 0.1 so that a norm
    applied with the wrong weights, or not at all, shows. The noaux_tc correction bias is drawn too (std
    0.1, sigmoid scores spread about that much) so that routing that ignores it picks other experts.
    """
    tensors = dict(model.named_parameters())
    tensors.update((n, b) for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))

    def draw(name: str) -> None:
        # In the tensor's own dtype, in place: no float32 copy of a multi-GB bf16 model.
        t = tensors[name].detach()
        generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        if name.endswith("e_score_correction_bias"):
            t.normal_(0.0, 0.1, generator=generator)
        elif t.ndim == 1:
            t.normal_(1.0, 0.1, generator=generator)
        elif "embed_tokens" in name:
            t.normal_(0.0, 1.0, generator=generator)
        else:
            t.normal_(0.0, 1.0 / math.sqrt(t.shape[-1]), generator=generator)

    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:  # normal_ releases the GIL
        list(pool.map(draw, sorted(tensors)))


def build_tiny_model(
    arch: TinyArch,
    out_dir: Path,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    shape: Shape = "tiny",
    config_only: bool = False,
    quantize: Quantize | None = None,
    **overrides: Any,
) -> Path:
    """Write a tiny random-weight model folder loadable by `AutoModelForCausalLM` and `AutoTokenizer`.

    The folder holds config.json (with `architectures` and `dtype`), model.safetensors, the tokenizer
    files with the chat template, and generation_config.json. Same arch, seed, dtype, shape and overrides
    -> byte-identical files. `shape` picks a named DeepseekV3 size (`SHAPES`; kimi-k2 and kimi-k2.5 only);
    `overrides` replace (language model) config fields (e.g. `num_hidden_layers=2`). The caller's torch RNG
    state is left untouched. Returns `out_dir`.

    `kimi-k2.5` writes Kimi-K2.5's wrapper layout (see `kimi_k25.py`), its weights drawn per tensor
    without building a model: `build_tiny_model("kimi-k2.5", d, dtype=torch.bfloat16,
    shape="kimi-k2-width")` writes ~6 GB in seconds on a many-core host. With `config_only` (kimi-k2.5 only) it
    writes everything but the weights: a folder SGLang serves with `--load-format dummy` (the seed-depth benchmark's
    61 layers), which the HF engine refuses. `quantize="int4"` (kimi-k2.5 only) writes the released INT4 folder:
    routed experts pack-quantized, the rest bf16 (`dtype` is ignored), one shard per decoder layer.
    """
    out_dir = Path(out_dir)
    if arch == "kimi-k2.5":
        text_config = deepseek_v3_config(shape, overrides)
        return build_kimi_k25(
            out_dir, text_config, seed=seed, dtype=dtype, config_only=config_only, quantization=quantize
        )
    if config_only or quantize:
        raise ValueError("config_only and quantize are for the kimi-k2.5 wrapper (the seed's model)")
    if shape != "tiny":
        if arch != "kimi-k2":
            raise ValueError(f"shape {shape!r} is a DeepseekV3 size; arch {arch!r} has only the 'tiny' shape")
        overrides = {**SHAPES[shape], **overrides}
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(overrides.get("vocab_size"))  # a larger vocabulary: reserved ids that decode
    # Built without initialising (meta device), then given uninitialised memory in `dtype`: every
    # saved tensor is drawn by `_init_weights`, so transformers' own init would be thrown away
    # (minutes at Kimi-K2 width).
    with torch.device("meta"):
        model = _make_model(arch, tokenizer, overrides)
    model = model.to(dtype).to_empty(device="cpu").eval()
    _init_weights(model, seed)
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
