"""The pure side of regeneration: which turns, turn seeds, generated ids -> an OpenAI assistant message (reasoning
kept apart), and the check that the sample gives back the ids a generation saw, on the tiny models' own
tokenizers and templates (the Kimi-K2.5 one with its thinking markers, which drops completed turns' reasoning as
Kimi-K2.5's does: each trained turn is still in its sample as generated)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from layertap.data.chat import REASONING_DROPPED, ChatTokenizer
from layertap.data.rows import Conversation, parse_row
from layertap.errors import RowError
from layertap.regenerate import (
    GeneratedTurn,
    GenerationSettings,
    Regenerated,
    TurnFormat,
    retokenization_mismatches,
    stored_conversation,
    turn_seed,
    turns_to_regenerate,
)
from layertap.regenerate.turns import KEPT_CALLS, KEPT_EARLIER, KEPT_UNANSWERING
from layertap.sample import TokenizedSample
from layertap.tiny.kimi_tokenizer import KIMI_CHAT_TEMPLATE, write_tokenizer_files
from layertap.tiny.tokenizer import build_tokenizer

# Every message shape regeneration meets (plain, system, single and parallel tool calls, a conversation ending in a tool
# result, reasoning, U+2028/U+2029/\r/control characters, a row that only calls tools); the CPU server tests run it too.
SHAPES = Path(__file__).resolve().parents[2] / "assets" / "datasets" / "regenerate_shapes.jsonl"
# The turns each row regenerates under ``all`` (``last``: the final one): the assistant turns answering in text.
ANSWERS = {"plain": [1, 3, 5], "system": [2, 4], "tool-single": [4, 6], "tool-parallel": [4], "tool-at-the-end": [1],
           "reasoning": [1, 3], "reasoning-tool": [3], "control-chars": [2, 4]}  # fmt: skip


def shape_rows() -> list[dict]:
    """The rows of `SHAPES`, read by JSON lines as written (raw U+2028 and U+0085 sit inside its strings)."""
    return [json.loads(line) for line in SHAPES.read_bytes().split(b"\n") if line]


CHAT = {
    "id": "c1",
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "assistant", "content": "Welcome!"},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another?"},
        {"role": "assistant", "content": "Red."},
        {"role": "user", "content": "Thanks."},
    ],
}


def _rewritten(template: str, *edits: tuple[str, str]) -> str:
    for old, new in edits:
        assert template.count(old) == 1, old
        template = template.replace(old, new)
    return template


@pytest.fixture(scope="module")
def llama_chat() -> ChatTokenizer:
    return ChatTokenizer(build_tokenizer())


@pytest.fixture(scope="module")
def kimi_tokenizer(tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("kimi-tokenizer")
    write_tokenizer_files(folder, 2048)
    return AutoTokenizer.from_pretrained(folder, trust_remote_code=True)


@pytest.fixture(scope="module")
def kimi_chat(kimi_tokenizer) -> ChatTokenizer:
    return ChatTokenizer(kimi_tokenizer)


def ids(chat: ChatTokenizer, text: str) -> list[int]:
    return chat.encode(text, row_number=0, sample_id="t")


def test_all_regenerates_every_answer_and_last_the_final_one() -> None:
    row = parse_row(0, CHAT)
    # The greeting before the first user turn answers nothing and is kept; a trailing user turn stays as given.
    assert turns_to_regenerate(row, "all", row=0, sample_id="c1") == [3, 5]
    assert turns_to_regenerate(row, "last", row=0, sample_id="c1") == [5]


@pytest.mark.parametrize(
    ("row", "reason"),
    [
        ({"text": "<s>user: hi</s>"}, "preformatted text"),
        ({"input_ids": [1, 2, 3]}, "token ids"),
        ({"messages": [{"role": "system", "content": "s"}, {"role": "assistant", "content": "a"}]}, "no user turn"),
        ({"messages": [{"role": "assistant", "content": "a"}, {"role": "user", "content": "u"}]}, "after a user turn"),
    ],
)
@pytest.mark.parametrize("mode", ["last", "all"])
def test_rows_with_nothing_to_regenerate_are_refused(row: dict, reason: str, mode: str) -> None:
    with pytest.raises(RowError, match=reason) as err:
        turns_to_regenerate(parse_row(7, row), mode, row=7, sample_id="x")  # type: ignore[arg-type]
    assert (err.value.kind, err.value.row, err.value.sample_id) == ("regenerate", 7, "x")


@pytest.mark.parametrize("mode", ["last", "all"])
def test_turns_that_call_tools_are_kept_with_their_results_and_only_answers_in_text_are_regenerated(mode: str) -> None:
    rows = shape_rows()
    assert [r["id"] for r in rows] == [*ANSWERS, "only-tool-calls"]
    for n, row in enumerate(rows[:-1]):
        parsed = parse_row(n, row)
        turns = turns_to_regenerate(parsed, mode, row=n, sample_id=row["id"])  # type: ignore[arg-type]
        assert turns == (ANSWERS[row["id"]] if mode == "all" else ANSWERS[row["id"]][-1:]), row["id"]
        assert not any(parsed.messages[k].get("tool_calls") for k in turns)  # type: ignore[union-attr]
    with pytest.raises(RowError, match="every assistant turn after a user turn calls tools") as err:
        turns_to_regenerate(parse_row(8, rows[-1]), mode, row=8, sample_id="only-tool-calls")  # type: ignore[arg-type]
    assert err.value.kind == "regenerate"


def test_each_stored_row_says_what_was_regenerated_and_what_kept_and_why(llama_chat) -> None:
    """The row's ``regeneration``: the regenerated turns, and each assistant turn kept as given with its reason."""
    tools = next(r for r in shape_rows() if r["id"] == "tool-single")
    regen = simulated(llama_chat, tools, {4: "Mild.", 6: "Bye."}, "all")
    assert recorded(llama_chat, regen)["regeneration"] == {
        "regenerated": [4, 6], "kept": [{"turn": 2, "why": KEPT_CALLS}], "context": [], "messages_in_sample": 7}  # fmt: skip
    regen = simulated(llama_chat, CHAT, {5: "Red."}, "last")
    assert recorded(llama_chat, regen)["regeneration"] == {"regenerated": [5], "kept": [
        {"turn": 1, "why": KEPT_UNANSWERING}, {"turn": 3, "why": KEPT_EARLIER}], "context": [],
        "messages_in_sample": 7}  # fmt: skip
    conversation, turns, cut = stored_conversation(json.loads(json.dumps(recorded(llama_chat, regen))))
    assert (conversation, turns, cut) == (regen.conversation, [5], [])


