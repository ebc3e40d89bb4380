"""A text-only view of a multimodal wrapper folder (Kimi-K2.5), for trainers that cannot take the wrapper.

speculators 0.9.0 reads its verifier with ``AutoConfig.from_pretrained`` and, when it loads the verifier's
embedding and LM head, without ``trust_remote_code``: a wrapper whose config class is code in the folder
(Kimi-K2.5's ``auto_map``) is refused there whatever flag the user gives. The view is a folder that such a
trainer takes: ``config.json`` is the wrapper's ``text_config`` (a type transformers knows, DeepseekV3), and
the weights are the wrapper's own shards by symlink, with a ``model.safetensors.index.json`` listing only the
language model's tensors. Nothing is copied: a view of a 1 TB folder is a few KB. The tensors keep their
``language_model.`` names (safetensors cannot rename without copying); speculators finds its embedding and LM
head by name suffix. The tokenizer files are linked too, so the view tokenizes as the wrapper does. A quantized
wrapper's view keeps ``text_config``'s ``quantization_config``: its shards hold packed INT4 experts, and a config
saying otherwise would have a full loader take them for missing weights; speculators reads only the config and the
bf16 embedding and LM head (the ``ignore`` list keeps them unquantized).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from layertap.errors import SpecError
from layertap.models.folder import WRAPPED_PREFIX, ModelFolder
from layertap.models.weights import INDEX, weight_map

# Not linked: the wrapper's config and its weight index (the view writes its own), and the image processor
# (the view is text only).
_NOT_LINKED = ("config.json", INDEX, "preprocessor_config.json", "processor_config.json")


def write_text_view(model: Path, out: Path) -> Path:
    """Write the text-only view of wrapper folder ``model`` at ``out`` (new or empty) and return ``out``.

    SpecError if ``model`` is no wrapper (a plain folder goes to the trainers as is) or ``out`` holds
    anything. Built in a temporary folder beside ``out`` and renamed into place: no half-made view."""
    folder = ModelFolder.read(model)
    if not folder.wrapped:
        raise SpecError(f"model {model} is a plain causal LM folder (no text_config): give it to the trainer as is")
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise SpecError(f"{out} exists and is not an empty folder; the view needs a new one")
    source = folder.path.resolve()
    weights = {name: shard for name, shard in weight_map(source).items() if name.startswith(WRAPPED_PREFIX)}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; a view is as readable as a folder made by mkdir
    try:
        for path in sorted(source.iterdir()):
            if path.is_file() and path.name not in _NOT_LINKED and not path.name.endswith(".safetensors"):
                (tmp / path.name).symlink_to(path)
        for shard in sorted(set(weights.values())):
            (tmp / shard).symlink_to(source / shard)
        (tmp / "config.json").write_text(json.dumps(folder.text_config, indent=2, sort_keys=True) + "\n")
        index = {"metadata": {"text_view_of": str(source)}, "weight_map": weights}
        (tmp / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
