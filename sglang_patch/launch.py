"""Start SGLang's own HTTP server with the capture hooks and safe settings.

Usage (in the server's environment, with a folder holding this package on PYTHONPATH)::

    python -m sglang_patch.launch --dump-root /dev/shm/dumps --capture-layers 3,31,59 \\
        --capture-final post [--rid-prefix hscap] [--dump-layout states|specforge|speculators] \\
        [--quantize none|fp8] [--writer-threads 4] [--pinned-cap 4G] [--keep-radix-cache] \\
        [--allreduce-fusion off|sglang] [--kernel-cache DIR] [--dry-run] <sglang server flags>

Each capture flag falls back to an environment variable (``LAYERTAP_DUMP_ROOT``,
``LAYERTAP_CAPTURE_LAYERS``, ``LAYERTAP_CAPTURE_FINAL``, ``LAYERTAP_RID_PREFIX``, ``LAYERTAP_DUMP_LAYOUT``,
``LAYERTAP_QUANTIZE``, ``LAYERTAP_WRITER_THREADS``, ``LAYERTAP_PINNED_CAP``, ``LAYERTAP_MAX_IDLE_PASSES``).
Everything else goes to SGLang's own parser, then the launcher

- forces prefill CUDA graphs off (hooks do not run under graph replay, where ``rids`` is None):
  ``--disable-piecewise-cuda-graph`` on sglang 0.5.10, ``--cuda-graph-backend-prefill disabled`` on
  0.5.14 (told apart by the fields of ``ServerArgs``); decode graphs may stay on;
- forces FlashInfer all-reduce fusion off (``--enforce-disable-flashinfer-allreduce-fusion``). SGLang
  turns it on by itself for DeepseekV3/Kimi at TP > 1 on Hopper/Blackwell, and then a decoder
  layer's output is a per-rank partial sum awaiting an all-reduce fused into the next layer's norm.
  It is forced for every model: always safe. ``--allreduce-fusion sglang`` leaves it at SGLang's
  choice, only to measure what it does to captures (`benchmarks/gpu/tp_bench.py`);
- refuses what it cannot make safe, checked on the final ``ServerArgs`` (after SGLang derived its
  own settings): speculative decoding, PP > 1, two-batch overlap, an all-to-all MoE backend,
  scattered attention-TP input, DP attention, and any prefill graph or all-reduce fusion still on;
- turns the radix (prefix) cache off (``--disable-radix-cache``): a cache hit means the hooks never
  see the first rows of a prompt, and caching gains nothing when every prompt must be computed in
  full. A unique ``extra_key`` per request is not enough on sglang 0.5.10.post1: its scheduler does
  not pass ``extra_key`` on to the request (measured: a different key still got 199 of 200 tokens
  from the cache; 0.5.14 passes it). ``--keep-radix-cache`` keeps it for servers that honour
  ``extra_key``; a hit is then still caught (an error dump, and ``cached_tokens > 0`` in the reply);
- on a GPU, defaults to ``--attention-backend flashinfer --chunked-prefill-size 8192`` (``GPU_DEFAULTS``, the
  fastest setting measured whose captures the audit passed) unless the flags set them;
- on a GPU, lets a first start build its kernels: the first forward pass (SGLang's warm-up) compiles
  flashinfer, triton and tvm-ffi kernels on first use (an INT4 MoE's Marlin GEMM among them: minutes on a
  fresh node), which SGLang's 300 s scheduler watchdog and 600 s warm-up timeout would kill, so both default
  to ``FIRST_START_S`` unless given (``--watchdog-timeout``, ``SGLANG_WARMUP_TIMEOUT``); keep SGLang's warm-up on
  so the builds end before the server answers ``/health``;
- ``--kernel-cache DIR`` (``LAYERTAP_KERNEL_CACHE``) keeps those builds in one folder of the node's
  (``KERNEL_CACHE_ENV``: flashinfer's, triton's and tvm-ffi's caches below it), where the next start finds them;
- adds one ``--forward-hooks`` spec per captured role (see `sglang_patch.hook`), for both the plain
  module paths and the ``language_model.`` ones of Kimi-K2.5's multimodal wrapper, each carrying the served
  folder's identity (`sglang_patch.identity`), which ``/server_info`` then returns to clients.

``--dry-run`` prints the resolved settings as JSON instead of starting the server. A command line it refuses
(a missing or malformed capture flag, an unsafe setting) ends it as argparse ends on one: a line
``python -m sglang_patch.launch: error: ...`` and status 2 (``USAGE_ERROR``), as SGLang's parser ends on a flag it
rejects, so that a client can tell a start that would fail again from one a retry may not meet.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

from sglang_patch.contract import DEFAULT_RID_PREFIX, FINAL_TENSORS
from sglang_patch.identity import has_weight_files, model_identity
from sglang_patch.settings import (
    FUSION_CHOICES,
    QUANTIZE_CHOICES,
    CaptureSettings,
    aux_role,
    env_default,
    parse_bytes,
    parse_finals,
    parse_layers,
)

PROG = "python -m sglang_patch.launch"
USAGE_ERROR = 2  # argparse's exit status for a command line it refuses
HOOK_FACTORY = "sglang_patch.hook:hook_factory"
# Module path prefixes of the decoder stack: plain causal LMs, and Kimi-K2.5's multimodal wrapper.
MODULE_PREFIXES = ("", "language_model.")


@dataclasses.dataclass(frozen=True, slots=True)
class LaunchOptions:
    """The launcher's own options; everything else on the command line belongs to SGLang."""

    settings: CaptureSettings
    dry_run: bool
    keep_radix_cache: bool
    kernel_cache: str | None
    sglang_argv: list[str]


