"""The folder's language model as HF transformers' own modules, materialized one decoder layer at a time.

The decoder is built by transformers on the meta device (no memory), in each dtype the audit computes in, so its
classes, attention implementation and per-parameter dtypes (a router kept in float32 under bf16) are transformers'
own. The embeddings, the final norm and the rotary embedding are materialized once; a decoder layer is
materialized from the tensors the read-ahead brought, run over every audited token, and dropped.

Routed experts are never materialized together (a Kimi-K2.5 MoE layer is ~68 GB in float32): `StreamedExperts`
runs the model's own experts module holding one expert at a time, dequantized on the device from the packed
tensors, for the tokens routed to it. The checkpoint's per-expert ``gate_proj``/``up_proj``/``down_proj`` are
fused as transformers fuses them on load (gate then up). Only model types whose other checkpoint names are the
modules' own, and whose decoder layers add the MLP's output to the residual last, are taken (`MODEL_TYPES`; each
is proven equal to the whole-model reference in CI).
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from transformers import AutoModel

from layertap.engines.hf import language_config
from layertap.errors import SpecError
from layertap.models.folder import ModelFolder
from layertap.models.weights import FolderWeights, Packed, Stored, layer_of

# DeepseekV3 covers Kimi-K2 and Kimi-K2.5's language model; Llama the dense decoders.
MODEL_TYPES = ("llama", "deepseek_v3")
EXPERTS = "mlp.experts."
EXPERT_PARTS = ("gate_proj", "up_proj", "down_proj")


def top_names(weights: FolderWeights) -> list[str]:
    """The decoder's tensors outside its layers: embeddings and final norm (the LM head is never run)."""
    return [n for n in weights.names if layer_of(n) is None and not n.startswith("lm_head.")]


def has_routed_experts(layer: torch.nn.Module) -> bool:
    """Whether a decoder layer's MLP is a MoE with routed experts."""
    return hasattr(getattr(layer, "mlp", None), "experts")


