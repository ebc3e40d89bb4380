"""Chat template -> ``input_ids`` + ``loss_mask``, for any template, with or without generation tags.

The loss mask is 1 exactly on what the assistant produced: its content, its tool calls and the
end-of-turn token the template closes its turn with (generation stops on that token, so the drafter
must predict it). Everything else is 0: system, user and tool turns, role headers, the generation
prompt, separators between turns. A regenerated turn cut at max_new_tokens (``cut``) produced no end of
turn: its mask ends with its generated text, and what the template closes it with (the end-of-turn
token, a ``</think>`` of a turn cut while thinking) is context only.

HF's ``return_assistant_tokens_mask`` needs ``{% generation %}`` tags and silently returns all-0 or
all-1 without them (the failure behind Megatron-Bridge #3359). Instead each assistant turn is found
by rendering: the text of ``messages[:k]`` with the generation prompt is a prefix of the text of
``messages[:k+1]`` when message ``k`` is the assistant's, and the new suffix is what the assistant
produced. That prefix property is checked, never assumed; the character spans are mapped to tokens
with the offsets of one tokenisation of the full text, so the ids are exactly the server's.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase
from transformers.utils.chat_template_utils import render_jinja_template

from layertap.data.rows import Conversation, ParsedRow, Preformatted, Pretokenized
from layertap.errors import DatasetError, OverlongRow, RowError, SpecError
from layertap.sample import TokenizedSample
from layertap.spec import OverlongPolicy

Span = tuple[int, int]

# Put after a cut turn's last generated text to find where that text ends in the rendering (`ChatTokenizer.render`):
# a private-use character pair no chat template writes.
_CUT_MARK = "\ue000cut\ue001"

# A plain two-turn chat every template must be able to mask: if it cannot, no conversation can be trusted.
_PROBE = Conversation(
    [
        {"role": "user", "content": "Hello there."},
        {"role": "assistant", "content": "Hi! How can I help?"},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
    ]
)


class ChatTokenizer:
    """Tokenises parsed rows with one tokenizer and one chat template, built once per process.

    ``chat_template`` overrides the tokenizer's own; ``template_kwargs`` go to the template as
    variables (e.g. ``{"enable_thinking": False}``).
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        chat_template: str | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        self._tiktoken = None if getattr(tokenizer, "is_fast", False) else _tiktoken_encoding(tokenizer)
        if not getattr(tokenizer, "is_fast", False) and self._tiktoken is None:
            raise SpecError(
                "the loss mask needs a fast (Rust) tokenizer or a tiktoken-backed one (as Kimi's): it maps "
                "characters to tokens by offsets"
            )
        self._tok = tokenizer
        # What apply_chat_template passes too: special tokens (bos_token...), then the caller's variables.
        self._variables = {**tokenizer.special_tokens_map, **(template_kwargs or {})}
        self._vocab_size = len(tokenizer)
        self._template_checked = False
        try:
            self._template: str | None = tokenizer.get_chat_template(chat_template)
        except ValueError:  # no template: fine for text and pretokenized rows, checked on a conversation
            self._template = None

    @property
    def chat_template(self) -> str | None:
        """The template text actually used (for the manifest's hash), or None when there is none."""
        return self._template

    def tokenize(
        self,
        row_number: int,
        sample_id: str,
        row: ParsedRow,
        *,
        max_length: int | None,
        overlong: OverlongPolicy,
        turns: Collection[int] | None = None,
        cut: Collection[int] = (),
    ) -> TokenizedSample:
        """One row -> TokenizedSample (``input_ids`` long [T], ``loss_mask`` uint8 [T], ``index`` = row number).

        Preformatted text is tokenised as it is (``add_special_tokens=False``: the text already
        carries what the template rendered, BOS included) with the mask all 1: its roles cannot be
        told apart any more, so every token is a target, as in pretraining-style drafter data.
        Pretokenized rows keep their ids and mask (all 1 when absent). ``turns`` (indices into a conversation's
        messages) limits the mask to those assistant turns (regenerated ones; the others are context as given);
        the ``cut`` ones among them end their mask with their text (see the module doc).

        Longer than ``max_length``: ``truncate`` keeps the first ``max_length`` tokens and flags the
        sample; ``skip`` raises RowError. Raises RowError (with its kind) for an empty result, a
        truncation that leaves no assistant token, ids outside the vocabulary, anything the template or
        the tokenizer raises, or a template that is not prefix-stable.
        """

        def fail(reason: str, kind: str | None = None) -> RowError:
            return RowError(reason, row=row_number, sample_id=sample_id, kind=kind)

        if isinstance(row, Conversation):
            self._check_template()
            ids, mask = self._conversation(row, row_number, sample_id, turns, cut)
        elif isinstance(row, Preformatted):
            ids = self._encode(row.text, row_number, sample_id)["input_ids"]
            mask = [1] * len(ids)
        elif isinstance(row, Pretokenized):
            ids = row.input_ids
            mask = row.loss_mask if row.loss_mask is not None else [1] * len(ids)
            if (bad := next((i for i in ids if i >= self._vocab_size), None)) is not None:
                raise fail(f"input_ids holds id {bad}, outside the tokenizer's vocabulary [0, {self._vocab_size})")
        else:
            raise TypeError(f"not a parsed row: {type(row).__name__}")
        if not ids:
            raise fail("tokenisation gave no tokens", "tokenizer")

        truncated = False
        if max_length is not None and len(ids) > max_length:
            if overlong == "skip":
                raise OverlongRow(
                    f"longer than max_length ({len(ids)} > {max_length} tokens)", row=row_number, sample_id=sample_id
                )
            ids, mask, truncated = ids[:max_length], mask[:max_length], True
            if isinstance(row, Conversation) and not any(mask):
                raise fail(f"no assistant token left after truncation to max_length={max_length}")
        return TokenizedSample(
            sample_id=sample_id,
            index=row_number,
            input_ids=torch.tensor(ids, dtype=torch.long),
            loss_mask=torch.tensor(mask, dtype=torch.uint8),
            truncated=truncated,
        )

    def _check_template(self) -> None:
        """Dataset-level guard, once, before the first conversation: raise DatasetError when the template
        masks a plain two-turn chat all 0 or all 1, since it would then do so to every sample, silently
        training the drafter wrongly. A probe the template cannot render gives no verdict (each row then
        fails on its own)."""
        if self._template_checked:
            return
        self._template_checked = True
        try:
            probe = self.tokenize(-1, "probe", _PROBE, max_length=None, overlong="truncate")
        except RowError:
            return
        if (what := _degenerate_mask(_PROBE, probe)) is not None:
            raise DatasetError(
                f"the chat template gives a plain user/assistant chat a loss mask that is {what}, so it would "
                "do so to every conversation: it does not render assistant turns in a way that can be located. "
                "Pass a chat template (chat_template override) that renders every turn, or pretokenize the "
                "dataset with input_ids and loss_mask"
            )

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        """The tokenizer itself (to decode generated ids and look up single tokens)."""
        return self._tok

    def encode(self, text: str, *, row_number: int, sample_id: str | None) -> list[int]:
        """The ids of ``text`` as `tokenize` tokenizes a rendered conversation (no special tokens added);
        RowError (kind ``tokenizer``) when the tokenizer refuses it."""
        return list(self._encode(text, row_number, sample_id)["input_ids"])

    def render_messages(
        self, conv: Conversation, upto: int, *, generation_prompt: bool, row_number: int, sample_id: str | None
    ) -> str:
        """The text of ``conv.messages[:upto]`` (with the template's generation prompt when asked: what a model is
        given to write turn ``upto``); RowError (kind ``template``) when the template fails on it."""

        def fail(reason: str) -> RowError:
            return RowError(reason, row=row_number, sample_id=sample_id, kind="template")

        return self._render(conv.messages[:upto], conv, generation_prompt, fail)

    def render(
        self,
        conv: Conversation,
        *,
        row_number: int,
        sample_id: str | None,
        turns: Collection[int] | None = None,
        cut: Collection[int] = (),
    ) -> tuple[str, list[Span]]:
        """The rendered conversation and the character spans ``[start, end)`` of its assistant turns (of those
        among ``turns``, indices into its messages, when given).

        A span runs from the end of the generation prompt to the end of the assistant's turn,
        whitespace the template puts after the end-of-turn token excluded (the model stops at the
        token and never produces the separator); a ``cut`` turn's span ends with its text (`_cut_end`).
        Raises RowError when the template is not prefix-stable (e.g. it rewrites earlier turns depending
        on what follows them).
        """

        def fail(reason: str) -> RowError:
            return RowError(reason, row=row_number, sample_id=sample_id, kind="template")

        msgs = conv.messages
        full = self._render(msgs, conv, False, fail)
        spans: list[Span] = []
        for k, msg in enumerate(msgs):
            if msg["role"] != "assistant" or (turns is not None and k not in turns):
                continue
            before = self._render(msgs[:k], conv, True, fail)
            through = self._render(msgs[: k + 1], conv, False, fail)
            for shorter, longer, what in (
                (before, through, f"messages[:{k}] with the generation prompt"),
                (through, full, f"messages[:{k + 1}]"),
            ):
                if not longer.startswith(shorter):
                    at = _first_difference(shorter, longer)
                    raise fail(
                        f"chat template is not prefix-stable, so assistant turns cannot be located: the text "
                        f"of {what} is not a prefix of the longer rendering (they differ at character {at}: "
                        f"{shorter[at : at + 40]!r} vs {longer[at : at + 40]!r}); pass a chat template "
                        "that renders earlier turns the same whatever follows"
                    )
            if k in cut:
                end = self._cut_end(msgs[: k + 1], conv, len(before), through, fail)
            else:
                end = max(len(before), len(through.rstrip()))
            if end > len(before):
                spans.append((len(before), end))
        return full, spans

    def _cut_end(
        self, msgs: list[dict[str, Any]], conv: Conversation, start: int, through: str, fail: Callable[[str], RowError]
    ) -> int:
        """Where the text of the cut turn ``msgs[-1]`` ends in ``through`` (the rendering of ``msgs``; the turn starts
        at ``start``): the end of its content, or of its reasoning when it was cut before any content (``start`` when
        it has neither). Found by rendering the turn again with `_CUT_MARK` after that text; RowError (kind
        ``template``) when the template does not render it as it is (then its made-up end cannot be told apart)."""
        msg = msgs[-1]
        field = next((f for f in ("content", "reasoning_content") if msg.get(f)), None)
        if field is None:
            return start
        marked = self._render([*msgs[:-1], {**msg, field: msg[field] + _CUT_MARK}], conv, False, fail)
        at = marked.find(_CUT_MARK)
        if at < start or marked[:at] + marked[at + len(_CUT_MARK) :] != through:
            raise fail(
                f"the chat template does not render the {field} of turn {len(msgs) - 1}, cut at max_new_tokens, as "
                "it was generated, so the end of turn it closes the turn with cannot be told apart from it"
            )
        return at

    def _conversation(
        self, conv: Conversation, row_number: int, sample_id: str, turns: Collection[int] | None, cut: Collection[int]
    ) -> tuple[list[int], list[int]]:
        text, spans = self.render(conv, row_number=row_number, sample_id=sample_id, turns=turns, cut=cut)
        enc = self._encode(text, row_number, sample_id, offsets=True)
        return enc["input_ids"], _mask_from_spans(enc["offset_mapping"], spans)

    def _render(
        self, messages: list[dict[str, Any]], conv: Conversation, gen: bool, fail: Callable[[str], RowError]
    ) -> str:
        """What ``apply_chat_template(tokenize=False)`` renders, called one level down because that
        refuses an empty message list, which is the prefix of an assistant-first conversation."""
        if self._template is None:
            raise DatasetError(
                "the tokenizer has no chat template and none was given; pass chat_template to render conversations"
            )
        try:
            rendered, _ = render_jinja_template(
                conversations=[messages],
                tools=conv.tools,
                chat_template=self._template,
                add_generation_prompt=gen,
                **self._variables,
            )
        except Exception as exc:  # Jinja errors, raise_exception() in templates: this row cannot render
            raise fail(f"chat template failed on messages[:{len(messages)}]: {type(exc).__name__}: {exc}") from exc
        return rendered[0]

    def _encode(self, text: str, row_number: int, sample_id: str | None, *, offsets: bool = False) -> Any:
        # The template renders BOS and every marker itself; adding special tokens would double BOS.
        # verbose=False: over-long rows are handled by max_length/overlong, not by a tokenizer warning.
        try:
            if self._tiktoken is None:
                return self._tok(text, add_special_tokens=False, return_offsets_mapping=offsets, verbose=False)
            enc = self._tok(text, add_special_tokens=False, verbose=False)
            if offsets:
                enc["offset_mapping"] = _tiktoken_offsets(self._tiktoken, enc["input_ids"], text)
            return enc
        except Exception as exc:  # Rust tokenizers raise TypeError/ValueError/their own types on text they refuse
            reason = f"tokenizer failed: {type(exc).__name__}: {exc}"
            raise RowError(reason, row=row_number, sample_id=sample_id, kind="tokenizer") from exc


