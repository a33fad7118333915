"""Tokenizers and models: load (path, hub name, previous stage's output) or build from a config, LoRA.

    tok = load_tokenizer(cfg.model)                        # pad token ensured
    lm = load_causal_lm(cfg.model, tok, seed=1234)         # + LoRA when cfg.model.lora.r > 0
    vm = load_value_model(cfg.model, tok, seed=1234)       # backbone + scalar head (reward, critic)
    (a stage wraps them in its role: Policy, ValueModel)
    (export: rlhf/modeling/export.py; roles: rlhf/modeling/roles.py)

A previous stage's output directory (`outputs/sft`) may be given wherever a model path is
expected: its `model/` subdirectory is used. A directory holding a peft adapter is loaded onto its
base model and merged. `trust_remote_code` is passed only when configured.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any

import torch
from torch import nn

from engine import TORCH_DTYPES, hf_base_model
from engine.vllm_backend import refusal as vllm_refusal
from rlhf.config import ModelConfig
from rlhf.core.errors import ConfigError
from rlhf.core.hub import check_local, ensure_hub, looks_local
from rlhf.data.packing import EXPLICIT_MASK_MODEL_TYPES, pack_length_of

logger = logging.getLogger(__name__)

MODEL_SUBDIR = "model"  # where a stage writes its final HF model inside output_dir


def quiet_transformers() -> None:
    """No per-shard progress bars from transformers' loading/saving (our own bars show progress)."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()


def resolve_model_path(path: str, require_model: bool = True) -> str:
    """A stage output directory -> its model/ subdirectory; anything else unchanged. A stage directory
    without summary.json (a killed, half-written or still running stage) is an error: its model/
    may be a previous run's (name the model/ directory itself to use it anyway)."""
    sub = os.path.join(path, MODEL_SUBDIR)
    if os.path.isdir(sub) and any(os.path.exists(os.path.join(sub, f)) for f in ("config.json", "adapter_config.json")):
        if os.path.exists(os.path.join(path, "config.yaml")) and not os.path.exists(os.path.join(path, "summary.json")):
            raise ConfigError(
                f"{path} is a stage's output without summary.json: that run did not finish (killed, failed or "
                f"still running), so {sub} may not be its model; finish it (train.resume=true), or name {sub} "
                "itself to use that model anyway"
            )
        return sub
    if require_model and os.path.isdir(path) and not any(
        os.path.exists(os.path.join(path, f)) for f in ("config.json", "adapter_config.json")
    ):
        raise ConfigError(
            f"{path} is a directory without a Hugging Face model (no config.json or adapter_config.json, "
            f"and no {MODEL_SUBDIR}/ holding one): did the stage that writes it finish?"
        )
    return path


def _check_exists(path: str, key: str) -> None:
    check_local(path, key)


# ----------------------------------------------------------------------------- tokenizer


