"""The trainers' own EAGLE-3 code trains on layertap's output, run as its TRAIN.md says, on the CPU.

SpecForge 0.2.0 and speculators 0.9.0 live in their own venv (scripts/setup_trainers.sh; they pin
torch/transformers of their own) and run as subprocesses through their own CLIs: their data loaders read
the tiny outputs made here, their draft models and losses take optimizer steps, and the loss must be finite
and fall. Where their code is bound to a GPU, `run_specforge.py` / `run_speculators.py` beside this file
bypass it in the smallest way and say how. Test-only settings (fewer steps, a smaller draft vocabulary,
CPU-capable attention and loss implementations, DDP instead of FSDP) are added to what TRAIN.md gives;
nothing TRAIN.md says is taken out.
"""

from __future__ import annotations

import ast
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from safetensors import safe_open

from layertap.models import ModelFolder
from layertap.pipeline import run_extraction
from layertap.spec import ExtractionSpec
from layertap.store.index import read_json_lines
from layertap.tiny import build_tiny_model
from tests.core.datasets import conversation_rows, write_jsonl
from tests.core.trainer_reads import token_freq_file
from tests.hf_engines import cpu_hf

HERE = Path(__file__).parent
EPOCHS = 3
DRAFT_VOCAB = 64  # smaller than the tiny target's 1536: the draft vocabulary comes from token_freq.pt

pytestmark = pytest.mark.trainers


@pytest.fixture(scope="module")
def kimi25(tmp_path_factory) -> Path:
    """The tiny Kimi-K2.5 wrapper with a vocabulary past SpecForge's 32000-token draft vocabulary, as the real
    one's (163,840): SpecForge generates its draft config from the language model, as it would for Kimi-K2.5. As
    released (INT4 routed experts): what a trainer reads of the folder (config, tokenizer, embedding and LM head,
    which stay bf16) is the same in a bf16 folder, and training on both cost a CI run ~3 minutes."""
    return build_tiny_model("kimi-k2.5", tmp_path_factory.mktemp("kimi25-32k"), vocab_size=32768, quantize="int4")


def _extract(
    model: Path, tmp_path: Path, fmt: str, samples: int, layers: tuple[int, ...] = (1, 3, 5), dtype: str = "bfloat16"
) -> Path:
    data = write_jsonl(tmp_path / f"{fmt}.jsonl", conversation_rows(samples, seed=21, max_words=25))
    out = tmp_path / f"states-{fmt}-{dtype}"
    remote = bool(ModelFolder.read(model).remote_code)
    spec = ExtractionSpec(
        model=model, data=data, layers=layers, format=fmt, store_dtype=dtype, trust_remote_code=remote
    )  # type: ignore[arg-type]
    run_extraction(spec, out, cpu_hf(batch_tokens=4096))
    return out


def _block(guide: str, lang: str) -> str:
    [block] = re.findall(rf"```{lang}\n(.*?)```", guide, flags=re.S)
    return block


def _train(python: Path, script: str, args: list[str], cwd: Path) -> str:
    env = {**os.environ, "COLUMNS": "400", "PYTHONUNBUFFERED": "1"}  # one rich log record per line
    run = subprocess.run([str(python), str(HERE / script), *args], cwd=cwd, env=env, capture_output=True,
                         text=True, timeout=900)  # fmt: skip
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-6000:]
    return output


def _falls(losses: list[float], per_epoch: int) -> None:
    assert losses and all(math.isfinite(x) for x in losses), losses
    first, last = losses[:per_epoch], losses[-per_epoch:]
    assert sum(last) / len(last) < sum(first) / len(first), losses


