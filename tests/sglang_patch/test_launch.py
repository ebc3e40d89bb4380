"""Launcher flag handling: capture flags and env, forced SGLang flags per version, refusals, hook specs.

The ``ServerArgs`` field lists of sglang 0.5.10.post1 and 0.5.14 in ``assets/`` were read from each
version's ``server_args.py``; `test_installed_fields_match_asset` keeps the installed one honest.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from layertap.engines.sglang.process import PluginFolder
from sglang_patch.launch import USAGE_ERROR, forced_flags, hook_specs, parse_launch_args, unsafe_settings
from sglang_patch.settings import CaptureSettings

ASSETS = Path(__file__).parent / "assets"


def fields_of(version: str) -> set[str]:
    return set((ASSETS / f"server_args_fields_{version}.txt").read_text().split())


def test_capture_flags_are_split_from_sglang_flags(tmp_path: Path) -> None:
    sglang_argv = ["--model-path", "/m", "--chunked-prefill-size", "64", "--disable-radix-cache", "--tp", "8"]
    options = parse_launch_args(
        ["--dump-root", str(tmp_path), *sglang_argv[:2], "--capture-layers", "3,31,59", "--capture-final", "post",
         *sglang_argv[2:], "--rid-prefix", "cap", "--writer-threads", "2", "--pinned-cap", "1M"],
        environ={},
    )  # fmt: skip
    assert options.sglang_argv == sglang_argv
    assert options.settings == CaptureSettings(
        dump_root=str(tmp_path), layers=(3, 31, 59), finals=("post",), rid_prefix="cap", writer_threads=2,
        pinned_cap_bytes=1 << 20,
    )  # fmt: skip
    assert not options.dry_run and not options.keep_radix_cache
    kept = parse_launch_args(["--keep-radix-cache", "--model-path", "/m"], environ=ENV)
    assert kept.keep_radix_cache and kept.sglang_argv == ["--model-path", "/m"]


ENV = {"LAYERTAP_DUMP_ROOT": "/d", "LAYERTAP_CAPTURE_LAYERS": "1", "LAYERTAP_CAPTURE_FINAL": "pre"}


def test_environment_fills_in_and_flags_win(tmp_path: Path) -> None:
    env = {
        "LAYERTAP_DUMP_ROOT": str(tmp_path / "env"),
        "LAYERTAP_CAPTURE_LAYERS": "2,4",
        "LAYERTAP_CAPTURE_FINAL": "both",
        "LAYERTAP_MAX_IDLE_PASSES": "9",
    }
    options = parse_launch_args(["--capture-layers", "1", "--model-path", "/m"], environ=env)
    assert options.settings.dump_root == str(tmp_path / "env")
    assert options.settings.layers == (1,)
    assert options.settings.finals == ("post", "pre")
    assert options.settings.max_idle_passes == 9
    assert options.settings.rid_prefix == "hscap"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--capture-layers", "1", "--capture-final", "post"], "--dump-root"),
        (["--dump-root", "/d", "--capture-layers", "1,x", "--capture-final", "post"], "comma-separated"),
        (["--dump-root", "/d", "--capture-layers", "1", "--capture-final", "last"], "final must be"),
        (["--dump-root", "/d", "--capture-layers", "0,2", "--capture-final", "post"], ">= 1"),
        (["--dump-root", "/d", "--capture-layers", "1", "--capture-final", "post", "--rid-prefix", "a:b"], "':'"),
    ],
)
def test_bad_capture_flags(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_launch_args(argv, environ={})


def test_forced_flags_in_each_version_spelling() -> None:
    assert forced_flags(fields_of("0.5.10.post1")) == [
        "--disable-piecewise-cuda-graph",
        "--enforce-disable-flashinfer-allreduce-fusion",
        "--disable-radix-cache",
    ]
    assert forced_flags(fields_of("0.5.14"), keep_radix_cache=True) == [
        "--cuda-graph-backend-prefill",
        "disabled",
        "--enforce-disable-flashinfer-allreduce-fusion",
    ]


def test_fp8_quantization_is_for_speculators_dumps_only() -> None:
    argv = ["--dump-layout", "speculators", "--quantize", "fp8", "--model-path", "/m"]
    assert parse_launch_args(argv, environ=ENV).settings.quantize == "fp8"
    assert (
        parse_launch_args(argv[:2] + argv[4:], environ={**ENV, "LAYERTAP_QUANTIZE": "fp8"}).settings.quantize == "fp8"
    )
    assert parse_launch_args(["--model-path", "/m"], environ=ENV).settings.quantize == "none"
    with pytest.raises(ValueError, match="fp8 needs the speculators layout"):
        parse_launch_args(["--quantize", "fp8", "--model-path", "/m"], environ=ENV)


def test_fusion_kept_only_when_a_measurement_asks() -> None:
    """``--allreduce-fusion sglang`` leaves fusion to SGLang (no enforce flag, no refusal); the default forces it off."""
    options = parse_launch_args(["--allreduce-fusion", "sglang", "--model-path", "/m"], environ=ENV)
    assert options.settings.allreduce_fusion == "sglang" and options.sglang_argv == ["--model-path", "/m"]
    assert parse_launch_args(["--model-path", "/m"], environ=ENV).settings.allreduce_fusion == "off"
    kept = forced_flags(fields_of("0.5.14"), keep_allreduce_fusion=True)
    assert "--enforce-disable-flashinfer-allreduce-fusion" not in kept and "--disable-radix-cache" in kept
    fused = v0514_args(enable_flashinfer_allreduce_fusion=True, flashinfer_allreduce_fusion_backend="auto")
    assert unsafe_settings(fused, allow_allreduce_fusion=True) == []
    assert len(unsafe_settings(fused)) == 1


def v0510_args(**overrides: object) -> SimpleNamespace:
    """The relevant ServerArgs fields of a safe 0.5.10 capture server (as the launcher leaves them)."""
    base = dict(
        speculative_algorithm=None, pp_size=1, disable_piecewise_cuda_graph=True, enforce_piecewise_cuda_graph=False,
        enable_flashinfer_allreduce_fusion=False, enable_aiter_allreduce_fusion=False, enable_two_batch_overlap=False,
        moe_a2a_backend="none", enable_attn_tp_input_scattered=False, disable_radix_cache=False,
        enable_dp_attention=False,
    )  # fmt: skip
    assert set(base) <= fields_of("0.5.10.post1")
    return SimpleNamespace(**{**base, **overrides})


def v0514_args(prefill_backend: str = "disabled", **overrides: object) -> SimpleNamespace:
    """The same for 0.5.14, where graph settings live in `cuda_graph_config` per phase."""
    base = dict(
        speculative_algorithm=None, pp_size=1, enable_flashinfer_allreduce_fusion=False,
        flashinfer_allreduce_fusion_backend=None, enable_aiter_allreduce_fusion=False, enable_two_batch_overlap=False,
        moe_a2a_backend="none", enable_attn_tp_input_scattered=False, enable_dp_attention=False,
        cuda_graph_config=SimpleNamespace(
            prefill=SimpleNamespace(backend=prefill_backend), decode=SimpleNamespace(backend="full")
        ),
    )  # fmt: skip
    assert set(base) <= fields_of("0.5.14")
    return SimpleNamespace(**{**base, **overrides})


def test_safe_settings_pass_in_both_versions() -> None:
    assert unsafe_settings(v0510_args()) == []
    assert unsafe_settings(v0514_args()) == []


@pytest.mark.parametrize(
    ("args", "reason"),
    [
        (v0510_args(disable_piecewise_cuda_graph=False), "prefill CUDA graphs"),
        (v0514_args(prefill_backend="tc_piecewise"), "prefill CUDA graphs"),
        (v0514_args(prefill_backend="breakable"), "prefill CUDA graphs"),
        (v0510_args(enable_flashinfer_allreduce_fusion=True), "all-reduce fusion"),
        (v0514_args(flashinfer_allreduce_fusion_backend="auto"), "all-reduce fusion"),
        (v0510_args(speculative_algorithm="EAGLE3"), "speculative"),
        (v0514_args(pp_size=2), "pipeline"),
        (v0510_args(enable_two_batch_overlap=True), "two-batch"),
        (v0514_args(moe_a2a_backend="deepep"), "all-to-all"),
        (v0510_args(enable_attn_tp_input_scattered=True), "scattered"),
        (v0510_args(enable_dp_attention=True), "DP attention"),
        (v0514_args(enable_dp_attention=True), "DP attention"),
    ],
)
def test_unsafe_settings_are_refused(args: SimpleNamespace, reason: str) -> None:
    problems = unsafe_settings(args)
    assert len(problems) == 1 and reason in problems[0]


def test_hook_specs_target_the_layer_before_each_index() -> None:
    settings = CaptureSettings(dump_root="/d", layers=(3, 31, 59), finals=("post", "pre"))
    specs = hook_specs(settings, num_layers=61)
    targets = {s["config"]["role"]: s["target_modules"] for s in specs}
    assert targets == {
        "aux:3": ["model.layers.2", "language_model.model.layers.2"],
        "aux:31": ["model.layers.30", "language_model.model.layers.30"],
        "aux:59": ["model.layers.58", "language_model.model.layers.58"],
        "final_post": ["logits_processor", "language_model.logits_processor"],
        "final_pre": ["model.layers.60", "language_model.model.layers.60"],
    }
    assert {s["hook_factory"] for s in specs} == {"sglang_patch.hook:hook_factory"}
    assert all(CaptureSettings.from_config(s["config"]["capture"]) == settings for s in specs)
    json.dumps(specs)  # goes through SGLang's JSON flag parsing unchanged


def test_hook_specs_refuse_indices_outside_the_model() -> None:
    with pytest.raises(ValueError, match="outside"):
        hook_specs(CaptureSettings(dump_root="/d", layers=(2, 6), finals=("post",)), num_layers=6)


def run_launcher(args: list[str], python: Path, cuda_stub_dir: Path) -> subprocess.CompletedProcess[str]:
    plugin = PluginFolder()  # the folder a server layertap launches gets; removed when this returns
    env = {
        **os.environ,
        "SGLANG_USE_CPU_ENGINE": "1",
        "LD_LIBRARY_PATH": str(cuda_stub_dir),
        "PYTHONPATH": str(plugin.path),
    }
    return subprocess.run(
        [str(python), "-m", "sglang_patch.launch", *args], env=env, capture_output=True, text=True, timeout=300
    )


@pytest.mark.sglang
def test_installed_fields_match_asset(sglang_python) -> None:
    code = "import dataclasses; from sglang.srt.server_args import ServerArgs; print(*[f.name for f in dataclasses.fields(ServerArgs)])"
    out = subprocess.run([str(sglang_python), "-c", code], capture_output=True, text=True, check=True).stdout
    version = subprocess.run(
        [str(sglang_python), "-c", "import importlib.metadata as m; print(m.version('sglang'))"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    assert set(out.split()) == fields_of(version)


CPU_ARGS = ["--device", "cpu", "--skip-tokenizer-init", "--attention-backend", "torch_native", "--disable-cuda-graph",
            "--max-total-tokens", "4096", "--dtype", "float32"]  # fmt: skip


@pytest.mark.sglang
def test_dry_run_with_installed_sglang(
    tiny_kimi: Path, tmp_path: Path, cuda_stub_dir: Path, sglang_python: Path
) -> None:
    capture = ["--dump-root", str(tmp_path), "--capture-layers", "1,4", "--capture-final", "both", "--dry-run"]
    done = run_launcher([*capture, "--model-path", str(tiny_kimi), *CPU_ARGS], sglang_python, cuda_stub_dir)
    assert done.returncode == 0, done.stderr[-3000:]
    args = json.loads(done.stdout)
    assert args["disable_piecewise_cuda_graph"] is True
    assert args["enforce_disable_flashinfer_allreduce_fusion"] is True
    assert args["enable_flashinfer_allreduce_fusion"] is False
    assert args["disable_radix_cache"] is True
    assert [h["target_modules"][0] for h in args["forward_hooks"]] == [
        "model.layers.0", "model.layers.3", "model.layers.4", "logits_processor"
    ]  # fmt: skip

    refused = run_launcher(
        [*capture, "--model-path", str(tiny_kimi), *CPU_ARGS, "--enforce-piecewise-cuda-graph"],
        sglang_python,
        cuda_stub_dir,
    )
    assert refused.returncode == USAGE_ERROR
    assert "prefill CUDA graphs are on" in refused.stderr

    dp_attention = ["--enable-dp-attention", "--dp-size", "2", "--tp-size", "2"]
    refused = run_launcher(
        [*capture, "--model-path", str(tiny_kimi), *CPU_ARGS, *dp_attention], sglang_python, cuda_stub_dir
    )
    assert refused.returncode == USAGE_ERROR
    assert "DP attention (--enable-dp-attention) is not supported" in refused.stderr


@pytest.mark.sglang
def test_a_config_only_folder_gets_random_weights(tmp_path: Path, cuda_stub_dir: Path, sglang_python: Path) -> None:
    from layertap.tiny import build_tiny_model

    model = build_tiny_model("kimi-k2.5", tmp_path / "config-only", config_only=True)
    capture = ["--dump-root", str(tmp_path / "dumps"), "--capture-layers", "1", "--capture-final", "post", "--dry-run"]
    done = run_launcher(
        [*capture, "--model-path", str(model), *CPU_ARGS, "--trust-remote-code"], sglang_python, cuda_stub_dir
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout)["load_format"] == "dummy" and "random weights" in done.stderr


def test_gpu_servers_default_to_the_fastest_audited_setting_and_given_flags_win() -> None:
    from sglang_patch.launch import default_flags

    watchdog = ["--watchdog-timeout", "1800"]
    assert default_flags(["--model-path", "m", "--tp-size", "8"]) == [
        "--attention-backend", "flashinfer", "--chunked-prefill-size", "8192", *watchdog]  # fmt: skip
    assert default_flags(["--attention-backend=fa3", "--chunked-prefill-size", "4096"]) == watchdog
    assert default_flags(["--attention-backend", "triton", "--watchdog-timeout=60"]) == [
        "--chunked-prefill-size", "8192"]  # fmt: skip
    assert default_flags(["--device", "cpu"]) == [] and default_flags(["--device=cpu"]) == []


def test_a_gpu_first_start_may_build_kernels_into_the_nodes_cache(tmp_path) -> None:
    """A fresh node's first forward pass builds kernels for minutes: SGLang's warm-up timeout is raised with its
    watchdog, and --kernel-cache puts flashinfer's, triton's and tvm-ffi's builds in one folder; set values win."""
    from sglang_patch.launch import first_start_env, parse_launch_args

    options = parse_launch_args(["--dump-root", "d", "--capture-layers", "1", "--capture-final", "post",
                                 "--model-path", "m"], {"LAYERTAP_KERNEL_CACHE": str(tmp_path)})  # fmt: skip
    assert options.kernel_cache == str(tmp_path) and options.sglang_argv == ["--model-path", "m"]
    env = first_start_env(options.sglang_argv, options.kernel_cache, {"TRITON_CACHE_DIR": "/elsewhere"})
    assert env == {"SGLANG_WARMUP_TIMEOUT": "1800", "FLASHINFER_WORKSPACE_BASE": str(tmp_path / "flashinfer"),
                   "TVM_FFI_CACHE_DIR": str(tmp_path / "tvm-ffi")}  # fmt: skip
    assert first_start_env(["--device", "cpu"], None, {}) == {}
