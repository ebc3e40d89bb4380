"""Kimi-K2.5's folder through `layertap extract --engine sglang` on real CPU servers running SGLang's own
`kimi_k25` class: hooks on `language_model.model.layers.N`, every state equal to HF float32 in both formats,
and a launched server computing in the folder's own dtype (float32 here) without being told; the folder's
processor loaded as SGLang loads it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.sglang import CPU_SERVER_ARGS, cpu_server_env
from layertap.store.store import OutputStore
from layertap.tiny import build_tiny_model
from layertap.verify import verify_store
from tests.core.test_kimi_k25_run import LAYERS, check_states_equal_hf, extract
from tests.sglang_fixtures import CHUNKED_PREFILL_SIZE

pytestmark = pytest.mark.sglang
WRAPPED_HOOK = "Registered forward hook 'layertap-aux:1' on language_model.model.layers.0"
MEDIA_KEYS = ("patch_size", "merge_kernel_size", "in_patch_limit", "patch_limit_on_one_side", "image_mean", "image_std")

# What SGLang 0.5.14's Kimi-K2.5 multimodal processor does at start-up, even with --skip-tokenizer-init:
# sglang's own get_processor, the <|media_pad|> special tokens built against it, then the media settings it
# reads from `media_processor.media_proc_cfg` (and the `image_processor` and `tokenizer` it wraps).
LOAD_LIKE_SGLANG = """
import json, re, sys
from sglang.srt.multimodal.processors.base_processor import MultimodalSpecialTokens
from sglang.srt.utils.hf_transformers_utils import get_processor, get_tokenizer_from_processor
folder, keys = sys.argv[1], sys.argv[2].split(",")
config = json.load(open(folder + "/config.json"))
processor = get_processor(folder, trust_remote_code=True)
tokens = MultimodalSpecialTokens(image_token="<|media_pad|>", image_token_id=config["media_placeholder_token_id"],
                                 image_token_regex=re.compile(r"(?:<\\|media_pad\\|>)+")).build(processor)
cfg = processor.media_processor.media_proc_cfg
print(json.dumps({"class": type(processor).__name__, "media": {k: cfg[k] for k in keys},
                  "fixed_output_tokens": cfg.get("fixed_output_tokens"),
                  "image_processor": type(processor.image_processor).__name__,
                  "tokenizer": type(get_tokenizer_from_processor(processor)).__name__,
                  "media_pad_id": processor.tokenizer.convert_tokens_to_ids(tokens.image_token)}))
"""


def test_sglang_loads_the_folders_processor_with_media_settings(tiny_kimi25, cuda_stub_dir, sglang_python) -> None:
    """Without a processor in the folder, AutoProcessor returns the bare tokenizer and SGLang 0.5.14 dies at
    start-up reading `media_processor`; the settings must match the folder's vision tower."""
    run = subprocess.run(
        [str(sglang_python), "-c", LOAD_LIKE_SGLANG, str(tiny_kimi25), ",".join(MEDIA_KEYS)],
        env={**os.environ, **cpu_server_env(cuda_stub_dir)}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    config = json.loads((tiny_kimi25 / "config.json").read_text())
    vision, media = config["vision_config"], got["media"]
    assert (got["class"], got["tokenizer"]) == ("TinyKimiProcessor", "TinyKimiTokenizer") and got["image_processor"]
    assert got["media_pad_id"] == config["media_placeholder_token_id"]
    assert media["patch_size"] == vision["patch_size"]
    assert [media["merge_kernel_size"]] * 2 == vision["merge_kernel_size"]
    side, merge = media["patch_limit_on_one_side"], media["merge_kernel_size"]
    assert side % merge == 0 and side**2 >= media["in_patch_limit"] >= merge**2
    assert len(media["image_mean"]) == len(media["image_std"]) == 3 and got["fixed_output_tokens"] is None


def test_attached_server_specforge_equal_to_hf(
    layertap_cli, sglang_servers, tiny_kimi25, tmp_path, hf_reference
) -> None:
    server = sglang_servers(tiny_kimi25, layers=LAYERS, extra_args=("--trust-remote-code",))
    assert WRAPPED_HOOK in server.log_path.read_text()
    out = tmp_path / "out"
    cli = extract(layertap_cli, tiny_kimi25, out, "--format", "specforge", "--engine", "sglang", "--server-url", server.url,
                  "--dump-root", str(server.dump_root), "--in-flight", "4", "--trust-remote-code")  # fmt: skip
    assert cli.returncode == 0, cli.stderr[-3000:]
    check = verify_store(out)
    assert check.ok, check.problems
    assert check_states_equal_hf(out, tiny_kimi25, hf_reference) == 6
    manifest = OutputStore.open_existing(out).manifest
    assert manifest.engine["name"] == "sglang" and manifest.compute_dtype == "float32"


def test_launched_server_speculators_computes_in_the_folders_dtype(
    tiny_kimi25, cuda_stub_dir, tmp_path, hf_reference, sglang_python
) -> None:
    out, dumps = tmp_path / "out", tmp_path / "dumps"
    # No --dtype and no --trust-remote-code in the server's flags: layertap adds both (SGLang's own "auto"
    # would run this float32 folder in float16).
    sglang_args = " ".join((*CPU_SERVER_ARGS, "--chunked-prefill-size", str(CHUNKED_PREFILL_SIZE)))
    env = {**os.environ, **cpu_server_env(cuda_stub_dir)}
    cli = subprocess.run(
        [sys.executable, "-m", "layertap", "extract", "--model", str(tiny_kimi25),
         "--data", str(Path(__file__).resolve().parents[2] / "assets" / "datasets" / "kimi_chats.jsonl"),
         "--layers", ",".join(map(str, LAYERS)), "--out", str(out), "--store-dtype", "float32",
         "--format", "speculators", "--engine", "sglang", "--sglang-python", str(sglang_python),
         "--sglang-args", sglang_args, "--dump-root", str(dumps), "--in-flight", "4", "--trust-remote-code"],
        env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert cli.returncode == 0, cli.stderr[-3000:]
    log = (tmp_path / "sglang-server.log").read_text()
    assert WRAPPED_HOOK in log and "Downcasting" not in log
    assert verify_store(out).ok
    assert check_states_equal_hf(out, tiny_kimi25, hf_reference) == 6
    manifest = OutputStore.open_existing(out).manifest
    assert manifest.compute_dtype == "float32" and manifest.engine["server"]["dtype"] == "float32"


def test_gpu_kernel_shape_runs_on_the_cpu_server_too(
    layertap_cli, sglang_servers, tmp_path_factory, tmp_path, hf_reference
) -> None:
    """The `mla-gpu` shape (Kimi's own MLA head sizes, which SGLang's GPU MLA kernels need) equals HF here too."""
    model = build_tiny_model("kimi-k2.5", tmp_path_factory.mktemp("mla-gpu"), shape="mla-gpu", num_hidden_layers=5)
    server = sglang_servers(model, layers=LAYERS, extra_args=("--trust-remote-code",))
    out = tmp_path / "out"
    cli = extract(layertap_cli, model, out, "--engine", "sglang", "--server-url", server.url, "--dump-root", str(server.dump_root),
                  "--in-flight", "4", "--trust-remote-code")  # fmt: skip
    assert cli.returncode == 0, cli.stderr[-3000:]
    assert check_states_equal_hf(out, model, hf_reference) == 6