def parse_launch_args(argv: Sequence[str], environ: Mapping[str, str]) -> LaunchOptions:
    """Split the command line into capture settings (flags, else ``LAYERTAP_*`` env) and SGLang's argv."""
    parser = argparse.ArgumentParser(prog=PROG, allow_abbrev=False, add_help=False)
    parser.add_argument("--dump-root", default=env_default(environ, "dump_root"))
    parser.add_argument("--capture-layers", default=env_default(environ, "capture_layers"))
    parser.add_argument("--capture-final", default=env_default(environ, "capture_final"))
    parser.add_argument("--rid-prefix", default=env_default(environ, "rid_prefix") or DEFAULT_RID_PREFIX)
    parser.add_argument("--dump-layout", default=env_default(environ, "dump_layout") or "states")
    parser.add_argument("--quantize", choices=QUANTIZE_CHOICES, default=env_default(environ, "quantize") or "none")
    parser.add_argument("--writer-threads", type=int, default=env_default(environ, "writer_threads"))
    parser.add_argument("--pinned-cap", default=env_default(environ, "pinned_cap"), help="bytes, e.g. 4G")
    parser.add_argument("--max-idle-passes", type=int, default=env_default(environ, "max_idle_passes"))
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--keep-radix-cache", action="store_true")
    parser.add_argument("--allreduce-fusion", choices=FUSION_CHOICES, default="off")
    parser.add_argument("--kernel-cache", default=env_default(environ, "kernel_cache"))
    ns, rest = parser.parse_known_args(list(argv))
    missing = [name for name in ("dump_root", "capture_layers", "capture_final") if getattr(ns, name) is None]
    if missing:
        flags = ", ".join("--" + m.replace("_", "-") for m in missing)
        raise ValueError(f"missing {flags} (or the LAYERTAP_* environment variables)")
    tuning = {
        name: int(getattr(ns, name)) for name in ("writer_threads", "max_idle_passes") if getattr(ns, name) is not None
    }
    if ns.pinned_cap is not None:
        tuning["pinned_cap_bytes"] = parse_bytes(ns.pinned_cap)
    settings = CaptureSettings(
        dump_root=os.path.abspath(ns.dump_root),  # a symlink stays one: it may be re-pointed
        layers=parse_layers(ns.capture_layers),
        finals=parse_finals(ns.capture_final),
        rid_prefix=ns.rid_prefix,
        layout=ns.dump_layout,
        quantize=ns.quantize,
        allreduce_fusion=ns.allreduce_fusion,
        **tuning,
    )
    return LaunchOptions(settings=settings, dry_run=ns.dry_run, keep_radix_cache=ns.keep_radix_cache,
                         kernel_cache=ns.kernel_cache, sglang_argv=rest)  # fmt: skip


# The fastest setting measured on one H200 whose captures the audit passed (benchmarks/results/gpu_seed_scale.md:
# 61 layers at Kimi-K2.5's width, 7.2K tok/s plain vs 3.0K for triton with 4096-token chunks); FA3, absent
# from the slim GPU bundle, was not measured. Given flags win; CPU servers (--device cpu) get none.
GPU_DEFAULTS = {"--attention-backend": "flashinfer", "--chunked-prefill-size": "8192"}


# Seconds a GPU server's first forward pass may take (SGLang: watchdog 300 s, warm-up 600 s). On a fresh H200 node
# an INT4 Kimi-K2.5-layout folder's first pass built flashinfer, triton and Marlin MoE kernels for over 300 s.
FIRST_START_S = "1800"
GPU_FIRST_START = {"--watchdog-timeout": FIRST_START_S}
# Where each first-use kernel builder keeps its builds, below --kernel-cache (flashinfer adds .cache/flashinfer).
KERNEL_CACHE_ENV = {"FLASHINFER_WORKSPACE_BASE": "flashinfer", "TRITON_CACHE_DIR": "triton",
                    "TVM_FFI_CACHE_DIR": "tvm-ffi"}  # fmt: skip