@pytest.mark.parametrize("variables", [None, {}, {"thinking": False}], ids=["llama", "kimi-thinking", "kimi-plain"])
def test_each_turns_prompt_is_hf_apply_chat_template_of_the_messages_before_it(
    llama_chat, kimi_tokenizer, variables
) -> None:
    """What `Regenerator` sends for turn i (the chat's render of messages[:i] with the generation prompt, encoded)
    is HF's ``apply_chat_template(messages[:i], tools=..., add_generation_prompt=True)``, for every shape."""
    chat = llama_chat if variables is None else ChatTokenizer(kimi_tokenizer, template_kwargs=variables)
    for n, row in enumerate(shape_rows()[:-1]):
        conv = parse_row(n, row)
        assert isinstance(conv, Conversation)
        for k in ANSWERS[row["id"]]:
            text = chat.render_messages(conv, k, generation_prompt=True, row_number=n, sample_id="s")
            hf = chat.tokenizer.apply_chat_template(conv.messages[:k], tools=conv.tools, add_generation_prompt=True,
                                                    tokenize=False, **(variables or {}))  # fmt: skip
            assert text == hf and ids(chat, text) == chat.tokenizer(hf, add_special_tokens=False)["input_ids"]


def masked_runs(tokenizer, ids: list[int], mask: list[int]) -> list[str]:
    """The text of each run of loss-mask 1 tokens."""
    runs: list[list[int]] = []
    for i, (tok, on) in enumerate(zip(ids, mask, strict=True)):
        if on:
            runs[-1:] = [[*runs[-1], tok]] if i and mask[i - 1] else [*runs[-1:], [tok]]
    return [tokenizer.decode(r) for r in runs]


