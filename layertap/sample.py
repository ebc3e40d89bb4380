"""The two records a sample is while it moves through the pipeline."""

from __future__ import annotations

import mmap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


@dataclass(frozen=True, slots=True)
class TokenizedSample:
    """A dataset row after the chat template.

    ``index`` is the dataset row number (0-based): the store's name for what the pipeline calls ``row`` (the key
    its records keep on disk, `SampleRecord.index`); output files are named by it.
    ``input_ids`` long [T]; ``loss_mask`` uint8 [T], 1 exactly on assistant-produced tokens.
    ``regenerated``: the regenerated row these ids are the text of (`Regenerated.record`), committed with the
    sample; None for a row captured as given. ``generated_tokens``: the new tokens the server generated for it (its
    re-tokenized text may count otherwise), committed with it so that a rebuilt job state counts them again.
    ``context``: the assistant turns asked to be trained that the sample holds only as context, outside the mask (the
    chat template renders them otherwise than generated once later turns follow), each with why; ``messages``: how many
    of a conversation's messages the sample holds (fewer when it ends with its last trained turn), None for other rows.
    """

    sample_id: str
    index: int
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    truncated: bool = False
    regenerated: dict[str, Any] | None = None
    generated_tokens: int = 0
    context: tuple[tuple[int, str], ...] = ()
    messages: int | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass(frozen=True, slots=True)
class SampleFile:
    """A file already holding a sample in a store format (written so by the SGLang plugin), read and checked
    once by the engine (`sglang_patch.contract.read_dump`): ``data`` is its bytes as read then, which the store
    hashes as it renames the file (or writes across filesystems), so the file is not read again; ``loss_mask``
    [T] is the mask a specforge file holds, checked against the sample's."""

    path: Path
    format: str
    data: mmap.mmap
    loss_mask: torch.Tensor | None = None


@dataclass(frozen=True, slots=True)
class CapturedSample:
    """Hidden states captured for one sample, on the CPU, in the engine's compute dtype.

    ``aux`` [T, k, H]: the capture indices of the spec, in spec order (capture index i = input of
    decoder layer i = HF ``output_hidden_states[i]``). ``final_post`` [T, H]: after the final norm;
    ``final_pre`` [T, H]: before it. Either is None when the spec did not ask for it.
    ``source``: set when these tensors are views of a file already in a store format; a store in
    that format and dtype commits by moving that file instead of writing one. ``scales`` float32
    [T, k+1, 1]: set when ``aux`` and ``final_pre`` are already FP8 (quantized by the capture server,
    `sglang_patch.sample_files.quantize_fp8`), one scale per token and state. ``placed``: the key of the
    stream object the capture server wrote this sample into (`layertap.engines.base.Placer`), the tensors
    views of it.
    """

    sample: TokenizedSample
    aux: torch.Tensor
    final_post: torch.Tensor | None
    final_pre: torch.Tensor | None
    source: SampleFile | None = None
    scales: torch.Tensor | None = None
    placed: str | None = None


@dataclass(frozen=True, slots=True)
class FailedCapture:
    """An engine's word that one sample's attempt failed (e.g. a prefix-cache hit, a dump that never
    came) while the rest of its batch went on; the pipeline counts it against the sample's attempts."""

    sample: TokenizedSample
    reason: str
