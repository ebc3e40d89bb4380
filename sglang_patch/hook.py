"""The ``--forward-hooks`` factory: a thin adapter from SGLang's forward pass to `capture` and `writer`.

`sglang_patch.launch` registers one hook spec per role, all with ``hook_factory =
"sglang_patch.hook:hook_factory"``:

- ``aux:<i>`` on decoder layer ``i-1``: rows ``output[0] + output[1]`` (hidden + residual, the input
  of layer i; Llama layers return a 2-tuple, DeepseekV3 a 3-tuple whose third item is not a state),
- ``final_pre`` on the last decoder layer: ``output[0] + output[1]``,
- ``final_post`` on ``logits_processor``: its ``hidden_states`` argument (``inputs[1]``).

Hooks of one pass hand their rows to a per-process `_Capturer`; once every role of the pass has
reported, it plans the pass from the ForwardBatch (`capture.plan_pass`), copies captured rows to the
host (`capture.Accumulator`) and queues complete requests for the writer thread. Only the rank that
holds full hidden states captures (attention-TP rank 0: TP rank 0, or rank 0 of each DP-attention
group); the factory returns None elsewhere, so other ranks run no hook at all.

Two small runtime additions, no SGLang file is edited:
- On the writer rank, `ForwardBatch.init_new` is wrapped to record each captured request's full
  prompt length (``len(req.origin_input_ids)``) and the loss mask its client sent (for specforge
  dumps) in `capture.Prompts`, keyed by rid: the forward batch does not say where a prompt ends,
  and sglang 0.5.14 copies it into static buffers before the model runs, so nothing can ride on the
  batch object itself.
- On import (SGLang imports this module in every scheduler process, which it starts with "spawn"),
  on the CPU engine only, a ``torch_native`` MLA attention handler for DeepseekV3 models.
"""

from __future__ import annotations

import atexit
import functools
import logging
from collections.abc import Callable
from typing import Any

import torch
from sglang.srt.model_executor.forward_batch_info import ForwardBatch

from sglang_patch.capture import Accumulator, Completed, Piece, Prompts, plan_pass
from sglang_patch.contract import AUX, AUX_FINAL_PRE, FINAL_TENSORS, INPUT_IDS, SCALES, SPECULATORS
from sglang_patch.sample_files import quantize_fp8
from sglang_patch.settings import CaptureSettings, aux_role
from sglang_patch.writer import DumpJob, DumpWriter, HostBudget, HostStaging

logger = logging.getLogger(__name__)

Hook = Callable[[torch.nn.Module, tuple[Any, ...], Any], None]


def _record_prompts(prompts: Prompts) -> None:
    """Wrap `ForwardBatch.init_new` so every prefill batch records its requests' prompt lengths and
    the custom params their clients sent (``sampling_params.custom_params``: a loss mask, a placement)."""
    func = ForwardBatch.init_new.__func__

    @functools.wraps(func)
    def init_new(cls: type[ForwardBatch], batch: Any, *args: Any, **kwargs: Any) -> ForwardBatch:
        mode = getattr(batch, "forward_mode", None)
        if mode is not None and mode.is_extend():
            for req in batch.reqs:
                params = getattr(req.sampling_params, "custom_params", None)
                prompts.record(req.rid, len(req.origin_input_ids), params if isinstance(params, dict) else None)
        return func(cls, batch, *args, **kwargs)

    ForwardBatch.init_new = classmethod(init_new)  # type: ignore[method-assign, assignment]


def _register_cpu_mla_handler() -> None:
    """Make MLA models (DeepseekV3/Kimi) pick the MLA path under ``--attention-backend torch_native``.

    Without it the CPU engine falls back to the triton handler, which picks the MHA prefill path
    while torch_native reads the MLA latent cache (a shape error). Harmless elsewhere: it only acts
    on the CPU engine and only where the registry exists and lacks a torch_native handler.
    """
    try:
        from sglang.srt.models.deepseek_common import attention_backend_handler as handlers
        from sglang.srt.utils import is_cpu
    except ImportError:
        return
    registry = getattr(handlers, "AttentionBackendRegistry", None)
    dispatch = getattr(handlers, "_dispatch_mla_subtype", None)
    if is_cpu() and registry is not None and dispatch is not None and "torch_native" not in registry._handlers:
        registry.register("torch_native", dispatch)


