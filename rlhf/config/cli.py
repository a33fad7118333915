"""The command line of the stage apps, around Hydra: `--help` from the schema, unknown keys caught.

    python -m rlhf.sft --help                  # every key: value after overrides + one-line description
    python -m rlhf.sft train.lr=3e-4 --help    # the same, with the override applied
    python -m rlhf.sft train.lrr=1             # error (configuration/data): ... did you mean 'train.lr'?

The descriptions come from the schema's source (rlhf/config/schema.py; engine.* from engine/config.py), so
there is one place to write them: a field's trailing `# comment`, else the comment block just above it, else
`field(metadata={"help": ...})`. A group's description is its field's comment in the parent, else its
docstring. Any dataclass schema works; `rlhf.run.app.stage_main` is the entry that uses this module.
"""
from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import io
import os
import textwrap
import tokenize
import types
import typing
from collections.abc import Iterator
from typing import Any

from rlhf.core.errors import ConfigError

DESC_COLUMN = 40  # where descriptions start in --help (a longer `key=value` puts it on the next line)


# ----------------------------------------------------------------------------- the schema's keys


@dataclasses.dataclass(frozen=True, slots=True)
class Key:
    path: str  # dotted, as on the command line: "train.lr"
    group: type | None  # the nested dataclass when this key is a group, else None
    description: str
    open: bool  # a dict / Any leaf: keys below it are the user's (model.config.hidden_size)


def _group_type(tp: Any) -> type | None:
    """The dataclass inside `tp` (also `X | None`), if any."""
    if dataclasses.is_dataclass(tp):
        return tp
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return next((a for a in typing.get_args(tp) if dataclasses.is_dataclass(a)), None)
    return None


def _is_open(tp: Any) -> bool:
    tps = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
    return any(t is Any or t is dict or typing.get_origin(t) is dict for t in tps)


def schema_keys(schema: type, prefix: str = "") -> Iterator[Key]:
    """Every key of `schema`, depth first: a group, then the keys inside it."""
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        tp = hints[f.name]
        group = _group_type(tp)
        desc = describe(schema, f.name) or (_class_doc(group) if group else "")
        yield Key(prefix + f.name, group, desc, open=group is None and _is_open(tp))
        if group:
            yield from schema_keys(group, prefix + f.name + ".")


def _class_doc(cls: type) -> str:
    doc = inspect.getdoc(cls) or ""
    if doc.startswith(cls.__name__ + "("):  # the signature that @dataclass writes when there is no docstring
        return ""
    return doc.split("\n\n")[0].replace("\n", " ")


def describe(schema: type, name: str) -> str:
    """The one-line description of field `name` of `schema` (searched along its bases)."""
    f = {f.name: f for f in dataclasses.fields(schema)}.get(name)
    if f is not None and f.metadata.get("help"):
        return f.metadata["help"]
    for cls in schema.__mro__:
        desc = _source_comments(cls).get(name)
        if desc:
            return desc
    return ""


@functools.cache
def _source_comments(cls: type) -> dict[str, str]:
    """{field name: its comment} from the class's source: the trailing comment of the field's lines,
    else the block of comment lines right above it."""
    if not dataclasses.is_dataclass(cls):
        return {}
    try:
        src = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    comments: dict[int, tuple[str, bool]] = {}  # line -> (text, whole line is the comment)
    lines = src.splitlines()
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            text = tok.string.lstrip("#").strip()
            comments[tok.start[0]] = (text, not lines[tok.start[0] - 1][: tok.start[1]].strip())
    out = {}
    for node in ast.parse(src).body[0].body:  # type: ignore[attr-defined]
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        trailing = [comments[n][0] for n in range(node.lineno, node.end_lineno + 1)
                    if n in comments and not comments[n][1]]
        above, n = [], node.lineno - 1
        while n in comments and comments[n][1]:
            above.insert(0, comments[n][0])
            n -= 1
        out[node.target.id] = trailing[0] if trailing else _as_phrase(" ".join(above))
    return out


def _as_phrase(sentence: str) -> str:
    """"A local path. Or ..." -> "a local path. Or ...": a block comment read like a trailing one."""
    sentence = sentence.rstrip(".")
    first = sentence.split(" ", 1)[0]
    return sentence[:1].lower() + sentence[1:] if first[1:].islower() or len(first) == 1 else sentence


# ----------------------------------------------------------------------------- command-line keys


