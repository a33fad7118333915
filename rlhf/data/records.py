"""Record shapes: raw rows (dicts with provenance) -> canonical SFT / pair / prompt examples.

The shape is detected once per dataset, from its first row; every row must then fit that shape,
and one that does not raises `DataFormatError` naming the row's origin (``file.jsonl:17``), the
missing or invalid field, and the accepted shapes. Texts are used exactly as stored: prompt and
response are concatenated with nothing in between (Dahoas and hh-rlhf prompts end with
"Assistant:", their responses start with a space).

    SFT      {prompt, response}            prompt may also be a message list (chat template)
             {messages: [{role, content}]} a ChatExample: the whole conversation, rendered with the
                                           tokenizer's chat template, every assistant turn trained
                                           (rlhf/data/chat.py); the last message must be "assistant"
             {conversations: [{from, value}]}  ShareGPT: from system|human|user|gpt|assistant|tool,
                                           read as {messages} (human -> user, gpt -> assistant)
             {instruction, input, output}  Alpaca: prompt = instruction (+ "\n\n" + input when it is
                                           not empty), response = output
             {text}                        no prompt: the loss covers every token
             any pair shape                prompt + the chosen response (one dataset for all stages)
    pairs    {prompt, chosen, rejected}    responses only (Dahoas/rm-static); prompt may be a
                                           message list, chosen/rejected a one-message list
             {chosen, rejected} strings    hh-rlhf transcripts: prompt = shared text up to and
                                           including the LAST "\\n\\nAssistant:", responses = rest
             {chosen, rejected} messages   whole conversations sharing all but the last message
    unpaired {prompt, completion, label}   KTO's rows (TRL's unpaired preference shape): label true
                                           (desirable) or false; prompt may be a message list,
                                           completion a one-message assistant list
             {prompt, response, label}     the same with `response`
             any pair shape                split into two rows: (prompt, chosen, true) and
                                           (prompt, rejected, false)
    prompts  {prompt} or any of the above  the prompt part is taken ({text} has none; a conversation's
                                           is all of it but a final assistant turn, + generation prompt)

Message lists are rendered with the tokenizer's chat template; only those shapes need a tokenizer.
Rows may carry a `dataset` (Row.dataset: which entry of a data.path list they came from): each
dataset's shape is detected on its own, from its first row here.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlhf.core.errors import DataFormatError


@dataclass(slots=True)
class Row:
    """One raw record plus where it came from: "a.jsonl:17", "a.parquet row 5", "dataset X row 5"."""

    data: dict[str, Any]
    origin: str
    dataset: str = ""  # the source (a data.path entry) when rows of several are mixed; a shape per dataset


@dataclass(slots=True)
class SFTExample:
    prompt: str  # "" for {text} rows
    response: str
    origin: str


@dataclass(slots=True)
class ChatExample:
    """A conversation trained on every assistant turn: rendered and masked by rlhf/data/chat.py."""

    messages: list[dict[str, str]]  # [{role, content}], the last one an assistant turn
    origin: str


@dataclass(slots=True)
class PairExample:
    prompt: str
    chosen: str
    rejected: str
    origin: str


@dataclass(slots=True)
class UnpairedExample:
    """A labelled row (KTO): the response is desirable (label True) or undesirable for the prompt."""

    prompt: str
    response: str
    label: bool
    origin: str  # "a.jsonl:17"; a row split from a pair: "a.jsonl:17 (chosen)" / "(rejected)"


@dataclass(slots=True)
class PromptExample:
    prompt: str
    origin: str
    answer: str | None = None  # gold answer, e.g. of the embedded default task's eval prompts
    meta: dict[str, Any] = field(default_factory=dict)  # other scalar fields, e.g. "task"


HH_ASSISTANT = "\n\nAssistant:"
# Fields that make up a record; any other scalar field of a prompt row goes into PromptExample.meta.
_RECORD_FIELDS = frozenset({"prompt", "response", "text", "messages", "chosen", "rejected", "answer",
                            "conversations", "instruction", "input", "output", "completion", "label"})

SFT_SHAPES = (
    "{prompt, response} (prompt: str or message list)",
    "{messages: [{role, content}, ...]} ending with an assistant message",
    "ShareGPT {conversations: [{from, value}, ...]} ending with a gpt/assistant turn",
    "Alpaca {instruction, input, output}",
    "{text}",
    "any pair shape (prompt + the chosen response)",
)
PAIR_SHAPES = (
    "{prompt, chosen, rejected} (responses only; prompt: str or message list)",
    '{chosen, rejected} hh-rlhf transcripts sharing the text up to the last "\\n\\nAssistant:"',
    "{chosen: [messages], rejected: [messages]} sharing all but the last (assistant) message",
)
UNPAIRED_SHAPES = (
    "{prompt, completion, label} (label: true = desirable, false = undesirable; prompt: str or message list, "
    "completion: str or a one-message assistant list)",
    "{prompt, response, label}",
    "any pair shape, split into (prompt, chosen, true) and (prompt, rejected, false)",
)
PROMPT_SHAPES = (
    "{prompt} (str or message list)",
    "{messages: [...]}",
    "ShareGPT {conversations: [{from, value}, ...]}",
    "Alpaca {instruction, input}",
    "{chosen, rejected} (hh-rlhf transcripts or message lists)",
)


# --------------------------------------------------------------------------- field access


class _RowError(Exception):
    """Internal: a problem with one row; turned into DataFormatError with origin and shapes."""


def _get(data: Mapping[str, Any], key: str) -> Any:
    # NOTE: datasets.load_dataset unifies columns across files, so a field a row lacks reads None.
    value = data.get(key)
    if value is None:
        raise _RowError(f"missing field {key!r}")
    return value


def _get_str(data: Mapping[str, Any], key: str) -> str:
    value = _get(data, key)
    if not isinstance(value, str):
        raise _RowError(f"field {key!r} must be a string, got {type(value).__name__}")
    if not value.strip():
        raise _RowError(f"field {key!r} is empty")
    return value


# Roles a chat template knows; another one is a typo more often than a template feature.
MESSAGE_ROLES = ("system", "developer", "user", "assistant", "tool")


def _is_messages(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and len(value) > 0 and all(isinstance(m, Mapping) for m in value)


def _get_messages(data: Mapping[str, Any], key: str, min_len: int = 1) -> list[dict[str, str]]:
    value = _get(data, key)
    if not isinstance(value, (list, tuple)):
        raise _RowError(f"field {key!r} must be a list of {{role, content}} messages, got {type(value).__name__}")
    if len(value) < min_len:
        raise _RowError(f"field {key!r} must hold at least {min_len} message(s), got {len(value)}")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise _RowError(f"field {key!r}[{i}] is not a {{role: str, content: str}} message: {m!r:.80}")
        if m["role"] not in MESSAGE_ROLES:
            raise _RowError(f"field {key!r}[{i}] has role {m['role']!r}; known roles: {', '.join(MESSAGE_ROLES)}")
        out.append({"role": m["role"], "content": m["content"]})
    return out


# ShareGPT's speakers -> chat roles (the role names themselves are accepted too).
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "tool": "tool"}


def _get_conversation(data: Mapping[str, Any], key: str = "conversations") -> list[dict[str, str]]:
    """A ShareGPT conversation ([{from, value}], or [{role, content}]) as {role, content} messages."""
    value = _get(data, key)
    if not isinstance(value, (list, tuple)) or not value:
        raise _RowError(f"field {key!r} must be a non-empty list of {{from, value}} turns, got {value!r:.80}")
    out = []
    for i, m in enumerate(value):
        turn = m if isinstance(m, Mapping) else {}
        who, text = (turn.get("from"), turn.get("value")) if "from" in turn else (turn.get("role"), turn.get("content"))
        if not isinstance(who, str) or not isinstance(text, str):
            raise _RowError(f"field {key!r}[{i}] is not a {{from: str, value: str}} turn: {m!r:.80}")
        if who not in SHAREGPT_ROLES:
            raise _RowError(f"field {key!r}[{i}] is from {who!r}; known: {', '.join(SHAREGPT_ROLES)}")
        out.append({"role": SHAREGPT_ROLES[who], "content": text})
    return out


def _last_assistant(messages: list[dict[str, str]], key: str) -> str:
    if messages[-1]["role"] != "assistant":
        raise _RowError(f"field {key!r}: last message has role {messages[-1]['role']!r}, expected 'assistant'")
    return messages[-1]["content"]


class _Renderer:
    """Chat-template rendering, checked lazily: only message-list shapes need a tokenizer."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer

    def check(self) -> None:
        tok = self.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            what = "no tokenizer was given" if tok is None else "the tokenizer has no chat_template"
            raise _RowError(f"message lists are rendered with a chat template, but {what}")

    def prompt(self, messages: list[dict[str, str]]) -> str:
        self.check()
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def _prompt_text(data: Mapping[str, Any], render: _Renderer) -> str:
    """`prompt` as stored, or rendered through the chat template when it is a message list."""
    value = _get(data, "prompt")
    if isinstance(value, (list, tuple)):
        return render.prompt(_get_messages(data, "prompt"))
    return _get_str(data, "prompt")