def _on_cpu(sglang_argv: Sequence[str]) -> bool:
    return "cpu" in sglang_argv or any(a.startswith("--device=cpu") for a in sglang_argv)


def default_flags(sglang_argv: Sequence[str]) -> list[str]:
    """``GPU_DEFAULTS`` and ``GPU_FIRST_START`` the user did not set (either spelling), for a GPU server; put
    before the user's flags."""
    if _on_cpu(sglang_argv):
        return []
    given = {a.split("=", 1)[0] for a in sglang_argv}
    defaults = {**GPU_DEFAULTS, **GPU_FIRST_START}
    return [part for flag, value in defaults.items() if flag not in given for part in (flag, value)]


def first_start_env(sglang_argv: Sequence[str], kernel_cache: str | None, environ: Mapping[str, str]) -> dict[str, str]:
    """Environment for SGLang's processes: the kernel caches under ``kernel_cache`` and, on a GPU, the warm-up
    timeout of a first start; variables already set win."""
    env = {} if _on_cpu(sglang_argv) else {"SGLANG_WARMUP_TIMEOUT": FIRST_START_S}
    if kernel_cache:
        root = Path(kernel_cache).expanduser().resolve()
        env |= {name: str(root / sub) for name, sub in KERNEL_CACHE_ENV.items()}
    return {k: v for k, v in env.items() if k not in environ}


def forced_flags(
    server_arg_fields: Collection[str], *, keep_radix_cache: bool = False, keep_allreduce_fusion: bool = False
) -> list[str]:
    """SGLang flags that turn prefill CUDA graphs, all-reduce fusion (unless kept for a measurement) and
    (unless kept) the radix cache off, in this version's spelling.

    `server_arg_fields` are the field names of the installed ``ServerArgs``. The flags go after the
    user's, so they win over the user's per-phase settings (an explicit ``--cuda-graph-config`` JSON
    still wins in 0.5.14; `unsafe_settings` then refuses it).
    """
    flags: list[str] = []
    if "cuda_graph_backend_prefill" in server_arg_fields:  # 0.5.14: per-phase graph backends
        flags += ["--cuda-graph-backend-prefill", "disabled"]
    elif "disable_piecewise_cuda_graph" in server_arg_fields:  # 0.5.10: piecewise graphs on by default
        flags += ["--disable-piecewise-cuda-graph"]
    if "enforce_disable_flashinfer_allreduce_fusion" in server_arg_fields and not keep_allreduce_fusion:
        flags += ["--enforce-disable-flashinfer-allreduce-fusion"]
    if not keep_radix_cache:
        flags += ["--disable-radix-cache"]
    return flags


def _prefill_graphs_on(server_args: Any) -> bool:
    config = getattr(server_args, "cuda_graph_config", None)
    if config is not None:  # 0.5.14
        return config.prefill.backend != "disabled"
    return not getattr(server_args, "disable_piecewise_cuda_graph", True)


def unsafe_settings(server_args: Any, *, allow_allreduce_fusion: bool = False) -> list[str]:
    """Reasons the final ``ServerArgs`` cannot capture correctly (empty list: safe); all-reduce fusion
    is let through only when a measurement asked for it (``--allreduce-fusion sglang``)."""
    problems = []
    if getattr(server_args, "speculative_algorithm", None):
        problems.append("speculative decoding changes what the target's forward passes hold; remove --speculative-*")
    if getattr(server_args, "pp_size", 1) > 1:
        problems.append("pipeline parallelism (--pp-size > 1) is not supported: use pp_size 1")
    if _prefill_graphs_on(server_args):
        problems.append("prefill CUDA graphs are on: hooks do not run under graph replay")
    if not allow_allreduce_fusion and (
        getattr(server_args, "enable_flashinfer_allreduce_fusion", False)
        or getattr(server_args, "flashinfer_allreduce_fusion_backend", None) is not None
    ):
        problems.append("FlashInfer all-reduce fusion is on: layer-boundary states would be per-rank partial sums")
    if getattr(server_args, "enable_aiter_allreduce_fusion", False):
        problems.append("AITER all-reduce fusion is on: layer-boundary states would be per-rank partial sums")
    if getattr(server_args, "enable_two_batch_overlap", False):
        problems.append("two-batch overlap splits passes into micro-batches the hooks cannot attribute")
    if getattr(server_args, "moe_a2a_backend", "none") not in (None, "none"):
        problems.append("an all-to-all MoE backend scatters tokens across ranks; use --moe-a2a-backend none")
    if getattr(server_args, "enable_attn_tp_input_scattered", False):
        problems.append("--enable-attn-tp-input-scattered splits a pass's tokens across ranks")
    if getattr(server_args, "enable_dp_attention", False):
        problems.append(
            "DP attention (--enable-dp-attention) is not supported: every attention-DP rank would hook and write; "
            "leave it off (--dp-size without it runs whole replicas, one writer each)"
        )
    return problems


