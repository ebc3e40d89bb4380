"""A tiktoken-backed tokenizer class shipped INSIDE the tiny Kimi-K2.5 folder, as the real model ships its own.

`build_tiny_model("kimi-k2.5", ...)` copies this file into the folder as `tokenization_tiny_kimi.py` and
names it in `tokenizer_config.json`'s `auto_map`, so loading the folder's tokenizer runs folder code and
needs `trust_remote_code=True`: the same path a real Kimi-K2.5 folder takes. It imports only the standard
library, tiktoken and transformers (it must load from the folder alone).

The ranks file (`tiktoken.model`, one `base64(token bytes) rank` per line) holds the byte-level BPE; the
special tokens come from `added_tokens_decoder` in tokenizer_config.json and are matched before BPE, as
tiktoken does. `self.model` is the `tiktoken.Encoding`: layertap's loss-mask code reads token offsets from
it (`decode_with_offsets`), since a Python tokenizer has no offset mapping.

The ids above the special tokens up to the model's vocabulary (`num_reserved_special_tokens` of them, as real
Kimi fills its vocabulary) are reserved tokens `<|reserved_token_N|>`: every id the model can emit decodes,
but text never encodes to them (they are not matched), so encoding is what the BPE and the specials give.
"""

from __future__ import annotations

import os
from typing import Any, ClassVar

import tiktoken
from tiktoken.load import load_tiktoken_bpe
from transformers import AddedToken, PreTrainedTokenizer

# Splits text into words, numbers, punctuation runs and whitespace before BPE (tiktoken regex syntax).
PAT_STR = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}{1,3}| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
VOCAB_FILE = "tiktoken.model"
RESERVED = "<|reserved_token_{}|>"


def byte_to_char() -> dict[int, str]:
    """A printable character per byte (GPT-2's byte-level trick), so token strings survive JSON and HF's API."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


class TinyKimiTokenizer(PreTrainedTokenizer):
    """Byte-level BPE over tiktoken ranks plus Kimi-style special tokens (`<|im_end|>`, `<think>`...)."""

    vocab_files_names: ClassVar[dict[str, str]] = {"vocab_file": VOCAB_FILE}
    model_input_names: ClassVar[list[str]] = ["input_ids", "attention_mask"]

    def __init__(
        self,
        vocab_file: str,
        added_tokens_decoder: dict[int, Any] | None = None,
        num_reserved_special_tokens: int = 0,
        **kwargs: Any,
    ) -> None:
        self.vocab_file = vocab_file
        self.num_reserved_special_tokens = num_reserved_special_tokens
        ranks = load_tiktoken_bpe(vocab_file)
        specials: dict[str, int] = {}
        for idx, tok in (added_tokens_decoder or {}).items():
            specials[tok.content if isinstance(tok, AddedToken) else tok["content"]] = int(idx)
        self.model = tiktoken.Encoding(
            name=os.path.basename(os.path.dirname(os.path.abspath(vocab_file))) or "tiny-kimi",
            pat_str=PAT_STR,
            mergeable_ranks=ranks,
            special_tokens=specials,
        )
        self._b2c = byte_to_char()
        self._c2b = {c: b for b, c in self._b2c.items()}
        self.encoder = {self._to_str(piece): rank for piece, rank in ranks.items()}
        self.decoder = {rank: piece for piece, rank in self.encoder.items()}
        first = self.model.n_vocab
        self._reserved = {RESERVED.format(i): i for i in range(first, first + num_reserved_special_tokens)}
        self._vocab_end = first + num_reserved_special_tokens
        super().__init__(
            added_tokens_decoder=added_tokens_decoder, num_reserved_special_tokens=num_reserved_special_tokens, **kwargs
        )

    def _to_str(self, piece: bytes) -> str:
        return "".join(self._b2c[b] for b in piece)

    @property
    def vocab_size(self) -> int:
        return self._vocab_end

    def get_vocab(self) -> dict[str, int]:
        return {**self.encoder, **self.added_tokens_encoder, **self._reserved}

    def _tokenize(self, text: str, **kwargs: Any) -> list[str]:
        # Special tokens were split off by the caller; what is left is plain text.
        return [self._to_str(self.model.decode_single_token_bytes(t)) for t in self.model.encode_ordinary(text)]

    def _convert_token_to_id(self, token: str) -> int:
        return self.encoder[token] if token in self.encoder else self._reserved[token]

    def _convert_id_to_token(self, index: int) -> str:
        if self.model.n_vocab <= index < self._vocab_end:
            return RESERVED.format(index)
        return self.decoder[index]

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        # Reserved tokens are whole strings; byte-level pieces between them are joined into bytes and decoded.
        out, pieces = [], []
        for token in tokens:
            if token in self._reserved:
                out += [bytes(pieces).decode("utf-8", errors="replace"), token]
                pieces = []
            else:
                pieces += [self._c2b[c] for c in token]
        return "".join(out) + bytes(pieces).decode("utf-8", errors="replace")

    def save_vocabulary(self, save_directory: str, filename_prefix: str | None = None) -> tuple[str]:
        import base64

        path = os.path.join(save_directory, (filename_prefix + "-" if filename_prefix else "") + VOCAB_FILE)
        ranks = sorted(((self.model.decode_single_token_bytes(r), r) for r in self.decoder), key=lambda x: x[1])
        with open(path, "w", encoding="utf-8") as f:
            f.writelines(f"{base64.b64encode(piece).decode()} {rank}\n" for piece, rank in ranks)
        return (path,)