def _response_text(data: Mapping[str, Any], key: str) -> str:
    """A response as a string, or a (one-message) assistant list as its content."""
    value = _get(data, key)
    if isinstance(value, (list, tuple)):
        return _last_assistant(_get_messages(data, key), key)
    return _get_str(data, key)


def _hh_split(data: Mapping[str, Any]) -> tuple[str, str, str]:
    chosen, rejected = _get_str(data, "chosen"), _get_str(data, "rejected")
    cut = []
    for key, text in (("chosen", chosen), ("rejected", rejected)):
        i = text.rfind(HH_ASSISTANT)
        if i < 0:
            raise _RowError(f"field {key!r} has no {HH_ASSISTANT!r} turn to split the prompt at")
        cut.append(i + len(HH_ASSISTANT))
    if chosen[: cut[0]] != rejected[: cut[1]]:
        raise _RowError(
            f"'chosen' and 'rejected' differ before their last {HH_ASSISTANT!r} "
            "(hh-rlhf transcripts must share the prompt)"
        )
    return chosen[: cut[0]], chosen[cut[0] :], rejected[cut[1] :]


def _message_pair_split(data: Mapping[str, Any], render: _Renderer) -> tuple[str, str, str]:
    chosen, rejected = _get_messages(data, "chosen", 2), _get_messages(data, "rejected", 2)
    if chosen[:-1] != rejected[:-1]:
        raise _RowError("'chosen' and 'rejected' conversations differ before their last message")
    c, r = _last_assistant(chosen, "chosen"), _last_assistant(rejected, "rejected")
    return render.prompt(chosen[:-1]), c, r