def masked_text(chat: ChatTokenizer, conv: Conversation, turns: list[int] | None, cut: list[int]) -> list[str]:
    """The text of each run of loss-mask 1 tokens of ``conv`` masked on ``turns`` (``cut`` ones cut)."""
    sample = chat.tokenize(0, "s", conv, max_length=None, overlong="truncate", turns=turns, cut=cut)
    return masked_runs(chat.tokenizer, sample.input_ids.tolist(), sample.loss_mask.tolist())


def test_a_cut_turn_is_masked_without_the_end_of_turn_it_never_produced(llama_chat, kimi_tokenizer) -> None:
    """A turn cut at max_new_tokens is stored closed by the template (context for what follows) but its mask ends with
    its text: not the end-of-turn token, nor the ``</think>`` closing a turn cut while thinking."""
    conv = Conversation([*CHAT["messages"][2:4], {"role": "user", "content": "More?"},
                         {"role": "assistant", "content": "Red and  "}])  # fmt: skip
    assert masked_text(llama_chat, conv, [1, 3], []) == ["Blue.<|im_end|>", "Red and  <|im_end|>"]
    assert masked_text(llama_chat, conv, [1, 3], [3]) == ["Blue.<|im_end|>", "Red and  "]
    kimi = ChatTokenizer(kimi_tokenizer)
    thinking = Conversation([conv.messages[0], {"role": "assistant", "reasoning_content": "Sky is", "content": ""}])
    assert masked_text(kimi, thinking, [1], []) == ["Sky is</think><|im_end|>"]
    assert masked_text(kimi, thinking, [1], [1]) == ["Sky is"]
    answering = Conversation([conv.messages[0], {"role": "assistant", "reasoning_content": "Sky.", "content": "Blu"}])
    assert masked_text(kimi, answering, [1], [1]) == ["Sky.</think>Blu"]
    # A template that renders every turn's reasoning, trimmed, renders a cut turn's text otherwise than generated: the
    # row's error.
    trims = ChatTokenizer(kimi_tokenizer, chat_template=_rewritten(KIMI_CHAT_TEMPLATE, (
        "loop.index0 <= ns.last_answer", "false"), ("(message.reasoning_content or '')",
                                                   "(message.reasoning_content or '') | trim")))  # fmt: skip
    with pytest.raises(RowError, match="does not render the reasoning_content of turn 1, cut") as err:
        masked_text(trims, Conversation([conv.messages[0], {**thinking.messages[1], "reasoning_content": "Sky is "}]),
                    [1], [1])  # fmt: skip
    assert err.value.kind == "template"


def test_turn_seeds_are_stable_and_apart() -> None:
    seeds = {turn_seed(s, i, t) for s in (0, 1) for i in ("a", "b", "0") for t in (1, 3)}
    assert len(seeds) == 12 and all(0 <= s < 2**63 for s in seeds)
    assert turn_seed(5, "a", 3) == turn_seed(5, "a", 3)


def test_settings_refuse_what_sampling_cannot_take() -> None:
    GenerationSettings(mode="all", max_new_tokens=8, temperature=0.7, top_p=0.9, seed=3)
    for bad in ({"mode": "first"}, {"max_new_tokens": 0}, {"temperature": -1}, {"top_p": 0}, {"nucleus": 1}):
        with pytest.raises(ValueError):
            GenerationSettings(**{"mode": "last", "max_new_tokens": 8, **bad})


def test_turn_format_reads_the_end_of_turn_and_thinking_markers(llama_chat, kimi_chat, kimi_tokenizer) -> None:
    llama = TurnFormat.of(llama_chat)
    assert llama == TurnFormat(llama_chat.tokenizer.convert_tokens_to_ids("<|im_end|>"), None, None)
    kimi = TurnFormat.of(kimi_chat)
    assert kimi == TurnFormat(*kimi_tokenizer.convert_tokens_to_ids(["<|im_end|>", "<think>", "</think>"]))
    assert kimi.stop_token_ids(kimi_chat) == [kimi.end_of_turn]  # the folder's eos is its end of turn


