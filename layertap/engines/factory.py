"""Engine factories: what a run calls to build its engine once the capture spec is known. The engines' own
modules are imported only when a factory is called (they load transformers or httpx)."""

from __future__ import annotations

from pathlib import Path

from layertap.spec import CaptureSpec
from sglang_patch.contract import DEFAULT_RID_PREFIX


def hf_engine_factory(model: Path, device: str, batch_tokens: int, dtype: str | None = None):
    """An engine factory for the in-process HF engine (imported lazily: it loads transformers); ``dtype`` None
    computes in the folder's own dtype."""

    def make(capture: CaptureSpec):
        import torch

        from layertap.engines.hf import HFEngine

        return HFEngine(model, capture, device=device, max_batch_tokens=batch_tokens,
                        dtype=getattr(torch, dtype) if dtype else None)  # fmt: skip

    return make


def sglang_engine_factory(model: Path, out: Path, store_format: str, server_url: str | None, dump_root: Path | None,
                          in_flight: int, sglang_python: Path, sglang_args: str, trust_remote_code: bool = False,
                          allow_dummy_weights: bool = False, store_dtype: str = "bfloat16"):  # fmt: skip
    """An engine factory for a capture server (the CLI's SGLang engine; imported only when chosen). The server is
    refused unless it serves ``model`` (with real weights, unless ``allow_dummy_weights``) for this capture."""

    def make(capture: CaptureSpec):
        from layertap.engines.sglang import SGLangEngine, start_server

        dumps = dump_root or out.parent / f".{out.name}-dumps"
        server = start_server(capture, model, dump_root=dumps, server_url=server_url, python=sglang_python,
                              sglang_args=sglang_args, rid_prefix=DEFAULT_RID_PREFIX, log_path=dumps.parent / "sglang-server.log",
                              store_format=store_format, store_dtype=store_dtype,
                              trust_remote_code=trust_remote_code)  # fmt: skip
        return SGLangEngine(server, capture, model=model, dump_root=dumps, job=out.name, in_flight=in_flight,
                            allow_dummy_weights=allow_dummy_weights)  # fmt: skip

    return make
