"""Conversations trained on every assistant turn, ShareGPT and Alpaca rows (issue #29; CPU, offline).

The loss mask of a conversation must cover exactly the assistant turns' tokens, their end-of-turn
tokens included, position by position. The expected mask is computed here independently of
rlhf/data/chat.py: the conversation is rendered with transformers' apply_chat_template, each
assistant turn is located in the rendered text by string search (the template's layout being known
here), and a token is expected trained when its character offsets lie inside such a turn. Two
templates: a ChatML one (a byte-level BPE tokenizer trained here, `<|im_end|>` not its eos, a tool
role), with and without `{% generation %}` markers, and the embedded tokenizer's (data/tokenizer).
"""
from __future__ import annotations

import json

import pytest

from conftest import ROOT
from rlhf.data import (
    IGNORE_INDEX,
    ChatExample,
    DataFormatError,
    Row,
    SFTExample,
    load_rows,
    parse_prompts,
    parse_sft,
    tokenize_sft,
)

SENTENCES = [
    "You are a helpful assistant.", "What is the weather in Paris today?", "Let me look that up for you.",
    "It is sunny and 21 degrees in Paris.", "Thanks! And tomorrow?", "Tomorrow brings rain, take an umbrella.",
    "Reverse the word cat.", "tac", "Sort 3 1 2.", "1 2 3", "get_weather city Paris", "sunny 21",
]
CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_TURN = "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
_TOOL = "{{ '<|im_start|>user\\n<tool_response>\\n' + m['content'] + '\\n</tool_response><|im_end|>\\n' }}"
_GEN = "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
# ChatML as Qwen2.5 writes it (a tool result goes back in a user turn between <tool_response> tags)
CHATML = ("{% for m in messages %}{% if m['role'] == 'tool' %}" + _TOOL + "{% else %}" + _TURN
          + "{% endif %}{% endfor %}" + _GEN)
# the same rendering, the assistant turns marked for return_assistant_tokens_mask
CHATML_MARKED = (
    "{% for m in messages %}{% if m['role'] == 'tool' %}" + _TOOL
    + "{% elif m['role'] == 'assistant' %}{{ '<|im_start|>assistant\\n' }}{% generation %}"
    "{{ m['content'] + '<|im_end|>\\n' }}{% endgeneration %}{% else %}" + _TURN + "{% endif %}{% endfor %}" + _GEN
)

MULTI = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Reverse the word cat."},
    {"role": "assistant", "content": "tac"},
    {"role": "user", "content": "Sort 3 1 2."},
    {"role": "assistant", "content": "1 2 3"},
]
TOOL = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the weather in Paris today?"},
    {"role": "assistant", "content": "Let me look that up: get weather, city Paris."},
    {"role": "tool", "content": "sunny, 21"},
    {"role": "assistant", "content": "It is sunny and 21 degrees in Paris."},
]


