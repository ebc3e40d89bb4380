"""What identifies the weights a capture server loads, computed inside the server's launcher and by layertap alike.

SGLang reports the model path it was started with, not what the folder holds: two folders of one shape (Kimi-K2 and
Kimi-K2.5 are both 61 x 7168) pass every shape check, and a folder can be replaced under its path. The launcher
puts `model_identity` of the folder it serves into the capture hooks' config, which SGLang's ``/server_info``
returns; layertap computes the same for its ``--model`` and refuses a server whose identity differs. Standard
library only (the plugin runs in the server's environment).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.gguf")
WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
ENDS_BYTES = 1 << 20  # read from each end of each weight file


def has_weight_files(folder: Path) -> bool:
    """Whether a model folder holds weight files (layertap's `ModelFolder.has_weights` asks this too)."""
    return any(next(Path(folder).glob(pattern), None) for pattern in WEIGHT_FILES)


def file_sha256(path: Path) -> str:
    """sha256 of one (small) file's bytes."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def weights_sha256(folder: Path) -> str | None:
    """A fingerprint of the folder's weights, cheap for a 1 TB folder: its weight index, then per weight file the
    name, the size and the first and last MiB (a safetensors header names every tensor, shape and offset; the data
    at both ends differs between any two trainings or random initialisations). None without weight files."""
    folder = Path(folder)
    files = sorted({p for pattern in WEIGHT_FILES for p in folder.glob(pattern) if p.is_file()})
    if not files:
        return None
    digest = hashlib.sha256()
    for name in WEIGHT_INDEXES:
        if (folder / name).is_file():
            digest.update(name.encode() + b"\0" + (folder / name).read_bytes())
    for path in files:
        size = path.stat().st_size
        digest.update(f"{path.name}\0{size}\0".encode())
        with path.open("rb") as f:
            digest.update(f.read(ENDS_BYTES))
            if size > ENDS_BYTES:
                f.seek(max(ENDS_BYTES, size - ENDS_BYTES))
                digest.update(f.read())
    return digest.hexdigest()


def model_identity(folder: Path) -> dict[str, str | None]:
    """``{"config_sha256", "weights_sha256"}`` of a model folder (None where it has no such file)."""
    config = Path(folder) / "config.json"
    return {
        "config_sha256": file_sha256(config) if config.is_file() else None,
        "weights_sha256": weights_sha256(folder),
    }