def load_tokenizer(cfg: ModelConfig, key: str = "model") -> Any:
    """The tokenizer of `cfg.tokenizer` (or of the model). Without a pad token, eos is used as pad:
    every position rule here comes from attention masks, never from comparing ids with pad."""
    from transformers import AutoTokenizer

    source = cfg.tokenizer or cfg.name_or_path
    which = f"{key}.tokenizer" if cfg.tokenizer else f"{key}.name_or_path"
    _check_exists(source, which)
    source = resolve_model_path(source, require_model=False) if os.path.isdir(source) else source
    while _is_adapter(source) and not os.path.exists(os.path.join(source, "tokenizer_config.json")):
        base = _adapter_base(source)  # an adapter saved without a tokenizer: its base's
        source = resolve_model_path(base, require_model=False) if os.path.isdir(base) else base
    ensure_hub(source, which)  # a hub name without a reachable hub: fails in seconds, not minutes
    try:
        tok = AutoTokenizer.from_pretrained(source, trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{which}={source!r}: cannot load a tokenizer ({e})") from None
    if tok.eos_token_id is None:
        raise ConfigError(f"{which}={source!r}: the tokenizer has no eos token (needed to end responses)")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
        logger.info("tokenizer has no pad token: using eos (%r) as pad", tok.eos_token)
    return tok


def tokenizer_mismatch(a: Any, b: Any) -> str | None:
    """Why tokenizers `a` and `b` would give different ids (vocabulary, bos/eos), or None if they agree."""
    va, vb = a.get_vocab(), b.get_vocab()
    if va != vb:
        differ = sorted(t for t in set(va) | set(vb) if va.get(t) != vb.get(t))
        return f"vocabularies differ ({len(va)} vs {len(vb)} tokens; e.g. {differ[:3]})"
    for name in ("bos", "eos"):
        ia, ib = getattr(a, f"{name}_token_id"), getattr(b, f"{name}_token_id")
        if ia != ib:
            return f"{name} token ids differ ({ia} vs {ib})"
    return None


def check_context(model: nn.Module, length: int, what: str) -> None:
    """Sequences of `length` tokens must fit the model's positions (`max_position_embeddings`): past
    them a learned position table fails deep in torch and rotary models silently extrapolate."""
    n = getattr(hf_base_model(model).config, "max_position_embeddings", None)
    if n is not None and length > n:
        raise ConfigError(f"{what} ({length}) exceeds the model's context (max_position_embeddings={n}): "
                          "lower it, or use a model with a longer context")


# Beside adapter_config.json (which keeps the absolute base path that plain peft reads): the base as a
# path relative to the adapter's directory, so that a runs folder moved or copied whole still loads.
ADAPTER_BASE_FILE = "adapter_base.json"


def _adapter_base(path: str) -> str:
    """The base model of the adapter directory `path`: adapter_base.json's path relative to `path` when
    it exists there (written by our exports), else adapter_config.json's base_model_name_or_path (an
    absolute path, a path relative to the working directory as peft reads it, or a hub name). A local
    base that exists nowhere is a ConfigError naming adapter_config.json and the path it records."""
    config = os.path.join(path, "adapter_config.json")
    with open(config) as f:
        base = json.load(f).get("base_model_name_or_path")
    if not base:
        raise ConfigError(f"{config} names no base_model_name_or_path")
    relative = None
    if os.path.exists(os.path.join(path, ADAPTER_BASE_FILE)):
        with open(os.path.join(path, ADAPTER_BASE_FILE)) as f:
            relative = json.load(f).get("relative_path")
        if relative and os.path.exists(os.path.join(path, relative)):
            return os.path.normpath(os.path.join(os.path.abspath(path), relative))
    if os.path.exists(os.path.expanduser(base)) or not (looks_local(base) or relative):
        return base  # where it was, or a hub name
    also = f" (nor {relative!r} relative to the adapter, from {ADAPTER_BASE_FILE})" if relative else ""
    raise ConfigError(f"{config} records base_model_name_or_path={base!r}, which does not exist{also}: the adapter's "
                      "base model was moved or deleted; put it back, or set base_model_name_or_path there to where "
                      "it is now")


def _path_key(key: str) -> str:
    """The config key of a model role's path: actor -> actor.model (PPO's roles, and distillation's
    teacher), model -> model.name_or_path."""
    return f"{key}.model" if key in ("actor", "critic", "reference", "reward_model", "teacher") else f"{key}.name_or_path"


def _role_evidence(path: str, task_type: str, archs_say) -> str | None:
    """What in the local model directory `path` (or a stage's output_dir) declares a role, read from its files
    before any weights load: its outermost adapter's task_type equal to `task_type`, or its config.json's
    architectures for which `archs_say(archs)` holds. None otherwise (and for what cannot be read here: a hub
    name, a directory without a model)."""
    if not os.path.isdir(path):
        return None
    path = resolve_model_path(path, require_model=False)
    if _is_adapter(path):
        with open(os.path.join(path, "adapter_config.json")) as f:
            task = json.load(f).get("task_type")
        return f"{path}/adapter_config.json has task_type {task!r}" if task == task_type else None
    if not os.path.exists(os.path.join(path, "config.json")):
        return None
    with open(os.path.join(path, "config.json")) as f:
        archs = json.load(f).get("architectures") or []
    return f"{path}/config.json has architectures {archs}" if archs_say(archs) else None


def value_model_reason(path: str) -> str | None:
    """Why `path` is a reward / value model rather than a causal LM (`_role_evidence`): an adapter of task_type
    SEQ_CLS, or architectures naming a *ForSequenceClassification."""
    return _role_evidence(path, "SEQ_CLS", lambda archs: any(a.endswith("ForSequenceClassification") for a in archs))


def check_causal_lm(path: str | None, key: str) -> None:
    """A policy (SFT, DPO, PPO's actor and reference) must be a causal LM: a reward model's directory would
    load as one with a random LM head, and train or score as if nothing were wrong."""
    why = value_model_reason(path) if path else None
    if why:
        k = _path_key(key)
        raise ConfigError(f"{k}={path!r} is a reward / value model ({why}), not a causal LM: {k} must be a "
                          "policy, e.g. the SFT stage's output_dir or a *ForCausalLM model")


def causal_lm_reason(path: str) -> str | None:
    """Why `path` is a causal LM rather than a reward model (`_role_evidence`): an adapter of task_type CAUSAL_LM,
    or architectures that are all *ForCausalLM / *LMHeadModel."""
    return _role_evidence(path, "CAUSAL_LM",
                          lambda archs: bool(archs) and all(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs))


def check_reward_model(path: str | None, key: str) -> None:
    """A model that scores (the served reward model, PPO's reward model and ensemble members, rlhf.evaluate's
    mode=reward) must be a reward model: a policy's directory would load with a random score head and score
    every row as noise, as if nothing were wrong. `key`: the whole config key (reward.model, ...)."""
    why = causal_lm_reason(path) if path else None
    if why:
        raise ConfigError(f"{key}={path!r} is a causal LM (a policy: {why}), not a reward model: its score head "
                          f"would be random; {key} must be a reward model, e.g. the reward stage's output_dir or a "
                          "*ForSequenceClassification model")


# ----------------------------------------------------------------------------- models


def from_config_kwargs(cfg: ModelConfig, tok: Any) -> dict[str, Any]:
    kw = dict(cfg.config)
    kw.setdefault("vocab_size", len(tok))
    for name in ("bos", "eos", "pad"):
        kw.setdefault(f"{name}_token_id", getattr(tok, f"{name}_token_id"))
    return kw


def _check_config_keys(model_type: str, keys: list[str], key: str) -> None:
    """Every `model.config` key must exist for the family (OPT has `ffn_dim`, not `intermediate_size`):
    transformers would keep an unknown key as a stray attribute and build the default size."""
    import difflib
    import inspect

    from transformers import AutoConfig

    try:
        cls = type(AutoConfig.for_model(model_type))
    except (KeyError, ValueError) as e:
        raise ConfigError(f"{key}.config: unknown or invalid model_type {model_type!r} ({e})") from None
    known = set(cls().to_dict()) | set(getattr(cls, "attribute_map", {})) | set(inspect.signature(cls.__init__).parameters)
    for k in keys:
        if k not in known:
            close = difflib.get_close_matches(k, sorted(known), n=3, cutoff=0.6)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise ConfigError(f"{key}.config.{k}: {cls.__name__} (model_type {model_type!r}) has no key {k!r}{hint}")


def check_tokenizer_fits(model: nn.Module, tok: Any, key: str) -> None:
    """A tokenizer that does not belong to the model is an error, not a silent resize: every id must
    have an embedding row, and the tokenizer's bos/eos must be the ones the model was trained with."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    rows = base.get_input_embeddings().weight.shape[0]
    fix = f"use the model's own tokenizer (leave {key}.tokenizer null) or a model trained with this one"
    if len(tok) > rows:
        raise ConfigError(f"{key}: the tokenizer has {len(tok)} tokens but the model's embedding has only {rows} rows: "
                          f"they do not belong together; {fix}")
    for name in ("bos", "eos"):
        want, have = getattr(base.config, f"{name}_token_id", None), getattr(tok, f"{name}_token_id")
        if want is None or have is None:
            continue
        if have not in (want if isinstance(want, (list, tuple)) else [want]):
            raise ConfigError(f"{key}: the tokenizer's {name} token is {getattr(tok, f'{name}_token')!r} (id {have}) "
                              f"but the model's config says {name}_token_id={want}; {fix}")


def _is_adapter(path: str) -> bool:
    return os.path.isdir(path) and os.path.exists(os.path.join(path, "adapter_config.json"))


def adapter_chain(path: str) -> tuple[str, list[str]]:
    """A model path -> (the plain base model, adapter dirs to apply from the base outwards).

    An adapter trained on top of another stage's unmerged adapter names that adapter's directory as
    its base, so SFT adapter -> reward/PPO adapter chains load whole."""
    adapters: list[str] = []
    while _is_adapter(path):
        adapters.append(path)
        if len(adapters) > 8:
            raise ConfigError(f"{adapters[0]}: adapter chain longer than 8 (a cycle?): {adapters}")
        base = _adapter_base(path)
        path = resolve_model_path(base) if os.path.isdir(base) else base
    return path, adapters[::-1]


def _merge_adapter(model: nn.Module, path: str) -> nn.Module:
    """Put the peft adapter at `path` onto `model` and merge it. A causal-LM adapter (an SFT output)
    also fits the backbone of a value model: it is loaded as a task-less adapter there."""
    from peft import PeftConfig, PeftModel

    pcfg = PeftConfig.from_pretrained(path)
    if pcfg.task_type == "CAUSAL_LM" and not hasattr(model, "prepare_inputs_for_generation"):
        pcfg.task_type = None
    merged = PeftModel.from_pretrained(model, path, config=pcfg).merge_and_unload()
    if pcfg.task_type == "SEQ_CLS":  # the adapter brought a trained score head: say so, as a saved reward model does
        merged.config.architectures = [type(merged).__name__]
    # NOTE: peft freezes the base; the merged weights are the new base and train unless LoRA freezes them.
    for p in merged.parameters():
        p.requires_grad_(True)
    # A new adapter trained on top names this one as its base (peft reads `name_or_path`).
    merged.name_or_path = merged.config._name_or_path = os.path.abspath(path)
    return merged


def _attn(cfg: ModelConfig) -> dict[str, Any]:
    return {} if cfg.attn_implementation is None else {"attn_implementation": cfg.attn_implementation}


def _build(cfg: ModelConfig, tok: Any, auto_cls: Any, extra: dict[str, Any], key: str, seed: int) -> nn.Module:
    """Load `cfg.name_or_path` (adapter dirs merged onto their base) or build from `cfg.config`."""
    from transformers import AutoConfig

    if cfg.name_or_path is not None and cfg.fallback_to_config and not os.path.exists(cfg.name_or_path):
        logger.warning("%s.name_or_path=%s does not exist (has the previous stage run?): building the model "
                       "from %s.config with random weights instead (%s.fallback_to_config=true)",
                       key, cfg.name_or_path, key, key)
        cfg = dataclasses.replace(cfg, name_or_path=None)
    if cfg.name_or_path is None:
        kw = from_config_kwargs(cfg, tok)
        model_type = kw.pop("model_type")
        _check_config_keys(model_type, list(cfg.config), key)
        try:
            hf_cfg = AutoConfig.for_model(model_type, **kw, **extra)
        except (KeyError, ValueError) as e:
            raise ConfigError(f"{key}.config: unknown or invalid model_type {model_type!r} ({e})") from None
        torch.manual_seed(seed)  # the random init is part of the run's reproducibility
        model = auto_cls.from_config(hf_cfg, trust_remote_code=cfg.trust_remote_code, **_attn(cfg))
        logger.info("built %s from %s.config with random weights (%s params)",
                    type(model).__name__, key, f"{sum(p.numel() for p in model.parameters()):,}")
        check_tokenizer_fits(model, tok, key)
        return model
    _check_exists(cfg.name_or_path, f"{key}.name_or_path")
    path = resolve_model_path(cfg.name_or_path) if os.path.isdir(cfg.name_or_path) else cfg.name_or_path
    dtype = "auto" if cfg.dtype == "auto" else TORCH_DTYPES[cfg.dtype]
    source, adapters = adapter_chain(path)
    if cfg.config:
        logger.info("%s.config is ignored: the model is loaded from %s (it describes a model built without weights)",
                    key, source)
    torch.manual_seed(seed)  # heads that the checkpoint lacks (e.g. a new value head) init reproducibly
    ensure_hub(source, f"{key}.name_or_path")  # a hub name without a reachable hub: fails in seconds
    try:
        model = auto_cls.from_pretrained(source, dtype=dtype, trust_remote_code=cfg.trust_remote_code, **extra,
                                         **_attn(cfg))
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"{key}.name_or_path={source!r}: cannot load a model ({type(e).__name__}: {e})") from None
    for adapter in adapters:
        model = _merge_adapter(model, adapter)
        logger.info("loaded the LoRA adapter %s onto its base and merged it", adapter)
    check_tokenizer_fits(model, tok, key)
    return model


def hf_config(cfg: ModelConfig, tok: Any, key: str = "model") -> Any:
    """The HF config of the model `cfg` loads or builds, read without its weights (a LoRA adapter's: its base's)."""
    from transformers import AutoConfig

    if cfg.name_or_path is None or (cfg.fallback_to_config and not os.path.exists(cfg.name_or_path)):
        kw = from_config_kwargs(cfg, tok)
        model_type = kw.pop("model_type")
        try:
            return AutoConfig.for_model(model_type, **kw)
        except (KeyError, ValueError) as e:
            raise ConfigError(f"{key}.config: unknown or invalid model_type {model_type!r} ({e})") from None
    _check_exists(cfg.name_or_path, f"{key}.name_or_path")
    path = resolve_model_path(cfg.name_or_path) if os.path.isdir(cfg.name_or_path) else cfg.name_or_path
    source, _ = adapter_chain(path)
    ensure_hub(source, f"{key}.name_or_path")
    try:
        return AutoConfig.from_pretrained(source, trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"{key}.name_or_path={source!r}: cannot read its config ({type(e).__name__}: {e})") from None


def check_generation_backend(generation: str, cfg: ModelConfig, tok: Any, key: str, device_type: str) -> None:
    """engine.generation=vllm: vLLM installed and able to run the policy on this device, checked before any
    weights load (one line naming what to install, or what of the model it cannot run)."""
    if generation != "vllm":
        return
    if (why := vllm_refusal(generation, hf_config(cfg, tok, key), device_type)) is not None:
        raise ConfigError(why)


def load_causal_lm(cfg: ModelConfig, tok: Any, *, seed: int, key: str = "model", lora: bool = True) -> nn.Module:
    """A causal LM (fp32 unless `cfg.dtype` says otherwise), with LoRA applied when configured."""
    from transformers import AutoModelForCausalLM

    check_causal_lm(cfg.name_or_path, key)  # before any weights load (a path that does not exist passes)
    model = _build(cfg, tok, AutoModelForCausalLM, {}, key, seed)
    model.config.pad_token_id = tok.pad_token_id
    return apply_lora(model, cfg, key, seed) if lora else model


def load_value_model(cfg: ModelConfig, tok: Any, *, seed: int, key: str = "model", lora: bool = True,
                     head_init_std: float | None = None) -> nn.Module:
    """Backbone + a scalar head (`AutoModelForSequenceClassification`, num_labels=1): a causal-LM
    checkpoint loses its LM head and gets a fresh head; a reward checkpoint keeps its head.
    `head_init_std`: a fresh head's weights are drawn from normal(0, head_init_std) instead (0 = zeros;
    None = the model's own init, normal(0, initializer_range)); a kept head is left as loaded."""
    from transformers import AutoModelForSequenceClassification

    model = _build(cfg, tok, AutoModelForSequenceClassification, {"num_labels": 1}, key, seed)
    model.config.pad_token_id = tok.pad_token_id
    if head_init_std is not None and not has_trained_head(model):
        torch.manual_seed(seed)
        with torch.no_grad():
            model.score.weight.normal_(0.0, head_init_std) if head_init_std > 0 else model.score.weight.zero_()
            if getattr(model.score, "bias", None) is not None:
                model.score.bias.zero_()
        logger.info("fresh score head: %s", f"normal(0, {head_init_std})" if head_init_std > 0 else "zeros")
    return apply_lora(model, cfg, key, seed, task_type="SEQ_CLS") if lora else model


def has_trained_head(model: nn.Module) -> bool:
    """Whether a value model's scalar head came from its checkpoint (a sequence-classification
    checkpoint: a reward model or critic) rather than being created fresh (a causal LM, or a build
    from config)."""
    return any(a.endswith("ForSequenceClassification") for a in (model.config.architectures or []))


def apply_lora(model: nn.Module, cfg: ModelConfig, key: str, seed: int, task_type: str = "CAUSAL_LM") -> nn.Module:
    """peft LoRA with `cfg.lora`; `only_adapters=false` leaves the base trainable as well."""
    lo = cfg.lora
    if lo.r == 0:
        return model
    from peft import LoraConfig, get_peft_model

    targets = lo.target_modules if lo.target_modules == "all-linear" else list(lo.target_modules)
    peft_cfg = LoraConfig(r=lo.r, lora_alpha=lo.alpha, lora_dropout=lo.dropout, target_modules=targets,
                          task_type=task_type)
    torch.manual_seed(seed + 1)
    try:
        model = get_peft_model(model, peft_cfg)
    except ValueError as e:
        raise ConfigError(f"{key}.lora.target_modules={lo.target_modules!r}: {e}") from None
    if not lo.only_adapters:
        for p in model.parameters():
            p.requires_grad_(True)
    n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    logger.info("LoRA r=%d alpha=%d on %s: %s trainable params", lo.r, lo.alpha, lo.target_modules, f"{n_train:,}")
    return model


# ----------------------------------------------------------------------------- export


def disable_dropout(model: nn.Module) -> nn.Module:
    """Zero every dropout (modules and HF's float `*dropout` attributes, as TRL does): in PPO the
    old and new log-probs must come from the same deterministic function, or the ratio is noise."""
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
        for attr in ("dropout", "attention_dropout", "activation_dropout", "layerdrop"):
            if isinstance(getattr(m, attr, None), float):
                setattr(m, attr, 0.0)
    return model


# ----------------------------------------------------------------------------- packing

# Families whose forward honours per-row `position_ids` in a packed row and builds the block-diagonal
# causal mask from them (transformers' masking_utils, attention_mask=None): llama and OPT are checked
# against the padded forward in tests/test_packing.py (OPT's learned positions read position_ids + 2;
# its mask builder ignores position_ids, so it gets an explicit block mask: rlhf/data/packing.py);
# mistral, qwen2 and qwen3 are llama's modeling code with other defaults. Other families may ignore
# position_ids (e.g. positions from a cumsum of the attention mask) and would silently attend across rows.
PACKABLE_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "opt")
PACKABLE_ATTENTION = ("sdpa", "eager", "flash_attention_2", "flash_attention_3")


