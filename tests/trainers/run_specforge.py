"""Run ``specforge train`` (SpecForge 0.2.0's own CLI, argv as given) on the CPU, in the trainers' venv.

Its offline reader, normalizer, collator, draft model, target head, TTT step and optimizer all run as
shipped. One bypass, the smallest that lets it run without a GPU: its EAGLE-3 loss ``LogSoftmaxLoss`` is a
Triton GPU kernel, and its module (``specforge.core.loss``) imports ``triton``, which has no CPU backend.
That module alone is imported with a stand-in ``triton`` (its decorators return what they decorate; no
kernel is ever launched) and with ``torch.compile`` as the identity, and ``LogSoftmaxLoss.apply`` becomes
the same module's reference implementation ``_compute_loss``, run eagerly (SpecForge's own loss benchmark
compares the two as equals). The draft model's other ``torch.compile``'d functions run eagerly too
(``TORCH_COMPILE_DISABLE``, set before torch is imported): inductor's CPU build of them is no part of what a CPU
run checks, and cold it took 37 s of an 8-step training.

``run_specforge.py --stream REDIS_URL NAME MASTER STEPS TARGET train ...``: fed from layertap's stream instead of
``data.hidden_states_path``'s files. SpecForge's offline trainer takes a fixed list of sample refs, so its
``build_offline_runtime`` becomes its own disaggregated consumer's (``build_disagg_offline_runtime``: "trains from a
caller-supplied feature store"), given STEPS samples read with `AckAfterStep`, each as the offline features
`specforge_features` makes with TARGET's final norm, in its own ``LocalFeatureStore``. Each sample is acked only
after the optimizer step that consumed it: the trainer's ``ack_fn`` (SpecForge's own hook at each optimizer-step
boundary, which its offline runtime leaves unset) acks the step's samples and prints ``stream-ack {json}`` (the step,
its samples, how many were pending with this consumer just before). It prints ``stream-check {json}``: each sample
against the file of the same tokens under ``data.hidden_states_path`` (SpecForge's own loader): which tensors are
equal, and the final state's largest difference relative to its scale.
"""

import atexit
import json
import os
import sys
import types
from pathlib import Path

os.environ["TORCH_COMPILE_DISABLE"] = "1"  # read when torch's compiler config is first imported

import torch


class _Triton(types.ModuleType):
    """Enough of ``triton`` for ``specforge.core.loss`` to import: decorators return what they decorate."""

    def __getattr__(self, name: str):
        return lambda *args, **kwargs: args[0] if args and callable(args[0]) else None


compile_ = torch.compile
torch.compile = lambda *args, **kwargs: args[0] if args and callable(args[0]) else (lambda fn: fn)
sys.modules["triton"] = _Triton("triton")
sys.modules["triton.language"] = sys.modules["triton"].language = _Triton("triton.language")
from specforge.core import loss  # noqa: E402

del sys.modules["triton"], sys.modules["triton.language"]
torch.compile = compile_
loss.LogSoftmaxLoss.apply = loss._compute_loss

from specforge.cli import main  # noqa: E402


def from_stream(redis_url: str, name: str, master: str, steps: int, target: Path):
    """``build_offline_runtime`` with the stream's samples for the files."""
    from specforge import launch
    from specforge.runtime.data_plane.feature_store import LocalFeatureStore
    from specforge.runtime.data_plane.offline_reader import list_feature_files

    from layertap.stream.consumer import StreamConsumer
    from layertap.stream.trainers import AckAfterStep, final_norm, specforge_features

    consumer = StreamConsumer(redis_url, name, master=master)
    atexit.register(consumer.close)
    held = AckAfterStep(consumer)

    def ack_after_step(ids: list[str], step: int) -> None:
        pending = consumer.redis.xpending(consumer.stream, consumer.group)["pending"]
        print("stream-ack " + json.dumps({"step": step, "samples": ids, "pending": pending}), flush=True)
        held.ack(ids, step)

    def build(*, hidden_states_path: str, **kwargs):
        norm, store = final_norm(target), LocalFeatureStore(kwargs["run_id"])
        samples = {sid: specforge_features(s, norm) for sid, s in held.take(steps).items()}
        meta = {"run_id": kwargs["run_id"], "strategy": "eagle3", "target_repr": "hidden_state",
                "ttt_length": kwargs["ttt_length"], "max_len": kwargs["max_len"]}  # fmt: skip
        refs = [store.put(s, sample_id=sid, metadata={**meta, "num_tokens": len(s["input_ids"])})
                for sid, s in samples.items()]  # fmt: skip
        print("stream-check " + json.dumps(check(list(samples.values()), list_feature_files(hidden_states_path))),
              flush=True)  # fmt: skip
        runtime = launch.build_disagg_offline_runtime(feature_store=store, refs=refs, **kwargs)
        runtime._controller.ack_fn = ack_after_step  # SpecForge's hook after each optimizer step (None offline)
        return runtime

    launch.build_offline_runtime = build


def check(samples: list[dict], paths: list[str]) -> list[dict]:
    """Each sample against the file of the same tokens among ``paths``, as SpecForge's own loader reads it."""
    from specforge.runtime.data_plane.feature_store import load_feature_file

    files = {bytes(f["input_ids"].numpy()): f for f in map(load_feature_file, paths)}
    out = []
    for s in samples:
        f = files[bytes(s["input_ids"].numpy())]
        keys = ("input_ids", "loss_mask", "aux_hidden_state")
        equal = [k for k in keys if s[k].dtype == f[k].dtype and torch.equal(s[k], f[k])]
        final = (s["hidden_state"].float() - f["hidden_state"].float()).abs().max() / f["hidden_state"].abs().max()
        out.append({"tokens": len(s["input_ids"]), "equal": equal, "final_rel_diff": float(final)})
    return out


if sys.argv[1] == "--stream":
    redis_url, name, master, steps, target = sys.argv[2:7]
    from_stream(redis_url, name, master, int(steps), Path(target))
    del sys.argv[1:7]
sys.argv = ["specforge", *sys.argv[1:]]
sys.exit(main())