def test_generated_ids_become_content_and_reasoning_apart(kimi_chat) -> None:
    fmt = TurnFormat.of(kimi_chat)
    think, end = fmt.think_open, fmt.think_close
    prompt = ids(kimi_chat, "<|im_user|>user<|im_middle|>Why?<|im_end|><|im_assistant|>assistant<|im_middle|>")
    reasoning, content = ids(kimi_chat, "Sky scatters blue."), ids(kimi_chat, "Rayleigh.")
    eot = [fmt.end_of_turn]
    assert fmt.message(kimi_chat, prompt, [think, *reasoning, end, *content, *eot], "stop") == {
        "role": "assistant", "content": "Rayleigh.", "reasoning_content": "Sky scatters blue."}  # fmt: skip
    # A generation prompt that opens the thinking block itself: the turn starts inside it.
    assert fmt.message(kimi_chat, [*prompt, think], [*reasoning, end, *content, *eot], "stop") == {
        "role": "assistant", "content": "Rayleigh.", "reasoning_content": "Sky scatters blue."}  # fmt: skip
    # Cut inside its thinking: all reasoning, no content; cut content keeps its last id (no stop token to drop).
    assert fmt.message(kimi_chat, prompt, [think, *reasoning], "length") == {
        "role": "assistant", "content": "", "reasoning_content": "Sky scatters blue."}  # fmt: skip
    assert fmt.message(kimi_chat, prompt, content, "length") == {"role": "assistant", "content": "Rayleigh."}
    # Special tokens inside the content are kept as text (a tool-call section renders back from it).
    call = ids(kimi_chat, "<|tool_calls_section_begin|>x<|tool_calls_section_end|>")
    assert fmt.message(kimi_chat, prompt, [*call, *eot], "stop")["content"] == (
        "<|tool_calls_section_begin|>x<|tool_calls_section_end|>"
    )


def test_without_thinking_markers_everything_is_content(llama_chat) -> None:
    fmt = TurnFormat.of(llama_chat)
    out = [*ids(llama_chat, "<think>no</think> plain"), fmt.end_of_turn]
    assert fmt.message(llama_chat, [], out, "stop") == {"role": "assistant", "content": "<think>no</think> plain"}


def sample_of(chat: ChatTokenizer, regen: Regenerated) -> TokenizedSample:
    """The sample of a regenerated row, as the regenerate step tokenizes it: masked on its regenerated turns."""
    turns = [t.index for t in regen.turns]
    return chat.tokenize(0, "s", regen.conversation, max_length=None, overlong="truncate", turns=turns, cut=regen.cut)


def recorded(chat: ChatTokenizer, regen: Regenerated) -> dict:
    """The regenerated row as the store keeps it, beside its sample."""
    return regen.record(sample_of(chat, regen))


def simulated(chat: ChatTokenizer, row: dict, texts: dict[int, str], mode: str) -> Regenerated:
    """What `Regenerator.regenerate` makes of ``row`` when the model writes ``texts[turn]`` (its canonical ids,
    then the end of turn): the same prompts, `TurnFormat.message`, in the same order."""
    conv = parse_row(0, row)
    assert isinstance(conv, Conversation)
    fmt, messages, turns = TurnFormat.of(chat), list(conv.messages), []
    for k in turns_to_regenerate(conv, mode, row=0, sample_id="s"):  # type: ignore[arg-type]
        text = chat.render_messages(Conversation(messages), k, generation_prompt=True, row_number=0, sample_id="s")
        prompt, out = ids(chat, text), [*ids(chat, texts[k]), fmt.end_of_turn]
        messages[k] = fmt.message(chat, prompt, out, "stop")
        turns.append(GeneratedTurn(k, prompt, out, "stop", 0))
    return Regenerated("s", Conversation(messages), tuple(turns))


THOUGHTS = {3: "Primary.</think>Blue.", 5: "Warm one.</think>Red."}  # after a generation prompt that opens <think>


