"""Kimi-K2.5's folder through `layertap extract` with the HF engine: states equal HF float32 in both formats;
without --trust-remote-code the run stops before writing anything, naming the flag and the file."""

import subprocess
from pathlib import Path

import pytest

from layertap.models.folder import ModelFolder
from layertap.store.store import OutputStore
from layertap.verify import verify_store
from tests.core.engines.test_hf_engine import max_rel_err

DATA = Path(__file__).resolve().parents[1] / "assets" / "datasets" / "kimi_chats.jsonl"
LAYERS = (1, 2, 4)  # first and last legal index; 2 is the output of the first MoE layer
REL_TOL = 1e-4


def extract(cli, model: Path, out: Path, *args: str) -> subprocess.CompletedProcess:
    """``layertap extract`` of the Kimi chats into ``out`` through ``cli`` (the ``layertap_cli`` fixture)."""
    return cli("extract", "--model", model, "--data", DATA, "--layers", ",".join(map(str, LAYERS)), "--out", out,
               "--store-dtype", "float32", *args, timeout=900)  # fmt: skip


def check_states_equal_hf(out: Path, model: Path, hf_reference) -> int:
    """Every stored state of every sample (at the store's capture indices) vs the independent HF float32 reference;
    returns samples checked."""
    store = OutputStore.open_existing(out)
    layers = store.manifest.capture_indices
    ref = hf_reference(model)
    num_layers = ModelFolder.read(model).num_layers
    for rec in store.records().values():
        tensors = store.format.load(out / rec.file)
        if store.manifest.format == "specforge":
            ids, hidden_size = tensors["input_ids"], tensors["hidden_state"].shape[-1]
            aux = tensors["aux_hidden_state"][0].unflatten(-1, (len(layers), hidden_size))
            final, which = tensors["hidden_state"][0], "post"
        else:
            ids, states = tensors["token_ids"], tensors["hidden_states"]
            aux, final, which = states[:, : len(layers)], states[:, len(layers)], "pre"
        hidden, pre = ref.states(ids)
        for j, layer in enumerate(layers):
            assert max_rel_err(aux[:, j], hidden[layer]) < REL_TOL, (rec.sample_id, layer)
            assert max_rel_err(aux[:, j], hidden[layer + 1]) > 1e-2  # a capture one layer off could not pass
        assert max_rel_err(final, hidden[num_layers] if which == "post" else pre) < REL_TOL
    return len(store.records())


@pytest.mark.parametrize("fmt", ["specforge", "speculators"])
def test_hf_engine_extracts_the_wrapper_equal_to_hf(layertap_cli, tiny_kimi25, tmp_path, hf_reference, fmt) -> None:
    out = tmp_path / "out"
    cli = extract(layertap_cli, tiny_kimi25, out, "--format", fmt, "--trust-remote-code")
    assert cli.returncode == 0, cli.stderr[-3000:]
    check = verify_store(out)
    assert check.ok, check.problems
    assert check_states_equal_hf(out, tiny_kimi25, hf_reference) == 6
    manifest = OutputStore.open_existing(out).manifest
    assert (manifest.num_layers, manifest.hidden_size, manifest.compute_dtype) == (5, 64, "float32")


def test_without_trust_remote_code_the_run_stops_and_writes_nothing(layertap_cli, tiny_kimi25, tmp_path) -> None:
    out = tmp_path / "out"
    cli = extract(layertap_cli, tiny_kimi25, out)
    assert cli.returncode == 2
    message = " ".join(cli.stderr.split())
    assert "--trust-remote-code" in message and "tokenization_tiny_kimi.py" in message
    assert not out.exists()
