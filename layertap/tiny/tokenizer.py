"""The tiny models' tokenizer and chat template, built here because no model hub is reachable.

A byte-level BPE trained on `corpus.CORPUS`: every Unicode string encodes (no unknown token) and offsets
map tokens back to character spans, which the loss-mask code relies on. Training is deterministic, so two
builds give byte-identical `tokenizer.json` files (and so identical tokenizer hashes in manifests).
"""

import json
from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from layertap.tiny.corpus import CORPUS

BOS = "<|bos|>"
PAD = "<|pad|>"
IM_START = "<|im_start|>"
# The end-of-turn token: the assistant produces it, so it is the tokenizer's eos (generation stops on it).
IM_END = "<|im_end|>"
TOOL_CALL_START = "<|tool_call|>"
TOOL_CALL_END = "<|/tool_call|>"
SPECIAL_TOKENS: tuple[str, ...] = (BOS, PAD, IM_START, IM_END, TOOL_CALL_START, TOOL_CALL_END)
RESERVED = "<|reserved_token_{}|>"  # ids past the BPE up to the model's vocabulary (as real Kimi fills its own)

# Once the pairs seen twice run out, the trainer merges pairs seen once (whole corpus words): harmless.
VOCAB_SIZE = 1536

# `text(content)`: a message's text, whether content is a string or a list of typed parts (text parts kept).
TEXT_MACRO = (
    "{%- macro text(content) -%}"
    "{%- if content is string -%}{{- content -}}"
    "{%- elif content is iterable and content is not mapping -%}"
    "{%- for part in content -%}{%- if part.type == 'text' -%}{{- part.text -}}{%- endif -%}{%- endfor -%}"
    "{%- endif -%}"
    "{%- endmacro -%}"
)

# ChatML-like. Turns are joined by "\n" placed BEFORE each `<|im_start|>` (never after `<|im_end|>`), so
# an assistant turn is exactly `<content><|im_end|>`: rendering messages[:k] with add_generation_prompt is
# a string prefix of rendering messages[:k+1] when message k is the assistant's, and the difference is
# what the assistant produced. Nothing depends on the number or position of messages for the same reason.
CHAT_TEMPLATE = (
    TEXT_MACRO + "{%- set ns = namespace(sep='') -%}"
    "{{- bos_token -}}"
    "{%- if tools -%}"
    "{{- '<|im_start|>tools\\n' + (tools | tojson) + '<|im_end|>' -}}"
    "{%- set ns.sep = '\\n' -%}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{{- ns.sep + '<|im_start|>' + message.role -}}"
    "{%- set ns.sep = '\\n' -%}"
    "{%- if message.role == 'tool' -%}"
    "{%- if message.name -%}{{- ' name=' + message.name -}}{%- endif -%}"
    "{%- if message.tool_call_id -%}{{- ' id=' + message.tool_call_id -}}{%- endif -%}"
    "{%- endif -%}"
    "{{- '\\n' + text(message.content) -}}"
    "{%- if message.role == 'assistant' and message.tool_calls -%}"
    "{%- for call in message.tool_calls -%}"
    "{%- set fn = call.function if call.function is defined else call -%}"
    "{%- if not loop.first or text(message.content) -%}{{- '\\n' -}}{%- endif -%}"
    "{{- '<|tool_call|>{\"name\": ' + (fn.name | tojson) + ', \"arguments\": ' -}}"
    "{%- if fn.arguments is string -%}{{- fn.arguments -}}{%- else -%}{{- fn.arguments | tojson -}}{%- endif -%}"
    "{{- '}<|/tool_call|>' -}}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- ns.sep + '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def train_bpe(lines: Iterable[str] | None = None, vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    """The byte-level BPE trained on `lines` (default: the tiny corpus, also the source of the tiny Kimi folder's
    tiktoken ranks), with the special tokens first."""
    tokenizer = Tokenizer(models.BPE())
    # No prefix space: a leading space would be text the user never wrote and would shift offsets.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    if lines is None:
        lines = (line for text in CORPUS for line in text.splitlines(keepends=True))
    tokenizer.train_from_iterator(lines, trainer)
    return tokenizer


def build_tokenizer(vocab_size: int | None = None) -> PreTrainedTokenizerFast:
    """Train the tiny byte-level BPE tokenizer (~1-2K tokens) and attach the chat template.

    BOS is not added by `encode` (no post-processor): the chat template renders it, so encoding a rendered
    conversation with or without `add_special_tokens` gives the same ids. `vocab_size` (a model's vocabulary,
    larger than the BPE's) fills the ids past the BPE with reserved tokens `<|reserved_token_N|>`, so every id
    the model can emit decodes; they sit in the BPE's vocabulary without merges, so no text encodes to them.
    """
    bpe = train_bpe()
    if vocab_size is not None:
        bpe = reserve_ids(bpe, vocab_size)
    return chat_tokenizer(bpe)


def chat_tokenizer(bpe: Tokenizer) -> PreTrainedTokenizerFast:
    """`bpe` (trained by `train_bpe`) as a HF fast tokenizer with the special tokens' roles and the chat template."""
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token=BOS,
        eos_token=IM_END,
        pad_token=PAD,
        extra_special_tokens=[IM_START, TOOL_CALL_START, TOOL_CALL_END],
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=4096,
    )


def reserve_ids(bpe: Tokenizer, vocab_size: int) -> Tokenizer:
    """`bpe` with ids [its size, vocab_size) added to its model's vocabulary as unmerged reserved tokens."""
    state = json.loads(bpe.to_str())
    vocab = state["model"]["vocab"]
    if vocab_size < len(vocab):
        raise ValueError(f"vocab_size {vocab_size} is smaller than the tokenizer's vocabulary ({len(vocab)} ids)")
    vocab.update({RESERVED.format(i): i for i in range(len(vocab), vocab_size)})
    return Tokenizer.from_str(json.dumps(state))
