"""Run ``speculators train`` (speculators 0.9.0's own CLI, argv as given) on the CPU, in the trainers' venv.

Three bypasses, the smallest that let its trainer run without an accelerator:
- ``Trainer`` moves the model and every batch to ``get_local_rank()`` (an accelerator index, 0): its
  module's ``get_local_rank`` answers the "cpu" device instead.
- ``Trainer`` autocasts on ``"cuda"`` when no accelerator is found (autocast then silently disables, and bf16
  batches meet fp32 weights): autocast on the CPU instead, in the same dtype.
- Its step timer calls ``torch.accelerator.synchronize()``, which raises without an accelerator: on the CPU
  there is nothing to wait for, so it returns at once.
"""

import sys

import torch
from speculators.__main__ import app
from speculators.train import trainer

trainer.get_local_rank = lambda: "cpu"
torch.accelerator.synchronize = lambda device=None: None
_init = trainer.Trainer.__init__


def _cpu_init(self, *args, **kwargs):
    _init(self, *args, **kwargs)
    self.device_type = "cpu"


trainer.Trainer.__init__ = _cpu_init
sys.exit(app(sys.argv[1:], standalone_mode=False) or 0)
