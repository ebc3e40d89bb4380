"""Capture plugin that runs inside SGLang's processes (see `launch` for how it is started).

It imports only torch, sglang, safetensors and the standard library, because it is installed into
the server's own environment. `contract` (the rid grammar and the dump folder layout) is stdlib-only
and shared with the `layertap` core package. This file imports nothing on purpose: importing
`sglang_patch.contract` must not pull in torch or sglang.
"""