def make_chatml(template: str = CHATML):
    """A byte-level BPE tokenizer trained on SENTENCES, ChatML specials, eos <|endoftext|> != <|im_end|>, no bos."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=CHATML_SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator(SENTENCES, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    tok.chat_template = template
    return tok


@pytest.fixture(scope="module")
def chatml():
    return make_chatml()


@pytest.fixture(scope="module")
def embedded():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ROOT / "data/tokenizer")


def rows(*dicts):
    return [Row(d, f"chat.jsonl:{i + 1}") for i, d in enumerate(dicts)]


def assistant_char_spans(text: str, messages, prompt: str, lead: str, closer: str) -> list[tuple[int, int]]:
    """[start, end) in `text` of each assistant turn's trained part: the template writes an assistant turn
    as `prompt` (its generation prompt) + `lead` + content + `closer` (its end-of-turn text); all of it
    but the generation prompt is trained."""
    spans, cursor = [], 0
    for m in messages:
        if m["role"] != "assistant":
            cursor = text.index(m["content"], cursor) + len(m["content"])
            continue
        turn = prompt + lead + m["content"] + closer
        at = text.index(turn, cursor)
        spans.append((at + len(prompt), at + len(turn)))
        cursor = at + len(turn)
    return spans


def expected_mask(tok, messages, prompt: str, lead: str, closer: str) -> tuple[list[int], list[bool]]:
    text = tok.apply_chat_template(messages, tokenize=False)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    spans = assistant_char_spans(text, messages, prompt, lead, closer)
    mask = [e > s and any(a <= s and e <= b for a, b in spans) for s, e in enc["offset_mapping"]]
    return enc["input_ids"], mask


def trained(feature) -> list[bool]:
    return [t != IGNORE_INDEX for t in feature["labels"]]


# ----------------------------------------------------------------------------- every assistant turn, two templates


@pytest.mark.parametrize("marked", [False, True], ids=["prefix-rendering", "generation-markers"])
def test_chatml_loss_mask_is_every_assistant_turn_with_its_im_end(marked, chatml):
    tok = make_chatml(CHATML_MARKED) if marked else chatml
    im_end, eos = tok.convert_tokens_to_ids("<|im_end|>"), tok.eos_token_id
    assert im_end != eos and tok.bos_token_id is None
    examples = parse_sft(rows({"messages": MULTI}, {"messages": TOOL}), tok)
    assert examples == [ChatExample(MULTI, "chat.jsonl:1"), ChatExample(TOOL, "chat.jsonl:2")]
    feats, stats = tokenize_sft(examples, tok, max_len=512, max_prompt_len=256)
    assert stats == dict(rows=2, kept=2, prompt_truncated=0, response_truncated=0, dropped=0)
    for f, msgs in zip(feats, (MULTI, TOOL)):
        ids, mask = expected_mask(tok, msgs, "<|im_start|>assistant\n", "", "<|im_end|>\n")
        assert f["input_ids"] == ids  # the template's rendering, nothing appended (no bos: the tokenizer has none)
        assert trained(f) == mask, [(tok.decode([t]), m) for t, m in zip(ids, mask)]
        assert all(lab == tok_id for lab, tok_id in zip(f["labels"], f["input_ids"]) if lab != IGNORE_INDEX)
        assert eos not in f["input_ids"]  # the template writes <|im_end|>, not the tokenizer's eos
        # each assistant turn ends trained on its <|im_end|>; no other turn's <|im_end|> is trained
        ends = [i for i, t in enumerate(f["input_ids"]) if t == im_end]
        assert [trained(f)[i] for i in ends] == [m["role"] == "assistant" for m in msgs]
        assert sum(mask) > sum(len(tok(m["content"])["input_ids"]) for m in msgs if m["role"] == "assistant")


def test_embedded_template_loss_mask_is_every_assistant_turn_with_its_eos(embedded):
    tok = embedded
    for msgs in (MULTI, TOOL):
        text = tok.apply_chat_template(msgs, tokenize=False)
        assert "System: You are a helpful assistant.\n\n" in text  # the system turn is kept (issue #29)
    assert "Tool: sunny, 21\n\n" in tok.apply_chat_template(TOOL, tokenize=False)
    feats, stats = tokenize_sft(parse_sft(rows({"messages": MULTI}, {"messages": TOOL}), tok), tok, 512, 256)
    assert stats["kept"] == 2
    for f, msgs in zip(feats, (MULTI, TOOL)):
        # the generation prompt is "Assistant:"; the turn is " content</s>\n\n" (its end-of-turn token is eos)
        ids, mask = expected_mask(tok, msgs, "Assistant:", " ", "</s>\n\n")
        assert f["input_ids"] == [tok.bos_token_id] + ids
        assert trained(f) == [False] + mask
        eos_at = [i for i, t in enumerate(f["input_ids"]) if t == tok.eos_token_id]
        assert len(eos_at) == 2 and all(trained(f)[i] for i in eos_at)


def test_embedded_template_refuses_an_unknown_role(embedded):
    bad = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert embedded.apply_chat_template(bad, tokenize=False) == "Human: hi\n\nAssistant: yo</s>\n\n"
    with pytest.raises(Exception, match="unknown role narrator"):
        embedded.apply_chat_template([{"role": "narrator", "content": "x"}], tokenize=False)


def test_a_template_that_is_not_prefix_stable_is_refused_naming_the_row(chatml):
    # writes a marker only before the last message: messages[:k] are not prefixes of the whole rendering
    tok = make_chatml("{% for m in messages %}{% if loop.last %}{{ 'Final:' }}{% endif %}"
                      "{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
                      "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}")
    with pytest.raises(DataFormatError, match=r"chat\.jsonl:1: the tokenizer's chat template is not prefix-stable"):
        tokenize_sft(parse_sft(rows({"messages": MULTI}), tok), tok, 512, 256)
    # the whole transcript needs no prefixes
    feats, _ = tokenize_sft(parse_sft(rows({"messages": MULTI}), tok), tok, 512, 256, assistant_only_loss=False)
    assert all(trained(feats[0]))


def test_assistant_only_loss_false_trains_the_whole_transcript(embedded):
    [ex] = parse_sft(rows({"messages": MULTI}), embedded)
    [f], _ = tokenize_sft([ex], embedded, 512, 256, assistant_only_loss=False)
    ids = embedded(embedded.apply_chat_template(MULTI, tokenize=False), add_special_tokens=False)["input_ids"]
    assert f["input_ids"] == [embedded.bos_token_id] + ids
    assert f["labels"] == [IGNORE_INDEX] + ids  # every token but the bos, as a {text} row


def test_overlong_conversations_follow_the_rule(embedded):
    tok = embedded
    [ex] = parse_sft(rows({"messages": MULTI}), tok)
    [full], _ = tokenize_sft([ex], tok, 512, 256)
    first = trained(full).index(True)  # bos + system + user + "Assistant:"
    # the prompt part (before the first trained token) is cut from the left, the rest on the right
    p = first - 5  # bos + the prompt's last first - 6 tokens; then room for 4 more
    [f], stats = tokenize_sft([ex], tok, max_len=p + 4, max_prompt_len=p)
    assert f["input_ids"] == [tok.bos_token_id] + full["input_ids"][6:first + 4]
    assert f["labels"] == [IGNORE_INDEX] * p + full["labels"][first:first + 4]
    assert stats == dict(rows=1, kept=1, prompt_truncated=1, response_truncated=1, dropped=0)
    _, stats = tokenize_sft([ex], tok, max_len=first + 4, max_prompt_len=first, overlong="drop")
    assert stats["dropped"] == 1 and stats["kept"] == 0
    [f], stats = tokenize_sft([ex], tok, max_len=len(full["input_ids"]), max_prompt_len=first, overlong="drop")
    assert f == full and stats["kept"] == 1  # an exact fit


def test_the_last_message_must_be_an_assistant_turn(embedded):
    with pytest.raises(DataFormatError, match=r"chat\.jsonl:1: field 'messages': last message has role 'user'"):
        parse_sft(rows({"messages": MULTI[:4]}), embedded)


def test_prompt_response_rows_keep_the_tokenizer_eos(embedded):
    """The other shapes are unchanged: {prompt, response} still ends with the tokenizer's eos."""
    [ex] = parse_sft(rows({"prompt": "Human: Reverse ab.\n\nAssistant:", "response": " ba"}), embedded)
    assert isinstance(ex, SFTExample)
    [f], _ = tokenize_sft([ex], embedded, 64, 48)
    assert f["input_ids"][-1] == embedded.eos_token_id and f["labels"][-4:] == f["input_ids"][-4:]
    no_template = make_chatml(template=None)  # and they need no chat template
    [f], _ = tokenize_sft(parse_sft(rows({"prompt": "Sort 3 1 2.", "response": " 1 2 3"}), no_template), no_template, 64, 48)
    assert f["input_ids"][-1] == no_template.eos_token_id


