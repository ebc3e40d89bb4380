"""The acceptance benchmark's own target (``acceptance_bench.py`` runs these stages): a code corpus from the
machine's installed packages, a BPE tokenizer with layertap's chat template, a small Llama trained from scratch
in chat form, and the conversations its drafter is trained on. No model hub is reachable, so the target is
made here; everything is a function of the seed and of the files under the corpus root.

- corpus: the ``.py`` / ``.md`` / ``.rst`` / ``.txt`` files under a site-packages folder (sorted walk, duplicates
  by content dropped), a seeded selection, split train / held-out by file: nothing of a held-out file is ever in
  the target's or the drafter's training data.
- a conversation: user = a window of a file's lines (the first is its head), assistant = the lines that follow.
- a source model: a smaller Llama trained on other files of the same root (none of the target's), whose greedy
  replies to the drafter's user turns stand for what users regenerate: responses written by a model that is not
  the target (ShareGPT / UltraChat answers for a Llama target).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from benchmarks.common import read_jsonl, write_jsonl
from layertap.data.chat import ChatTokenizer
from layertap.data.rows import parse_row
from layertap.errors import RowError
from layertap.models.weights import INDEX, weight_map
from layertap.tiny.tokenizer import BOS, IM_END, PAD, chat_tokenizer, reserve_ids, train_bpe

SUFFIXES = (".py", ".md", ".rst", ".txt")
# A trained model's shape as its facts (and the report) give it.
CONFIG_KEYS = ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size",
               "vocab_size")  # fmt: skip


@dataclass(frozen=True)
class Sizes:
    """Everything that differs between the H200 run and the CPU smoke test."""

    corpus_files: int  # files selected from the corpus root (before the split)
    held_out: float  # share of files held out
    tokenizer_chars: int  # characters of training text the BPE learns from
    vocab: int
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    seq_len: int  # the target's training blocks (packed conversations)
    batch: int
    steps: int
    lr: float
    head_chars: int  # a conversation's user turn, about
    reply_chars: int  # its assistant turn, about
    conversations: int  # the drafter's training set
    prompts: int  # held-out prompts served
    capture: tuple[int, int, int]  # aux capture indices (each <= layers - 2: control (b) stays in range)
    max_new_tokens: int
    drafter_epochs: int
    drafter_lr: float
    regen_tokens: int  # arms d and f: the most new tokens of a regenerated (d) or source-written (f) turn
    drafter_batch: int  # SpecForge's training.batch_size (its default 1 leaves a GPU idle on a drafter this small)
    target_seconds: float  # the target's training stops here even if `steps` are not done (a device call's limit)
    source_files: int  # files outside the selection the source model trains on
    source_layers: int  # the source model: a Llama of this depth and width, heads of 64, MLP 3x
    source_hidden: int
    source_steps: int
    prompts_c1: int  # prompts served one at a time (concurrency 1 is the slow measurement)
    source_temperature: float  # the source model samples its replies (as the models behind ShareGPT answers did)
    regen_temperature: float  # arm d's `--temperature` (greedy on the GPU, as served; the tiny smoke models
    # answer greedily with whitespace only, a row layertap refuses)


# A target whose forward pass dominates the drafter's (one layer): 64 layers of hidden 1024, 0.8B parameters,
# trained for a few minutes; at one request in flight its decode step is launch-bound, so depth is what it costs.
# SpecForge batch 1: at 4, HF-engine stores (no server context limit: a 7,966-token sample) ran its eager attention
# out of an H200's memory (121 GiB allocated; 2026-12-06).
GPU = Sizes(corpus_files=12000, held_out=0.05, tokenizer_chars=10_000_000, vocab=32000, layers=64, hidden=1024,
            heads=16, kv_heads=8, intermediate=2816, seq_len=1024, batch=16, steps=640, lr=5e-4, head_chars=900,
            reply_chars=1200, conversations=1000, prompts=200, capture=(4, 33, 60), max_new_tokens=128,
            drafter_epochs=3, drafter_lr=1e-3, drafter_batch=1, regen_tokens=256, target_seconds=110,
            source_files=4000, source_layers=8, source_hidden=512, source_steps=150, prompts_c1=32,
            source_temperature=0.7, regen_temperature=0.0)  # fmt: skip
# The H200 path end to end at a tenth of the work, in one device call: proves the stages run there, not a result.
PROBE = Sizes(corpus_files=2000, held_out=0.05, tokenizer_chars=3_000_000, vocab=8000, layers=8, hidden=512, heads=8,
              kv_heads=4, intermediate=1536, seq_len=512, batch=32, steps=200, lr=1e-3, head_chars=900, reply_chars=900,
              conversations=600, prompts=40, capture=(2, 4, 6), max_new_tokens=64, drafter_epochs=1,
              drafter_lr=1e-3, drafter_batch=4, regen_tokens=128, target_seconds=120, source_files=1000,
              source_layers=4, source_hidden=256, source_steps=100, prompts_c1=8,
              source_temperature=0.7, regen_temperature=0.0)  # fmt: skip
SMOKE = Sizes(corpus_files=160, held_out=0.1, tokenizer_chars=600_000, vocab=1024, layers=5, hidden=64, heads=4,
              kv_heads=2, intermediate=128, seq_len=128, batch=4, steps=12, lr=3e-3, head_chars=300, reply_chars=300,
              conversations=16, prompts=4, capture=(1, 2, 3), max_new_tokens=16, drafter_epochs=1,
              drafter_lr=3e-3, drafter_batch=2, regen_tokens=16, target_seconds=600, source_files=60, source_layers=2,
              source_hidden=64, source_steps=8, prompts_c1=2,
              source_temperature=1.0, regen_temperature=1.0)  # fmt: skip


def source_sizes(sizes: Sizes) -> Sizes:
    """The source model's sizes: `sizes` with its depth, width and steps (heads of 64 dimensions, half as many
    key-value heads, an MLP 3x wide)."""
    heads = max(1, sizes.source_hidden // 64)
    return replace(sizes, layers=sizes.source_layers, hidden=sizes.source_hidden, heads=heads,
                   kv_heads=max(1, heads // 2), intermediate=3 * sizes.source_hidden,
                   steps=sizes.source_steps)  # fmt: skip


def _stable_rank(seed: int, key: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{key}".encode()).digest()[:8], "big")


def build_corpus(root: Path, out: Path, seed: int, sizes: Sizes) -> dict[str, Any]:
    """Select files under `root` and write ``train.jsonl`` / ``held_out.jsonl`` ({"path", "text"} per file) and
    ``facts.json`` into `out`; returns the facts. Same root contents + seed -> same files, same split."""
    found: dict[str, tuple[str, str]] = {}  # content sha -> (relative path, text): one copy of each text
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for name in sorted(filenames):
            path = Path(dirpath) / name
            if path.suffix not in SUFFIXES or path.is_symlink() or not 2_000 <= path.stat().st_size <= 64_000:
                continue
            try:
                text = path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            found.setdefault(hashlib.sha256(text.encode()).hexdigest(), (str(path.relative_to(root)), text))
    if not found:
        raise SystemExit(f"no text files of 2-64 KB under {root}: pass --corpus-root a site-packages folder")
    files = sorted(found.values())
    files.sort(key=lambda f: _stable_rank(seed, f[0]))
    files, source = files[: sizes.corpus_files], files[sizes.corpus_files : sizes.corpus_files + sizes.source_files]
    if not source:
        raise SystemExit(f"{len(found)} text files of 2-64 KB under {root}: the source model needs files beyond "
                         f"the {sizes.corpus_files} selected; pass --corpus-root a larger site-packages "
                         "folder")  # fmt: skip
    held = [f for f in files if _stable_rank(seed + 1, f[0]) % 10_000 < sizes.held_out * 10_000]
    held_paths = {p for p, _ in held}
    train = [f for f in files if f[0] not in held_paths]
    out.mkdir(parents=True, exist_ok=True)
    for name, part in (("train", train), ("held_out", held), ("source", source)):
        write_jsonl(out / f"{name}.jsonl", [{"path": p, "text": t} for p, t in part])
    facts = {"root": str(root), "files_found": len(found), "train_files": len(train), "held_out_files": len(held),
             "train_chars": sum(len(t) for _, t in train), "held_out_chars": sum(len(t) for _, t in held),
             "source_files": len(source), "source_chars": sum(len(t) for _, t in source),
             "files_sha256": hashlib.sha256("\n".join(p for p, _ in files).encode()).hexdigest()}  # fmt: skip
    (out / "facts.json").write_text(json.dumps(facts, indent=1))
    return facts


def build_tokenizer_folder(corpus: Path, out: Path, sizes: Sizes) -> PreTrainedTokenizerFast:
    """A byte-level BPE of `sizes.vocab` ids (reserved tokens fill what the merges leave) learnt from the first
    `sizes.tokenizer_chars` characters of the training files, with layertap's chat template; saved in `out`."""

    def lines() -> Iterator[str]:
        left = sizes.tokenizer_chars
        for f in read_jsonl(corpus / "train.jsonl"):
            for line in f["text"].splitlines(keepends=True):
                yield line
                left -= len(line)
                if left <= 0:
                    return

    bpe = train_bpe(lines(), sizes.vocab)
    tokenizer = chat_tokenizer(reserve_ids(bpe, sizes.vocab))
    tokenizer.save_pretrained(out)
    return tokenizer


