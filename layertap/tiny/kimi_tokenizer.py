"""The tiny Kimi-K2.5 folder's tokenizer files: tiktoken ranks, the folder's own tokenizer class, a Kimi-style
chat template. All generated here; nothing is taken from the vendor's files.

The ranks come from the project's own byte-level BPE (`tokenizer.py`): the 256 bytes, then each merge's
result in merge order. The special tokens carry Kimi's role markers, so a conversation renders with the
same structure a real Kimi-K2.5 folder gives it: `<|im_system|>`/`<|im_user|>`/`<|im_assistant|>` role
headers closed by `<|im_middle|>`, `<|im_end|>` ending every turn, `<think>...</think>` for reasoning (opened by the
generation prompt unless the template variable `thinking` is false; left empty in every turn up to the last answer, as
Kimi-K2.5's template leaves it) and a tool-call section.
"""

from __future__ import annotations

import base64
import json
import shutil
from pathlib import Path
from typing import Any

from layertap.tiny import tiktoken_tokenizer
from layertap.tiny.tokenizer import SPECIAL_TOKENS, TEXT_MACRO, train_bpe

TOKENIZER_MODULE = "tokenization_tiny_kimi"
TOKENIZER_CLASS = "TinyKimiTokenizer"
BOS, EOS, PAD = "[BOS]", "[EOS]", "[PAD]"
IM_END = "<|im_end|>"  # the end-of-turn token: the assistant produces it, so the loss mask covers it
MEDIA_PAD = "<|media_pad|>"
KIMI_SPECIAL_TOKENS: tuple[str, ...] = (
    BOS, EOS, PAD, IM_END, "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>",
    "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>", "<|tool_call_end|>", "<think>", "</think>", MEDIA_PAD,
)  # fmt: skip

# Our own template in Kimi's layout, with Kimi-K2.5's habits. The thinking switch: the template variable `thinking` (on
# unless given false, as SGLang's `chat_template_kwargs`); on, the generation prompt opens the thinking block
# (`<|im_assistant|>assistant<|im_middle|><think>`), off it closes an empty one (`<think></think>`). Turns render as
# Kimi-K2.5's do whatever the switch: the conversation is split after its last assistant turn without tool calls (the
# last answer); every assistant turn up to it renders an empty `<think></think>` (its reasoning dropped: completed
# turns), every one after it (tool-calling turns of the turn in progress) `<think>reasoning</think>`; then content,
# tool-call section, `<|im_end|>`. So a turn renders otherwise once a later answer follows it, and an answer's own
# rendering holds no reasoning (`layertap.data.chat` shows each trained turn as it was generated all the same).
KIMI_CHAT_TEMPLATE = (
    TEXT_MACRO
    + "{%- if tools -%}{{- '<|im_system|>tool_declare<|im_middle|>' + (tools | tojson) + '<|im_end|>' -}}{%- endif -%}"
    "{%- set ns = namespace(last_answer=-1) -%}"
    "{%- for message in messages -%}"
    "{%- if message.role == 'assistant' and not message.tool_calls -%}{%- set ns.last_answer = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for message in messages -%}"
    "{%- if message.role == 'user' -%}{{- '<|im_user|>user<|im_middle|>' + text(message.content) -}}"
    "{%- elif message.role == 'assistant' -%}"
    "{{- '<|im_assistant|>assistant<|im_middle|>' -}}"
    "{%- if loop.index0 <= ns.last_answer -%}{{- '<think></think>' -}}"
    "{%- else -%}{{- '<think>' + (message.reasoning_content or '') + '</think>' -}}{%- endif -%}"
    "{{- text(message.content) -}}"
    "{%- if message.tool_calls -%}"
    "{{- '<|tool_calls_section_begin|>' -}}"
    "{%- for call in message.tool_calls -%}"
    "{%- set fn = call.function if call.function is defined else call -%}"
    "{%- set call_id = call.id if call.id is defined and call.id else 'functions.' + fn.name + ':' + loop.index0|string -%}"
    "{{- '<|tool_call_begin|>' + call_id + '<|tool_call_argument_begin|>' -}}"
    "{%- if fn.arguments is string -%}{{- fn.arguments -}}{%- else -%}{{- fn.arguments | tojson -}}{%- endif -%}"
    "{{- '<|tool_call_end|>' -}}"
    "{%- endfor -%}"
    "{{- '<|tool_calls_section_end|>' -}}"
    "{%- endif -%}"
    "{%- elif message.role == 'tool' -%}"
    "{{- '<|im_system|>tool<|im_middle|>## Return of ' + (message.tool_call_id or message.name or 'tool') + '\\n' -}}"
    "{{- text(message.content) -}}"
    "{%- else -%}{{- '<|im_system|>' + message.role + '<|im_middle|>' + text(message.content) -}}"
    "{%- endif -%}"
    "{{- '<|im_end|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_assistant|>assistant<|im_middle|>' -}}"
    "{%- if thinking is defined and thinking is false -%}{{- '<think></think>' -}}{%- else -%}{{- '<think>' -}}{%- endif -%}"
    "{%- endif -%}"
)