def _tiktoken_encoding(tokenizer: PreTrainedTokenizerBase) -> Any:
    """The ``tiktoken.Encoding`` a Python tokenizer class keeps (Kimi's keep it as ``.model``), or None."""
    try:
        import tiktoken
    except ImportError:
        return None
    return next((v for v in vars(tokenizer).values() if isinstance(v, tiktoken.Encoding)), None)


def _tiktoken_offsets(encoding: Any, ids: list[int], text: str) -> list[tuple[int, int]]:
    """Character spans of ``ids`` in ``text``, from tiktoken's own decoder (a token that starts inside a
    character starts at that character). The decoded text must be ``text`` itself, else spans would lie."""
    decoded, starts = encoding.decode_with_offsets(ids)
    if decoded != text:
        at = _first_difference(decoded, text)
        raise SpecError(f"the tokenizer does not round-trip the rendered text (differs at character {at})")
    return list(zip(starts, [*starts[1:], len(text)], strict=True))


def _first_difference(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def _mask_from_spans(offsets: list[tuple[int, int]], spans: list[Span]) -> list[int]:
    """1 for each token whose characters overlap a span; spans sorted and disjoint.

    A token that straddles a span edge (a BPE merge across the boundary) counts as inside: the
    assistant produced part of it. A ``trim_offsets`` post-processor (GPT-2 style) shrinks a
    whitespace token to zero width at its end; it counts as inside only strictly within a span.
    """
    mask = [0] * len(offsets)
    j = 0
    for t, (s, e) in enumerate(offsets):
        while j < len(spans) and spans[j][1] <= s:
            j += 1
        if j == len(spans):
            break
        if s < spans[j][1] and e > spans[j][0]:
            mask[t] = 1
    return mask


def check_loss_mask(row: ParsedRow, sample: TokenizedSample) -> None:
    """Raise RowError (kind ``loss_mask``) when a conversation with user and assistant turns comes out
    with an all-0 or all-1 loss mask: the sample would train the drafter on nothing, or on everything.

    On one row that is the row's doing (e.g. an assistant turn the template drops); a template that
    does it to every row is caught once, before the first conversation, by ``ChatTokenizer.tokenize``.
    """
    if (what := _degenerate_mask(row, sample)) is not None:
        raise RowError(
            f"loss mask is {what}, although the row has user and assistant turns; the chat template does "
            "not render this row's assistant turns in a way that can be located",
            row=sample.index,
            sample_id=sample.sample_id,
            kind="loss_mask",
        )


def _degenerate_mask(row: ParsedRow, sample: TokenizedSample) -> str | None:
    """ "all 0: ..." or "all 1: ..." for a conversation with user and assistant turns whose mask is, else None."""
    if not (isinstance(row, Conversation) and row.has_role("user") and row.has_role("assistant")):
        return None
    ones = int(sample.loss_mask.sum())
    if 0 < ones < sample.num_tokens:
        return None
    return "all 0: no assistant token was found" if ones == 0 else "all 1: user and system tokens are masked in"