def test_the_template_gives_back_what_the_generation_saw(kimi_chat, llama_chat) -> None:
    for chat, texts in ((kimi_chat, THOUGHTS), (llama_chat, {3: "Blue.", 5: "Red."})):
        regen = simulated(chat, CHAT, texts, "all")
        sample = sample_of(chat, regen)
        assert retokenization_mismatches(regen, sample) == []
        # and the capture's own tokenization holds each trained turn's prompt and output ids, in place (Kimi: the
        # last, its sample ending with it; the first is context, its reasoning dropped once the second follows)
        trained = [t for t in regen.turns if t.index not in dict(sample.context)]
        assert [t.index for t in trained] == ([5] if chat is kimi_chat else [3, 5])
        for turn in trained:
            seen = turn.prompt_ids + turn.output_ids
            assert sample.input_ids.tolist()[: len(seen)] == seen
        assert sample.input_ids.tolist() == seen or chat is llama_chat
    assert recorded(llama_chat, regen)["messages"][3] == {"role": "assistant", "content": "Blue.",
                                                          "finish_reason": "stop"}  # fmt: skip


@pytest.mark.parametrize(
    ("variables", "thinks"), [({}, True), ({"thinking": True}, True), ({"thinking": False}, False)]
)
def test_the_thinking_switch_opens_or_closes_the_think_block_as_kimi_k25s(kimi_tokenizer, variables, thinks) -> None:
    """Kimi-K2.5's switch: thinking (on unless false) ends the generation prompt with an open ``<think>``, off with an
    empty ``<think></think>``; the turn is in the sample as generated after it: its reasoning on, none off."""
    chat = ChatTokenizer(kimi_tokenizer, template_kwargs=variables)
    conv = parse_row(0, {"messages": [{"role": "user", "content": "Why?"},
                                      {"role": "assistant", "reasoning_content": "Sky.", "content": "Rayleigh."}]})  # fmt: skip
    prompt = chat.render_messages(conv, 1, generation_prompt=True, row_number=0, sample_id="t")
    head = "<|im_user|>user<|im_middle|>Why?<|im_end|><|im_assistant|>assistant<|im_middle|>"
    assert prompt == head + ("<think>" if thinks else "<think></think>")
    assert prompt == kimi_tokenizer.apply_chat_template(conv.messages[:1], tokenize=False, add_generation_prompt=True,
                                                        **variables)  # fmt: skip
    fmt = TurnFormat.of(chat)
    assert ids(chat, prompt) == ids(chat, head) + ([fmt.think_open] if thinks else [fmt.think_open, fmt.think_close])
    sample = chat.render(conv, row_number=0, sample_id="t")
    assert sample.text == prompt + ("Sky.</think>" if thinks else "") + "Rayleigh.<|im_end|>"
    assert [sample.text[a:b] for a, b in sample.spans] == [sample.text[len(prompt) :]]


def test_turns_generated_under_either_switch_render_back_as_generated(kimi_tokenizer) -> None:
    """On, the prompt opens the thinking block, so the turn's ids up to ``</think>`` are its reasoning; off, the turn
    is all content. Either way the template gives back the ids each turn saw, and the first turn's prompts differ
    only by the closing marker."""
    on, off = ChatTokenizer(kimi_tokenizer), ChatTokenizer(kimi_tokenizer, template_kwargs={"thinking": False})
    thought = simulated(on, CHAT, THOUGHTS, "all")
    plain = simulated(off, CHAT, {3: "Blue.", 5: "Red."}, "all")
    assert [thought.conversation.messages[t.index] for t in thought.turns] == [
        {"role": "assistant", "content": "Blue.", "reasoning_content": "Primary."},
        {"role": "assistant", "content": "Red.", "reasoning_content": "Warm one."},
    ]
    assert [plain.conversation.messages[t.index] for t in plain.turns] == [
        {"role": "assistant", "content": "Blue."}, {"role": "assistant", "content": "Red."}]  # fmt: skip
    assert retokenization_mismatches(thought, sample_of(on, thought)) == []
    assert retokenization_mismatches(plain, sample_of(off, plain)) == []
    fmt = TurnFormat.of(on)
    assert thought.turns[0].prompt_ids[-1] == fmt.think_open
    assert plain.turns[0].prompt_ids == [*thought.turns[0].prompt_ids, fmt.think_close]