# ----------------------------------------------------------------------------- ShareGPT and Alpaca files


def sharegpt(messages) -> dict:
    speaker = {"system": "system", "user": "human", "assistant": "gpt", "tool": "tool"}
    return {"id": "x", "conversations": [{"from": speaker[m["role"]], "value": m["content"]} for m in messages]}


def write_jsonl(path, dicts) -> str:
    path.write_text("".join(json.dumps(d) + "\n" for d in dicts))
    return str(path)


def test_sharegpt_rows_are_conversations_for_sft_and_prompts(tmp_path, embedded):
    user_assistant = [{"from": "user", "value": "Sort 3 1 2."}, {"from": "assistant", "value": "1 2 3"}]
    path = write_jsonl(tmp_path / "sharegpt.jsonl", [sharegpt(MULTI), sharegpt(TOOL), {"conversations": user_assistant}])
    got = parse_sft(load_rows(path), embedded)
    assert got == [ChatExample(MULTI, f"{path}:1"), ChatExample(TOOL, f"{path}:2"),
                   ChatExample([{"role": "user", "content": "Sort 3 1 2."}, {"role": "assistant", "content": "1 2 3"}],
                               f"{path}:3")]
    as_messages = parse_sft(rows({"messages": MULTI}, {"messages": TOOL}), embedded)
    assert tokenize_sft(got[:2], embedded, 512, 256)[0] == tokenize_sft(as_messages, embedded, 512, 256)[0]
    # as RL prompts: the conversation without its final assistant turn, + the generation prompt
    prompts = parse_prompts(load_rows(path), embedded)
    assert prompts[0].prompt == embedded.apply_chat_template(MULTI[:-1], tokenize=False, add_generation_prompt=True)
    assert prompts[0].prompt.endswith("Human: Sort 3 1 2.\n\nAssistant:") and prompts[0].meta == {"id": "x"}


