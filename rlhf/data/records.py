"""Record shapes: raw rows (dicts with provenance) -> canonical SFT / pair / prompt examples.

The shape is detected once per dataset, from its first row; every row must then fit that shape,
and one that does not raises `DataFormatError` naming the row's origin (``file.jsonl:17``), the
missing or invalid field, and the accepted shapes. Texts are used exactly as stored: prompt and
response are concatenated with nothing in between (Dahoas and hh-rlhf prompts end with
"Assistant:", their responses start with a space).

    SFT      {prompt, response}            prompt may also be a message list (chat template)
             {text}                        no prompt: the loss covers every token
             {messages: [{role, content}]} prompt = template(messages[:-1]) + generation prompt,
                                           response = the last message, which must be "assistant"
             any pair shape                prompt + the chosen response (one dataset for all stages)
    pairs    {prompt, chosen, rejected}    responses only (Dahoas/rm-static); prompt may be a
                                           message list, chosen/rejected a one-message list
             {chosen, rejected} strings    hh-rlhf transcripts: prompt = shared text up to and
                                           including the LAST "\\n\\nAssistant:", responses = rest
             {chosen, rejected} messages   whole conversations sharing all but the last message
    prompts  {prompt} or any of the above  the prompt part is taken ({text} has none)

Message lists are rendered with the tokenizer's chat template; only those shapes need a tokenizer.
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


@dataclass(slots=True)
class SFTExample:
    prompt: str  # "" for {text} rows
    response: str
    origin: str


@dataclass(slots=True)
class PairExample:
    prompt: str
    chosen: str
    rejected: str
    origin: str


@dataclass(slots=True)
class PromptExample:
    prompt: str
    origin: str
    answer: str | None = None  # gold answer, e.g. of the embedded default task's eval prompts
    meta: dict[str, Any] = field(default_factory=dict)  # other scalar fields, e.g. "task"


HH_ASSISTANT = "\n\nAssistant:"
# Fields that make up a record; any other scalar field of a prompt row goes into PromptExample.meta.
_RECORD_FIELDS = frozenset({"prompt", "response", "text", "messages", "chosen", "rejected", "answer"})

SFT_SHAPES = (
    "{prompt, response} (prompt: str or message list)",
    "{text}",
    "{messages: [{role, content}, ...]} ending with an assistant message",
    "any pair shape (prompt + the chosen response)",
)
PAIR_SHAPES = (
    "{prompt, chosen, rejected} (responses only; prompt: str or message list)",
    '{chosen, rejected} hh-rlhf transcripts sharing the text up to the last "\\n\\nAssistant:"',
    "{chosen: [messages], rejected: [messages]} sharing all but the last (assistant) message",
)
PROMPT_SHAPES = (
    "{prompt} (str or message list)",
    "{messages: [...]}",
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


def _last_assistant(messages: list[dict[str, str]], key: str) -> str:
    if messages[-1]["role"] != "assistant":
        raise _RowError(f"field {key!r}: last message has role {messages[-1]['role']!r}, expected 'assistant'")
    return messages[-1]["content"]


class _Renderer:
    """Chat-template rendering, checked lazily: only message-list shapes need a tokenizer."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer

    def prompt(self, messages: list[dict[str, str]]) -> str:
        tok = self.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            what = "no tokenizer was given" if tok is None else "the tokenizer has no chat_template"
            raise _RowError(f"message lists are rendered with a chat template, but {what}")
        return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


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


_SFT_TABLE: list[tuple[str, Callable, _Parser]] = [
    ("{prompt, response}", _has("prompt", "response"), lambda d, r: (_prompt_text(d, r), _get_str(d, "response"))),
    ("{messages}", _has("messages"), lambda d, r: _sft_messages(d, r)),
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


def _sft_messages(d: Mapping[str, Any], render: _Renderer) -> tuple[str, str]:
    msgs = _get_messages(d, "messages", 2)
    response = _last_assistant(msgs, "messages")
    return render.prompt(msgs[:-1]), response


_PAIR_TABLE: list[tuple[str, Callable, _Parser]] = [
    ("{chosen: [messages], rejected: [messages]}", _chosen_is_conversation, _message_pair_split),
    (
        "{prompt, chosen, rejected}",
        _has("prompt", "chosen", "rejected"),
        lambda d, r: (_prompt_text(d, r), _response_text(d, "chosen"), _response_text(d, "rejected")),
    ),
    ("{chosen, rejected} hh-rlhf transcripts", _has("chosen", "rejected"), lambda d, r: _hh_split(d)),
]


def _prompt_of_messages(d: Mapping[str, Any], render: _Renderer) -> str:
    msgs = _get_messages(d, "messages")
    if msgs[-1]["role"] == "assistant":
        msgs = msgs[:-1]
    if not msgs:
        raise _RowError("field 'messages' holds only an assistant message, no prompt")
    return render.prompt(msgs)


_PROMPT_TABLE: list[tuple[str, Callable, _Parser]] = [
    ("{prompt}", _has("prompt"), _prompt_text),
    ("{messages}", _has("messages"), _prompt_of_messages),
    ("{chosen: [messages], rejected: [messages]}", _chosen_is_conversation, lambda d, r: _message_pair_split(d, r)[0]),
    ("{chosen, rejected} hh-rlhf transcripts", _has("chosen", "rejected"), lambda d, r: _hh_split(d)[0]),
]


def _as_rows(rows: Sequence[Row | Mapping[str, Any]]) -> list[Row]:
    return [r if isinstance(r, Row) else Row(dict(r), f"row {i}") for i, r in enumerate(rows)]


def _parse(rows, tokenizer, table, accepted: Sequence[str], kind: str) -> list[tuple[Row, Any]]:
    rows = _as_rows(rows)
    if not rows:
        return []
    shapes = "; ".join(accepted)
    first = rows[0]
    if not isinstance(first.data, Mapping):
        raise DataFormatError(f"{first.origin}: a {kind} row must be an object. Accepted {kind} shapes: {shapes}")
    for name, selects, parser in table:
        if selects(first.data):
            break
    else:
        keys = sorted(k for k, v in first.data.items() if v is not None)
        raise DataFormatError(
            f"{first.origin}: fields {keys} fit no {kind} shape (the first row decides the dataset's shape). "
            f"Accepted {kind} shapes: {shapes}"
        )
    render = _Renderer(tokenizer)
    out = []
    for row in rows:
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


def parse_sft(rows: Sequence[Row | Mapping[str, Any]], tokenizer: Any = None) -> list[SFTExample]:
    """Rows -> SFTExample; the tokenizer (with a chat_template) is needed only for message lists."""
    return [SFTExample(p, r, row.origin) for row, (p, r) in _parse(rows, tokenizer, _SFT_TABLE, SFT_SHAPES, "SFT")]


def parse_pairs(rows: Sequence[Row | Mapping[str, Any]], tokenizer: Any = None) -> list[PairExample]:
    """Rows -> PairExample (prompt, chosen response, rejected response)."""
    parsed = _parse(rows, tokenizer, _PAIR_TABLE, PAIR_SHAPES, "pair")
    return [PairExample(p, c, r, row.origin) for row, (p, c, r) in parsed]


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
