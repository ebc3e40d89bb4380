"""Which server a run talks to, read once from SGLang's ``/server_info`` and checked before any sample.

Every check on a dump proves it is what the server computed; none proves the server is the one the run needs. A
server of another folder of the same shape, or one making random weights (``--load-format dummy``), passes ids,
shapes, finiteness and sha256. So on attach and after every (re)start the engine reads the server's facts
(`ServerFacts`: SGLang's own server args, its input limit, and what the capture plugin reports from inside the
server: the capture config and `sglang_patch.identity.model_identity` of the folder it serves) and refuses, in
one line naming both sides, a server that does not serve ``--model``, loads random weights without the benchmark
flag, captures other layers or for another client, runs DP attention, or (after a restart) changed its settings.
"""

from __future__ import annotations

import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from layertap.errors import ServerError
from layertap.models.folder import ModelFolder
from layertap.models.quantization import METHOD
from layertap.spec import CaptureSpec
from sglang_patch.identity import model_identity

log = logging.getLogger(__name__)
DUMMY_FLAG = "--allow-dummy-weights"


@dataclass(frozen=True, slots=True)
class ServerFacts:
    """What a capture server says about itself. ``dtype`` is its ``--dtype`` as given (``auto`` included);
    ``model`` the plugin's ``{"config_sha256", "weights_sha256"}`` of the folder it loaded ({} from a launcher
    that did not report it); ``capture`` the plugin's capture settings (None: no layertap hooks);
    ``input_limit`` the longest prompt it accepts (None when it does not say); ``deterministic`` whether it
    samples with the seeds requests carry."""

    url: str
    version: str | None
    model_path: str
    model: dict[str, str | None]
    load_format: str
    dtype: str
    quantization: str | None
    tp_size: int
    dp_size: int
    dp_attention: bool
    attention_backend: str | None
    chunked_prefill_size: int | None
    capture: dict[str, Any] | None
    input_limit: int | None
    # --enable-deterministic-inference: only then does SGLang sample with a request's sampling_seed (0.5.10 and 0.5.14:
    # sampling_batch_info builds per-request seeds under it alone; the sampler otherwise draws from torch's generator).
    deterministic: bool = False

    @classmethod
    def from_info(cls, url: str, info: dict[str, Any]) -> ServerFacts:
        """The facts in a ``/server_info`` reply (SGLang's server args, its scheduler's limits, our hooks' config)."""
        hooks = [h.get("config") or {} for h in info.get("forward_hooks") or [] if isinstance(h, dict)]
        ours = next((c for c in hooks if isinstance(c.get("capture"), dict)), None)
        # The scheduler refuses a prompt of max_req_input_len tokens or more (sglang 0.5.10 and 0.5.14).
        limit = info.get("max_req_input_len")
        return cls(
            url=url,
            version=info.get("version"),
            model_path=str(info.get("model_path")),
            model=dict(ours.get("model") or {}) if ours else {},
            load_format=str(info.get("load_format", "auto")),
            dtype=str(info.get("dtype", "auto")),
            quantization=info.get("quantization"),
            tp_size=int(info.get("tp_size") or 1),
            dp_size=int(info.get("dp_size") or 1),
            dp_attention=bool(info.get("enable_dp_attention")),
            attention_backend=info.get("attention_backend"),
            chunked_prefill_size=info.get("chunked_prefill_size"),
            capture=ours["capture"] if ours else None,
            input_limit=limit - 1 if isinstance(limit, int) and limit > 1 else None,
            deterministic=bool(info.get("enable_deterministic_inference")),
        )

    def computes(self) -> dict[str, Any]:
        """What decides the values a server stores: the weights, how it computes and what it captures. Servers
        whose samples share one store must agree on it (a store's records: `OutputStore.note_server`)."""
        capture = self.capture or {}
        return {
            "model": self.model or {"path": self.model_path},
            "load_format": self.load_format,
            "dtype": self.dtype,
            "quantization": self.quantization,
            "tp_size": self.tp_size,
            "dp_size": self.dp_size,
            "attention_backend": self.attention_backend,
            "chunked_prefill_size": self.chunked_prefill_size,
            "layers": list(capture.get("layers", ())),
            "finals": sorted(capture.get("finals", ())),
        }

    def settings(self) -> dict[str, Any]:
        """What must stay the same across restarts of one server: everything but its address and its input limit
        (its KV pool, which can bound it, is sized from the memory free at each start)."""
        return {k: v for k, v in asdict(self).items() if k not in ("url", "input_limit")}

    def record(self) -> dict[str, Any]:
        """The facts as the manifest records them."""
        return asdict(self)