def _specforge_run(out: Path, tmp_path: Path) -> tuple[dict, Path]:
    """TRAIN.md's SpecForge config with the test-only settings added, saved beside TRAIN.md's draft config (as
    draft.json); returns (config, its path)."""
    guide = (out / "TRAIN.md").read_text()
    config = yaml.safe_load(_block(guide, "yaml"))
    assert config["data"]["hidden_states_path"] == str(out.resolve())
    assert config["model"]["draft_model_config"] == "draft.json"
    (tmp_path / "draft.json").write_text(_block(guide, "json"))
    # SpecForge's target head finds the LM head through `*.index.json` (TRAIN.md says so); a tiny model of one
    # model.safetensors gets an index in a copy (a sharded one, as the INT4 folder, has its own).
    target = tmp_path / "target"
    shutil.copytree(config["model"]["target_model_path"], target)
    if not (target / "model.safetensors.index.json").exists():
        with safe_open(str(target / "model.safetensors"), "pt") as f:
            weight_map = dict.fromkeys(f.keys(), "model.safetensors")
        (target / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config["model"]["target_model_path"] = str(target)
    config["training"] |= {"num_epochs": EPOCHS, "log_interval": 1, "learning_rate": 3e-3,
                           "fsdp_sharding": "NO_SHARD",  # DDP: FSDP refuses to run without an accelerator
                           "attention_backend": "sdpa"}  # fmt: skip
    config["output_dir"] = str(tmp_path / "specforge-run")
    config["data"]["cache_dir"] = str(tmp_path / "specforge-cache")
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    return config, tmp_path / "run.yaml"


def test_specforge_trains_on_a_specforge_output_as_train_md_says(trainers_python, tiny_llama, tmp_path) -> None:
    samples = 6
    config, path = _specforge_run(_extract(tiny_llama, tmp_path, "specforge", samples), tmp_path)
    assert config["model"]["aux_hidden_state_layer_ids"] == [0, 2, 4]  # SGLang ids of capture indices 1, 3, 5

    output = _train(trainers_python, "run_specforge.py", ["train", "--config", str(path)], tmp_path)
    steps = _specforge_steps(output)
    assert len(steps) == EPOCHS * samples, output[-3000:]  # one sample per step: every file read each epoch
    _falls([s["loss"] for s in steps], samples)


def test_stock_specforge_cannot_train_on_2_aux_layers_which_layertap_refuses(
    trainers_python, tiny_llama, tmp_path
) -> None:
    data = write_jsonl(tmp_path / "two.jsonl", conversation_rows(3, seed=22))
    out = tmp_path / "states-two"
    spec = ExtractionSpec(model=tiny_llama, data=data, layers=(1, 3), allow_any_aux_layers=True)
    run_extraction(spec, out, cpu_hf(batch_tokens=4096))
    _, path = _specforge_run(out, tmp_path)
    run = subprocess.run([str(trainers_python), str(HERE / "run_specforge.py"), "train", "--config", str(path)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=900)  # fmt: skip
    assert run.returncode != 0 and "must contain exactly three" in run.stdout + run.stderr, run.stderr[-3000:]


@pytest.mark.parametrize("dtype", ["bfloat16", "fp8"])
def test_speculators_trains_on_a_speculators_output_as_train_md_says(
    trainers_python, tiny_llama, tmp_path, dtype
) -> None:
    out = _extract(tiny_llama, tmp_path, "speculators", 20, dtype=dtype)
    command = shlex.split(_block((out / "TRAIN.md").read_text(), "bash").replace("\\\n", " "))
    assert command[:2] == ["speculators", "train"]
    ids = command[command.index("--target-layer-ids") + 1 : command.index("--target-layer-ids") + 4]
    assert ids == ["1", "3", "5"]  # vLLM ids = capture indices
    if dtype == "fp8":  # read through hs-connectors' FP8Transfer, dequantized to the dtype it trains in
        assert command[command.index("--hidden-states-backend") + 1] == "fp8"
        assert command[command.index("--hidden-states-dtype") + 1] == "bfloat16"

    extra = ["--draft-vocab-size", str(DRAFT_VOCAB), "--epochs", str(EPOCHS), "--total-seq-len", "512",
             "--num-workers", "0", "--lr", "3e-3", "--save-path", str(tmp_path / "speculators-run"),
             "--draft-attn-impl", "sdpa",  # flex attention has no backward on the CPU
             "--loss-implementation", "eager"]  # the fused loss needs Triton  # fmt: skip
    output = _train(trainers_python, "run_speculators.py", [*command[1:], *extra], tmp_path)

    # Its draft vocabulary came from our token_freq.pt: every token that occurs under the loss mask is in it.
    freq = token_freq_file(out)
    assert len(freq) <= DRAFT_VOCAB
    d2t = np.load(out / f"d2t-{DRAFT_VOCAB}.npy")
    assert set(freq) <= set((d2t + np.arange(DRAFT_VOCAB)).tolist())
    train = [float(x) for x in re.findall(r"train/loss=([-+.\de]+)", output)]
    val = [float(x) for x in re.findall(r"val/loss_epoch=([-+.\de]+)", output)]
    assert len(val) == EPOCHS and train, output[-3000:]
    assert all(math.isfinite(x) for x in train)
    _falls(val, 1)  # the same held-out samples after each epoch


def _specforge_steps(output: str) -> list[dict]:
    return [ast.literal_eval(m) for m in re.findall(r"^step \d+: (\{.*\})$", output, flags=re.M)]


def test_specforge_trains_on_a_kimi25_store_as_train_md_says(trainers_python, kimi25, tmp_path) -> None:
    """The wrapper as it is: TRAIN.md names its tensors and allows its config code; SpecForge generates the draft
    from `text_config` (32000-token draft vocabulary) and maps it from the same loss-masked tokens as token_freq.pt."""
    samples = 6
    out = _extract(kimi25, tmp_path, "specforge", samples, layers=(1, 2, 4))
    config, path = _specforge_run(out, tmp_path)
    assert config["model"]["embedding_key"] == "language_model.model.embed_tokens.weight"
    assert config["model"]["lm_head_key"] == "language_model.lm_head.weight" and config["model"]["trust_remote_code"]

    output = _train(trainers_python, "run_specforge.py", ["train", "--config", str(path)], tmp_path)
    steps = _specforge_steps(output)
    assert len(steps) == EPOCHS * samples, output[-3000:]
    _falls([s["loss"] for s in steps], samples)
    # Its draft vocabulary: every token under the loss mask (token_freq.pt's keys) and zero-count fillers.
    [mapping] = (tmp_path / "specforge-cache" / "vocab_mapping").glob("*.pt")
    d2t = torch.load(mapping)["d2t"]
    assert len(d2t) == 32000 and set(token_freq_file(out)) <= set((d2t + torch.arange(len(d2t))).tolist())


def test_speculators_trains_on_a_kimi25_store_as_train_md_says(trainers_python, kimi25, tmp_path) -> None:
    """speculators cannot take the wrapper (it reads the verifier's config without remote code): TRAIN.md makes
    the text-only view with `layertap text-view` and trains against it."""
    out = _extract(kimi25, tmp_path, "speculators", 20, layers=(1, 2, 4))
    block = _block((out / "TRAIN.md").read_text(), "bash").replace("\\\n", " ")
    view_line, train_line = block.strip().splitlines()
    view = shlex.split(view_line)
    assert view[:2] == ["layertap", "text-view"] and view[2] == str(kimi25)
    made = subprocess.run([sys.executable, "-m", "layertap", *view[1:]], capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    command = shlex.split(train_line)
    assert command[:2] == ["speculators", "train"] and "--trust-remote-code" in command
    assert command[command.index("--verifier-name-or-path") + 1] == view[3]

    extra = ["--draft-vocab-size", str(DRAFT_VOCAB), "--epochs", str(EPOCHS), "--total-seq-len", "512",
             "--num-workers", "0", "--lr", "3e-3", "--save-path", str(tmp_path / "speculators-run"),
             "--draft-attn-impl", "sdpa", "--loss-implementation", "eager"]  # fmt: skip
    output = _train(trainers_python, "run_speculators.py", [*command[1:], *extra], tmp_path)
    freq = token_freq_file(out)
    d2t = np.load(out / f"d2t-{DRAFT_VOCAB}.npy")
    assert set(freq) <= set((d2t + np.arange(DRAFT_VOCAB)).tolist())
    val = [float(x) for x in re.findall(r"val/loss_epoch=([-+.\de]+)", output)]
    assert len(val) == EPOCHS, output[-3000:]
    _falls(val, 1)


def test_hs_connectors_fp8_reader_loads_every_file_of_an_fp8_store(trainers_python, tiny_llama, tmp_path) -> None:
    """Their `FP8Transfer` dequantizes every file within FP8's rounding of the float32 states of the same run, and
    their own quantizer, applied state by state, gives exactly the files' bytes and scales ([T, k+1, 1])."""
    fp8 = _extract(tiny_llama, tmp_path, "speculators", 12, dtype="fp8")
    ref = _extract(tiny_llama, tmp_path, "speculators", 12, dtype="float32")
    run = subprocess.run([str(trainers_python), str(HERE / "read_fp8.py"), str(fp8), str(ref)], capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    assert summary["files"] == 12 and summary["tokens"] == sum(r["num_tokens"]
           for log in (fp8 / "index").glob("*.jsonl") for r in read_json_lines(log))  # fmt: skip
    assert summary["keys"] == ["hidden_states", "token_ids"] and summary["dtype"] == "torch.bfloat16"
    assert summary["bytes_equal"], summary
    assert 0 < summary["worst_over_bound"] <= 1, summary