def test_sharegpt_bad_rows_name_the_line(tmp_path, embedded):
    path = write_jsonl(tmp_path / "bad.jsonl", [sharegpt(MULTI), {"conversations": [{"from": "bot", "value": "hi"}]}])
    with pytest.raises(DataFormatError, match=r"bad\.jsonl:2: field 'conversations'\[0\] is from 'bot'; known: system, "
                                              r"human, user, gpt, assistant, tool"):
        parse_sft(load_rows(path), embedded)
    path = write_jsonl(tmp_path / "last.jsonl", [sharegpt(MULTI[:4])])
    with pytest.raises(DataFormatError, match=r"last\.jsonl:1: field 'conversations': last message has role 'user'"):
        parse_sft(load_rows(path), embedded)
    path = write_jsonl(tmp_path / "shape.jsonl", [{"conversations": "hi"}])
    with pytest.raises(DataFormatError, match=r"shape\.jsonl:1: field 'conversations' must be a non-empty list"):
        parse_sft(load_rows(path))


def test_alpaca_rows(tmp_path, embedded):
    path = write_jsonl(tmp_path / "alpaca.jsonl", [
        {"instruction": "Reverse the word.", "input": "cat", "output": "tac", "text": "the dataset's own format"},
        {"instruction": "Sort 3 1 2.", "input": "", "output": "1 2 3"},
        {"instruction": "Say hi.", "output": "hi"},
    ])
    got = parse_sft(load_rows(path))  # detected as Alpaca before {text}; no tokenizer needed
    assert [(e.prompt, e.response) for e in got] == [("Reverse the word.\n\ncat", "tac"), ("Sort 3 1 2.", "1 2 3"),
                                                     ("Say hi.", "hi")]
    assert [p.prompt for p in parse_prompts(load_rows(path))] == ["Reverse the word.\n\ncat", "Sort 3 1 2.", "Say hi."]
    [f], _ = tokenize_sft(got[1:2], embedded, 64, 48)
    assert f["input_ids"][-1] == embedded.eos_token_id  # an {prompt, response} example: the tokenizer's eos
    path = write_jsonl(tmp_path / "bad.jsonl", [{"instruction": "a", "output": "b"}, {"instruction": "a", "output": ""}])
    with pytest.raises(DataFormatError, match=r"bad\.jsonl:2: field 'output' is empty.*Alpaca"):
        parse_sft(load_rows(path))


def test_each_dataset_has_its_own_shape(embedded):
    """Rows of several sources (a data.path mixture) are each checked against their own dataset's shape."""
    mixed = [Row({"instruction": "Say hi.", "output": "hi"}, "a.jsonl:1", "a.jsonl"),
             Row(sharegpt(MULTI), "b.jsonl:1", "b.jsonl"),
             Row({"instruction": "Say yo.", "output": "yo"}, "a.jsonl:2", "a.jsonl")]
    got = parse_sft(mixed, embedded)
    assert [type(e).__name__ for e in got] == ["SFTExample", "ChatExample", "SFTExample"]
    feats, stats = tokenize_sft(got, embedded, 512, 256)
    assert stats["kept"] == 3 and feats[0]["input_ids"][-1] == feats[2]["input_ids"][-1] == embedded.eos_token_id
    with pytest.raises(DataFormatError, match=r"a\.jsonl:2: missing field 'instruction'"):
        parse_sft([mixed[0], mixed[1], Row(sharegpt(MULTI), "a.jsonl:2", "a.jsonl")], embedded)