def packing_support(model: nn.Module) -> str | None:
    """Why `model` cannot train on packed rows, or None when it can."""
    config = getattr(hf_base_model(model), "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in PACKABLE_MODEL_TYPES:
        return f"model_type {model_type!r} is not one of {PACKABLE_MODEL_TYPES}, checked to keep packed rows apart"
    attn = getattr(config, "_attn_implementation", None) or "sdpa"
    allowed = ("sdpa", "eager") if model_type in EXPLICIT_MASK_MODEL_TYPES else PACKABLE_ATTENTION
    if attn not in allowed:
        return f"attention implementation {attn!r} of {model_type} is not one of {allowed}"
    return None


def use_packing(packing: Any, model: nn.Module, key: str = "data.packing") -> bool:
    """`data.packing` (auto | true | false) for `model`: auto packs where supported; true on a model
    that is not supported is a ConfigError naming the key."""
    return packing_choice(packing, None if packing is False else packing_support(model), key)


def packing_choice(packing: Any, why: str | None, key: str = "data.packing") -> bool:
    """`use_packing` given `packing_support`'s answer `why` (None: the model packs)."""
    if packing is False:
        return False
    if why is None:
        return True
    if packing is True:
        raise ConfigError(f"{key}=true: {why}; set {key}=false (or auto) for padded batches")
    logger.info("%s=auto: padded batches (%s)", key, why)
    return False


def stage_pack_length(data_cfg: Any, why: str | None, shared: bool | None = False) -> int | None:
    """The pack width of a stage's training batches (data.pack_length resolved), or None for padded ones: packed per
    data.packing on a model whose `packing_support` answer is `why`, never under data.shared_prompts=true (`shared`).
    SFT, reward and DPO ask it of their model, the planner of its meta-device copy."""
    return pack_length_of(data_cfg) if shared is not True and packing_choice(data_cfg.packing, why) else None
