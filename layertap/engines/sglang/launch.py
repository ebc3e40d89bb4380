"""What a launched capture server is started with: `ServerConfig` (its command line) and the flags a run gives it for
its model folder and store (`server_model_args`, `dump_layout`, `dump_quantize`), with what SGLang computes in for a
``--dtype`` (`sglang_compute_dtype`). Nothing here starts a process (`layertap.engines.sglang.process` does)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from layertap.models.folder import ModelFolder
from layertap.spec import CaptureSpec
from sglang_patch.contract import DEFAULT_RID_PREFIX, FORMAT_FINAL, SPECULATORS

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """How to launch one capture server. ``sglang_args`` go to SGLang (model flags, device, chunking)."""

    python: Path
    model: Path
    dump_root: Path
    layers: tuple[int, ...]
    final: str
    log_path: Path
    rid_prefix: str = DEFAULT_RID_PREFIX
    layout: str = "states"
    quantize: str = "none"  # "fp8": the plugin quantizes speculators dumps on the device
    writer_threads: int | None = None  # None: the plugin's default (sglang_patch.settings)
    pinned_cap: str | None = None  # bytes, e.g. "4G"; None: the plugin's default
    sglang_args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    host: str = "127.0.0.1"
    port: int | None = None
    # A first start on a fresh node loads the weights (554 GB for Kimi-K2.5) and builds kernels in SGLang's warm-up
    # (the launcher allows that pass 1800 s): a start that outlasts this hangs, and is not retried.
    startup_timeout_s: float = 3600.0
    start_attempts: int = 3
    start_backoff_s: float = 5.0  # before the 2nd try; doubles after each failed try

    def command(self, port: int) -> list[str]:
        return [
            str(self.python), "-m", "sglang_patch.launch",
            "--dump-root", str(self.dump_root),
            "--capture-layers", ",".join(map(str, self.layers)),
            "--capture-final", self.final,
            "--rid-prefix", self.rid_prefix,
            "--dump-layout", self.layout,
            *(["--quantize", self.quantize] if self.quantize != "none" else []),
            *(["--writer-threads", str(self.writer_threads)] if self.writer_threads else []),
            *(["--pinned-cap", self.pinned_cap] if self.pinned_cap else []),
            "--model-path", str(self.model),
            "--host", self.host, "--port", str(port),
            *self.sglang_args,
        ]  # fmt: skip


def dump_layout(store_format: str, capture: CaptureSpec) -> str:
    """The dump layout a server should write for a store in `store_format`: that format itself when
    it holds exactly the final state asked for (commits become renames), else "states"."""
    if FORMAT_FINAL.get(store_format) == capture.final_kind:
        return store_format
    return "states"


def dump_quantize(layout: str, store_dtype: str) -> str:
    """What the server quantizes to: "fp8" for speculators dumps of an FP8 store (on the device, before the copy
    to the host), else "none" (a "states" dump of an FP8 store is quantized by the store as it writes)."""
    return "fp8" if store_dtype == "fp8" and layout == SPECULATORS else "none"


def sglang_compute_dtype(server_dtype: str, folder_dtype: str) -> str:
    """What SGLang computes in for ``--dtype server_dtype`` on a folder saved in ``folder_dtype``: ``auto``
    keeps the folder's dtype except float32, which it downcasts to float16 (sglang 0.5.10 and 0.5.14)."""
    if server_dtype != "auto":
        return {"half": "float16", "float": "float32", "bf16": "bfloat16"}.get(server_dtype, server_dtype)
    return "float16" if folder_dtype == "float32" else folder_dtype


# layertap's own opt-out of --skip-tokenizer-init, given in --sglang-args; never passed to SGLang.
KEEP_TOKENIZER_FLAG = "--no-skip-tokenizer-init"


def server_model_args(folder: ModelFolder, sglang_args: list[str], *, trust_remote_code: bool) -> list[str]:
    """Every flag a launched server gets for ``folder``: the user's ``sglang_args``, then

    - ``--skip-tokenizer-init``: the engine sends token ids and reads no text, and SGLang's detokenizer
      would kill the server on a generated id the folder's tokenizer lacks; ``--no-skip-tokenizer-init``
      in ``sglang_args`` keeps SGLang's tokenizer (and is not passed on);
    - the folder's own dtype unless ``--dtype`` is given (a warning when the given one downcasts);
    - ``--trust-remote-code`` when the run allows the folder's code;
    - ``--load-format dummy`` (random weights, a warning) for a config-only folder.
    """
    args = [a for a in sglang_args if a != KEEP_TOKENIZER_FLAG]
    if KEEP_TOKENIZER_FLAG not in sglang_args and "--skip-tokenizer-init" not in args:
        args.append("--skip-tokenizer-init")
    given = next((a.split("=", 1)[1] if "=" in a else args[i + 1] for i, a in enumerate(args)
                  if a == "--dtype" or a.startswith("--dtype=")), None)  # fmt: skip
    if given is None:
        args += ["--dtype", folder.dtype]
    elif (computed := sglang_compute_dtype(given, folder.dtype)) != folder.dtype:
        log.warning(
            "the SGLang server will compute in %s (--dtype %s) while %s is saved in %s: expect states to differ "
            "from the model's own (MoE routing can flip on near-ties); leave --dtype out to compute in %s",
            computed, given, folder.path, folder.dtype, folder.dtype,
        )  # fmt: skip
    if trust_remote_code and "--trust-remote-code" not in args:
        args.append("--trust-remote-code")
    if not folder.has_weights and not any(a.startswith("--load-format") for a in args):
        log.warning("%s has no weight files: the server makes random weights (--load-format dummy); its states are "
                    "for benchmarks, not for training", folder.path)  # fmt: skip
        args += ["--load-format", "dummy"]
    return args