def test_a_multi_turn_thinking_row_is_its_last_trained_turn_as_generated_earlier_turns_context(kimi_tokenizer) -> None:
    """Kimi-K2.5's template drops a turn's reasoning once a later answer follows, so the whole conversation holds
    neither thinking turn as generated: the sample is the conversation as the target saw it writing the last one (its
    prompt, then it as generated), the earlier one context (as the template shows it, outside the mask), the user turn
    after it left out; the row says so. Given (not regenerated) rows follow the same rule; nothing is refused."""
    chat = ChatTokenizer(kimi_tokenizer)
    regen = simulated(chat, CHAT, THOUGHTS, "all")
    sample = sample_of(chat, regen)
    last = regen.turns[-1]
    assert sample.input_ids.tolist() == last.prompt_ids + last.output_ids  # a whole turn: canonical ids here
    assert masked_runs(kimi_tokenizer, sample.input_ids.tolist(), sample.loss_mask.tolist()) == [
        "Warm one.</think>Red.<|im_end|>"]  # fmt: skip
    prompt = kimi_tokenizer.decode(last.prompt_ids)
    assert "<think></think>Blue.<|im_end|>" in prompt and "Primary." not in prompt  # turn 3 as the template shows it
    assert (sample.context, sample.messages) == (((3, REASONING_DROPPED),), 6)
    assert recorded(chat, regen)["regeneration"] == {
        "regenerated": [3, 5], "kept": [{"turn": 1, "why": KEPT_UNANSWERING}],
        "context": [{"turn": 3, "why": REASONING_DROPPED}], "messages_in_sample": 6}  # fmt: skip
    assert retokenization_mismatches(regen, sample) == []
    # The same row given: the same sample, every assistant turn trained that it holds as generated (the greeting too).
    assert masked_text(chat, regen.conversation, None, []) == ["</think>Welcome!<|im_end|>",
                                                               "Warm one.</think>Red.<|im_end|>"]  # fmt: skip
    # With `last` only the final turn is generated; its prompt already renders the earlier turns as given.
    ending = simulated(chat, {"id": "c2", "messages": CHAT["messages"][:-1]}, THOUGHTS, "last")
    assert sample_of(chat, ending).context == () and retokenization_mismatches(ending, sample_of(chat, ending)) == []


def test_a_single_thinking_turn_keeps_its_reasoning_in_the_sample(kimi_tokenizer) -> None:
    """The template renders a lone answer with an empty ``<think></think>`` (it is the last answer), which the
    generation prompt ``...<think>`` is a prefix of: the sample is the turn as generated, its reasoning put back into
    that block, the mask over ``reasoning</think>content<|im_end|>`` (not a ``</think>`` right after ``<think>``)."""
    chat = ChatTokenizer(kimi_tokenizer)
    row = {"messages": [{"role": "user", "content": "Why?"},
                        {"role": "assistant", "reasoning_content": "Sky.", "content": "Rayleigh."}]}  # fmt: skip
    conv = parse_row(0, row)
    assert kimi_tokenizer.apply_chat_template(conv.messages, tokenize=False).endswith(
        "<think></think>Rayleigh.<|im_end|>"
    )
    assert masked_text(chat, conv, None, []) == ["Sky.</think>Rayleigh.<|im_end|>"]
    regen = simulated(chat, {"messages": [*row["messages"][:1], {"role": "assistant", "content": "Given."}]},
                      {1: "Sky.</think>Rayleigh."}, "all")  # fmt: skip
    sample = sample_of(chat, regen)
    assert sample.input_ids.tolist() == regen.turns[0].prompt_ids + regen.turns[0].output_ids
    assert (sample.context, sample.messages) == ((), 2)