def random_weights_for_config_only(server_args: Any) -> None:
    """A local model folder without weight files (a benchmark's config-only folder) is served with random
    weights (``--load-format dummy``), said on stderr; any ``--load-format`` given is kept."""
    folder = Path(server_args.model_path)
    if server_args.load_format != "auto" or not folder.is_dir():
        return
    if not has_weight_files(folder):
        print(f"sglang_patch.launch: {folder} has no weight files: random weights (--load-format dummy), "
              "for benchmarks only", file=sys.stderr)  # fmt: skip
        server_args.load_format = "dummy"


def hook_specs(
    settings: CaptureSettings, num_layers: int, model: dict[str, str | None] | None = None
) -> list[dict[str, Any]]:
    """``--forward-hooks`` specs: one per role, on decoder layer ``i-1`` for capture index i.

    Capture indices must lie in [1, num_layers - 1] (index 0 is the embedding output, which no
    decoder layer returns; the last layer's output is the pre-norm final state, ``final_pre``).
    ``model`` (`sglang_patch.identity.model_identity` of the served folder) rides in each spec's config, so
    that SGLang's ``/server_info`` tells clients which weights the server loaded; the hooks ignore it.
    """
    bad = [i for i in settings.layers if not 1 <= i <= num_layers - 1]
    if bad:
        raise ValueError(f"capture indices {bad} outside [1, {num_layers - 1}] for {num_layers} decoder layers")
    targets = {aux_role(i): f"model.layers.{i - 1}" for i in settings.layers}
    if "pre" in settings.finals:
        targets[FINAL_TENSORS["pre"]] = f"model.layers.{num_layers - 1}"
    if "post" in settings.finals:
        targets[FINAL_TENSORS["post"]] = "logits_processor"
    return [
        {
            "name": f"layertap-{role}",
            "target_modules": [prefix + module for prefix in MODULE_PREFIXES],
            "hook_factory": HOOK_FACTORY,
            "config": {"role": role, "capture": settings.to_config(), "model": model or {}},
        }
        for role, module in targets.items()
    ]


def refuse(message: str) -> NoReturn:
    """End as argparse ends on a command line it refuses (see the module's docstring): one line, status 2."""
    print(f"{PROG}: error: {message}", file=sys.stderr)
    raise SystemExit(USAGE_ERROR)


def main(argv: Sequence[str] | None = None) -> None:
    try:
        options = parse_launch_args(sys.argv[1:] if argv is None else argv, os.environ)
    except ValueError as exc:
        refuse(str(exc))

    from sglang.srt.server_args import ServerArgs, prepare_server_args

    try:  # 0.5.14 loads its plugins before parsing, as its own launch_server does
        from sglang.srt.plugins import load_plugins
    except ImportError:
        pass
    else:
        load_plugins()

    field_names = {f.name for f in dataclasses.fields(ServerArgs)}
    measure_fusion = options.settings.allreduce_fusion == "sglang"
    forced = forced_flags(field_names, keep_radix_cache=options.keep_radix_cache, keep_allreduce_fusion=measure_fusion)
    server_args = prepare_server_args([*default_flags(options.sglang_argv), *options.sglang_argv, *forced])
    random_weights_for_config_only(server_args)
    problems = unsafe_settings(server_args, allow_allreduce_fusion=measure_fusion)
    if problems:
        refuse("these settings cannot capture correctly: " + "; ".join(problems))
    try:
        model = model_identity(Path(server_args.model_path)) if Path(server_args.model_path).is_dir() else {}
        specs = hook_specs(options.settings, server_args.get_model_config().num_hidden_layers, model)
    except ValueError as exc:
        refuse(str(exc))
    server_args.forward_hooks = [*(server_args.forward_hooks or []), *specs]

    if options.dry_run:
        print(json.dumps(dataclasses.asdict(server_args), default=str, indent=1, sort_keys=True))
        return
    Path(options.settings.dump_root).mkdir(parents=True, exist_ok=True)
    env = first_start_env(options.sglang_argv, options.kernel_cache, os.environ)
    for path in (v for k, v in env.items() if k in KERNEL_CACHE_ENV):
        Path(path).mkdir(parents=True, exist_ok=True)
    os.environ.update(env)  # before SGLang starts its scheduler processes, which inherit it
    from sglang.launch_server import run_server
    from sglang.srt.utils import kill_process_tree

    try:
        run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)


if __name__ == "__main__":
    main()
