"""The Hugging Face export that the next stage (or plain `transformers`) reads: weights gathered from the
engine, LoRA merged (or saved as an adapter naming its base), the tokenizer saved so that it encodes
exactly as training did.

    export_model(engine, tok, cfg.output_dir, cfg.model, add_bos=True)   # output_dir/model, atomic
    export_hf(engine.full_state_dict(), lm, tok, out_dir, cfg.model)      # rank 0
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
from typing import Any

import torch
from torch import nn

from engine import TORCH_DTYPES, atomic_directory
from rlhf.config import ModelConfig
from rlhf.modeling.load import ADAPTER_BASE_FILE, MODEL_SUBDIR

logger = logging.getLogger(__name__)


PROBE_TEXT = "Human: Reverse abc.\n\nAssistant: cba"  # for checking that an exported tokenizer encodes as training


def export_tokenizer(tokenizer: Any, *, add_bos: bool, add_eos: bool) -> Any:
    """A copy of `tokenizer` whose plain `tokenizer(text)` gives what the stages trained on.

    The stages tokenize without special tokens and add them by hand (rlhf/data/tokenize.py):
    `[bos] + prompt + response + [eos]`, with bos only when `data.add_bos` and the tokenizer has one.
    The exported copy adds bos the same way, and eos too for a reward/value model, which scores
    whole sequences at their last token; a causal LM's copy adds no eos, so `tokenizer(prompt)` ->
    `generate` continues the prompt exactly as in training. Where a tokenizer cannot be told to
    (a slow tokenizer without these switches) the mismatch is logged once with the fix.
    """
    import copy

    tok = copy.deepcopy(tokenizer)
    bos = add_bos and tok.bos_token_id is not None
    want = ([tok.bos_token_id] if bos else []) + tokenizer(PROBE_TEXT, add_special_tokens=False)["input_ids"] + (
        [tok.eos_token_id] if add_eos else [])
    try:
        tok.add_bos_token, tok.add_eos_token = bos, add_eos  # transformers 5 rebuilds the post-processor
    except (AttributeError, ValueError):
        pass
    if tok(PROBE_TEXT)["input_ids"] != want and getattr(tok, "is_fast", False):
        from tokenizers import processors  # transformers 4's fast tokenizers: set the template directly

        specials = [(t, i) for t, i, on in ((tok.bos_token, tok.bos_token_id, bos), (tok.eos_token, tok.eos_token_id, add_eos)) if on]
        single = " ".join([f"{tok.bos_token}:0"] * bos + ["$A:0"] + [f"{tok.eos_token}:0"] * add_eos)
        pair = single + " " + " ".join([f"{tok.bos_token}:1"] * bos + ["$B:1"] + [f"{tok.eos_token}:1"] * add_eos)
        tok._tokenizer.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)
    got = tok(PROBE_TEXT)["input_ids"]
    if got != want:
        logger.warning("the exported tokenizer (%s) cannot be set to add %s itself: with plain transformers, "
                       "add them by hand to match training (encoded %s, trained on %s)", type(tok).__name__,
                       " and ".join(n for n, on in (("bos", bos), ("eos", add_eos)) if on) or "no special tokens",
                       got, want)
    return tok


def scoring_pad(tok: Any) -> int | None:
    """Give a value model's exported tokenizer (`export_tokenizer`'s copy, changed in place) a pad token
    that is not eos, so that plain transformers scores as the run does; returns the new pad id, or None
    when the pad token already differs from eos (nothing changes).

    The run scores a sequence at its last real token, found from the attention mask (rlhf/algos/
    reward_model.py), which for the exported tokenizer is always the eos it appends. transformers'
    `*ForSequenceClassification` pools at the last token that is not `config.pad_token_id` instead: with
    pad == eos (the Qwen convention, and what `load_tokenizer` sets for a tokenizer without a pad token)
    that is the token before eos. So the export pads with another token the vocabulary already has (the
    vocabulary, the embeddings and every other id stay as trained; padding is masked, so what it holds
    never reaches a real token's score): unk, else a special token (not bos), else bos, else the first id.
    """
    eos = tok.eos_token_id
    if tok.pad_token_id is not None and tok.pad_token_id != eos:
        return None
    specials = sorted(i for i, t in getattr(tok, "added_tokens_decoder", {}).items() if getattr(t, "special", False))
    candidates = [tok.unk_token_id, *(i for i in specials if i != tok.bos_token_id), tok.bos_token_id, 0, 1]
    pad = next(i for i in candidates if i is not None and i != eos and i < len(tok))
    tok.pad_token = tok.convert_ids_to_tokens(pad)
    logger.info("export: the tokenizer's pad token was its eos token %r; the exported value model pads with %r "
                "(id %d), so that transformers' sequence classification, which scores the last token that is not "
                "pad, scores at eos as training did", tok.eos_token, tok.pad_token, pad)
    return pad


def export_model(engine: Any, tokenizer: Any, output_dir: str, cfg: ModelConfig, *, add_bos: bool) -> str:
    """A stage's final export: the engine's model as `output_dir/model` (HF). Collective: every rank
    calls it (the state dict is consolidated), rank 0 writes. Returns the model directory."""
    state = engine.full_state_dict()
    model_dir = os.path.join(output_dir, MODEL_SUBDIR)
    if engine.info.is_main:
        export_hf(state, engine.inner, tokenizer, model_dir, cfg, add_bos=add_bos)
    return model_dir


def export_hf(
    state_dict: dict[str, torch.Tensor],
    like: nn.Module,
    tokenizer: Any,
    out_dir: str,
    cfg: ModelConfig,
    extra_files: dict[str, str] | None = None,
    *,
    add_bos: bool = True,
    atomic: bool = True,
    final_dir: str | None = None,
) -> str:
    """Write a consolidated state dict as a Hugging Face directory, atomically; returns out_dir.

    `state_dict`: clean names of `like` (the unwrapped training module, possibly a peft model), as
    `engine.full_state_dict()` returns on rank 0. LoRA: merged into the base weights
    (`lora.merge_on_save`) or saved as a peft adapter naming its base (a stage's merged adapter
    input, when there was one: see `_merge_adapter`): by absolute path in adapter_config.json, for
    plain peft, and relative to the adapter in adapter_base.json, which our loader reads first
    (`_record_adapter_base`). Weights are cast to `cfg.save_dtype`. The tokenizer is saved so that it
    encodes as training did (`export_tokenizer`; `add_bos` = the run's `data.add_bos`); a merged value
    model's pads with a token other than eos (`scoring_pad`), so that transformers' sequence
    classification scores as the run does. `atomic=False`: into `out_dir` as is (a temporary directory
    of `engine.atomic_directories`, which publishes several exports together; `final_dir` is then the
    directory it becomes, which relative paths start from).
    """
    dtype = TORCH_DTYPES[cfg.save_dtype]
    peft_cfg = getattr(like, "peft_config", None)
    # NOTE: the skeleton takes these tensors as its own (assign=True) and merging LoRA writes into
    # the base weights in place, so copy: the state dict may share storage with the live model.
    copy = bool(peft_cfg) and cfg.lora.merge_on_save
    state_dict = _tied_as_one(state_dict, like)
    sd, made = {}, {}
    for k, v in state_dict.items():
        if v.is_floating_point():
            key = (v.data_ptr(), v.shape, v.stride())  # tied weights stay one tensor after the copy
            if key not in made:
                made[key] = v.to(dtype, copy=copy)
            v = made[key]
        sd[k] = v
    base_like = like.get_base_model() if hasattr(like, "get_base_model") else like
    with torch.device("meta"):
        skeleton = type(base_like)(base_like.config)
    if peft_cfg:
        from peft import get_peft_model

        skeleton = get_peft_model(skeleton, peft_cfg["default"])
    missing, unexpected = skeleton.load_state_dict(sd, strict=False, assign=True)
    missing = [k for k in missing if "rotary_emb" not in k]
    if missing or unexpected:
        raise RuntimeError(f"export: state dict does not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    if peft_cfg and cfg.lora.merge_on_save:
        skeleton = skeleton.merge_and_unload()
    if hasattr(skeleton, "tie_weights"):
        skeleton.tie_weights()
    is_value_model = "ForSequenceClassification" in type(base_like).__name__
    tok = export_tokenizer(tokenizer, add_bos=add_bos, add_eos=is_value_model)
    if is_value_model and not (peft_cfg and not cfg.lora.merge_on_save) and scoring_pad(tok) is not None:
        skeleton.config.pad_token_id = tok.pad_token_id  # what transformers' pooling compares ids with
    with atomic_directory(out_dir) if atomic else contextlib.nullcontext(out_dir) as tmp:
        skeleton.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        if peft_cfg and not cfg.lora.merge_on_save:
            _record_adapter_base(tmp, final_dir or out_dir)
        for name, text in (extra_files or {}).items():
            with open(os.path.join(tmp, name), "w") as f:
                f.write(text)
    return out_dir


def _tied_as_one(state_dict: dict[str, torch.Tensor], like: nn.Module) -> dict[str, torch.Tensor]:
    """`state_dict` with the entries of each group of tied parameters of `like` (one Parameter under several
    names: a tied embedding and LM head) made one tensor, the group's first. A state dict gathered from
    GPU shards holds them as separate CPU copies (on the CPU the gather returns one shared tensor), and
    an export of two tensors writes an untied `lm_head.weight` the model does not have."""
    names: dict[int, list[str]] = {}
    for name, p in like.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    out = dict(state_dict)
    for group in names.values():
        present = [n for n in group if n in out]
        for n in present[1:]:
            out[n] = out[present[0]]
    return out


def _record_adapter_base(adapter_dir: str, final_dir: str) -> None:
    """A local base path made absolute in adapter_config.json, so that plain peft loads the adapter from
    any working directory, and written relative to the adapter's `final_dir` in adapter_base.json (read
    first by rlhf/modeling/load.py), so that a runs folder moved or copied whole keeps its chain. A hub
    name is left as it is (no adapter_base.json)."""
    path = os.path.join(adapter_dir, "adapter_config.json")
    with open(path) as f:
        meta = json.load(f)
    base = meta.get("base_model_name_or_path")
    if not (base and os.path.exists(base)):
        return
    meta["base_model_name_or_path"] = os.path.abspath(base)
    with open(path, "w") as f:
        json.dump(meta, f, indent=2)
    relative = os.path.relpath(os.path.abspath(base), os.path.abspath(final_dir))
    with open(os.path.join(adapter_dir, ADAPTER_BASE_FILE), "w") as f:
        json.dump({"relative_path": relative, "note": "the base model relative to this directory (read before "
                                                      "adapter_config.json's absolute base_model_name_or_path)"},
                  f, indent=2)
