"""Which turns of a conversation are regenerated, and how generated ids become an OpenAI assistant message.

Pure functions of a conversation, a `ChatTokenizer` and token ids: no server here (`client.py` sends them).

- `turns_to_regenerate`: the rule (`RULES`, recorded in a regenerated store's manifest): the assistant turns after the
  first user turn that answer in text, every one in order (``all``) or the last of them (``last``). A turn that calls
  tools (``tool_calls``) is kept as given, and so are the tool results answering it: regenerated as text, its results
  would answer a call the stored conversation no longer holds. Rows with nothing to regenerate are refused (RowError
  kind ``regenerate``). `kept_turns` says, per assistant turn kept, why (each stored row carries it); the row also
  names the regenerated turns its sample holds only as context (`layertap.data.chat`: a template that rewrites a
  turn once later ones follow) and how many messages the sample holds.
- `TurnFormat`: what a folder's template and tokenizer say about a generated turn: the end-of-turn token the
  template closes an assistant turn with (sent as a stop token: the model's own eos may be another token) and
  the thinking markers (``<think>``/``</think>`` as single tokens, as Kimi-K2.5's), if the tokenizer has them.
- `TurnFormat.message`: generated ids -> ``{"role": "assistant", "content", ["reasoning_content"]}``: ids
  between the thinking markers (the opening one may be the generation prompt's last token) are the reasoning,
  the rest the content; the stop token is left out (the template writes the end of the turn itself). Special
  tokens inside the content (e.g. a tool-call section) are kept as text.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Literal

from layertap.data.chat import THINK_CLOSE, THINK_OPEN, ChatTokenizer
from layertap.data.rows import Conversation, ParsedRow, Preformatted, Pretokenized
from layertap.errors import RowError
from layertap.sample import TokenizedSample
from layertap.spec import RegenerateMode as Mode

FinishReason = Literal["stop", "length"]

# What a regenerating run regenerates and keeps, and what a cut turn is: the manifest's ``generation.rules``. A store
# made under other rules is another run (a resume is refused); the docs' table (docs/cli.md) says the same per shape.
RULES: dict[str, str] = {
    "turns": "regenerated: the assistant turns after the first user turn that answer in text (no tool_calls), every "
    "one (all) or the last (last), each on the chat template of the stored messages before it (with the row's tools) "
    "and the generation prompt; kept as given: system, user and tool messages, assistant turns that call tools "
    "(tool_calls, with the tool results answering them) and assistant turns before the first user turn",
    "trained": "each trained turn appears in the sample as the target produced it: the chat template of the messages "
    "before it with the generation prompt, then the turn as generated (its reasoning, </think>, its content, its end "
    "of turn); where the template's rendering of the whole conversation holds every regenerated turn so, it is the "
    "sample; where it rewrites turns once later ones follow (drops their reasoning), the sample is the conversation up "
    "to the last regenerated turn as the target saw it when writing it, earlier turns the template shows otherwise "
    "than generated are context (outside the loss mask, named in the row) and the messages after it are left out; a "
    "turn whose own rendering drops its reasoning into an empty <think></think> has it put back there",
    "cut": "a turn cut at max_new_tokens (finish_reason length) is stored as generated; the end of turn the chat "
    "template closes it with, which the model never produced, is context for what follows and outside the loss mask",
}
# Why an assistant turn is kept as given (`kept_turns`).
KEPT_CALLS = "calls tools: kept with the tool results answering it"
KEPT_UNANSWERING = "before the first user turn: it answers nothing"
KEPT_EARLIER = "before the last answer in text (regenerate last)"

# A plain chat whose assistant turn the template renders as this content, then its end of turn.
_PROBE_CONTENT = "Hi."
_PROBE = Conversation([{"role": "user", "content": "Hello."}, {"role": "assistant", "content": _PROBE_CONTENT}])


@dataclass(frozen=True, slots=True)
class GeneratedTurn:
    """One regenerated assistant turn: ``index`` into the messages, the ids the server was given
    (``prompt_ids``), the ids it generated (``output_ids``, the stop token last when it stopped on one, as HF
    ``generate`` returns them), why it ended and the seed it sampled with."""

    index: int
    prompt_ids: list[int]
    output_ids: list[int]
    finish_reason: FinishReason
    seed: int


@dataclass(frozen=True, slots=True)
class Regenerated:
    """A row with its assistant turns regenerated: ``conversation`` (what the chat template renders for the
    capture) and its ``turns`` in order."""

    sample_id: str
    conversation: Conversation
    turns: tuple[GeneratedTurn, ...]

    def record(self, sample: TokenizedSample) -> dict[str, Any]:
        """The row as the regenerated dataset stores it: ``{"id", "messages", ["tools"], "regeneration"}``, the
        messages in OpenAI form, each regenerated turn with its ``finish_reason`` (``length``: cut, see `RULES`);
        ``regeneration`` says which turns were regenerated, which assistant turns were kept as given and why, which
        regenerated turns its ``sample`` (this row tokenized) holds only as context and why, and how many messages
        the sample holds."""
        messages = [dict(m) for m in self.conversation.messages]
        for turn in self.turns:
            messages[turn.index]["finish_reason"] = turn.finish_reason
        row: dict[str, Any] = {"id": self.sample_id, "messages": messages}
        if self.conversation.tools is not None:
            row["tools"] = self.conversation.tools
        indices = [t.index for t in self.turns]
        row["regeneration"] = {
            "regenerated": indices,
            "kept": kept_turns(self.conversation.messages, indices),
            "context": [{"turn": k, "why": why} for k, why in sample.context],
            "messages_in_sample": sample.messages,
        }
        return row

    @property
    def cut(self) -> list[int]:
        """The indices of the turns cut at max_new_tokens (finish_reason ``length``)."""
        return [t.index for t in self.turns if t.finish_reason == "length"]

    @property
    def generated_tokens(self) -> int:
        return sum(len(t.output_ids) for t in self.turns)

    @property
    def cut_turns(self) -> int:
        """Turns cut at max_new_tokens (finish_reason ``length``), kept as generated."""
        return sum(t.finish_reason == "length" for t in self.turns)


def stored_conversation(record: dict[str, Any]) -> tuple[Conversation, list[int], list[int]]:
    """A stored row (`Regenerated.record`) as the conversation it renders, the indices of its regenerated turns
    (those with a ``finish_reason``) and of those cut (``length``)."""
    messages = [{k: v for k, v in m.items() if k != "finish_reason"} for m in record["messages"]]
    finish = {i: m["finish_reason"] for i, m in enumerate(record["messages"]) if "finish_reason" in m}
    return Conversation(messages, record.get("tools")), list(finish), [i for i, f in finish.items() if f == "length"]


def turn_seed(seed: int, sample_id: str, turn: int) -> int:
    """The sampling seed of turn ``turn`` (its index in the messages) of sample ``sample_id`` in a run seeded
    ``seed``: a hash of the three, so a resumed or re-sent sample gets the same seed (63 bits: SGLang's int64)."""
    digest = hashlib.sha256(f"{seed}\0{sample_id}\0{turn}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def turns_to_regenerate(parsed: ParsedRow, mode: Mode, *, row: int, sample_id: str) -> list[int]:
    """Indices (into ``parsed.messages``: row ``row``'s) of the assistant turns to regenerate, in order (`RULES`):
    those after the first user turn that answer in text, all or the last; RowError (kind ``regenerate``) when there
    are none. Kept as given: an assistant turn with no user turn before it (a greeting: there is nothing to answer)
    and one that calls tools (its tool results answer its calls)."""

    def refuse(reason: str) -> RowError:
        return RowError(reason, row=row, sample_id=sample_id, kind="regenerate")

    if isinstance(parsed, Preformatted):
        raise refuse("preformatted text (the chat template already applied) has no turns to regenerate")
    if isinstance(parsed, Pretokenized):
        raise refuse("a row of token ids has no turns to regenerate")
    messages = parsed.messages
    first_user = next((i for i, m in enumerate(messages) if m["role"] == "user"), None)
    if first_user is None:
        raise refuse("no user turn: there is nothing for a regenerated response to answer")
    assistants = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not assistants:
        raise refuse("no assistant turn to regenerate")
    if assistants[-1] < first_user:
        raise refuse("no assistant turn after a user turn to regenerate")
    answers = [i for i in assistants if i > first_user and not messages[i].get("tool_calls")]
    if not answers:
        raise refuse(
            "every assistant turn after a user turn calls tools: such turns are kept as given with the tool results "
            "answering them, and no turn answers in text to regenerate"
        )
    return answers if mode == "all" else answers[-1:]


def kept_turns(messages: list[dict[str, Any]], regenerated: list[int]) -> list[dict[str, Any]]:
    """``{"turn", "why"}`` for each assistant turn of ``messages`` kept as given (not in ``regenerated``), in order:
    it calls tools, comes before the first user turn, or (``last``) before the last answer."""
    first_user = next((i for i, m in enumerate(messages) if m["role"] == "user"), len(messages))
    kept = []
    for i, m in enumerate(messages):
        if m["role"] == "assistant" and i not in regenerated:
            why = KEPT_CALLS if m.get("tool_calls") else KEPT_UNANSWERING if i < first_user else KEPT_EARLIER
            kept.append({"turn": i, "why": why})
    return kept


def _single_token(chat: ChatTokenizer, text: str) -> int | None:
    """The id of ``text`` when the tokenizer holds it as one token, else None."""
    if not text:
        return None
    ids = chat.encode(text, row_number=-1, sample_id=None)
    return ids[0] if len(ids) == 1 and chat.tokenizer.decode(ids) == text else None


@dataclass(frozen=True, slots=True)
class TurnFormat:
    """What the folder's template and tokenizer say about a generated assistant turn (see the module doc)."""

    end_of_turn: int | None
    think_open: int | None
    think_close: int | None

    @classmethod
    def of(cls, chat: ChatTokenizer) -> TurnFormat:
        """Read from the template's rendering of a plain chat and from the tokenizer; RowError (kind ``template``)
        when the template cannot render one."""
        probe = chat.render(_PROBE, row_number=-1, sample_id=None)
        turn = probe.text[slice(*probe.spans[-1])] if probe.spans else ""
        end = turn.rpartition(_PROBE_CONTENT)[2] if _PROBE_CONTENT in turn else ""
        opened, closed = _single_token(chat, THINK_OPEN), _single_token(chat, THINK_CLOSE)
        thinking = opened is not None and closed is not None
        return cls(_single_token(chat, end), opened if thinking else None, closed if thinking else None)

    def stop_token_ids(self, chat: ChatTokenizer) -> list[int]:
        """Tokens generation stops on besides the model's own eos (which the server adds): the template's end of
        turn and the tokenizer's eos."""
        ids = [self.end_of_turn, chat.tokenizer.eos_token_id]
        return sorted({i for i in ids if i is not None})

    def message(
        self, chat: ChatTokenizer, prompt_ids: list[int], output_ids: list[int], finish: FinishReason
    ) -> dict[str, Any]:
        """The assistant message of generated ``output_ids`` (see the module doc); ``prompt_ids`` say whether the
        generation prompt opened a thinking block. The stop token (the last id of a turn that stopped) is left
        out. ``reasoning_content`` is present only when the turn thought: a thinking block opened by the prompt
        or by the turn's first token (a turn cut inside it has reasoning and empty content)."""
        ids = output_ids[:-1] if finish == "stop" and output_ids else output_ids
        reasoning: list[int] | None = None
        if self.think_open is not None:
            opened = _opens_thinking(prompt_ids, self.think_open, self.think_close)
            if not opened and ids[:1] == [self.think_open]:
                ids, opened = ids[1:], True
            if opened:
                end = ids.index(self.think_close) if self.think_close in ids else len(ids)
                reasoning, ids = ids[:end], ids[end + 1 :]
        message: dict[str, Any] = {"role": "assistant", "content": _decode(chat, ids)}
        if reasoning is not None:
            message["reasoning_content"] = _decode(chat, reasoning)
        return message


def _opens_thinking(prompt_ids: list[int], think_open: int, think_close: int | None) -> bool:
    """Whether the prompt ends inside a thinking block (its last opening marker after its last closing one)."""
    last_open = max((i for i, t in enumerate(prompt_ids) if t == think_open), default=-1)
    last_close = max((i for i, t in enumerate(prompt_ids) if t == think_close), default=-1)
    return last_open > last_close


def _decode(chat: ChatTokenizer, ids: list[int]) -> str:
    # Special tokens stay: a tool-call section or a marker in the content is text the template renders back.
    return chat.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False) if ids else ""


def retokenization_mismatches(regenerated: Regenerated, sample: TokenizedSample) -> list[str]:
    """Where the ids of ``sample`` (the regenerated conversation through the chat template, tokenized: what the
    capture stores and a trainer tokenizes) do not begin with a trained turn's prompt ids then its output ids (as far
    as a truncated sample goes), one line per turn; empty when they hold every trained turn as it was generated. They
    do not when the model wrote a token sequence its tokenizer would not (a non-canonical split, a character's bytes
    cut in two, an id that decodes to text of other ids), stopped on an eos the template does not end turns with, or
    when the template renders a turn otherwise than it was generated (closes a turn cut inside its thinking with
    ``</think>``). A turn the sample holds only as context (`TokenizedSample.context`) is not trained: not checked."""
    ids = sample.input_ids.tolist()
    context = {k for k, _ in sample.context}
    problems = []
    for turn in regenerated.turns:
        seen = turn.prompt_ids + turn.output_ids
        n = min(len(ids), len(seen))
        if turn.index not in context and ids[:n] != seen[:n]:
            at = next((i for i, (a, b) in enumerate(zip(ids, seen, strict=False)) if a != b), n)
            problems.append(
                f"turn {turn.index}: the conversation's ids differ from the {len(turn.prompt_ids)} prompt + "
                f"{len(turn.output_ids)} generated ids it saw, first at id {at}"
            )
    return problems
