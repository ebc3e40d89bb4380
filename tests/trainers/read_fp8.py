"""Read an FP8 speculators store with hs-connectors 0.9.0's own code, in the trainers' venv; print a JSON summary.

``python read_fp8.py FP8_STORE REFERENCE_STORE`` where REFERENCE_STORE is a float32 speculators store of the same
run (the states the FP8 ones were quantized from). For every ``hidden_states/hs_<i>.safetensors``:
- ``FP8Transfer`` (what ``speculators train --hidden-states-backend fp8`` reads through) loads it and hands back
  bf16 ``hidden_states`` [T, k+1, H] and no scales: its values must lie within FP8's rounding of the reference
  (half a step of e4m3's 3-bit mantissa, relative, or half a subnormal step, plus bf16's rounding);
- hs-connectors' own quantizer (``quantize_tensor_to_fp8``), applied to each reference state on its own (one
  scale per token and state), must give exactly the file's bytes and scales.
Nothing here imports layertap.
"""

import json
import sys
from pathlib import Path

import torch
from hs_connectors import FP8Transfer
from hs_connectors.fp8_utils import SCALES_KEY, quantize_tensor_to_fp8
from safetensors.torch import load_file

fp8_root, ref_root = Path(sys.argv[1]), Path(sys.argv[2])
transfer = FP8Transfer(fp8_root / "hidden_states")
files = sorted((fp8_root / "hidden_states").glob("hs_*.safetensors"), key=lambda p: int(p.stem[3:]))
summary = {"files": 0, "tokens": 0, "worst_over_bound": 0.0, "bytes_equal": True, "keys": None, "dtype": None}
for path in files:
    i = int(path.stem[3:])
    raw = load_file(path)
    ref = load_file(ref_root / "hidden_states" / path.name)["hidden_states"]  # float32 [T, k+1, H]
    read = transfer.get_cached(i)
    states = read["hidden_states"]
    summary["keys"], summary["dtype"] = sorted(read), str(states.dtype)
    assert states.shape == ref.shape, (path.name, states.shape, ref.shape)
    assert torch.equal(read["token_ids"], raw["token_ids"])
    scale = raw[SCALES_KEY]
    # e4m3 rounds to half a step: 2^-4 relative (3 mantissa bits), or 2^-10 x scale among its subnormals; bf16
    # rounds the scale and the product: 2^-9 relative each. The bound allows that and a little more, no more.
    bound = ref.abs() * (2**-4 + 2**-7) + scale * 2**-9
    summary["worst_over_bound"] = max(summary["worst_over_bound"], float(((states.float() - ref).abs() / bound).max()))
    for j in range(ref.shape[1]):
        theirs, their_scale = quantize_tensor_to_fp8(ref[:, j : j + 1])
        same = torch.equal(theirs.view(torch.uint8), raw["hidden_states"][:, j : j + 1].view(torch.uint8))
        summary["bytes_equal"] &= same and torch.equal(their_scale, scale[:, j : j + 1])
    summary["files"] += 1
    summary["tokens"] += int(ref.shape[0])
print(json.dumps(summary))
