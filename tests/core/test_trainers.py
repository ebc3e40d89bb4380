"""The hand-off to the trainers through the command line: what is refused, and what TRAIN.md tells them."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from layertap.errors import SpecError
from layertap.spec import ExtractionSpec
from layertap.verify import verify_store
from tests.core.datasets import conversation_rows, write_jsonl


def extract(model: Path, data: Path, out: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "layertap", "extract", "--model", str(model), "--data", str(data), "--out", str(out),
         *args],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip


@pytest.fixture
def data(tmp_path: Path) -> Path:
    return write_jsonl(tmp_path / "data.jsonl", conversation_rows(12, seed=9))


def test_a_2_aux_specforge_extraction_is_refused_before_any_work_unless_overridden(tiny_llama, data, tmp_path) -> None:
    out = tmp_path / "out"
    refused = extract(tiny_llama, data, out, "--format", "specforge", "--layers", "1,3")
    assert refused.returncode == 2, refused.stderr[-2000:]
    message = " ".join(refused.stderr.split())
    assert "SpecForge 0.2.0's EAGLE-3 draft takes exactly 3" in message and "Linear(3 * hidden, hidden)" in message
    assert "2 aux layers (capture indices [1, 3])" in message and "--allow-any-aux-layers" in message
    assert not out.exists()  # nothing was created, not even the folder
    # Counted after conversion: vLLM's id 6 (= num_layers) is the final state, not an aux layer.
    with pytest.raises(SpecError, match="exactly 3"):
        ExtractionSpec(model=tiny_llama, data=data, layers=(1, 3, 6), layer_convention="vllm").resolve(6)
    assert ExtractionSpec(model=tiny_llama, data=data, layers=(1, 3), format="speculators").resolve(6).layers == (1, 3)

    # A user of a modified trainer says so; the run goes through and TRAIN.md warns.
    allowed = extract(tiny_llama, data, out, "--format", "specforge", "--layers", "1,3", "--allow-any-aux-layers")
    assert allowed.returncode == 0, allowed.stderr[-2000:]
    assert verify_store(out).ok
    guide = (out / "TRAIN.md").read_text()
    assert "**Warning**: 2 aux layers" in guide and "aux_hidden_state_layer_ids: [0, 2]" in guide
    assert guide in allowed.stdout  # printed at the end of the run


def _printed_ids(text: str) -> list[int]:
    [ids] = re.findall(r"--target-layer-ids ([\d ]+)", text)
    return [int(i) for i in ids.split()]


@pytest.mark.parametrize(
    ("convention", "given"), [("capture", "1,3,5"), ("sglang-eagle3", "0,2,4"), ("vllm", "1,3,5,6")]
)
def test_speculators_layer_ids_printed_equal_the_manifest_under_each_convention(
    tiny_llama, data, tmp_path, convention, given
) -> None:
    out = tmp_path / "out"
    run = extract(tiny_llama, data, out, "--format", "speculators", "--layer-convention", convention, "--layers", given)
    assert run.returncode == 0, run.stderr[-2000:]
    manifest = json.loads((out / "manifest.json").read_text())
    # The same three layers whatever the convention: the inputs of decoder layers 1, 3 and 5.
    assert manifest["capture_indices"] == [1, 3, 5] and manifest["layer_convention"] == convention
    assert _printed_ids(run.stdout) == manifest["capture_indices"]
    assert (
        f"--verifier-name-or-path {tiny_llama.resolve()}" in run.stdout and f"--data-path {out.resolve()}" in run.stdout
    )

    verified = subprocess.run([sys.executable, "-m", "layertap", "verify", str(out)], capture_output=True, text=True)
    assert verified.returncode == 0, verified.stderr[-2000:]
    assert _printed_ids(verified.stdout) == manifest["capture_indices"]
    assert (out / "TRAIN.md").read_text() in verified.stdout


def test_train_md_gives_specforge_a_draft_config_that_names_the_served_aux_layers(tiny_llama, data, tmp_path) -> None:
    """SpecForge 0.2.0 writes no draft config and SGLang serves the drafter's aux layers from its draft config's
    eagle_config alone (its default otherwise): TRAIN.md's draft config, which training and the export both take,
    carries the SGLang ids (capture index - 1) and caps the draft vocabulary at the target's."""
    out = tmp_path / "out"
    done = extract(tiny_llama, data, out, "--format", "specforge", "--layers", "1,3,4")
    assert done.returncode == 0, done.stderr[-2000:]
    guide = (out / "TRAIN.md").read_text()
    [draft] = re.findall(r"```json\n(.*?)```", guide, flags=re.S)
    draft = json.loads(draft)
    target = json.loads((tiny_llama / "config.json").read_text())
    assert draft["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [0, 2, 3]}
    assert draft["architectures"] == ["LlamaForCausalLMEagle3"] and draft["num_hidden_layers"] == 1
    assert draft["vocab_size"] == target["vocab_size"] == draft["draft_vocab_size"]  # 1536 < 32000
    assert draft["hidden_size"] == target["hidden_size"]
    assert "  draft_model_config: draft.json" in guide
    assert "specforge export --to sglang --checkpoint OUTPUT_DIR --draft-config draft.json" in guide
