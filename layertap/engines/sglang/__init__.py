"""The SGLang engine, by concern.

- ``engine``: `SGLangEngine`, the client side of a capture (requests in flight, the dump's wait, read and checks).
- ``session``: `ServerSession`, one per server: the HTTP client, the identity check, the one policy for a dropped
  request (recovery, resends) that capture and generation share.
- ``launch``: what a launched server is started with (`ServerConfig`, `server_model_args`, the dump layout, dtype).
- ``process``: `SGLangServer`, the server's process (launch, readiness, restart, stop), `start_server`.

What the server says about itself is `layertap.engines.server_facts`.
"""

from layertap.engines.sglang.engine import SGLangEngine, captured_from_dump
from layertap.engines.sglang.launch import (
    KEEP_TOKENIZER_FLAG,
    ServerConfig,
    server_model_args,
    sglang_compute_dtype,
)
from layertap.engines.sglang.process import SGLangServer, free_port, start_server
from layertap.engines.sglang.session import ServerSession

__all__ = [
    "KEEP_TOKENIZER_FLAG",
    "SGLangEngine",
    "SGLangServer",
    "ServerConfig",
    "ServerSession",
    "captured_from_dump",
    "free_port",
    "server_model_args",
    "sglang_compute_dtype",
    "start_server",
]
