"""A tiny Kimi-K2.5 folder laid out as the real one: a multimodal wrapper around a DeepseekV3 language model.

`config.json` is the wrapper (`KimiK25ForConditionalGeneration`, `model_type: kimi_k25`) with the language
model's DeepseekV3 config under `text_config` (MLA + MoE + yarn, as `tiny.py`'s kimi-k2) and a tiny
MoonViT `vision_config`; `model.safetensors` holds the language model under `language_model.` and a tiny
vision tower and projector under `vision_tower.` / `mm_projector.`, so SGLang's own `kimi_k25` class loads
it; the config class, the tokenizer and the processor are code in the folder (`kimi_config.py`,
`kimi_tokenizer.py`, `kimi_processor.py`), named by `auto_map`.

Weights are drawn tensor by tensor from generators seeded by (seed, tensor name), in threads, straight into
the checkpoint's names and shapes: no model is built, so a Kimi-K2-width folder (hidden 7168, ~3B
parameters) takes seconds, and each tensor's bytes do not depend on which other tensors exist.

``quantize="int4"`` writes the folder as Kimi-K2.5 ships: routed experts in compressed-tensors pack-quantized INT4
(quantized from the bf16 draws, round to nearest per group of 32), everything else bf16 (the routing bias float32),
the ``quantization_config`` inside ``text_config``, and the weights in one shard per decoder layer with a
``model.safetensors.index.json`` (the real folder: 64 shards for 61 layers), each shard written as it is drawn.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors.torch import save_file

from layertap.models.folder import WRAPPED_PREFIX
from layertap.models.quantization import Quantization, quantize
from layertap.models.weights import INDEX
from layertap.tiny import kimi_config, kimi_processor
from layertap.tiny.kimi_tokenizer import BOS, IM_END, MEDIA_PAD, PAD, write_tokenizer_files

# MoonViT scaled down: head dim 16 (the 2-D rope needs a multiple of 4), one block, a 4x4 position grid.
TINY_VISION: dict[str, Any] = {
    "patch_size": 14,
    "init_pos_emb_height": 4,
    "init_pos_emb_width": 4,
    "init_pos_emb_time": 4,
    "pos_emb_type": "divided_fixed",
    "num_attention_heads": 2,
    "num_hidden_layers": 1,
    "hidden_size": 32,
    "intermediate_size": 64,
    "merge_kernel_size": [2, 2],
    "video_attn_type": "spatial_temporal",
    "merge_type": "sd2_tpool",
    "mm_projector_type": "patchmerger",
    "projector_hidden_act": "gelu",
    "projector_ln_eps": 1e-5,
}


# Kimi-K2.5's quantization_config as released (inside text_config): only routed experts are packed.
KIMI_K25_INT4: dict[str, Any] = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "quantization_status": "compressed",
    "kv_cache_scheme": None,
    "global_compression_ratio": None,
    "sparsity_config": {},
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "input_activations": None,
            "output_activations": None,
            "weights": {
                "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32,
                "dynamic": False, "observer": "minmax", "observer_kwargs": {}, "actorder": None,
                "block_structure": None,
            },
        }
    },
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
}  # fmt: skip
Quantize = Literal["int4"]


def _vision_config(text_hidden: int) -> dict[str, Any]:
    """The vision tower's fields under both spellings SGLang's classes read (`hidden_size` for the tower,
    `vt_*` for the projector), and the width it projects to."""
    vt = {f"vt_{k}": TINY_VISION[k] for k in ("hidden_size", "num_attention_heads", "num_hidden_layers",
                                                "intermediate_size")}  # fmt: skip
    return {**TINY_VISION, **vt, "mm_hidden_size": TINY_VISION["hidden_size"], "text_hidden_size": text_hidden}


def _media_proc_cfg(vision: dict[str, Any]) -> dict[str, Any]:
    """The image settings SGLang's Kimi-K2.5 processor reads, matched to the tower: its patch size, its merge
    kernel (square; SGLang reads one side), and patch limits set to the grid its position embedding was drawn for."""
    grid_h, grid_w = vision["init_pos_emb_height"], vision["init_pos_emb_width"]
    return {
        "patch_size": vision["patch_size"],
        "merge_kernel_size": vision["merge_kernel_size"][0],
        "in_patch_limit": grid_h * grid_w,
        "patch_limit_on_one_side": max(grid_h, grid_w),
        "fixed_output_tokens": None,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
    }


def write_processor_files(out_dir: Path, vision: dict[str, Any]) -> None:
    """The folder's processor class and `preprocessor_config.json` (its `auto_map` and `media_proc_cfg`)."""
    module = "processing_tiny_kimi"
    shutil.copyfile(kimi_processor.__file__, out_dir / f"{module}.py")
    config = {
        "auto_map": {"AutoProcessor": f"{module}.{kimi_processor.TinyKimiProcessor.__name__}"},
        "processor_class": kimi_processor.TinyKimiProcessor.__name__,
        "media_proc_cfg": _media_proc_cfg(vision),
    }
    (out_dir / kimi_processor.PROCESSOR_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def write_config_class(out_dir: Path) -> dict[str, str]:
    """The folder's config class (`configuration_kimi_k25.py`); returns config.json's `auto_map` naming it."""
    module = "configuration_kimi_k25"
    shutil.copyfile(kimi_config.__file__, out_dir / f"{module}.py")
    return {"AutoConfig": f"{module}.{kimi_config.KimiK25Config.__name__}"}


def deepseek_v3_shapes(cfg: dict[str, Any]) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(checkpoint name, shape) of every tensor of a DeepseekV3 causal LM as HF saves it (one tensor per expert)."""
    h, nh = cfg["hidden_size"], cfg["num_attention_heads"]
    nope, rope, v = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    kv_lora, q_lora = cfg["kv_lora_rank"], cfg.get("q_lora_rank")
    yield "model.embed_tokens.weight", (cfg["vocab_size"], h)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", (h,)
        yield p + "post_attention_layernorm.weight", (h,)
        if q_lora:
            yield p + "self_attn.q_a_proj.weight", (q_lora, h)
            yield p + "self_attn.q_a_layernorm.weight", (q_lora,)
            yield p + "self_attn.q_b_proj.weight", (nh * (nope + rope), q_lora)
        else:
            yield p + "self_attn.q_proj.weight", (nh * (nope + rope), h)
        yield p + "self_attn.kv_a_proj_with_mqa.weight", (kv_lora + rope, h)
        yield p + "self_attn.kv_a_layernorm.weight", (kv_lora,)
        yield p + "self_attn.kv_b_proj.weight", (nh * (nope + v), kv_lora)
        yield p + "self_attn.o_proj.weight", (h, nh * v)
        if i < cfg["first_k_dense_replace"]:
            yield from _mlp(p + "mlp.", h, cfg["intermediate_size"])
            continue
        yield p + "mlp.gate.weight", (cfg["n_routed_experts"], h)
        yield p + "mlp.gate.e_score_correction_bias", (cfg["n_routed_experts"],)
        for e in range(cfg["n_routed_experts"]):
            yield from _mlp(f"{p}mlp.experts.{e}.", h, cfg["moe_intermediate_size"])
        yield from _mlp(p + "mlp.shared_experts.", h, cfg["moe_intermediate_size"] * cfg["n_shared_experts"])
    yield "model.norm.weight", (h,)
    yield "lm_head.weight", (cfg["vocab_size"], h)


def _mlp(p: str, h: int, inter: int) -> Iterator[tuple[str, tuple[int, ...]]]:
    yield p + "gate_proj.weight", (inter, h)
    yield p + "up_proj.weight", (inter, h)
    yield p + "down_proj.weight", (h, inter)


def vision_shapes(vc: dict[str, Any]) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(checkpoint name, shape) of the MoonViT tower and the patch-merging projector."""
    d, inter, ps = vc["hidden_size"], vc["intermediate_size"], vc["patch_size"]
    merged = d * vc["merge_kernel_size"][0] * vc["merge_kernel_size"][1]
    yield "vision_tower.patch_embed.proj.weight", (d, 3, ps, ps)
    yield "vision_tower.patch_embed.proj.bias", (d,)
    yield "vision_tower.patch_embed.pos_emb.weight", (vc["init_pos_emb_height"], vc["init_pos_emb_width"], d)
    for i in range(vc["num_hidden_layers"]):
        p = f"vision_tower.encoder.blocks.{i}."
        for name, shape in (("norm0", (d,)), ("norm1", (d,))):
            yield p + name + ".weight", shape
            yield p + name + ".bias", shape
        for name, (out, inp) in (
            ("wqkv", (3 * d, d)),
            ("wo", (d, d)),
            ("mlp.fc0", (inter, d)),
            ("mlp.fc1", (d, inter)),
        ):
            yield p + name + ".weight", (out, inp)
            yield p + name + ".bias", (out,)
    for p, width in (("vision_tower.encoder.final_layernorm.", d), ("mm_projector.pre_norm.", d)):
        yield p + "weight", (width,)
        yield p + "bias", (width,)
    for name, (out, inp) in (("proj.0", (merged, merged)), ("proj.2", (vc["text_hidden_size"], merged))):
        yield f"mm_projector.{name}.weight", (out, inp)
        yield f"mm_projector.{name}.bias", (out,)


def draw_tensor(name: str, shape: tuple[int, ...], seed: int, dtype: torch.dtype) -> torch.Tensor:
    """One tensor from a generator seeded by (seed, name), scaled to keep activations O(1).

    Matrices std 1/sqrt(fan_in); embeddings std 1 (the residual stream starts at unit scale); norm gains
    1 +- 0.1 so a norm applied with the wrong weights or not at all shows; biases std 0.02; the noaux_tc
    routing bias std 0.1 and float32 (real checkpoints keep it so), so that routing ignoring it differs.
    """
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    gen = torch.Generator(device="cpu").manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    value = torch.randn(shape, generator=gen)
    if name.endswith("e_score_correction_bias"):
        return value.mul_(0.1)
    if name.endswith(".bias") or name.endswith("pos_emb.weight"):
        value.mul_(0.02)
    elif len(shape) == 1:
        value.mul_(0.1).add_(1.0)
    elif "embed_tokens" not in name:
        value.div_(math.sqrt(math.prod(shape[1:])))
    return value.to(dtype)


def build_kimi_k25(
    out_dir: Path,
    text_config: dict[str, Any],
    *,
    seed: int,
    dtype: torch.dtype,
    config_only: bool = False,
    quantization: Quantize | None = None,
) -> Path:
    """Write the wrapper folder for the DeepseekV3 `text_config` (vocab, layers, MLA and MoE sizes set); with
    `config_only`, no weights (a folder for `--load-format dummy`); with `quantization="int4"`, the released INT4
    layout (bf16 whatever `dtype` says, as the real folder)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    if quantization is not None:
        dtype = torch.bfloat16
        text_config = {**text_config, "quantization_config": KIMI_K25_INT4}
    special = write_tokenizer_files(out_dir, text_config["vocab_size"])
    dtype_name = str(dtype).removeprefix("torch.")
    ids = {"bos_token_id": special[BOS], "eos_token_id": special[IM_END], "pad_token_id": special[PAD]}
    text = {**text_config, **ids, "dtype": dtype_name, "architectures": ["DeepseekV3ForCausalLM"]}
    vision = _vision_config(text["hidden_size"])
    write_processor_files(out_dir, vision)
    config = {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "auto_map": write_config_class(out_dir),
        "model_type": kimi_config.KimiK25Config.model_type,
        "text_config": text,
        "vision_config": vision,
        "media_placeholder_token_id": special[MEDIA_PAD],
        "tie_word_embeddings": False,
        "dtype": dtype_name,
        **ids,
    }
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    gen_config = {**ids, "eos_token_id": [special[IM_END], special["[EOS]"]], "max_new_tokens": 1024}
    (out_dir / "generation_config.json").write_text(json.dumps(gen_config, indent=2, sort_keys=True) + "\n")

    if config_only:
        return out_dir
    specs = [(WRAPPED_PREFIX + n, s) for n, s in deepseek_v3_shapes(text)] + list(vision_shapes(vision))
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        if quantization is None:
            save_file(_draw(pool, specs, seed, dtype), str(out_dir / "model.safetensors"), metadata={"format": "pt"})
        else:
            _write_int4_shards(out_dir, pool, specs, seed, Quantization.read(text, where="text_config", model=""))
    return out_dir


def _draw(pool: ThreadPoolExecutor, specs: list[tuple[str, tuple[int, ...]]], seed: int,
          dtype: torch.dtype) -> dict[str, torch.Tensor]:  # fmt: skip
    tensors = pool.map(lambda spec: draw_tensor(*spec, seed, dtype), specs)
    return {name: t for (name, _), t in zip(specs, tensors, strict=True)}


def _packed(name: str, tensor: torch.Tensor, quant: Quantization) -> dict[str, torch.Tensor]:
    """A language-model Linear weight the scheme quantizes as its three packed tensors; any other tensor as is."""
    module = name.removeprefix(WRAPPED_PREFIX).removesuffix(".weight")
    if name.startswith(WRAPPED_PREFIX) and module.endswith("_proj") and quant.quantizes(module):
        return {f"{WRAPPED_PREFIX}{module}.{k}": v for k, v in quantize(tensor, quant.group_size).items()}
    return {name: tensor}


def _shard_key(name: str) -> int:
    """Which shard holds ``name``: decoder layer N's tensors shard N; embeddings and the vision tower ride with
    layer 0, the final norm and LM head with the last layer (-1)."""
    parts = name.removeprefix(WRAPPED_PREFIX).split(".")
    if parts[:2] == ["model", "layers"]:
        return int(parts[2])
    return -1 if name.removeprefix(WRAPPED_PREFIX) in ("model.norm.weight", "lm_head.weight") else 0


def _write_int4_shards(out_dir: Path, pool: ThreadPoolExecutor, specs: list[tuple[str, tuple[int, ...]]], seed: int,
                       quant: Quantization) -> None:  # fmt: skip
    """One bf16 + INT4 safetensors shard per decoder layer, drawn and written one at a time, and the index."""
    layers = max(_shard_key(name) for name, _ in specs) + 1
    by_shard: dict[int, list[tuple[str, tuple[int, ...]]]] = {}
    for spec in specs:
        by_shard.setdefault(_shard_key(spec[0]) % layers, []).append(spec)
    weight_map: dict[str, str] = {}
    total = 0
    for i in range(layers):
        shard = f"model-{i + 1:05d}-of-{layers:05d}.safetensors"
        tensors: dict[str, torch.Tensor] = {}
        for name, value in _draw(pool, by_shard[i], seed, torch.bfloat16).items():  # the routing bias stays float32
            tensors.update(_packed(name, value, quant))
        save_file(tensors, str(out_dir / shard), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, shard))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out_dir / INDEX).write_text(json.dumps(index, indent=2) + "\n")