def windows(text: str, sizes: Sizes) -> Iterator[tuple[str, str]]:
    """(user, assistant) pairs along a file: a window of whole lines of about `head_chars` (the first is the
    file's head), then the lines that follow, about `reply_chars`; both non-blank."""
    lines, i = text.splitlines(keepends=True), 0

    def take(budget: int) -> str:
        nonlocal i
        part = ""
        while i < len(lines) and len(part) < budget:
            part, i = part + lines[i], i + 1
        return part

    while i < len(lines):
        user, reply = take(sizes.head_chars), take(sizes.reply_chars)
        if user.strip() and reply.strip():
            yield user, reply


def conversation(path: str, j: int, user: str, reply: str | None) -> dict[str, Any]:
    """One row in the messages form layertap reads (a prompt when `reply` is None)."""
    messages = [{"role": "user", "content": user}]
    if reply is not None:
        messages.append({"role": "assistant", "content": reply})
    return {"id": f"{path}#{j}", "messages": messages}


def train_conversations(corpus: Path, seed: int, sizes: Sizes, part: str = "train") -> list[dict[str, Any]]:
    """Every window of every file of `part` (the target's ``train`` files, the source model's ``source`` files) as
    a conversation, in a seeded order."""
    rows = [conversation(f["path"], j, u, r) for f in read_jsonl(corpus / f"{part}.jsonl")
            for j, (u, r) in enumerate(windows(f["text"], sizes))]  # fmt: skip
    random.Random(seed).shuffle(rows)
    return rows


