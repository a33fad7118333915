"""Conversations -> token ids and a per-token loss mask, from the tokenizer's own chat template.

    [(ids, mask)] = chat_tokens(tokenizer, [example])        # ChatExample: messages + origin
    chat_tokens(tokenizer, examples, assistant_only=False)   # mask: every token

Every assistant turn is trained: mask[i] is True on each token the template writes for an assistant
turn after its generation prompt, that is the content and the end-of-turn tokens that follow it as
the template writes them (ChatML: `content<|im_end|>\\n`; the embedded template: ` content</s>\\n\\n`).
Nothing is appended: no tokenizer.eos_token unless the template writes it (a template that writes
no end-of-turn token trains a model that does not stop). System, user and tool turns, and the
generation prompts (`<|im_start|>assistant\\n`), are context: rendered, never trained.

The turns are found from the template itself, in one of two ways:
- a template with `{% generation %}...{% endgeneration %}` markers: transformers'
  `apply_chat_template(..., return_assistant_tokens_mask=True)`; what the markers enclose is trained.
- any other template, by rendering prefixes: the assistant turn k starts where
  `messages[:k]` rendered with the generation prompt ends, and ends where `messages[:k+1]` rendered
  without it ends. Each such rendering must be a prefix, in token ids, of the whole conversation's
  rendering (the template is "prefix-stable"); where one is not, the row is refused with a
  DataFormatError naming it, since its turns' tokens cannot be located. (A template without a
  generation prompt trains the assistant's role header too: it is part of the turn it writes.)
A conversation that opens with an assistant turn is refused on this path (no prefix to render).

`assistant_only=False` (data.assistant_only_loss=false): the mask covers the whole rendered
transcript, every token of every turn, as a {text} row's does (no prefix rendering needed).
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from jinja2 import TemplateError

from rlhf.core.errors import DataFormatError
from rlhf.data.records import ChatExample

GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")  # as transformers detects it


def _render(tok: Any, messages: list[dict[str, str]], origin: str, generation_prompt: bool) -> str:
    try:
        return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    except (TemplateError, ValueError, TypeError, KeyError, IndexError) as e:
        msg = " ".join(str(e).split())
        raise DataFormatError(f"{origin}: the tokenizer's chat template fails on this conversation: "
                              f"{type(e).__name__}: {msg}") from None


def _has_markers(tok: Any) -> bool:
    try:
        template = tok.get_chat_template() if hasattr(tok, "get_chat_template") else tok.chat_template
    except ValueError:  # no template: rendering says so, naming the row
        return False
    return isinstance(template, str) and bool(GENERATION_MARKER.search(template))


def _not_prefix_stable(origin: str, n: int, k: int, generation_prompt: bool, how: str) -> DataFormatError:
    what = f"messages[:{n}]" + (" with the generation prompt" if generation_prompt else "")
    return DataFormatError(
        f"{origin}: the tokenizer's chat template is not prefix-stable: {what} (around assistant turn "
        f"messages[{k}]) renders as {how} the whole conversation's rendering, so the assistant turns' tokens "
        "cannot be located. Give the template {% generation %} markers, or set data.assistant_only_loss=false "
        "(loss on the whole transcript)")


def _marked(tok: Any, ex: ChatExample) -> tuple[list[int], list[bool]]:
    try:
        out = tok.apply_chat_template(ex.messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    except (TemplateError, ValueError, TypeError, KeyError, IndexError) as e:
        msg = " ".join(str(e).split())
        raise DataFormatError(f"{ex.origin}: the tokenizer's chat template fails on this conversation: "
                              f"{type(e).__name__}: {msg}") from None
    return list(out["input_ids"]), [bool(m) for m in out["assistant_masks"]]


def chat_tokens(tok: Any, examples: Sequence[ChatExample], assistant_only: bool = True
                ) -> list[tuple[list[int], list[bool]]]:
    """(ids, mask) per conversation: the template's rendering tokenized without added special tokens,
    mask True on the tokens trained (see the module docstring)."""
    if not examples:
        return []
    if assistant_only and _has_markers(tok):
        return [_marked(tok, ex) for ex in examples]
    wholes = [_render(tok, ex.messages, ex.origin, False) for ex in examples]
    texts: list[str] = list(wholes)  # every rendering, encoded in one batch: the wholes, then the prefixes
    turns: list[list[tuple[int, int, int | None]]] = []  # per example: (k, index of its start text, of its end text)
    for ex, whole in zip(examples, wholes):
        mine = []
        for k, m in enumerate(ex.messages if assistant_only else []):
            if m["role"] != "assistant":
                continue
            if k == 0:
                raise DataFormatError(f"{ex.origin}: the conversation opens with an assistant turn: there is no "
                                      "prompt before it to locate its tokens by (start with a system or user turn)")
            start = _render(tok, ex.messages[:k], ex.origin, True)
            end = None if k == len(ex.messages) - 1 else _render(tok, ex.messages[: k + 1], ex.origin, False)
            for n, text, gen in ((k, start, True), (k + 1, end, False)):
                if text is not None and not whole.startswith(text):
                    raise _not_prefix_stable(ex.origin, n, k, gen, "text that does not begin")
            texts.append(start)
            if end is not None:
                texts.append(end)
            mine.append((k, len(texts) - (2 if end is not None else 1), None if end is None else len(texts) - 1))
        turns.append(mine)
    encoded = tok(texts, add_special_tokens=False)["input_ids"] if texts else []
    out = []
    for ex, ids, mine in zip(examples, encoded, turns):
        ids = list(ids)
        mask = [not assistant_only] * len(ids)
        for k, i_start, i_end in mine:
            a = _prefix_len(ids, encoded[i_start], ex.origin, k, k, True)
            b = len(ids) if i_end is None else _prefix_len(ids, encoded[i_end], ex.origin, k + 1, k, False)
            if b < a:
                raise _not_prefix_stable(ex.origin, k + 1, k, False, "fewer tokens than its prompt in")
            mask[a:b] = [True] * (b - a)
        out.append((ids, mask))
    return out


def _prefix_len(ids: list[int], part: list[int], origin: str, n: int, k: int, gen: bool) -> int:
    """len(part), checked to be a prefix of ids."""
    if ids[: len(part)] != list(part):
        raise _not_prefix_stable(origin, n, k, gen, "token ids that are not the beginning of")
    return len(part)