# --------------------------------------------------------------------------- shape tables

# Each shape: (name, fields whose presence in the first row selects it, parser). The first whose
# selector fields are present (and predicate holds) wins; order matters.
_Parser = Callable[[Mapping[str, Any], _Renderer], Any]


def _has(*keys: str) -> Callable[[Mapping[str, Any]], bool]:
    return lambda d: all(d.get(k) is not None for k in keys)


def _chosen_is_conversation(d: Mapping[str, Any]) -> bool:
    return _is_messages(d.get("chosen")) and len(d["chosen"]) >= 2


def _alpaca_prompt(d: Mapping[str, Any]) -> str:
    """instruction, + "\n\n" + input when the row has a non-empty one."""
    instruction, extra = _get_str(d, "instruction"), d.get("input")
    if extra is not None and not isinstance(extra, str):
        raise _RowError(f"field 'input' must be a string, got {type(extra).__name__}")
    return instruction + ("\n\n" + extra if extra and extra.strip() else "")


# Alpaca rows come before {text}: tatsu-lab/alpaca also has a `text` column (its own prompt format).
_SFT_TABLE: list[tuple[str, Callable, _Parser]] = [
    ("{prompt, response}", _has("prompt", "response"), lambda d, r: (_prompt_text(d, r), _get_str(d, "response"))),
    ("{messages}", _has("messages"), lambda d, r: _sft_chat(_get_messages(d, "messages", 2), "messages", r)),
    ("ShareGPT {conversations}", _has("conversations"), lambda d, r: _sft_chat(_get_conversation(d), "conversations", r)),
    ("Alpaca {instruction, input, output}", _has("instruction", "output"),
     lambda d, r: (_alpaca_prompt(d), _get_str(d, "output"))),
    ("{text}", _has("text"), lambda d, r: ("", _get_str(d, "text"))),
    # Preference data used for SFT (e.g. one dataset split between the stages): the chosen response.
    ("pairs (chosen response)", lambda d: any(sel(d) for _, sel, _ in _PAIR_TABLE), lambda d, r: _sft_from_pair(d, r)),
]