def held_out_conversations(corpus: Path, sizes: Sizes) -> list[dict[str, Any]]:
    """The head of each held-out file and its continuation (prompts and the target's held-out loss)."""
    return [conversation(f["path"], 0, u, r) for f in read_jsonl(corpus / "held_out.jsonl")
            for u, r in [next(windows(f["text"], sizes), ("", ""))] if u]  # fmt: skip


def tokenize(tokenizer: PreTrainedTokenizerFast, rows: list[dict[str, Any]]) -> list[tuple[list[int], list[int]]]:
    """(input_ids, loss_mask) of each conversation as layertap's extraction tokenizes it (rows it refuses dropped)."""
    chat, out = ChatTokenizer(tokenizer), []
    for i, row in enumerate(rows):
        try:
            sample = chat.tokenize(i, row["id"], parse_row(i, row), max_length=None, overlong="truncate")
        except RowError:
            continue
        out.append((sample.input_ids.tolist(), sample.loss_mask.tolist()))
    return out


def _blocks(tokenizer: PreTrainedTokenizerFast, rows: list[dict[str, Any]], seq_len: int) -> torch.Tensor:
    """The conversations rendered by the chat template, encoded in one batch (the ids layertap's extraction gets
    for them: the template renders BOS, encode adds nothing) and packed end to end into [n, seq_len] blocks."""
    texts = [tokenizer.apply_chat_template(r["messages"], tokenize=False) for r in rows]
    stream = [t for ids in tokenizer(texts, add_special_tokens=False)["input_ids"] for t in ids]
    n = len(stream) // seq_len
    return torch.tensor(stream[: n * seq_len], dtype=torch.long).view(n, seq_len)


