"""The audit's reference: the folder's language model in HF transformers, streamed one decoder layer at a time.

Every audited token goes through the model together, layer by layer: a layer is read from the shards (the next one
read meanwhile, `readahead.py`), materialized (`layers.py`), run over each batch, then dropped. Two residual streams
run side by side: float32, the reference, and the store's compute dtype, the noise floor. Memory is one layer's
weights plus the audited tokens' activations, whatever the depth (`memory.py` says how much before it starts).

Only the layers the store needs are run: up to the deepest captured state (and the neighbouring layer the
wrong-layer control reads), the whole stack only when a final state is stored. Capture index i = input of decoder
layer i = output of layer i-1; pre-norm final = the last layer's output; post-norm final = the final norm of it.
Each point's states are handed to an observer as soon as they exist (the states of every point at once would not
fit at Kimi's width). A hook on each MoE router records each token's routing margin.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from layertap.audit.layers import Decoder, Deferred, LayerInputs, StreamedExperts, top_names
from layertap.audit.readahead import ReadAhead, ReadStats
from layertap.models.folder import ModelFolder
from layertap.models.weights import FolderWeights
from sglang_patch.sample_files import FP8, dequantize_fp8, quantize_fp8

Point = int | str  # a capture index, or "pre" / "post" for the final state
# observe(point, batch, states, floor): one batch's [B, T, H] float32 reference at a point, and its floor (the same
# states computed in the store's compute dtype, rounded to its store dtype)
Observer = Callable[[Point, int, torch.Tensor, torch.Tensor], None]
Batch = tuple[torch.Tensor, list[int]]  # right-padded token ids [B, T] and each row's length
Progress = Callable[[int, int], None]  # (decoder layers run over every batch, layers to run)


class Reference:
    """The float32 reference of ``folder`` at ``points`` (plus the same model in ``compute_dtype`` when the store
    computed in another dtype), on ``device``."""

    def __init__(
        self,
        folder: ModelFolder,
        points: Sequence[Point],
        *,
        compute_dtype: torch.dtype,
        store_dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.points = tuple(points)
        self.full = any(isinstance(p, str) for p in points)
        self.depth = folder.num_layers if self.full else max(int(p) for p in points)
        self.store_dtype, self.device = store_dtype, device
        self.weights = FolderWeights(folder)
        dtypes = [torch.float32] + ([compute_dtype] if compute_dtype != torch.float32 else [])
        self.decoders = [Decoder(folder, self.depth, dtype, device) for dtype in dtypes]
        self.moe_layers = self.decoders[0].moe_layers
        self.k = int(folder.text_config.get("num_experts_per_tok") or 0)
        self.stats = ReadStats()

    @torch.inference_mode()
    def run(
        self, batches: Sequence[Batch], observe: Observer, progress: Progress | None = None
    ) -> dict[int, torch.Tensor]:
        """Push ``batches`` through the model, calling ``observe`` at each point and ``progress`` before the first
        layer and after each; returns per MoE layer the routing margins of the real tokens [N], batch by batch and
        row by row."""
        if progress:
            progress(0, self.depth)
        reader = ReadAhead(self.weights, range(self.depth))
        top = reader.read(top_names(self.weights))
        streams, inputs = [], []
        for decoder in self.decoders:
            decoder.load_top(top)
            embedded = [self._layer_inputs(decoder, ids, lengths) for ids, lengths in batches]
            streams.append([h for h, _ in embedded])
            inputs.append([kwargs for _, kwargs in embedded])
            decoder.drop_embeddings()
        del top
        lengths = [lengths for _, lengths in batches]
        self._observe(0, streams, observe)
        margins: dict[int, torch.Tensor] = {}
        for index, tensors in reader:
            for s, decoder in enumerate(self.decoders):
                layer = decoder.layer(index, tensors)
                run_layer(layer, streams[s], [kw[index] for kw in inputs[s]], lengths,
                          self._margin_hook(index, margins) if s == 0 else None)  # fmt: skip
                del layer
            del tensors
            self._observe(index + 1, streams, observe)
            if progress:
                progress(index + 1, self.depth)
        if self.full:
            self._observe("pre", streams, observe)
            for s, decoder in enumerate(self.decoders):
                streams[s] = [decoder.model.norm(h) for h in streams[s]]
            self._observe("post", streams, observe)
        self.stats = reader.stats
        return margins

    def _layer_inputs(self, decoder: Decoder, ids: torch.Tensor, lengths: list[int]) -> tuple[torch.Tensor, list[dict]]:
        """The embeddings of one batch and what the model passes each decoder layer with it (mask, positions), from
        one forward of the decoder with stand-ins for its layers."""
        seen: list[tuple[torch.Tensor, dict]] = []
        keep = lambda h, kwargs: seen.append((h, kwargs))  # noqa: E731
        decoder.model.layers = torch.nn.ModuleList(LayerInputs(keep) for _ in range(self.depth))
        mask = torch.zeros_like(ids)
        for row, n in enumerate(lengths):
            mask[row, :n] = 1
        decoder.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device), use_cache=False)
        decoder.model.layers = torch.nn.ModuleList()
        return seen[0][0], [kwargs for _, kwargs in seen]

    def _observe(self, point: Point, streams: list[list[torch.Tensor]], observe: Observer) -> None:
        if point not in self.points:
            return
        for b, (states, last) in enumerate(zip(streams[0], streams[-1], strict=True)):
            observe(point, b, states, round_to_store(last.float(), self.store_dtype))

    def _margin_hook(self, layer: int, margins: dict[int, torch.Tensor]):
        """A router hook keeping the gap between the k-th and (k+1)-th selection score per token (sigmoid +
        correction bias as DeepseekV3/Kimi select; softmax otherwise). Exact for one routing group; a proxy under
        group limits."""

        def hook(module: torch.nn.Module, _args: tuple, output: torch.Tensor | tuple) -> None:
            logits = (output[0] if isinstance(output, tuple) else output).float()
            logits = logits.reshape(-1, logits.shape[-1])
            bias = getattr(module, "e_score_correction_bias", None)
            scores = logits.sigmoid() + bias.float() if bias is not None else logits.softmax(dim=-1)
            if scores.shape[-1] <= self.k:  # every expert is chosen: no choice to flip
                margins[layer] = torch.full(scores.shape[:1], torch.inf, device=scores.device)
                return
            top = scores.topk(self.k + 1, dim=-1).values
            margins[layer] = top[:, self.k - 1] - top[:, self.k]

        return hook


def run_layer(
    layer: torch.nn.Module,
    hidden: list[torch.Tensor],
    kwargs: list[dict],
    lengths: list[list[int]],
    margin_hook: Callable | None,
) -> None:
    """Replace each batch's ``hidden`` [B, T, H] by ``layer``'s output. A MoE layer runs its attention batch by
    batch and its MLP once over the real tokens of every batch, so each routed expert is read once per layer."""
    mlp = getattr(layer, "mlp", None)
    if not isinstance(getattr(mlp, "experts", None), StreamedExperts):
        for b, h in enumerate(hidden):
            hidden[b] = layer(h, **kwargs[b])
        return
    layer.mlp = deferred = Deferred()
    for b, h in enumerate(hidden):
        hidden[b] = layer(h, **kwargs[b])
    tokens = torch.cat([x[row, :n] for x, rows in zip(deferred.inputs, lengths, strict=True)
                        for row, n in enumerate(rows)])  # fmt: skip
    deferred.inputs.clear()
    hook = mlp.gate.register_forward_hook(margin_hook) if margin_hook else None
    out = mlp(tokens[None])[0]
    if hook:
        hook.remove()
    del tokens
    offset = 0
    for h, rows in zip(hidden, lengths, strict=True):
        for row, n in enumerate(rows):
            h[row, :n] += out[offset : offset + n]  # the layer's own last step: residual + MLP output
            offset += n


def round_to_store(states: torch.Tensor, store_dtype: torch.dtype) -> torch.Tensor:
    """``states`` [..., H] as a store in ``store_dtype`` gives them to its trainer, in float32: cast, or for FP8
    quantized with its scale per token and state and dequantized to bf16 as speculators does (each state's rounding
    depends on that state alone, so the reference's states round one by one)."""
    if store_dtype != FP8:
        return states.to(store_dtype).float()
    fp8, scales = quantize_fp8(states.reshape(-1, 1, states.shape[-1]))
    return dequantize_fp8(fp8, scales).float().reshape(states.shape)