def _sft_from_pair(d: Mapping[str, Any], render: _Renderer) -> tuple[str, str]:
    for _, selects, parser in _PAIR_TABLE:
        if selects(d):
            prompt, chosen, _ = parser(d, render)
            return prompt, chosen
    raise _RowError("fits no pair shape (prompt/chosen/rejected, hh-rlhf transcripts, message lists)")


def _sft_chat(msgs: list[dict[str, str]], key: str, render: _Renderer) -> list[dict[str, str]]:
    """A conversation for a ChatExample: at least two messages, the last an assistant turn."""
    if len(msgs) < 2:
        raise _RowError(f"field {key!r} must hold at least 2 messages, got {len(msgs)}")
    _last_assistant(msgs, key)
    render.check()
    return msgs


_PAIR_TABLE: list[tuple[str, Callable, _Parser]] = [
    ("{chosen: [messages], rejected: [messages]}", _chosen_is_conversation, _message_pair_split),
    (
        "{prompt, chosen, rejected}",
        _has("prompt", "chosen", "rejected"),
        lambda d, r: (_prompt_text(d, r), _response_text(d, "chosen"), _response_text(d, "rejected")),
    ),
    ("{chosen, rejected} hh-rlhf transcripts", _has("chosen", "rejected"), lambda d, r: _hh_split(d)),
]


def _label(data: Mapping[str, Any]) -> bool:
    value = _get(data, "label")
    # NOTE: a bool column read through numpy (parquet) arrives as numpy.bool_, not a bool subclass.
    if not (isinstance(value, bool) or type(value).__name__ == "bool_"):
        raise _RowError(f"field 'label' must be true or false, got {type(value).__name__} {value!r:.40}")
    return bool(value)


def _unpaired(key: str) -> _Parser:
    return lambda d, r: [(_prompt_text(d, r), _response_text(d, key), _label(d), "")]


def _split_pair(parser: _Parser) -> _Parser:
    def split(d: Mapping[str, Any], render: _Renderer) -> list[tuple[str, str, bool, str]]:
        prompt, chosen, rejected = parser(d, render)
        return [(prompt, chosen, True, " (chosen)"), (prompt, rejected, False, " (rejected)")]

    return split


# The unpaired shapes select on prompt + completion/response alone, so that a row without a label is
# read as what it is meant to be and refused as "missing field 'label'".
_UNPAIRED_TABLE: list[tuple[str, Callable, _Parser]] = [
    ("{prompt, completion, label}", _has("prompt", "completion"), _unpaired("completion")),
    ("{prompt, response, label}", _has("prompt", "response"), _unpaired("response")),
    *[(f"pairs {name}, split", selects, _split_pair(parser)) for name, selects, parser in _PAIR_TABLE],
]


def _prompt_of_messages(msgs: list[dict[str, str]], key: str, render: _Renderer) -> str:
    if msgs[-1]["role"] == "assistant":
        msgs = msgs[:-1]
    if not msgs:
        raise _RowError(f"field {key!r} holds only an assistant message, no prompt")
    return render.prompt(msgs)


_PROMPT_TABLE: list[tuple[str, Callable, _Parser]] = [
    ("{prompt}", _has("prompt"), _prompt_text),
    ("{messages}", _has("messages"), lambda d, r: _prompt_of_messages(_get_messages(d, "messages"), "messages", r)),
    ("ShareGPT {conversations}", _has("conversations"),
     lambda d, r: _prompt_of_messages(_get_conversation(d), "conversations", r)),
    ("Alpaca {instruction, input}", _has("instruction"), lambda d, r: _alpaca_prompt(d)),
    ("{chosen: [messages], rejected: [messages]}", _chosen_is_conversation, lambda d, r: _message_pair_split(d, r)[0]),
    ("{chosen, rejected} hh-rlhf transcripts", _has("chosen", "rejected"), lambda d, r: _hh_split(d)[0]),
]