def held_out_loss(model: LlamaForCausalLM, samples: list[tuple[list[int], list[int]]], device: str) -> float:
    """Mean next-token loss over the assistant tokens of the held-out conversations."""
    total, count = 0.0, 0
    model.eval()
    with torch.no_grad(), torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
        for ids, mask in samples:
            x = torch.tensor([ids], device=device)
            logits = model(x).logits[0, :-1].float()
            target, weight = x[0, 1:], torch.tensor(mask[1:], device=device, dtype=torch.bool)
            losses = torch.nn.functional.cross_entropy(logits, target, reduction="none")[weight]
            total, count = total + float(losses.sum()), count + int(weight.sum())
    model.train()
    return total / max(count, 1)


def train_target(
    corpus: Path, tokenizer_dir: Path, out: Path, seed: int, sizes: Sizes, device: str, part: str = "train"
) -> dict[str, Any]:
    """Train the Llama from scratch on the conversations of `part`'s files (next-token loss on every token of
    packed blocks; AdamW, warm-up then cosine; stopped after `sizes.target_seconds` if the steps are not done),
    save it in `out` (bf16 on a GPU, float32 on the CPU) with the tokenizer, and return its facts (size, tokens
    seen, time, held-out loss)."""
    torch.manual_seed(seed)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(tokenizer_dir)
    ids = tokenizer.convert_tokens_to_ids
    config = LlamaConfig(vocab_size=sizes.vocab, hidden_size=sizes.hidden, num_hidden_layers=sizes.layers,
                         num_attention_heads=sizes.heads, num_key_value_heads=sizes.kv_heads,
                         intermediate_size=sizes.intermediate, max_position_embeddings=4096, tie_word_embeddings=False,
                         bos_token_id=ids(BOS), eos_token_id=ids(IM_END), pad_token_id=ids(PAD),
                         architectures=["LlamaForCausalLM"])  # fmt: skip
    model = LlamaForCausalLM(config).to(device)
    train = _blocks(tokenizer, train_conversations(corpus, seed, sizes, part), sizes.seq_len)
    held = tokenize(tokenizer, held_out_conversations(corpus, sizes))
    optimizer = torch.optim.AdamW(model.parameters(), lr=sizes.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, sizes.steps // 20)

    def lr_factor(step: int) -> float:  # linear warm-up, then cosine to 0
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, sizes.steps - warmup))))

    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(seed))
    losses, t0 = [], time.monotonic()
    for step in range(sizes.steps):
        rows = order[[(step * sizes.batch + k) % len(order) for k in range(sizes.batch)]]
        x = train[rows].to(device)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            loss = model(x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss))
        if step % max(1, sizes.steps // 20) == 0 or step == sizes.steps - 1:
            print(f"{out.name} step {step}/{sizes.steps}: loss {losses[-1]:.3f} ({time.monotonic() - t0:.0f} s)",
                  flush=True)  # fmt: skip
        if time.monotonic() - t0 > sizes.target_seconds:
            print(f"{out.name}: stopped after {step + 1} of {sizes.steps} steps ({sizes.target_seconds:.0f} s)")
            break
    seconds, steps = time.monotonic() - t0, len(losses)
    loss = held_out_loss(model, held, device)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model.to(dtype).save_pretrained(out)
    if not (out / INDEX).exists():  # TRAIN.md: SpecForge's target head finds the LM head through the index
        (out / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map(out)}))
    GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                     pad_token_id=config.pad_token_id).save_pretrained(out)  # fmt: skip
    tokenizer.save_pretrained(out)
    facts = {"params": sum(p.numel() for p in model.parameters()),
             "config": {k: getattr(config, k) for k in CONFIG_KEYS}, "dtype": str(dtype).removeprefix("torch."),
             "train_blocks": len(train), "steps": steps,
             "tokens_seen": steps * sizes.batch * sizes.seq_len, "epochs": steps * sizes.batch / max(1, len(train)),
             "train_seconds": seconds, "first_loss": losses[0], "last_loss": sum(losses[-10:]) / len(losses[-10:]),
             "held_out_loss": loss, "held_out_conversations": len(held), "sizes": asdict(sizes)}  # fmt: skip
    (out / "target_facts.json").write_text(json.dumps(facts, indent=1))
    return facts