def quantization_mismatch(server: str | None, folder: str | None) -> str | None:
    """Why a server's quantization is not the folder's, comparing only what both sides state (a folder's own
    quantization (``ModelFolder.quantization``), or a server left to detect it)."""

    def norm(name: str) -> str:
        return name.lower().replace("_", "-")

    if server is None or folder is None or norm(server) == norm(folder):
        return None
    return f"quantization {server!r}, the folder's is {folder!r}"


@dataclass(frozen=True, slots=True)
class ServerExpectation:
    """What the run needs from its server: the folder it names, what it captures, and where and how it reads dumps."""

    model: Path
    capture: CaptureSpec
    rid_prefix: str
    dump_root: Path
    allow_dummy_weights: bool = False
    quantization: str | None = None  # the folder's, where known

    def problems(self, facts: ServerFacts) -> list[str]:
        """Each way ``facts`` differ from this expectation, naming both sides; empty: the server is the right one."""
        if facts.capture is None:
            return ["it has no layertap capture hooks (start it with python -m sglang_patch.launch)"]
        out = self._model_problems(facts)
        if facts.load_format == "dummy" and not self.allow_dummy_weights:
            out.append(f"it makes random weights (--load-format dummy); pass {DUMMY_FLAG} for a benchmark")
        if (why := quantization_mismatch(facts.quantization, self.quantization)) is not None:
            out.append(f"it runs {why}")
        if facts.dp_attention:
            out.append("it runs DP attention (--enable-dp-attention), where every attention-DP rank writes")
        cap = facts.capture
        if tuple(cap.get("layers", ())) != self.capture.layers:
            out.append(f"it captures layers {list(cap.get('layers', ()))}, this run {list(self.capture.layers)}")
        if not set(self.capture.finals) <= set(cap.get("finals", ())):
            out.append(
                f"it captures final states {list(cap.get('finals', ()))}, this run needs {sorted(self.capture.finals)}"
            )
        if cap.get("rid_prefix") != self.rid_prefix:
            out.append(f"it captures rids prefixed {cap.get('rid_prefix')!r}, this run sends {self.rid_prefix!r}")
        if os.path.realpath(str(cap.get("dump_root"))) != os.path.realpath(self.dump_root):
            out.append(f"it dumps into {cap.get('dump_root')}, this run reads {self.dump_root}")
        return out

    def _model_problems(self, facts: ServerFacts) -> list[str]:
        """The served folder against ``model``: by the plugin's identity where it reports one, else by path."""
        ours = model_identity(self.model)
        if not facts.model:
            if os.path.realpath(facts.model_path) != os.path.realpath(self.model):
                return [f"it serves {facts.model_path}, --model is {self.model}"]
            return []
        keys = ["config_sha256"] if facts.load_format == "dummy" else ["config_sha256", "weights_sha256"]
        differ = [k for k in keys if facts.model.get(k) != ours[k]]
        if differ:
            theirs = ", ".join(f"{k.removesuffix('_sha256')} {str(facts.model.get(k))[:12]}" for k in differ)
            mine = ", ".join(f"{k.removesuffix('_sha256')} {str(ours[k])[:12]}" for k in differ)
            return [f"it serves {facts.model_path} ({theirs}), --model is {self.model} ({mine})"]
        if os.path.realpath(facts.model_path) != os.path.realpath(self.model):
            log.info("the server loads %s, the same weights as --model %s", facts.model_path, self.model)
        return []


def check_server(facts: ServerFacts, expected: ServerExpectation, pinned: ServerFacts | None = None) -> None:
    """ServerError (one line) unless the server is ``expected``'s and, when ``pinned`` (its facts before a
    restart), has the same settings as then."""
    problems = expected.problems(facts)
    if pinned is not None and (was := pinned.settings()) != (now := facts.settings()):
        problems += [f"after its restart {k} is {now[k]!r}, before it was {was[k]!r}" for k in was if was[k] != now[k]]
    if problems:
        raise ServerError(f"refusing the SGLang server at {facts.url}: " + "; ".join(problems))


def expectation_for(
    folder: ModelFolder, capture: CaptureSpec, *, rid_prefix: str, dump_root: Path, allow_dummy_weights: bool = False
) -> ServerExpectation:
    """The expectation of a run on the model ``folder`` (as the run read it)."""
    return ServerExpectation(
        model=folder.path,
        capture=capture,
        rid_prefix=rid_prefix,
        dump_root=dump_root,
        allow_dummy_weights=allow_dummy_weights,
        quantization=METHOD if folder.quantization else None,
    )