def bpe_ranks() -> dict[bytes, int]:
    """Byte-level BPE ranks from the project's trained tokenizer: 256 single bytes, then merges in order."""
    c2b = {c: b for b, c in tiktoken_tokenizer.byte_to_char().items()}
    state = json.loads(train_bpe().to_str())
    ranks = {bytes([b]): b for b in range(256)}
    for merge in state["model"]["merges"]:
        left, right = merge.split(" ") if isinstance(merge, str) else merge
        piece = bytes(c2b[c] for c in left + right)
        ranks.setdefault(piece, len(ranks))
    assert not any(tok.encode() in ranks for tok in SPECIAL_TOKENS)
    return ranks


def write_tokenizer_files(out_dir: Path, vocab_size: int) -> dict[str, int]:
    """Write `tiktoken.model`, the tokenizer class, `tokenizer_config.json` (with `auto_map` and the chat
    template) into `out_dir`; return the special token ids by name. Deterministic: same bytes every time.

    The ids past the special tokens up to `vocab_size` (the model's vocabulary) are reserved tokens, so every
    id the model can emit decodes, as in a real folder (ValueError if `vocab_size` leaves no room for them)."""
    ranks = bpe_ranks()
    end = len(ranks) + len(KIMI_SPECIAL_TOKENS)
    if vocab_size < end:
        raise ValueError(f"vocab_size {vocab_size} is smaller than the tokenizer's vocabulary ({end} ids)")
    lines = [
        f"{base64.b64encode(piece).decode()} {rank}\n" for piece, rank in sorted(ranks.items(), key=lambda x: x[1])
    ]
    (out_dir / tiktoken_tokenizer.VOCAB_FILE).write_text("".join(lines))
    shutil.copyfile(tiktoken_tokenizer.__file__, out_dir / f"{TOKENIZER_MODULE}.py")
    special = {tok: len(ranks) + i for i, tok in enumerate(KIMI_SPECIAL_TOKENS)}
    added: dict[str, Any] = {
        str(idx): {"content": tok, "lstrip": False, "normalized": False, "rstrip": False,
                   "single_word": False, "special": True}
        for tok, idx in special.items()
    }  # fmt: skip
    config = {
        "tokenizer_class": TOKENIZER_CLASS,
        "auto_map": {"AutoTokenizer": [f"{TOKENIZER_MODULE}.{TOKENIZER_CLASS}", None]},
        "added_tokens_decoder": added,
        "num_reserved_special_tokens": vocab_size - end,
        "bos_token": BOS,
        "eos_token": IM_END,
        "pad_token": PAD,
        "unk_token": None,
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
        "chat_template": KIMI_CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (out_dir / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": BOS, "eos_token": IM_END, "pad_token": PAD}, indent=2) + "\n"
    )
    return special