def test_tool_calling_turns_after_the_last_answer_keep_their_reasoning(kimi_tokenizer) -> None:
    """Turns after the last answer (a tool call in progress) render their reasoning: a sample ending with one holds it
    as generated; the reasoning of a tool call answered later is in the answer's prompt (the target saw it)."""
    chat = ChatTokenizer(kimi_tokenizer)
    call = {"role": "assistant", "reasoning_content": "Look it up.", "content": "",
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}  # fmt: skip
    first = {"role": "assistant", "reasoning_content": "Easy.", "content": "Blue."}
    row = Conversation([*CHAT["messages"][2:3], first, {"role": "user", "content": "Weather?"}, call,
                        {"role": "tool", "tool_call_id": "c1", "content": "sun"}])  # fmt: skip
    full = chat.render_messages(row, 5, generation_prompt=False, row_number=0, sample_id="t")
    assert "<think></think>Blue." in full and "<think>Look it up.</think>" in full
    calls = "<|tool_calls_section_begin|><|tool_call_begin|>c1<|tool_call_argument_begin|>{}<|tool_call_end|>" \
            "<|tool_calls_section_end|><|im_end|>"  # fmt: skip
    assert masked_text(chat, row, None, []) == [f"Look it up.</think>{calls}"]  # the first answer: context
    sample = chat.tokenize(0, "s", row, max_length=None, overlong="truncate")
    assert (sample.context, sample.messages) == (((1, REASONING_DROPPED),), 4)  # the tool result after it left out
    answered = Conversation([*row.messages, {"role": "assistant", "content": "Sunny."}])
    assert masked_text(chat, answered, [5], []) == ["</think>Sunny.<|im_end|>"]
    text = kimi_tokenizer.decode(chat.tokenize(0, "s", answered, max_length=None, overlong="truncate",
                                               turns=[5]).input_ids.tolist())  # fmt: skip
    assert "<think>Look it up.</think>" in text and text == chat.render_messages(
        answered, 5, generation_prompt=True, row_number=0, sample_id="t") + "</think>Sunny.<|im_end|>"  # fmt: skip


@pytest.mark.parametrize("variables", [None, {"thinking": False}], ids=["llama", "kimi-plain"])
def test_where_the_template_keeps_every_trained_turn_the_sample_is_its_whole_rendering(
    llama_chat, kimi_tokenizer, variables
) -> None:
    """Llama's template, and Kimi-K2.5's with thinking off (no reasoning written, so none dropped): every shape's
    sample is HF's template of the whole row, every turn trained."""
    chat = llama_chat if variables is None else ChatTokenizer(kimi_tokenizer, template_kwargs=variables)
    for n, row in enumerate(shape_rows()):
        conv = parse_row(n, row)
        messages = [m if variables is None else {k: v for k, v in m.items() if k != "reasoning_content"}
                    for m in conv.messages]  # fmt: skip
        conv = Conversation(messages, conv.tools)
        sample = chat.tokenize(n, "s", conv, max_length=None, overlong="truncate")
        hf = chat.tokenizer.apply_chat_template(messages, tools=conv.tools, tokenize=False, **(variables or {}))
        assert sample.input_ids.tolist() == ids(chat, hf) and (sample.context, sample.messages) == ((), len(messages))


def test_a_non_canonical_generation_is_named(llama_chat) -> None:
    """A model may write a split its tokenizer never makes (tiny random models nearly always do): the text then
    tokenizes to other ids than the generation's."""
    regen = simulated(llama_chat, CHAT, {5: "Red."}, "last")
    turn = regen.turns[0]
    split = [i for ch in "Red." for i in ids(llama_chat, ch)]
    assert split != turn.output_ids[:-1]
    other = Regenerated(
        "s", regen.conversation, (GeneratedTurn(5, turn.prompt_ids, [*split, turn.output_ids[-1]], "stop", 0),)
    )
    assert [p.split(":")[0] for p in retokenization_mismatches(other, sample_of(llama_chat, other))] == ["turn 5"]


def test_generation_rids_are_never_captured() -> None:
    from sglang_patch.contract import generation_rid, rid_matches

    rid = generation_rid("job:1", "a:b", 3, "n")
    assert ":" not in rid
    assert not any(rid_matches(rid, p) for p in ("hscap", "gen", "gen.job%3A1", rid, ""))
