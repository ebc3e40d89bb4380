"""Every id a tiny model can emit decodes, as with a real folder's tokenizer (SGLang's detokenizer died on an id
the tiny kimi-k2.5 tokenizer lacked), and the reserved ids filling the vocabulary change no text's encoding."""

from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from layertap.tiny import SHAPES, build_tokenizer
from layertap.tiny.build import deepseek_v3_config
from layertap.tiny.kimi_tokenizer import write_tokenizer_files

SAMPLE = "Déjà vu 😀 <|im_end|> <|reserved_token_1700|> x = [1, 2]\n\tdone"


def _vocab(arch: str, shape: str) -> int:
    """The model vocabulary `build_tiny_model(arch, shape=shape)` gives."""
    if arch == "kimi-k2.5":
        return deepseek_v3_config(shape, {})["vocab_size"]  # type: ignore[arg-type]
    return SHAPES[shape].get("vocab_size", len(build_tokenizer()))


def _tokenizer(arch: str, vocab: int, folder: Path) -> PreTrainedTokenizerBase:
    if arch == "kimi-k2.5":
        folder.mkdir()
        write_tokenizer_files(folder, vocab)
        return AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    return build_tokenizer(vocab)


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("arch", ["kimi-k2", "kimi-k2.5"])
def test_every_id_of_the_vocabulary_decodes_and_text_encodes_as_before(arch, shape, tmp_path) -> None:
    vocab = _vocab(arch, shape)
    tok = _tokenizer(arch, vocab, tmp_path / "tok")
    assert len(tok) == vocab
    ids = list(range(vocab))
    tokens = tok.convert_ids_to_tokens(ids)
    assert None not in tokens and len(set(tokens)) == vocab
    assert tok.convert_tokens_to_ids(tokens) == ids
    assert all(isinstance(tok.decode([i]), str) for i in ids)

    # The same tokenizer without reserved ids (its own tokens end at its last special token) encodes alike.
    own = max(tok.added_tokens_decoder) + 1 if arch == "kimi-k2.5" else len(build_tokenizer())
    plain = _tokenizer(arch, own, tmp_path / "plain")
    assert tok(SAMPLE)["input_ids"] == plain(SAMPLE)["input_ids"] and max(plain(SAMPLE)["input_ids"]) < own