def check_overrides(overrides: list[str], schema: type, conf_dir: str, app: str, *,
                    multirun: bool = False) -> dict[str, str]:
    """Raise ConfigError for an override naming a key that `schema` does not have (with `+` or
    without), suggesting the closest valid key, a value of the wrong type for its key (Hydra, which
    composes onto the schema, would stop with its own report), a config-group option that does
    not exist, a sweep without `multirun` (`key=a,b`: Hydra's several-line "Ambiguous value"; a list is
    `key=[a,b]`), or an `output_dir` that is a file (Hydra would fail making it its run directory);
    hydra.* passes through. Returns {override: rewritten} for keys below a dict-valued key
    (`model.config.rope_theta=1e4` -> `++...`: set or add, as the dict's contents are the user's)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException
    from omegaconf import OmegaConf

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except OverrideParseException as e:
        raise ConfigError(f"command line: {str(e).splitlines()[0]}") from None
    keys = {k.path: k for k in schema_keys(schema)}
    rewrites = {}
    typed = None  # the schema as an OmegaConf node, built for the first value to check
    for o in parsed:
        name = o.key_or_group
        if name == "hydra" or name.startswith(("hydra.", "hydra/")) or o.package is not None:
            continue
        if o.is_sweep_override() and not multirun:
            _refuse_sweep(o, group=os.path.isdir(os.path.join(conf_dir, name)))
        if name == "output_dir" and isinstance(o.value(), str):
            check_output_dir(o.value())
        if os.path.isdir(os.path.join(conf_dir, name)):  # a config group choice: model=llama
            _check_option(o, conf_dir)
            continue
        if name in keys:
            typed = OmegaConf.structured(schema) if typed is None else typed
            _check_not_below_interpolation(typed, name, o.input_line)
            if not (o.is_delete() or o.is_sweep_override()):
                _check_value(typed, name, o.value(), o.input_line)
            continue
        parts = name.split(".")
        prefixes = [".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1)]
        parent = next((p for p in prefixes if p in keys), None)
        if parent is not None and keys[parent].open:
            if not (o.is_add() or o.is_force_add() or o.is_delete()):
                rewrites[o.input_line] = "++" + o.input_line
            continue
        if parent is not None and keys[parent].group is None:
            hint = [parent]  # `train.lr.x`: train.lr holds a value, not keys
        else:
            hint = suggest(name, [k for k, v in keys.items() if v.group is None]) or suggest(name, list(keys))
        raise ConfigError(
            f"unknown config key {name!r} (in {o.input_line!r})"
            + (f"; did you mean {' or '.join(repr(h) for h in hint)}?" if hint else "")
            + f" (python -m {app} --help lists every key)"
        )
    return rewrites


def _refuse_sweep(o: Any, group: bool) -> None:
    """`model.lora.target_modules=q_proj,v_proj`: Hydra reads a comma as a sweep over values (runs with
    --multirun), and without it stops with several lines; the intended list is `key=[q_proj,v_proj]`."""
    from hydra.core.override_parser.types import ChoiceSweep

    key, value = o.input_line.lstrip("+~").split("=", 1)
    if group:
        raise ConfigError(f"{o.input_line}: choose one option of the config group {key!r} (several are a sweep "
                          "over runs, for --multirun)")
    if isinstance(o.value(), ChoiceSweep) and o.value().simple_form:  # `a,b`, not `choice(a,b)`
        raise ConfigError(f"{o.input_line}: a comma-separated value is a sweep over runs for Hydra (--multirun): "
                          f"write {key}=[{value}] for a list, or {key}='{value}' for one string")
    raise ConfigError(f"{o.input_line}: a sweep over runs needs --multirun; a stage runs one value per key")


def check_output_dir(value: str, key: str = "output_dir") -> None:
    """`output_dir` must be (or become) a directory: an existing file there, or above it, is an error
    naming the key (Hydra makes it its run directory before the stage starts: a traceback)."""
    if "${" in value:  # an interpolation, resolved by Hydra
        return
    path = os.path.abspath(os.path.expanduser(value))
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"{key}={value!r} is a file, not a directory: the run writes its outputs (config.yaml, "
                          "metrics.jsonl, checkpoints/, model/) into a directory; choose another path")
    parent = os.path.dirname(path)
    while not os.path.exists(parent) and os.path.dirname(parent) != parent:
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ConfigError(f"{key}={value!r}: {parent} is a file, so no directory can be made below it; choose "
                          "another path")


def _check_not_below_interpolation(typed: Any, key: str, line: str) -> None:
    """`critic.lora.alpha=8` where critic.lora is ${model.lora}: OmegaConf would write through the
    link into model.lora (the actor's too), so it is an error naming the key to set instead."""
    from omegaconf import OmegaConf

    parts, node = key.split("."), typed
    for i, part in enumerate(parts[:-1]):
        if OmegaConf.is_interpolation(node, part):
            link = OmegaConf.to_container(node, resolve=False)[part]  # "${model.lora}"
            raise ConfigError(f"{key!r} (in {line!r}) is below {'.'.join(parts[:i + 1])}, which is {link}: "
                              f"set {link[2:-1]}.{'.'.join(parts[i + 1:])} (everything that links to it follows)")
        node = node[part]


def _check_value(typed: Any, key: str, value: Any, line: str) -> None:
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        OmegaConf.update(typed, key, value, merge=True)
    except OmegaConfBaseException as e:
        raise ConfigError(f"config key {key!r} (in {line!r}): {str(e).splitlines()[0]}") from None


def _check_option(o: Any, conf_dir: str) -> None:
    value = o.value()
    options = sorted(f[:-5] for f in os.listdir(os.path.join(conf_dir, o.key_or_group)) if f.endswith(".yaml"))
    if isinstance(value, str) and not o.is_delete() and value not in options:
        raise ConfigError(f"{o.key_or_group}={value}: no such option of the config group {o.key_or_group!r} "
                          f"(options: {', '.join(options)})")


def suggest(name: str, valid: list[str]) -> list[str]:
    """The closest of the `valid` keys to `name` (difflib): the same last part elsewhere (a key
    nested wrongly; up to 3), else a close whole key, else keys with a close last part (up to 3)."""
    last = name.rsplit(".", 1)[-1]

    def best(cands: list[str]) -> list[str]:
        return sorted(cands, key=lambda k: -difflib.SequenceMatcher(None, name, k).ratio())[:3]

    same = [k for k in valid if k.rsplit(".", 1)[-1] == last]
    if same:
        return best(same)
    close = difflib.get_close_matches(name, valid, n=1, cutoff=0.8)
    if close:
        return close
    lasts = {k.rsplit(".", 1)[-1] for k in valid}
    near = difflib.get_close_matches(last, list(lasts), n=1, cutoff=0.7)
    if near:
        return best([k for k in valid if k.rsplit(".", 1)[-1] == near[0]])
    return difflib.get_close_matches(name, valid, n=1, cutoff=0.6)


# ----------------------------------------------------------------------------- flags of other tools

# TRL's and transformers' TrainingArguments flags (`--learning_rate 1e-5`) -> our keys: the first
# candidate that the stage's schema has (PPO's policy is actor.*, the others' model.* and train.*).
FOREIGN_FLAGS: dict[str, tuple[str, ...]] = {
    "model_name_or_path": ("actor.model", "model.name_or_path"),
    "output_dir": ("output_dir",),
    "seed": ("seed",),
    "dataset_name": ("data.path",),
    "learning_rate": ("train.lr", "actor.lr"),
    "num_train_epochs": ("train.epochs",),
    "max_steps": ("train.max_steps",),
    "per_device_train_batch_size": ("train.micro_batch_size", "rollout.micro_batch_size"),
    "warmup_steps": ("train.warmup_steps", "actor.warmup_steps"),
    "weight_decay": ("train.weight_decay", "actor.weight_decay"),
    "lr_scheduler_type": ("train.scheduler", "actor.scheduler"),
    "max_grad_norm": ("train.grad_clip", "actor.grad_clip"),
    "logging_steps": ("train.log_every",),
    "eval_steps": ("train.eval_every",),
    "save_steps": ("train.save_every",),
    "save_total_limit": ("train.keep_last_n",),
    "resume_from_checkpoint": ("train.resume",),
    "max_length": ("data.max_len",),
    "max_seq_length": ("data.max_len",),
    "max_prompt_length": ("data.max_prompt_len",),
    "max_completion_length": ("rollout.max_new_tokens",),
    "num_generations": ("rollout.n_samples_per_prompt",),
    "temperature": ("rollout.temperature",),
    "beta": ("dpo.beta", "ppo.kl_loss_coef"),
    "loss_type": ("dpo.loss_type",),
    "lora_r": ("model.lora.r",),
    "lora_alpha": ("model.lora.alpha",),
    "lora_dropout": ("model.lora.dropout",),
    "lora_target_modules": ("model.lora.target_modules",),
    "torch_dtype": ("model.dtype",),
    "dtype": ("model.dtype",),
    "attn_implementation": ("model.attn_implementation",),
    "trust_remote_code": ("model.trust_remote_code",),
    "gradient_checkpointing": ("engine.activation_checkpointing",),
    "deepspeed": ("engine.ds_config",),
}
FOREIGN_SWITCHES = {"bf16": "engine.precision=bf16", "fp16": "engine.precision=fp16"}  # a fixed override
FOREIGN_DERIVED = {"gradient_accumulation_steps": ("train.global_batch_size",
                                                   "<train.micro_batch_size x {} x the number of ranks>")}


def check_foreign_flags(argv: list[str], foreign: set[str], schema: type, app: str) -> None:
    """Raise ConfigError for the words of `argv` named in `foreign` (flags that Hydra's parser does not
    know, e.g. TRL's `--model_name_or_path X` or `--learning_rate=1e-5`, on which Hydra prints its usage
    page): one line with the override to write instead, for the flags that have a key in this stage's
    `schema`, and `key=value` with the --help pointer for the others. A flag's value is its `=value` or
    the next word (unless that is a flag or an override); a flag without one is a switch (`true`)."""
    keys = {k.path for k in schema_keys(schema) if k.group is None}
    given, write, unknown = [], [], []
    i = 0
    while i < len(argv):
        word, i = argv[i], i + 1
        name, eq, value = word.partition("=")
        if name not in foreign:
            continue
        if not eq and i < len(argv) and not argv[i].startswith("-") and "=" not in argv[i]:
            value, i = argv[i], i + 1
        given.append(f"{name}={value}" if eq else f"{name} {value}".strip())
        bare = name.lstrip("-")
        key = next((k for k in FOREIGN_FLAGS.get(bare, ()) if k in keys), None)
        if bare in keys:  # one of ours, written as a flag: --train.lr=1e-5
            key = bare
        if key is not None:
            write.append(f"{key}={value or 'true'}")
        elif bare in FOREIGN_SWITCHES:
            write.append(FOREIGN_SWITCHES[bare])
        elif bare in FOREIGN_DERIVED and FOREIGN_DERIVED[bare][0] in keys:
            k, form = FOREIGN_DERIVED[bare]
            write.append(f"{k}={form.format(value or 'N')}")
        else:
            unknown.append(name)
    if not given:
        return
    msg = f"{' '.join(given)}: python -m {app} takes Hydra overrides (key=value, no dashes), not flags: "
    if write:
        msg += "write " + " ".join(write)
    if unknown:
        msg += ("; for " if write else "for ") + ", ".join(unknown) + f" write key=value (python -m {app} --help " \
               "lists the keys)"
    raise ConfigError(msg)


# ----------------------------------------------------------------------------- --help


def _fmt(value: Any) -> str:
    import yaml

    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return value if value else "''"
    if isinstance(value, (list, tuple, dict)):
        return yaml.safe_dump(value, default_flow_style=True, sort_keys=False, width=10**6).strip()
    return str(value)


def help_text(app: str, doc: str, config: Any, schema: type, choices: dict[str, list[str]],
              chosen: dict[str, str]) -> str:
    """The `--help` page: usage, config groups, then every key of `config` (an instance of
    `schema`, overrides applied) with its value and description, grouped as the schema is."""
    usage = [("[key=value ...]", "run, with the keys below overridden"),
             ("[key=value ...] --help", "this page, with the overrides applied"),
             ("[key=value ...] --cfg job", "the composed config as YAML, values resolved"),
             ("--hydra-help", "Hydra's own flags (--info, --multirun, ...)")]
    out = [f"{app}: {doc}" if doc else app, ""]
    width = max(len(args) for args, _ in usage) + len(app) + 11
    for i, (args, what) in enumerate(usage):
        out.append(f"{'usage:' if i == 0 else '':<7}{f'python -m {app} {args}':<{width}}  {what}")
    out.append("")
    if choices:
        out.append("config groups (group=option, the current one in [brackets]):")
        for group, options in choices.items():
            opts = " ".join(f"[{o}]" if o == chosen.get(group) else o for o in options)
            out.append(f"  {group}: {opts}")
        out.append("")
    out.append("keys (key=current value, then what it means):")
    for key in schema_keys(schema):
        if key.group is not None:
            out += ["", f"{key.path}: {key.description}" if key.description else f"{key.path}:"]
            continue
        value = config
        for part in key.path.split("."):
            value = getattr(value, part)
        kv = f"  {key.path}={_fmt(value)}"
        if len(kv) < DESC_COLUMN - 1:
            out.append(f"{kv:<{DESC_COLUMN}}{key.description}")
        else:
            out += [kv, " " * DESC_COLUMN + key.description]
    return "\n".join(out) + "\n"


def config_groups(conf_dir: str) -> dict[str, list[str]]:
    """{group: [options]} for the config groups in `conf_dir` (its subdirectories of .yaml files)."""
    groups = {}
    for name in sorted(os.listdir(conf_dir)):
        sub = os.path.join(conf_dir, name)
        if os.path.isdir(sub):
            groups[name] = sorted(f[:-5] for f in os.listdir(sub) if f.endswith(".yaml"))
    return groups
