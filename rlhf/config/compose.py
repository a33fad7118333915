"""Hydra composition: conf/<stage>.yaml + overrides -> the typed dataclass of rlhf/config/schema.py.

Each stage's dataclass is stored in Hydra's ConfigStore as `<stage>_schema` (on import), the first
entry of conf/<stage>.yaml's defaults list; the `${root:...}`, `${tokenizer_unless_model:...}` and
`${shipped_eval:...}` resolvers are registered here too. A key the schema lacks or a value of the wrong type raises
ConfigError naming the key, at composition (`compose`) or conversion (`to_config`).
"""
from __future__ import annotations

import os
from typing import Any, TypeVar

from hydra import compose as hydra_compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from rlhf.config.schema import SCHEMAS
from rlhf.core.errors import ConfigError
from rlhf.core.paths import CONF_DIR, is_root_file, root_path

T = TypeVar("T")


def _tokenizer_unless_model(name_or_path: str | None, fallback_to_config: bool, tokenizer: str) -> str | None:
    """`tokenizer` for a model built from `model.config` (no name_or_path, or the fallback case),
    else null: a loaded model brings its own tokenizer unless `model.tokenizer` is set explicitly."""
    if name_or_path is None or (fallback_to_config and not os.path.exists(name_or_path)):
        return tokenizer
    return None


def _shipped_eval(path: Any, shipped: str, eval_file: str) -> str | None:
    """The shipped task's evaluation file `eval_file` while data.path is the shipped `shipped` file (or
    empty), else null: with data of your own, a stage evaluates on your held-out rows (data.eval_size
    of data.path, or data.eval_path), never on the toy task's; a mixture (a list of sources, even one
    holding the shipped file) is data of your own. An explicit override of the key wins."""
    if not path or (isinstance(path, str) and is_root_file(path, shipped)):
        return root_path(eval_file)
    return None


if not OmegaConf.has_resolver("root"):
    # ${root:data/default/sft_train.jsonl} -> an absolute path inside the checkout, so the shipped
    # data is found from any working directory.
    OmegaConf.register_new_resolver("root", root_path)
    # The tiny preset's tokenizer: ${tokenizer_unless_model:${.name_or_path},${.fallback_to_config},...}
    OmegaConf.register_new_resolver("tokenizer_unless_model", _tokenizer_unless_model)
    # conf/data/*.yaml: eval_path: ${shipped_eval:${.path},data/default/pairs_train.jsonl,data/default/pairs_eval.jsonl}
    OmegaConf.register_new_resolver("shipped_eval", _shipped_eval)


def register_schemas() -> None:
    """Each stage's dataclass into Hydra's ConfigStore as `<stage>_schema`, the first entry of
    conf/<stage>.yaml's defaults list (done on import: composing needs it)."""
    cs = ConfigStore.instance()
    for stage, schema in SCHEMAS.items():
        cs.store(name=f"{stage}_schema", node=schema)


register_schemas()


def compose(config_name: str, overrides: list[str] | tuple[str, ...] = (), *, return_hydra_config: bool = False,
            job_name: str | None = None) -> DictConfig:
    """conf/<config_name>.yaml with `overrides`, composed by Hydra outside a Hydra app (`--help`,
    scripts/stage_plan.py, tests). A key the schema lacks or a value of the wrong type, on the command
    line or in a YAML file, raises ConfigError naming the key."""
    # job_name: hydra.job.name (in a run: the app's module); Hydra cannot always tell it from the stack
    job_name = job_name or config_name
    try:
        with initialize_config_dir(version_base="1.3", config_dir=CONF_DIR, job_name=job_name):
            return hydra_compose(config_name, overrides=list(overrides), return_hydra_config=return_hydra_config)
    except HydraException as e:
        cause = e.__cause__
        key = getattr(cause, "full_key", None) if isinstance(cause, OmegaConfBaseException) else None
        if key:
            raise ConfigError(f"config key {key!r}: {str(cause).splitlines()[0]}") from None
        raise ConfigError(f"config: {str(e).splitlines()[0]}") from None


# ----------------------------------------------------------------------------- conversion


def to_config(cfg: DictConfig | dict, schema: type[T]) -> T:
    """Hydra's config -> the dataclass `schema`; unknown keys and wrong types raise ConfigError."""
    raw = OmegaConf.create(cfg) if isinstance(cfg, dict) else cfg
    raw = OmegaConf.masked_copy(raw, [k for k in raw if k != "hydra"]) if "hydra" in raw else raw
    try:
        raw = OmegaConf.create(OmegaConf.to_container(raw, resolve=True))  # ${...} resolved before typing
        merged = OmegaConf.merge(OmegaConf.structured(schema), raw)
        return OmegaConf.to_object(merged)  # type: ignore[return-value]
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None)
        msg = str(e).splitlines()[0]
        raise ConfigError(f"config key {key!r}: {msg}" if key else f"config: {msg}") from None


def as_yaml(config: Any) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(config))