def _is_writer_rank() -> bool:
    from sglang.srt.layers.dp_attention import get_attention_tp_rank

    return get_attention_tp_rank() == 0


def _forward_batch(inputs: tuple[Any, ...]) -> ForwardBatch:
    for value in inputs:
        if isinstance(value, ForwardBatch):
            return value
    raise RuntimeError(f"layertap hook: no ForwardBatch among the module inputs {[type(v).__name__ for v in inputs]}")


@functools.cache
def _warn_unreduced() -> None:
    logger.warning(
        "layertap: capturing per-rank partial sums (--allreduce-fusion sglang; all-reduce fused into the next layer)"
    )


def _layer_rows(output: Any, *, allow_unreduced: bool) -> torch.Tensor:
    hidden, residual = output[0], output[1]
    if getattr(hidden, "_sglang_needs_allreduce_fusion", False):
        # The all-reduce was deferred into the next layer: these are per-rank partial sums.
        if allow_unreduced:
            _warn_unreduced()
            return hidden + residual
        raise RuntimeError(
            "layertap: decoder layer output awaits a fused all-reduce; start the server with "
            "--enforce-disable-flashinfer-allreduce-fusion (sglang_patch.launch does)"
        )
    return hidden + residual


class _Capturer:
    """Per-process capture state: the pass being assembled, the accumulator and the writer."""

    def __init__(self, settings: CaptureSettings) -> None:
        self.settings = settings
        self._roles = set(settings.roles())
        self._writer = DumpWriter(
            settings.dump_root,
            layers=settings.layers,
            finals=settings.finals,
            budget=HostBudget(settings.pinned_cap_bytes),
            threads=settings.writer_threads,
            layout=settings.layout,
        )
        atexit.register(self._writer.close, 30.0)
        self._prompts = Prompts(settings.rid_prefix)
        _record_prompts(self._prompts)
        # Created at the first captured pass, when the device of the rows is known.
        self._staging: HostStaging | None = None
        self._accumulator: Accumulator | None = None
        self._batch: ForwardBatch | None = None
        self._pieces: list[Piece] = []
        self._rows: dict[str, torch.Tensor] = {}
        self._reserved: dict[str, int] = {}  # rid -> host bytes reserved for its buffers

    def take(self, role: str, batch: ForwardBatch, rows: Callable[[], torch.Tensor]) -> None:
        """Record `role`'s rows for `batch` (computed only if the pass captures anything)."""
        if batch is not self._batch:
            if self._rows:
                logger.error("layertap: pass dropped with only roles %s reported", sorted(self._rows))
            self._batch, self._rows = batch, {}
            self._pieces = plan_pass(
                batch.forward_mode.name,
                batch.rids,
                batch.extend_seq_lens_cpu,
                batch.extend_prefix_lens_cpu,
                self._prompts,
                rid_prefix=self.settings.rid_prefix,
            )
            if self._pieces and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                # Host-side work would run once at capture and never at replay: capture nothing.
                logger.error("layertap: captured rids in a pass under CUDA graph capture; skipped")
                self._pieces = []
        if not self._pieces:
            return
        self._rows[role] = rows()
        if len(self._rows) == len(self._roles):
            self._finish_pass(batch)

    def _finish_pass(self, batch: ForwardBatch) -> None:
        captured = self._rows
        self._rows = {}
        needed = max(p.row_start + p.num_rows for p in self._pieces)
        # Tensors of our own (copied once on the device): the copies to the host run on a side stream
        # while the forward pass goes on, which may reuse SGLang's buffers (input ids, the final norm's).
        aux = [captured[aux_role(i)][:needed] for i in self.settings.layers]
        rows = {INPUT_IDS: batch.input_ids[:needed].to(torch.int64, copy=True)}
        if self.settings.layout == SPECULATORS:  # the file's [T, k+1, H] assembled here, saved as it is
            states = torch.stack([*aux, captured[FINAL_TENSORS["pre"]][:needed]], dim=1)
            if self.settings.quantize == "fp8":  # on the device: half the bytes to copy, pin, write and hash
                rows[AUX_FINAL_PRE], rows[SCALES] = quantize_fp8(states)
            else:
                rows[AUX_FINAL_PRE] = states
        else:
            rows[AUX] = torch.stack(aux, dim=1)
            rows.update((FINAL_TENSORS[f], captured[FINAL_TENSORS[f]][:needed].clone()) for f in self.settings.finals)
        if self._staging is None or self._accumulator is None:
            self._staging = HostStaging(rows[INPUT_IDS].device)
            self._accumulator = Accumulator(alloc=self._staging.alloc, max_idle_passes=self.settings.max_idle_passes)
        self._reserve(rows)
        with self._staging.copying(rows.values()):
            outcomes = self._accumulator.add_pass(self._pieces, rows)
            ready = self._staging.record() if outcomes else None
        for outcome in outcomes:
            nbytes = self._reserved.pop(outcome.rid, 0)
            if isinstance(outcome, Completed):
                params = self._prompts.params(outcome.rid)
                job = DumpJob(outcome.rid, tensors=outcome.tensors, ready=ready, params=params, nbytes=nbytes)
                self._writer.submit(job)
            else:
                logger.warning("layertap: capture of %s failed: %s", outcome.rid, outcome.reason)
                self._writer.budget.release(nbytes, handed=False)  # its buffers were dropped
                self._writer.submit(DumpJob(outcome.rid, error=outcome.reason))
            self._prompts.forget(outcome.rid)
        for piece in self._pieces:
            if piece.position + piece.num_rows >= piece.prompt_len:
                self._prompts.forget(piece.rid)

    def _reserve(self, rows: dict[str, torch.Tensor]) -> None:
        """Reserve host memory for the requests whose first rows are in this pass (the accumulator
        allocates their whole prompt's buffers now); blocks while the writers lag (`HostBudget`)."""
        assert self._staging is not None
        for piece in self._pieces:
            if piece.position == 0 and piece.rid not in self._reserved:
                nbytes = sum(
                    self._staging.footprint(piece.prompt_len * t[0].numel() * t.element_size()) for t in rows.values()
                )
                self._writer.budget.reserve(nbytes)
                self._reserved[piece.rid] = nbytes