def _as_rows(rows: Sequence[Row | Mapping[str, Any]]) -> list[Row]:
    return [r if isinstance(r, Row) else Row(dict(r), f"row {i}") for i, r in enumerate(rows)]


def _detect(first: Row, table, shapes: str, kind: str) -> tuple[str, _Parser]:
    """The shape of the dataset `first` opens: the first table entry whose selector holds."""
    if not isinstance(first.data, Mapping):
        raise DataFormatError(f"{first.origin}: a {kind} row must be an object. Accepted {kind} shapes: {shapes}")
    for name, selects, parser in table:
        if selects(first.data):
            return name, parser
    keys = sorted(k for k, v in first.data.items() if v is not None)
    raise DataFormatError(
        f"{first.origin}: fields {keys} fit no {kind} shape (the first row decides the dataset's shape). "
        f"Accepted {kind} shapes: {shapes}"
    )


def _parse(rows, tokenizer, table, accepted: Sequence[str], kind: str) -> list[tuple[Row, Any]]:
    rows = _as_rows(rows)
    shapes = "; ".join(accepted)
    shape: dict[str, tuple[str, _Parser, Row]] = {}  # per dataset (Row.dataset): name, parser, its first row
    render = _Renderer(tokenizer)
    out = []
    for row in rows:
        if row.dataset not in shape:
            shape[row.dataset] = (*_detect(row, table, shapes, kind), row)
        name, parser, first = shape[row.dataset]
        try:
            if not isinstance(row.data, Mapping):
                raise _RowError("row is not an object")
            out.append((row, parser(row.data, render)))
        except _RowError as e:
            raise DataFormatError(
                f"{row.origin}: {e} (dataset detected as {kind} shape {name} from {first.origin}). "
                f"Accepted {kind} shapes: {shapes}"
            ) from None
    return out


# --------------------------------------------------------------------------- public parsers


def parse_sft(rows: Sequence[Row | Mapping[str, Any]], tokenizer: Any = None) -> list[SFTExample | ChatExample]:
    """Rows -> SFTExample, or ChatExample for conversations ({messages}, ShareGPT); the tokenizer (with a
    chat_template) is needed only for message lists."""
    out: list[SFTExample | ChatExample] = []
    for row, parsed in _parse(rows, tokenizer, _SFT_TABLE, SFT_SHAPES, "SFT"):
        out.append(ChatExample(parsed, row.origin) if isinstance(parsed, list) else SFTExample(*parsed, row.origin))
    return out


def parse_pairs(rows: Sequence[Row | Mapping[str, Any]], tokenizer: Any = None) -> list[PairExample]:
    """Rows -> PairExample (prompt, chosen response, rejected response)."""
    parsed = _parse(rows, tokenizer, _PAIR_TABLE, PAIR_SHAPES, "pair")
    return [PairExample(p, c, r, row.origin) for row, (p, c, r) in parsed]


def parse_unpaired(rows: Sequence[Row | Mapping[str, Any]], tokenizer: Any = None) -> list[UnpairedExample]:
    """Rows -> UnpairedExample (prompt, response, label): KTO's rows as they are, or every pair split
    into its desirable (chosen) and undesirable (rejected) row, in that order."""
    out = []
    for row, parts in _parse(rows, tokenizer, _UNPAIRED_TABLE, UNPAIRED_SHAPES, "unpaired"):
        out += [UnpairedExample(p, y, label, row.origin + side) for p, y, label, side in parts]
    return out


def _scalar(v: Any) -> bool:
    return isinstance(v, (str, int, bool)) or (isinstance(v, float) and math.isfinite(v))


def parse_prompts(rows: Sequence[Row | Mapping[str, Any]], tokenizer: Any = None) -> list[PromptExample]:
    """Rows -> PromptExample; keeps `answer` (as str) and other scalar fields (e.g. `task`) in meta."""
    out = []
    for row, prompt in _parse(rows, tokenizer, _PROMPT_TABLE, PROMPT_SHAPES, "prompt"):
        answer = row.data.get("answer")
        meta = {k: v for k, v in row.data.items() if k not in _RECORD_FIELDS and _scalar(v)}
        out.append(PromptExample(prompt, row.origin, None if answer is None else str(answer), meta))
    return out
