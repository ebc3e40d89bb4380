"""Run ``speculators train`` (speculators 0.9.0's own CLI, argv as given) on the CPU, in the trainers' venv.

Three bypasses, the smallest that let its trainer run without an accelerator:
- ``Trainer`` moves the model and every batch to ``get_local_rank()`` (an accelerator index, 0): its
  module's ``get_local_rank`` answers the "cpu" device instead.
- ``Trainer`` autocasts on ``"cuda"`` when no accelerator is found (autocast then silently disables, and bf16
  batches meet fp32 weights): autocast on the CPU instead, in the same dtype.
- Its step timer calls ``torch.accelerator.synchronize()``, which raises without an accelerator: on the CPU
  there is nothing to wait for, so it returns at once.

``run_speculators.py --stream REDIS_URL NAME MASTER STEPS train ...``: fed from layertap's stream instead of the
``--data-path`` store's files. Its CLI's ``create_train_val_loaders`` (an index-sampled Arrow dataset) becomes a
DataLoader over `StreamDataset` (STEPS samples, one a step: each acked when the next is asked for), each sample as
its dataset item (`speculators_item`), collated by its own ``CollateFn`` with the model's own preprocessing; no
validation loader. After training it prints ``stream-check {json}``: which keys of each item fed equal the item its
own ``ArrowDataset`` reads from the ``--data-path`` store for the same tokens.
"""

import json
import sys

import torch
from speculators.__main__ import app
from speculators.train import cli, trainer

trainer.get_local_rank = lambda: "cpu"
torch.accelerator.synchronize = lambda device=None: None
_init = trainer.Trainer.__init__


def _cpu_init(self, *args, **kwargs):
    _init(self, *args, **kwargs)
    self.device_type = "cpu"


trainer.Trainer.__init__ = _cpu_init


def from_stream(redis_url: str, name: str, master: str, steps: int, fed: list) -> None:
    """The CLI's loaders read the stream; what they feed is kept in ``fed``."""
    from speculators.train.data import CollateFn
    from torch.utils.data import DataLoader

    from layertap.stream.consumer import StreamDataset
    from layertap.stream.trainers import speculators_item

    def loaders(*, total_seq_len, hidden_states_dtype, hidden_size, num_target_layers, preprocess, **_):
        collate = CollateFn(total_seq_len, hidden_size, num_target_layers=num_target_layers, dtype=hidden_states_dtype,
                            preprocess=preprocess)  # fmt: skip

        def feed(samples: list) -> dict:
            fed.extend(map(speculators_item, samples))
            return collate(fed[-len(samples) :])

        return DataLoader(StreamDataset(redis_url, name, master=master, limit=steps), batch_size=1,
                          collate_fn=feed), None  # fmt: skip

    cli.create_train_val_loaders = loaders


def check(fed: list, data_path: str) -> list[dict]:
    from speculators.train.data import ArrowDataset

    files = ArrowDataset(max_len=1 << 20, datapath=data_path, on_missing="raise", train_ratio=1.0)
    index = {bytes(row["input_ids"].numpy()): i for i, row in enumerate(files.data)}
    out = []
    for item in fed:
        theirs = files[index[bytes(item["input_ids"].numpy())]]
        equal = [k for k in theirs if item[k].dtype == theirs[k].dtype and torch.equal(item[k], theirs[k])]
        out.append({"tokens": len(item["input_ids"]), "keys": sorted(theirs), "equal": sorted(equal)})
    return out


if sys.argv[1] == "--stream":
    fed: list = []
    from_stream(*sys.argv[2:5], int(sys.argv[5]), fed)
    del sys.argv[1:6]
    rc = app(sys.argv[1:], standalone_mode=False) or 0
    print("stream-check " + json.dumps(check(fed, sys.argv[sys.argv.index("--data-path") + 1])), flush=True)
    sys.exit(rc)
sys.exit(app(sys.argv[1:], standalone_mode=False) or 0)