def source_responses(
    model_dir: Path, rows: list[dict[str, Any]], sizes: Sizes, seed: int, device: str, batch: int
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """`rows` with each assistant turn replaced by the source model's reply to the user turn (sampled at
    `sizes.source_temperature`, at most `sizes.regen_tokens`, ended by the chat template's end of turn), and the
    facts: replies written, cut at the limit, dropped as blank (a row with a blank reply is left out)."""
    torch.manual_seed(seed)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(model_dir)
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16 if device == "cuda" else torch.float32)
    model.to(device).eval()
    end, pad = tokenizer.convert_tokens_to_ids(IM_END), tokenizer.convert_tokens_to_ids(PAD)
    prompts = [tokenizer.apply_chat_template(r["messages"][:1], add_generation_prompt=True, tokenize=True,
                                             return_dict=False) for r in rows]  # fmt: skip
    order = sorted(range(len(rows)), key=lambda i: len(prompts[i]))  # similar lengths batched: little padding
    replies: dict[int, list[int]] = {}
    cut, t0 = 0, time.monotonic()
    for start in range(0, len(order), batch):
        chunk = order[start : start + batch]
        width = max(len(prompts[i]) for i in chunk)
        ids = torch.tensor([[pad] * (width - len(prompts[i])) + prompts[i] for i in chunk], device=device)
        mask = torch.tensor([[0] * (width - len(prompts[i])) + [1] * len(prompts[i]) for i in chunk], device=device)
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=sizes.regen_tokens,
                                 do_sample=True, temperature=sizes.source_temperature, top_p=1.0, top_k=0,
                                 eos_token_id=end, pad_token_id=pad)  # fmt: skip
        for i, new in zip(chunk, out[:, width:].tolist(), strict=True):
            replies[i] = new[: new.index(end)] if end in new else new
            cut += end not in new
    written, dropped = [], 0
    for i, row in enumerate(rows):
        text = tokenizer.decode(replies[i], skip_special_tokens=True)
        if not text.strip():
            dropped += 1
            continue
        written.append(conversation(row["id"].rsplit("#", 1)[0], int(row["id"].rsplit("#", 1)[1]),
                                    row["messages"][0]["content"], text))  # fmt: skip
    facts = {"rows": len(written), "dropped_empty": dropped, "cut_at_limit": cut,
             "reply_tokens": sum(len(r) for r in replies.values()), "seconds": time.monotonic() - t0}  # fmt: skip
    return written, facts
