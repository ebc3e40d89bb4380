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

Each trained turn appears in the sample as the target produced it: the template's rendering of the messages before
it with the generation prompt, then the turn as generated (its reasoning, ``</think>``, its content, its end of turn).
Where the full rendering holds every trained turn so, it is the sample. A template that rewrites turns once later ones
follow (Kimi-K2.5's drops the reasoning of every turn up to the last answer) does not: the sample is then the
conversation up to its last trained turn as the target saw it when writing that turn (the messages before it rendered
with the generation prompt, then the turn), earlier turns trained where it shows them as generated and context
(`Rendering.context`, outside the mask) where not, the messages after it left out. A turn whose own rendering drops its
reasoning into an empty ``<think></think>`` has the reasoning put back into that block; a generation prompt that closes
the block itself (thinking off) and a template with no thinking block keep the turn as rendered.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase
from transformers.utils.chat_template_utils import render_jinja_template

from layertap.data.rows import Conversation, ParsedRow, Preformatted, Pretokenized
from layertap.errors import DatasetError, OverlongRow, RowError, SpecError
from layertap.sample import TokenizedSample
from layertap.spec import OverlongPolicy

Span = tuple[int, int]
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
# Why a turn asked to be trained is context only in its sample (`Rendering.context`).
REWRITTEN = "context: the chat template rewrites it once later turns follow"
REASONING_DROPPED = f"{REWRITTEN} (drops its reasoning)"
UNLOCATED = "context: the chat template does not render it after its generation prompt"

# Put after a cut turn's last generated text to find where that text ends in the rendering (`ChatTokenizer.render`):
# a private-use character pair no chat template writes.
_CUT_MARK = "\ue000cut\ue001"
# A turn's reasoning replaced by this shows whether the template renders the reasoning at all.
_REASONING_MARK = "\ue000reasoning\ue001"

# A plain two-turn chat every template must be able to mask: if it cannot, no conversation can be trusted.
_PROBE = Conversation(
    [
        {"role": "user", "content": "Hello there."},
        {"role": "assistant", "content": "Hi! How can I help?"},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
    ]
)


@dataclass(frozen=True, slots=True)
class Rendering:
    """A conversation as its sample holds it (`ChatTokenizer.render`): ``text``; ``spans``, the characters
    ``[start, end)`` the loss mask covers, of the trained turns in order; ``context``, each assistant turn asked to be
    trained that the text holds only as context (not as it was generated), with why; ``messages``, how many of the
    conversation's messages the text holds (fewer when it ends with its last trained turn)."""

    text: str
    spans: list[Span]
    context: tuple[tuple[int, str], ...]
    messages: int


@dataclass(frozen=True, slots=True)
class _Turn:
    """One assistant turn as generated: ``before``, its prompt (the messages before it rendered with the generation
    prompt); ``text``, what follows it; ``end``, where in ``before + text`` its loss mask ends."""

    before: str
    text: str
    end: int


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
        the ``cut`` ones among them end their mask with their text; a turn the sample holds only as context is named
        in the sample's ``context`` (see the module doc).

        Longer than ``max_length``: ``truncate`` keeps the first ``max_length`` tokens and flags the
        sample; ``skip`` raises RowError. Raises RowError (with its kind) for an empty result, a
        truncation that leaves no assistant token, ids outside the vocabulary, anything the template or
        the tokenizer raises, or a turn the template cannot show as generated (`render`).
        """

        def fail(reason: str, kind: str | None = None) -> RowError:
            return RowError(reason, row=row_number, sample_id=sample_id, kind=kind)

        context: tuple[tuple[int, str], ...] = ()
        held = None
        if isinstance(row, Conversation):
            self._check_template()
            ids, mask, rendering = self._conversation(row, row_number, sample_id, turns, cut)
            context, held = rendering.context, rendering.messages
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
            context=context,
            messages=held,
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
    ) -> Rendering:
        """The conversation as its sample holds it (see the module doc): the text, the character spans of the
        assistant turns it trains (of those among ``turns``, indices into its messages, when given) and the turns it
        holds as context only.

        A span runs from the end of the generation prompt to the end of the assistant's turn,
        whitespace the template puts after the end-of-turn token excluded (the model stops at the
        token and never produces the separator); a ``cut`` turn's span ends with its text (`_cut_end`).
        Raises RowError (kind ``template``) when the last turn to train cannot be shown as generated: its generation
        prompt is not where the template renders the turn, or the template drops its reasoning with no empty
        thinking block to put it in.
        """

        def fail(reason: str) -> RowError:
            return RowError(reason, row=row_number, sample_id=sample_id, kind="template")

        msgs = conv.messages
        full = self._render(msgs, conv, False, fail)
        wanted = [k for k, m in enumerate(msgs) if m["role"] == "assistant" and (turns is None or k in turns)]
        generated: dict[int, _Turn | None] = {}
        for k in wanted:
            try:
                generated[k] = self._turn(conv, k, k in cut, fail)
            except RowError:
                if k == wanted[-1]:
                    raise
                generated[k] = None  # an earlier turn the template cannot show as generated: context
        text, held = full, len(msgs)
        if not all(t is not None and full.startswith(t.before + t.text) for t in generated.values()):
            last = generated[wanted[-1]]
            assert last is not None
            text, held = last.before + last.text, wanted[-1] + 1
        spans, context = [], []
        for k, t in generated.items():
            if t is None:
                context.append((k, UNLOCATED))
            elif not text.startswith(t.before + t.text):
                context.append((k, REASONING_DROPPED if msgs[k].get("reasoning_content") else REWRITTEN))
            elif t.end > len(t.before):
                spans.append((len(t.before), t.end))
        return Rendering(text, spans, tuple(context), held)

    def _turn(self, conv: Conversation, k: int, cut: bool, fail: Callable[[str], RowError]) -> _Turn:
        """Assistant turn ``k`` of ``conv`` as generated: its prompt, its text (`_turn_text`) and where its mask ends
        (a ``cut`` one's at the end of its text: `_cut_end`)."""
        before = self._render(conv.messages[:k], conv, True, fail)
        text = self._turn_text(conv, k, conv.messages[k], before, fail)
        end = self._cut_end(conv, k, before, text, fail) if cut else len(before) + len(text.rstrip())
        return _Turn(before, text, end)

    def _turn_text(
        self, conv: Conversation, k: int, msg: dict[str, Any], before: str, fail: Callable[[str], RowError]
    ) -> str:
        """What the target wrote after its prompt ``before`` for ``msg`` as turn ``k``: the template's rendering of
        ``messages[:k] + [msg]`` after the prompt (after the prompt's last occurrence when the template renders the
        earlier messages otherwise once the turn follows), its reasoning put into the empty thinking block where the
        template drops it."""
        msgs = conv.messages[:k]
        through = self._render([*msgs, msg], conv, False, fail)
        if through.startswith(before):
            text = through[len(before) :]
        else:  # the template rewrites what came before once this turn follows: the turn follows the last prompt
            base = self._render(msgs, conv, False, fail)
            prompt = before[len(base) :] if before.startswith(base) else ""
            at = through.rfind(prompt) if prompt else -1
            if at < 0:
                at = _first_difference(before, through)
                raise fail(
                    f"chat template is not prefix-stable, so assistant turn {k} cannot be located: its generation "
                    f"prompt is not where the template renders the turn (the text of messages[:{k}] with the "
                    f"generation prompt and of messages[:{k + 1}] differ at character {at}: "
                    f"{before[at : at + 40]!r} vs {through[at : at + 40]!r}); pass a chat template whose generation "
                    "prompt begins the assistant turn it renders"
                )
            text = through[at + len(prompt) :]
        reasoning = msg.get("reasoning_content")
        if reasoning and _REASONING_MARK not in self._render(
            [*msgs, {**msg, "reasoning_content": _REASONING_MARK}], conv, False, fail
        ):
            text = _with_reasoning(before, text, reasoning, lambda why: fail(f"turn {k}: {why}"))
        return text

    def _cut_end(self, conv: Conversation, k: int, before: str, text: str, fail: Callable[[str], RowError]) -> int:
        """Where the text of the cut turn ``k`` ends in ``before + text`` (the turn starts at ``len(before)``): the end
        of its content, or of its reasoning when it was cut before any content (``len(before)`` when it has
        neither). Found by making the turn again with `_CUT_MARK` after that text; RowError (kind ``template``) when
        the template does not render it as it is (then its made-up end cannot be told apart)."""
        msg = conv.messages[k]
        field = next((f for f in ("content", "reasoning_content") if msg.get(f)), None)
        if field is None:
            return len(before)
        marked = self._turn_text(conv, k, {**msg, field: msg[field] + _CUT_MARK}, before, fail)
        at = marked.find(_CUT_MARK)
        if at < 0 or marked[:at] + marked[at + len(_CUT_MARK) :] != text:
            raise fail(
                f"the chat template does not render the {field} of turn {k}, cut at max_new_tokens, as "
                "it was generated, so the end of turn it closes the turn with cannot be told apart from it"
            )
        return len(before) + at

    def _conversation(
        self, conv: Conversation, row_number: int, sample_id: str, turns: Collection[int] | None, cut: Collection[int]
    ) -> tuple[list[int], list[int], Rendering]:
        rendering = self.render(conv, row_number=row_number, sample_id=sample_id, turns=turns, cut=cut)
        enc = self._encode(rendering.text, row_number, sample_id, offsets=True)
        return enc["input_ids"], _mask_from_spans(enc["offset_mapping"], rendering.spans), rendering

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


def _with_reasoning(before: str, text: str, reasoning: str, fail: Callable[[str], RowError]) -> str:
    """Turn ``text`` (after its prompt ``before``), whose rendering drops its ``reasoning``, as generated: the
    reasoning put into its empty thinking block (``<think></think>``, opened by the prompt or by the turn). Kept as
    rendered where the prompt closes the block itself (thinking off: the target writes no reasoning after it) or the
    template has no thinking block at all; RowError where it has one the reasoning cannot be put into."""
    if before.endswith(THINK_OPEN) and text.startswith(THINK_CLOSE):
        return reasoning + text
    if text.startswith(THINK_OPEN + THINK_CLOSE):
        return THINK_OPEN + reasoning + text[len(THINK_OPEN) :]
    if before.endswith(THINK_OPEN + THINK_CLOSE) or not (
        before.endswith(THINK_OPEN) or THINK_OPEN in text or THINK_CLOSE in text
    ):
        return text
    raise fail(
        f"the chat template drops the turn's reasoning and renders no empty {THINK_OPEN}{THINK_CLOSE} right after "
        "its generation prompt to put it back into, so the turn cannot be shown as the target generated it"
    )


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
