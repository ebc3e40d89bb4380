"""A streamed sample (`StreamDataset`'s) in the shapes the trainers' own data pipelines take, for a trainer process
that reads the stream itself: speculators 0.9.0's dataset item (what its ``ArrowDataset`` hands its ``CollateFn``)
and SpecForge 0.2.0's offline EAGLE-3 features (what its offline reader loads from a ``.ckpt``, for its normalizer
and collator). The stream carries speculators' layout, whose final state is pre-norm; SpecForge's is post-norm, so
its features take the target's own final norm (`final_norm`). `AckAfterStep` holds a trainer's samples unacked until
the optimizer step that used them (SpecForge's trainer calls its ``ack_fn`` at each step's boundary).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open

from layertap.stream.consumer import Delivery, StreamConsumer


class AckAfterStep:
    """A trainer's samples from ``consumer``, each acked only once the optimizer step that consumed it is taken (not
    when it is read, as `StreamDataset` does), so a trainer killed before that step leaves it pending to another
    consumer of its group: `take` reads them, `ack` (SpecForge's ``ack_fn(sample_ids, step)``, which its
    ``TrainerController`` calls after each optimizer step with the step's samples) acks them. The consumer's
    ``claim_idle_ms`` must outlast the steps a sample waits for, or another consumer reclaims it meanwhile."""

    def __init__(self, consumer: StreamConsumer) -> None:
        self.consumer = consumer
        self.held: dict[str, Delivery] = {}  # sample id -> its delivery, read and not acked

    def take(self, count: int) -> dict[str, dict[str, torch.Tensor]]:
        """``count`` samples (fewer once the stream has ended), by sample id, in `StreamDataset`'s shape, unacked."""
        taken = {}
        while len(taken) < count and not self.consumer.finished():
            if (delivery := self.consumer.receive()) is not None:
                self.held[delivery.sample_id] = delivery
                taken[delivery.sample_id] = delivery.sample()
        return taken

    def ack(self, sample_ids: list[str], step: int) -> None:
        """Ack the samples of optimizer step ``step`` (an id acked already, by an earlier epoch's step, is let be)."""
        for sample_id in sample_ids:
            if (delivery := self.held.pop(sample_id, None)) is not None:
                self.consumer.ack(delivery)


def speculators_item(sample: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """speculators' dataset item of ``sample``: the aux states concatenated, the pre-norm final as the verifier's last
    state, the loss mask as int64 (its Arrow rows'), the sample's length and positions (its ``ArrowDataset`` and
    ``BaseDataset.__getitem__``)."""
    states, num_tokens = sample["hidden_states"], sample["input_ids"].shape[0]
    return {"hidden_states": states[:, :-1].flatten(1), "input_ids": sample["input_ids"],
            "verifier_last_hidden_states": states[:, -1], "loss_mask": sample["loss_mask"].long(),
            "lengths": torch.tensor([num_tokens]), "position_ids": torch.arange(num_tokens)}  # fmt: skip


def specforge_features(
    sample: dict[str, torch.Tensor], norm: Callable[[torch.Tensor], torch.Tensor]
) -> dict[str, torch.Tensor]:
    """SpecForge's offline features of ``sample`` (``layertap extract --format specforge``'s file): ``input_ids``,
    ``loss_mask`` (int64), ``aux_hidden_state`` [1, T, k*H] and ``hidden_state`` [1, T, H], the final state after
    ``norm`` (`final_norm`), in the stream's dtype."""
    states = sample["hidden_states"]
    return {"input_ids": sample["input_ids"], "loss_mask": sample["loss_mask"].long(),
            "aux_hidden_state": states[:, :-1].flatten(1).unsqueeze(0),
            "hidden_state": norm(states[:, -1].float()).to(states.dtype).unsqueeze(0)}  # fmt: skip


@torch.no_grad()
def final_norm(model: Path) -> Callable[[torch.Tensor], torch.Tensor]:
    """The final norm of the target at ``model`` (a plain causal LM's folder): transformers' own module for its
    architecture, built without the rest of the model, with the folder's ``model.norm.weight``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        lm = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model))
    norm = lm.get_decoder().norm.to_empty(device="cpu").float()
    index = model / "model.safetensors.index.json"
    shard = json.loads(index.read_text())["weight_map"]["model.norm.weight"] if index.exists() else "model.safetensors"
    with safe_open(str(model / shard), "pt") as f:
        norm.weight.copy_(f.get_tensor("model.norm.weight"))
    return norm.requires_grad_(False)
