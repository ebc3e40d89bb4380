"""The audit's reference: the folder's language model in HF transformers, run on the store's own token ids.

Only the layers the store needs are loaded and run: up to the deepest captured state (and the neighbouring
layer the wrong-layer control reads), the whole stack only when a final state is stored. States are read with
hooks (capture index i = input of decoder layer i = output of layer i-1; pre-norm final = the final norm's
input; post-norm final = the model's output), never through ``output_hidden_states``, so a truncated stack
means the same thing as a whole one. Hooks on the MoE routers record each token's routing margin.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from layertap.engines.hf import load_language_model
from layertap.errors import SpecError
from layertap.models.folder import ModelFolder
from layertap.models.quantization import PACKED, SCALE, SHAPE
from sglang_patch.sample_files import FP8, dequantize_fp8, quantize_fp8

Point = int | str  # a capture index, or "pre" / "post" for the final state
GiB = 1024**3


@dataclass(frozen=True, slots=True)
class RefRun:
    """One batch's reference: point -> [B, T, H] float32 states, the floor states at the store's precision
    (`round_to_store`), and per MoE layer (index -> [B, T]) the routing margins."""

    states: dict[Point, torch.Tensor]
    floor: dict[Point, torch.Tensor]
    margins: dict[int, torch.Tensor]


class Reference:
    """The float32 reference (plus, when the store computed in another dtype, the same model in that dtype)."""

    def __init__(
        self,
        folder: ModelFolder,
        points: Sequence[Point],
        *,
        compute_dtype: torch.dtype,
        store_dtype: torch.dtype,
        device: str,
    ) -> None:
        self.points = tuple(points)
        self.full = any(isinstance(p, str) for p in points)
        depth = folder.num_layers if self.full else max(int(p) for p in points)
        self.store_dtype = store_dtype
        device_map = "auto" if device == "auto" else None
        check_memory(folder, depth, compute_dtype, device)
        self.models = [_load(folder, torch.float32, depth, device, device_map)]
        if compute_dtype != torch.float32:
            self.models.append(_load(folder, compute_dtype, depth, device, device_map))
        self.device = next(self.models[0].parameters()).device
        self.k = int(folder.text_config.get("num_experts_per_tok") or 0)
        self.moe_layers = [i for i, layer in enumerate(self.models[0].layers) if _router(layer) is not None]
        self._seen: dict[Point, torch.Tensor] = {}
        self._margins: dict[int, torch.Tensor] = {}
        self._hooks = [self._attach(m, margins=(m is self.models[0])) for m in self.models]

    def _attach(self, model: torch.nn.Module, *, margins: bool) -> list:
        handles = []
        for i, layer in enumerate(model.layers):
            if i + 1 in self.points:
                handles.append(layer.register_forward_hook(self._keep(i + 1)))
            if margins and (gate := _router(layer)) is not None:
                handles.append(gate.register_forward_hook(self._margin_hook(i)))
        if 0 in self.points:
            handles.append(
                model.layers[0].register_forward_pre_hook(lambda _m, args: self._seen.__setitem__(0, args[0]))
            )
        if self.full:
            handles.append(
                model.norm.register_forward_pre_hook(lambda _m, args: self._seen.__setitem__("pre", args[0]))
            )
        return handles

    def _keep(self, point: Point):
        def hook(_module: torch.nn.Module, _args: tuple, output: torch.Tensor | tuple) -> None:
            self._seen[point] = output[0] if isinstance(output, tuple) else output

        return hook

    def _margin_hook(self, layer: int):
        """The gap between the k-th and (k+1)-th selection score per token (sigmoid + correction bias as
        DeepseekV3/Kimi select; softmax otherwise). Exact for one routing group; a proxy under group limits."""

        def hook(module: torch.nn.Module, _args: tuple, output: torch.Tensor | tuple) -> None:
            logits = (output[0] if isinstance(output, tuple) else output).float()
            logits = logits.reshape(-1, logits.shape[-1])
            bias = getattr(module, "e_score_correction_bias", None)
            scores = logits.sigmoid() + bias.float() if bias is not None else logits.softmax(dim=-1)
            top = scores.topk(min(self.k + 1, scores.shape[-1]), dim=-1).values
            self._margins[layer] = top[:, self.k - 1] - top[:, self.k]

        return hook

    @torch.inference_mode()
    def run(self, ids: torch.Tensor, attention_mask: torch.Tensor) -> RefRun:
        """The reference of one right-padded batch ``ids`` [B, T]."""
        results = []
        for model in self.models:
            self._seen.clear()
            out = model(input_ids=ids.to(self.device), attention_mask=attention_mask.to(self.device), use_cache=False)
            if self.full:
                self._seen["post"] = out.last_hidden_state
            results.append({p: self._seen[p].float() for p in self.points})
        states, shape = results[0], ids.shape
        floor = {p: round_to_store(t, self.store_dtype) for p, t in results[-1].items()}
        margins = {i: m.reshape(shape) for i, m in self._margins.items()}
        self._seen.clear()
        self._margins.clear()
        return RefRun(states=states, floor=floor, margins=margins)


def round_to_store(states: torch.Tensor, store_dtype: torch.dtype) -> torch.Tensor:
    """``states`` [..., H] as a store in ``store_dtype`` gives them to its trainer, in float32: cast, or for FP8
    quantized with its scale per token and state and dequantized to bf16 as speculators does (each state's rounding
    depends on that state alone, so the reference's states round one by one)."""
    if store_dtype != FP8:
        return states.to(store_dtype).float()
    fp8, scales = quantize_fp8(states.reshape(-1, 1, states.shape[-1]))
    return dequantize_fp8(fp8, scales).float().reshape(states.shape)


def _router(layer: torch.nn.Module) -> torch.nn.Module | None:
    """A decoder layer's MoE router (``mlp.gate`` with experts beside it), or None for a dense layer."""
    mlp = getattr(layer, "mlp", None)
    return getattr(mlp, "gate", None) if hasattr(mlp, "experts") else None


def _load(folder: ModelFolder, dtype: torch.dtype, depth: int, device: str, device_map: str | None) -> torch.nn.Module:
    model = load_language_model(folder, dtype, num_layers=depth, device_map=device_map).get_decoder()
    return (model if device_map else model.to(device)).eval()


def check_memory(folder: ModelFolder, depth: int, compute_dtype: torch.dtype, device: str) -> None:
    """SpecError saying what the reference needs when ``device`` (one GPU) cannot hold it."""
    if not device.startswith("cuda"):
        return
    need = weight_bytes(folder, depth, torch.float32)
    if compute_dtype != torch.float32:
        need += weight_bytes(folder, depth, compute_dtype)
    free, _ = torch.cuda.mem_get_info(torch.device(device))
    if need * 1.1 > free:
        total = sum(torch.cuda.mem_get_info(i)[0] for i in range(torch.cuda.device_count()))
        raise SpecError(
            f"the reference needs ~{need / GiB:.1f} GiB of weights on {device} (float32"
            f"{' plus ' + str(compute_dtype).removeprefix('torch.') if compute_dtype != torch.float32 else ''}, "
            f"{depth} layers) and {free / GiB:.1f} GiB is free; --device auto spreads it over the "
            f"{torch.cuda.device_count()} GPUs here ({total / GiB:.1f} GiB free in all)"
        )


def weight_bytes(folder: ModelFolder, depth: int, dtype: torch.dtype) -> int:
    """Bytes of the language model's weights for its first ``depth`` layers in ``dtype``, from the safetensors
    headers (no weights read); packed INT4 weights count as the values they dequantize to."""
    layer = re.compile(r"layers\.(\d+)\.")
    numel = 0
    for path in folder.path.glob("*.safetensors"):
        with open(path, "rb") as f:
            header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        for name, info in header.items():
            if name == "__metadata__" or not name.startswith(folder.prefix):
                continue
            if ((m := layer.search(name)) and int(m.group(1)) >= depth) or name.endswith((f".{SCALE}", f".{SHAPE}")):
                continue  # a packed weight's scale and shape are folded into its dequantized values
            n = 8 if name.endswith(f".{PACKED}") else 1  # an int32 word packs 8 INT4 values
            for d in info["shape"]:
                n *= d
            numel += n
    return numel * dtype.itemsize