def to_device(value: Stored, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A stored tensor (or packed weight, dequantized exactly on ``device``) in ``dtype`` on ``device``."""
    tensor = value.dequantize(device) if isinstance(value, Packed) else value.to(device)
    return tensor.to(dtype)


class Decoder:
    """The decoder of ``folder`` cut to ``depth`` layers, in ``dtype``, with no weights until asked for."""

    def __init__(self, folder: ModelFolder, depth: int, dtype: torch.dtype, device: torch.device) -> None:
        config = language_config(folder, depth)
        if config.model_type not in MODEL_TYPES:
            raise SpecError(
                f"model {folder.path}: the audit's streamed reference runs {', '.join(MODEL_TYPES)} language models "
                f"(each proven equal to the whole model in CI), not {config.model_type!r}"
            )
        with torch.device("meta"):
            self.model = AutoModel.from_config(config, dtype=dtype).eval()
        self.dtype, self.device = dtype, device
        self.layers = self.model.layers
        self.model.layers = torch.nn.ModuleList()

    @property
    def moe_layers(self) -> list[int]:
        """Indices of the layers with routed experts."""
        return [i for i, layer in enumerate(self.layers) if has_routed_experts(layer)]

    def load_top(self, tensors: dict[str, Stored]) -> None:
        """Materialize the embeddings and the final norm from ``tensors`` (`top_names`) and a rotary embedding
        computed on the device (its buffers are not weights)."""
        top = {k.removeprefix("model."): v for k, v in tensors.items()}
        for name in ("embed_tokens", "norm"):
            load(getattr(self.model, name), {k.removeprefix(name + "."): v for k, v in top.items()
                                             if k.startswith(name + ".")}, self.device, f"model.{name}")  # fmt: skip
        with self.device:  # its frequencies are computed as it is built
            self.model.rotary_emb = type(self.model.rotary_emb)(config=self.model.config)

    def drop_embeddings(self) -> None:
        """Free the embedding table once the audited tokens are embedded."""
        self.model.embed_tokens = torch.nn.Identity()

    def layer(self, index: int, tensors: dict[str, Stored]) -> torch.nn.Module:
        """Decoder layer ``index`` on the device from its tensors (names without the ``model.layers.N.`` prefix);
        its routed experts streamed (`StreamedExperts`)."""
        module = copy.deepcopy(self.layers[index])
        plain = {k: v for k, v in tensors.items() if not k.startswith(EXPERTS)}
        if has_routed_experts(module):
            module.mlp.experts = StreamedExperts(module.mlp.experts, expert_weights(tensors, index), self.device)
        load(module, plain, self.device, f"model.layers.{index}")
        return module


def load(module: torch.nn.Module, tensors: dict[str, Stored], device: torch.device, where: str) -> None:
    """Give a meta ``module`` its weights from ``tensors``, each in the dtype transformers chose for it; SpecError
    when the checkpoint lacks one or holds one the module does not have (a weight left random would pass)."""
    expected = dict(module.state_dict(keep_vars=True))
    missing, unexpected = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise SpecError(
            f"{where}: the checkpoint's tensors are not the model's: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    state = {}
    for name, value in tensors.items():
        shape = tuple(value.shape.tolist() if isinstance(value, Packed) else value.shape)
        if shape != tuple(expected[name].shape):
            raise SpecError(
                f"{where}.{name}: shape {shape} in the checkpoint, {tuple(expected[name].shape)} in the model"
            )
        state[name] = to_device(value, device, expected[name].dtype)
    module.load_state_dict(state, strict=True, assign=True)


def expert_weights(tensors: dict[str, Stored], index: int) -> dict[int, dict[str, Stored]]:
    """expert -> part -> stored weight, from a layer's ``mlp.experts.E.PART.weight`` tensors; SpecError on a gap."""
    experts: dict[int, dict[str, Stored]] = {}
    for name, value in tensors.items():
        if name.startswith(EXPERTS):
            expert, part, _ = name.removeprefix(EXPERTS).split(".", 2)
            experts.setdefault(int(expert), {})[part] = value
    for e, parts in experts.items():
        if sorted(parts) != sorted(EXPERT_PARTS):
            raise SpecError(f"model.layers.{index}.mlp.experts.{e}: has {sorted(parts)}, needs {list(EXPERT_PARTS)}")
    return experts


class StreamedExperts(torch.nn.Module):
    """Stands in for a layer's experts module: runs that module's own class, holding one expert at a time
    (dequantized on the device as it is needed, dropped after), on the tokens routed to it. Contributions add up
    in expert order, as the whole module adds them."""

    def __init__(self, template: torch.nn.Module, experts: dict[int, dict[str, Stored]], device: torch.device) -> None:
        super().__init__()
        if sorted(experts) != list(range(template.num_experts)):
            raise SpecError(f"the checkpoint has {len(experts)} routed experts, the config {template.num_experts}")
        template = copy.deepcopy(template)
        template.config = copy.copy(template.config)
        template.config._experts_implementation = "eager"  # the per-expert loop (fused kernels assume every expert)
        object.__setattr__(self, "template", template)  # not a submodule: its (meta) weights are never loaded
        self.weights, self.device = experts, device

    def one(self, expert: int) -> torch.nn.Module:
        """The experts module holding ``expert`` alone."""
        parts = {
            p: to_device(v, self.device, self.template.gate_up_proj.dtype) for p, v in self.weights[expert].items()
        }
        module = copy.deepcopy(self.template)
        module.num_experts = 1
        module.gate_up_proj = torch.nn.Parameter(torch.cat([parts["gate_proj"], parts["up_proj"]])[None], False)
        module.down_proj = torch.nn.Parameter(parts["down_proj"][None], False)
        return module

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        for expert in torch.unique(top_k_index).tolist():
            tokens, slot = torch.where(top_k_index == expert)  # the tokens routed to it, and in which of their k slots
            only = torch.zeros_like(slot)[:, None]  # each of those tokens' one route: expert 0 of the one-expert module
            routed = self.one(expert)(hidden_states[tokens], only, top_k_weights[tokens, slot, None])
            out.index_add_(0, tokens, routed)
        return out


class Deferred(torch.nn.Module):
    """Stands in for a MoE layer's MLP while its attention runs batch by batch: keeps the MLP's input and adds
    nothing, so the layer returns the residual after attention; the MLP then runs once over every token."""

    def __init__(self) -> None:
        super().__init__()
        self.inputs: list[torch.Tensor] = []

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        self.inputs.append(hidden_states)
        return torch.zeros_like(hidden_states)


class LayerInputs(torch.nn.Module):
    """Stands in for decoder layer ``index`` in one forward of the decoder without layers: keeps what the model
    passes that layer (the causal mask, position embeddings...) and its input (for layer 0, the embeddings)."""

    def __init__(self, keep: Callable[[torch.Tensor, dict], None]) -> None:
        super().__init__()
        self.keep = keep

    def forward(self, hidden_states: torch.Tensor, **kwargs: object) -> torch.Tensor:
        self.keep(hidden_states, kwargs)
        return hidden_states