_CAPTURER: _Capturer | None = None


def _capturer(settings: CaptureSettings) -> _Capturer:
    global _CAPTURER
    if _CAPTURER is None:
        _CAPTURER = _Capturer(settings)
    elif _CAPTURER.settings != settings:
        raise ValueError("layertap: all capture hooks of one server must share the same settings")
    return _CAPTURER


def hook_factory(config: dict[str, Any]) -> Hook | None:
    """SGLang ``hook_factory``: ``config = {"role": <role>, "capture": CaptureSettings.to_config()}``.

    Returns None (no hook) on ranks that do not hold full hidden states.
    """
    settings = CaptureSettings.from_config(config["capture"])
    role = config["role"]
    if role not in settings.roles():
        raise ValueError(f"layertap: role {role!r} is not one of {settings.roles()}")
    if not _is_writer_rank():
        logger.info("layertap: not the writer rank, no %s hook here", role)
        return None
    capturer = _capturer(settings)
    from_logits_input = role == FINAL_TENSORS["post"]
    allow_unreduced = settings.allreduce_fusion == "sglang"

    def hook(module: torch.nn.Module, inputs: tuple[Any, ...], output: Any) -> None:
        rows = (
            (lambda: inputs[1]) if from_logits_input else (lambda: _layer_rows(output, allow_unreduced=allow_unreduced))
        )
        capturer.take(role, _forward_batch(inputs), rows)

    return hook


_register_cpu_mla_handler()
