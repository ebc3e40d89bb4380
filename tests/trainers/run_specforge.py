"""Run ``specforge train`` (SpecForge 0.2.0's own CLI, argv as given) on the CPU, in the trainers' venv.

Its offline reader, normalizer, collator, draft model, target head, TTT step and optimizer all run as
shipped. One bypass, the smallest that lets it run without a GPU: its EAGLE-3 loss ``LogSoftmaxLoss`` is a
Triton GPU kernel, and its module (``specforge.core.loss``) imports ``triton``, which has no CPU backend.
That module alone is imported with a stand-in ``triton`` (its decorators return what they decorate; no
kernel is ever launched) and with ``torch.compile`` as the identity, and ``LogSoftmaxLoss.apply`` becomes
the same module's reference implementation ``_compute_loss``, run eagerly (SpecForge's own loss benchmark
compares the two as equals).
"""

import sys
import types

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

sys.argv = ["specforge", *sys.argv[1:]]
sys.exit(main())
