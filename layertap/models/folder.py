"""The facts of a model folder as users have it, read once for every component.

A real target is not always a plain causal LM folder. Kimi-K2.5 wraps a DeepseekV3 language model in a
multimodal config (``text_config`` beside ``vision_config``, weights under ``language_model.``) and ships
its tokenizer as Python code (``tokenizer_config.json`` ``auto_map``, a tiktoken ranks file). The
pipeline, the planner, the HF engine, the SGLang engine and the manifest all ask this module, so they
agree on the layer count, the hidden size, the dtype, where the language model's weights sit and
whether remote code must run. (The capture plugin, which may not import layertap, hooks the decoder
layers under both module prefixes itself: `sglang_patch.launch.MODULE_PREFIXES`.)

Remote code is opt-in per run (``trust_remote_code``): a folder that needs it fails before any work,
naming the flag and the file that would run.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from layertap.errors import SpecError
from layertap.models.quantization import Quantization
from sglang_patch.identity import has_weight_files

if TYPE_CHECKING:  # transformers (and torch under it) load when a tokenizer is first needed: commands that never
    from transformers import PreTrainedTokenizerBase  # tokenize (status, submit, verify, --help) start in a second

# Where a wrapper keeps its language model: the weight-name prefix and the module path in SGLang.
WRAPPED_PREFIX = "language_model."
REMOTE_CODE_FLAG = "--trust-remote-code"
# What a tokenizer loads besides its code: transformers' own files, then the vocabularies of the tokenizer
# classes in use (Rust tokenizers, sentencepiece, BPE vocab + merges, WordPiece, tiktoken ranks as Kimi's).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json", "vocab.json", "vocab.txt", "merges.txt")  # fmt: skip
TOKENIZER_PATTERNS = ("*.tiktoken", "tiktoken.model", "*.model", "*.vocab", "additional_chat_templates/*.jinja")
_RELATIVE_IMPORT = re.compile(r"^\s*(?:from\s+\.(\w+)\s+import|import\s+\.(\w+))", re.MULTILINE)


@dataclass(frozen=True, slots=True)
class ModelFolder:
    """What layertap needs to know about a model folder, without loading weights.

    ``config`` is the whole ``config.json``; ``text_config`` the language model's part of it (the same
    dict for a plain causal LM). ``prefix`` is ``"language_model."`` for a multimodal wrapper, else ``""``.
    """

    path: Path
    config: dict[str, Any]
    text_config: dict[str, Any]
    prefix: str
    remote_code: tuple[str, ...]  # the folder's Python files that loading its tokenizer, processor or config would run
    quantization: Quantization | None  # packed INT4 weights (Kimi-K2.5's experts), or None for plain weights

    @classmethod
    def read(cls, path: Path) -> ModelFolder:
        """Read ``path``'s config.json and tokenizer_config.json; SpecError if it is not a model folder."""
        path = Path(path)
        config = _read_json(path / "config.json")
        if config is None:
            raise SpecError(f"model {path} is not a model folder (no config.json)")
        text = config.get("text_config")
        wrapped = isinstance(text, dict)
        text_config = text if wrapped else config
        for key in ("num_hidden_layers", "hidden_size"):
            if key not in text_config:
                where = "text_config" if wrapped else "config.json"
                raise SpecError(f"model {path}: {where} has no {key!r}; not a causal language model layertap can read")
        return cls(
            path=path,
            config=config,
            text_config=text_config,
            prefix=WRAPPED_PREFIX if wrapped else "",
            remote_code=_remote_code_files(path, config),
            quantization=_quantization(path, config, text_config if wrapped else None),
        )

    @property
    def num_layers(self) -> int:
        """Decoder layers of the language model (MTP/nextn layers excluded: they are not in the stack)."""
        return int(self.text_config["num_hidden_layers"])

    @property
    def hidden_size(self) -> int:
        return int(self.text_config["hidden_size"])

    @property
    def wrapped(self) -> bool:
        """True for a multimodal wrapper whose language model sits under ``language_model.``."""
        return bool(self.prefix)

    @property
    def dtype(self) -> str:
        """The dtype the weights are meant to compute in (config ``dtype``/``torch_dtype``; float32 if unset)."""
        for cfg in (self.text_config, self.config):
            if value := cfg.get("dtype") or cfg.get("torch_dtype"):
                return str(value).removeprefix("torch.")
        return "float32"

    @property
    def context_length(self) -> int | None:
        """The language model's context length (``max_position_embeddings``); None when its config has none."""
        value = self.text_config.get("max_position_embeddings")
        return value if isinstance(value, int) and value > 0 else None

    def preflight(self, *, trust_remote_code: bool, max_length: int | None) -> None:
        """SpecError for what a run would otherwise meet only later: code it did not allow, or a
        ``max_length`` above the context length (a server refuses each longer row, one by one)."""
        self.check_remote_code(trust_remote_code)
        if max_length is not None and self.context_length is not None and max_length > self.context_length:
            where = "text_config.max_position_embeddings" if self.wrapped else "max_position_embeddings"
            raise SpecError(
                f"max_length {max_length} is above the context length of {self.path} ({self.context_length}, "
                f"{where} in config.json): give at most {self.context_length}"
            )

    @property
    def has_weights(self) -> bool:
        """Whether the folder holds weight files; a config-only folder (SGLang's ``--load-format dummy`` makes
        random weights for it) serves benchmarks, never a reference."""
        return has_weight_files(self.path)

    def check_remote_code(self, trust_remote_code: bool) -> None:
        """SpecError naming the flag and the files when the folder needs code the run did not allow."""
        if self.remote_code and not trust_remote_code:
            files = ", ".join(str(self.path / name) for name in self.remote_code)
            raise SpecError(
                f"model {self.path} ships code that loading it would run ({files}, named by auto_map). "
                f"Read it, and if you trust it pass {REMOTE_CODE_FLAG} (job spec: trust_remote_code: true)"
            )

    @property
    def tokenizer_files(self) -> tuple[str, ...]:
        """Every file of the folder that loading its tokenizer reads (relative names, sorted): transformers' own
        files, the vocabularies (a tiktoken ranks file, sentencepiece models, BPE merges) and the tokenizer's code
        (its ``auto_map`` modules and the folder's modules they import), found without running any of it."""
        names = {name for name in TOKENIZER_FILES if (self.path / name).is_file()}
        names |= {
            p.relative_to(self.path).as_posix() for pattern in TOKENIZER_PATTERNS for p in self.path.glob(pattern)
        }
        tok_map = (_read_json(self.path / "tokenizer_config.json") or {}).get("auto_map")
        code = [name for name in _auto_map_files(self.path, tok_map) if (self.path / name).is_file()]
        while code:
            name = code.pop()
            if name not in names:
                names.add(name)
                imported = _RELATIVE_IMPORT.findall((self.path / name).read_text(errors="replace"))
                code += [f"{m}.py" for pair in imported for m in pair if m and (self.path / f"{m}.py").is_file()]
        return tuple(sorted(names))

    def load_tokenizer(self, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
        """The folder's tokenizer, loaded once per process while its files stay the same (a worker runs
        many shards, and a large model's tokenizer can take seconds to load). Checks remote code first."""
        self.check_remote_code(trust_remote_code)
        files = tuple(sorted((p.name, p.stat().st_mtime_ns) for p in self.path.iterdir()))
        return _cached_tokenizer(str(self.path.resolve()), files, trust_remote_code)


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except json.JSONDecodeError as exc:
        raise SpecError(f"{path} is not valid JSON: {exc}") from exc


def _quantization(path: Path, config: dict[str, Any], text_config: dict[str, Any] | None) -> Quantization | None:
    """The language model's quantization: a wrapper states it in ``text_config`` (servers copy it up to the top
    level; either place is read, ``text_config`` first)."""
    places = [("text_config", text_config)] if text_config is not None else []
    for where, cfg in [*places, ("config.json", config)]:
        if cfg.get("quantization_config") is not None:
            return Quantization.read(cfg, where=where, model=str(path))
    return None


def _auto_map_files(path: Path, auto_map: Any) -> list[str]:
    """``module.Class`` references of an auto_map -> the folder's ``module.py`` files (other repos' code
    named as ``repo--module.Class`` are listed as given: they would be downloaded and run too)."""
    refs: list[str] = []
    for value in (auto_map or {}).values():
        refs.extend(v for v in (value if isinstance(value, list | tuple) else [value]) if isinstance(v, str))
    files = []
    for ref in refs:
        module = ref.rsplit(".", 1)[0]
        name = module if "--" in module else f"{module.replace('.', '/')}.py"
        if name not in files:
            files.append(name)
    return files


def _remote_code_files(path: Path, config: dict[str, Any]) -> tuple[str, ...]:
    """The files a run would execute: the tokenizer's and the processor's auto_map always (their classes exist
    nowhere else; SGLang loads the processor at start-up); config.json's auto_map only when transformers lacks
    the model type and the folder is no wrapper whose language model layertap loads itself."""
    files: list[str] = []
    for name in ("tokenizer_config.json", "processor_config.json", "preprocessor_config.json"):
        files += [f for f in _auto_map_files(path, (_read_json(path / name) or {}).get("auto_map")) if f not in files]
    if not isinstance(config.get("text_config"), dict):
        from transformers import CONFIG_MAPPING

        if config.get("model_type") not in CONFIG_MAPPING:
            files += [f for f in _auto_map_files(path, config.get("auto_map")) if f not in files]
    return tuple(files)


@functools.lru_cache(maxsize=4)
def _cached_tokenizer(
    model: str, files: tuple[tuple[str, int], ...], trust_remote_code: bool
) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model, trust_remote_code=trust_remote_code)


def model_dims(model_dir: Path) -> tuple[int, int]:
    """(number of decoder layers, hidden size) of the folder's language model, without loading weights."""
    folder = ModelFolder.read(model_dir)
    return folder.num_layers, folder.hidden_size
