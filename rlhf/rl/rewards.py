"""Reward sources of the RL stage: the reward model, verifiable rewards, a user function, a weighted sum.

    python -m rlhf.ppo reward.sources=[model]                                   # the reward model (default)
    python -m rlhf.ppo reward.sources=[judge]                                   # the task's gold judge
    python -m rlhf.ppo reward.sources=[answer] data.path=qa.jsonl               # exact match with each row's answer
    python -m rlhf.ppo reward.sources=[function] reward.function=mypkg.mod:score
    python -m rlhf.ppo reward.sources=[judge,function] reward.weights=[1,0.5] reward.function=mypkg.mod:score
    python -m rlhf.ppo reward.sources=[http] reward.url=http://127.0.0.1:8000   # a `python -m rlhf.serve` server

Each source implements `RewardSource` (below): `score(rollout) -> [B] float32`, one score
per row of this rank, `rollout.group[i]` being the index of row i's prompt in the table of prompt rows
the source was built with. The sources (`reward.sources`, weights `reward.weights`, default all 1):

    model     the frozen reward model's value at the last real token (`RewardModelScore`); the only
              source that loads a model: without it the reward model is not loaded at all. With
              `reward.ensemble_models`, several reward models (`RewardEnsemble`): their mean, min or
              mean - lambda x std (`reward.ensemble_agg`, `ensemble_reward`), their std the step's
              `reward_disagreement`
    judge     the gold judge of the held-out gold score (`rlhf.core.task.judge`): exact match with the row's
              `answer` field when it has one, else the embedded task's judge (1.0 / 0.0); every prompt
              must be judgeable
    answer    exact match with the row's `answer` field after `normalize_answer` (surrounding
              whitespace stripped, inner runs of whitespace collapsed to one space; case is kept,
              since it can be the task: "Uppercase kqzt." -> "KQZT"); every prompt row needs `answer`
    function  `reward.function=module:function` (`FunctionReward`), called in one of two ways, told
              apart by its signature (`calling_convention`):
              per row: `fn(prompt: str, response: str, row: dict) -> float`, once per response, where
                `response` is the decoded response (special tokens dropped) and `row` the prompt row's
                fields: `prompt`, `answer` (when the row has one) and its other scalar fields (`task`);
              batched, TRL's reward-function convention (a parameter named `completions`, or only
                `**kwargs`): `fn(prompts=[...], completions=[...], completion_ids=[...], **columns)
                -> list[float]`, once per step over this rank's responses, each of the prompt rows'
                other fields passed as a keyword list (`answer=[...]`, `task=[...]`; None where a row
                lacks it); only the keywords it names, unless it takes **kwargs
    http      a reward server (`HttpReward`, rlhf/rl/remote.py; `python -m rlhf.serve`, rlhf/rl/service.py) at
              `reward.url`: each row's prompt, decoded response and prompt-row fields, and its token ids when the
              server's tokenizer is the actor's (its /health says), so a served reward model scores the very
              tokens an in-process one would; sent when the step's scoring begins (`begin`), concurrently with
              the other forwards; a row unscored after `reward.retries` is NaN (counted in reward_errors)

When rewards stop arriving (the run-level rule, `check_step`): a step or held-out evaluation none of
whose rows got a finite reward (a server gone, a function failing on every row, a reward model giving
NaN) teaches nothing, so the run stops there (`RewardsStopped`, naming the source's key: reward.url,
reward.function, ...), after a checkpoint of the state before the step (`train.resume=true` redoes it; an
evaluation's stop leaves the last regular checkpoint).
The http source is asked GET /health before any model loads (`check_http`): nothing listening, an
https:// URL for a plain-HTTP server, or a URL that is not a reward server's stops the run there.

A function that raises, or returns something that is not a finite number, is an error for that row
(batched: a call that raises, or returns other than one number per completion, fails all its rows):
its score is NaN, so `mask_nonfinite` drops the row from the step's update, and the step logs one
WARN line naming the function, the count and the first exception (`errors`, `first_error`). Before
any model loads, `check_function` calls it on the first prompt rows: one that fits neither
signature, or fails on every one of them, stops the run (ConfigError naming reward.function) rather
than training on nothing but dropped rows. Several sources give `sum_k weights[k] * score_k` (a NaN in
any one drops the row).
"""
from __future__ import annotations

import hashlib
import inspect
import json
import logging
import math
import os
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from engine import FrozenEngine
from engine.distributed import all_reduce_sum
from rlhf.algos.reward_model import sequence_scores
from rlhf.config import REWARD_SOURCES, RewardSourcesConfig
from rlhf.config.schema import REWARD_ENSEMBLE_AGGREGATES
from rlhf.core.errors import ConfigError, TrainingError
from rlhf.core.plugins import as_score, load_function
from rlhf.core.task import judge, parse_prompt
from rlhf.modeling.forward import position_ids_from_mask, row_values
from rlhf.rl.remote import API_KEY_ENV, RewardClient, RewardServerDown, RewardServiceError
from rlhf.rl.rollout import Rollout

logger = logging.getLogger("rlhf.rewards")

SOURCES = REWARD_SOURCES  # the names reward.sources takes (rlhf/config/schema.py), each built in `build`

RewardFn = Callable[[str, str, dict], Any]  # (prompt, response, row) -> float


# ----------------------------------------------------------------------------- the protocol and the reward model


class RewardSource(Protocol):
    """Scores whole responses: `score(rollout)` -> [B] float32, one per row (every rank its rows).

    The reward model is one (`RewardModelScore`). Another source is one class with this method: e.g.
    a verifiable reward that decodes the responses and judges them against the dataset rows that
    `rollout.group` indexes. `Models(..., reward_source=...)` takes it instead of the reward model."""

    def score(self, rollout: Rollout) -> torch.Tensor: ...


class RewardModelScore:
    """The frozen reward model's value at the last real token of prompt + response (rlhf/algos/reward_model.py),
    its forwards packed as the other RL passes are when `pack_length` is set (data.packing=true), or each
    prompt shared by several rows run once when `shared_prompts` is (rollout.shared_prompt_forward)."""

    def __init__(self, engine: FrozenEngine, micro_batch_size: int, pack_length: int | None = None,
                 shared_prompts: bool = False):
        self.engine, self.micro_batch_size, self.pack_length = engine, micro_batch_size, pack_length
        self.shared_prompts = shared_prompts

    @torch.no_grad()
    def score(self, rollout: Rollout) -> torch.Tensor:
        ids, mask = rollout.sequences, rollout.attention_mask
        positions = position_ids_from_mask(mask)
        parts = []
        for s in range(0, ids.shape[0], self.micro_batch_size):  # the same forwards on every rank
            sl = slice(s, s + self.micro_batch_size)
            values = row_values(self.engine.model, {"sequences": ids[sl], "attention_mask": mask[sl],
                                                    "position_ids": positions[sl], "pack_length": self.pack_length,
                                                    "shared_prompts": self.shared_prompts,
                                                    "prompt_len": rollout.prompt_len if self.shared_prompts else None})
            parts.append(sequence_scores(values.float(), mask[sl]))
        return torch.cat(parts)


ENSEMBLE_AGGREGATES = REWARD_ENSEMBLE_AGGREGATES  # reward.ensemble_agg


def ensemble_reward(scores: torch.Tensor, how: str, lam: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """A reward-model ensemble's reward from its members' scores `scores` [K, B] (member k, row b), and
    its disagreement: the members' standard deviation per row (divisor K; 0 for one member).

        mean            mean_k s_k                      (the ensemble average)
        min             min_k s_k                       (worst-case optimisation)
        mean_minus_std  mean_k s_k - lam * std_k s_k    (uncertainty-weighted optimisation)

    Coste et al. 2023, "Reward Model Ensembles Help Mitigate Overoptimization" (mean / worst-case /
    uncertainty-weighted objectives; their UWO penalises the variance, here the std so that lam is
    in the score's units), and Eisenstein et al. 2023, "Helping or Herding? Reward Model Ensembles
    Mitigate but do not Eliminate Reward Hacking": a policy pushed where the members disagree is
    exploiting errors they do not share; a penalty on disagreement, or the minimum, keeps it off there."""
    if scores.dim() != 2 or scores.shape[0] < 1:
        raise ValueError(f"ensemble_reward takes member scores [K, B] with K >= 1, got shape {tuple(scores.shape)}")
    mean, std = scores.mean(0), scores.std(0, unbiased=False)
    if how == "mean":
        return mean, std
    if how == "min":
        return scores.min(0).values, std
    if how == "mean_minus_std":
        return mean - lam * std, std
    raise ValueError(f"unknown ensemble aggregate {how!r} (known: {', '.join(ENSEMBLE_AGGREGATES)})")


class RewardEnsemble:
    """Several reward models' scores (`members`, each a RewardSource) as one reward, `ensemble_reward`'s
    `how` over them; `last_std` [B]: the members' disagreement on the last call's rows (the step's
    `reward_disagreement`, which the disagreement alarm watches, rlhf/rl/alarms.py)."""

    def __init__(self, members: Sequence[RewardSource], how: str = "mean", lam: float = 1.0):
        if not members:
            raise ValueError("a reward ensemble needs at least one member")
        self.members, self.how, self.lam = list(members), how, lam
        self.last_std: torch.Tensor | None = None
        self.last_members: torch.Tensor | None = None  # [K, B] of the last call

    def score(self, rollout: Rollout) -> torch.Tensor:
        scores = torch.stack([m.score(rollout).float() for m in self.members])
        reward, self.last_std = ensemble_reward(scores, self.how, self.lam)
        self.last_members = scores
        return reward


def disagreement(source: RewardSource) -> torch.Tensor | None:
    """The reward ensemble's per-row std on its last call (alone or inside a weighted sum); None without one."""
    for _, part in getattr(source, "parts", [(1.0, source)]):
        if isinstance(part, RewardEnsemble):
            return part.last_std
    return None


# ----------------------------------------------------------------------------- the verifiable rewards


def text_mask(rollout) -> torch.Tensor:
    """[B, T] the tokens a text source reads as the response: a multi-turn episode's last model turn
    (`Rollout.answer_mask`), else the response mask."""
    answer = getattr(rollout, "answer_mask", None)
    return rollout.response_mask if answer is None else answer


def normalize_answer(text: str) -> str:
    """The `answer` source's normalisation: strip, and collapse every inner run of whitespace to one
    space. Case is kept (an answer may be the case: the embedded task's "Uppercase")."""
    return " ".join(text.split())


def answer_reward(prompt: str, response: str, row: dict) -> float:
    """1.0 when the response equals the row's `answer` after `normalize_answer`, else 0.0."""
    return 1.0 if normalize_answer(response) == normalize_answer(str(row["answer"])) else 0.0


def judge_reward(prompt: str, response: str, row: dict) -> float:
    """The gold judge of the held-out gold score (the row's `answer`, else the embedded task)."""
    score = judge(prompt, response, row.get("answer"))
    if score is None:  # check_rows refuses such data up front; a row reaching here is a bug
        raise ValueError(f"no gold judge for the prompt {prompt!r}")
    return score


def prompt_row(prompt: str, answer: str | None, meta: dict) -> dict:
    """The `row` a reward function receives: prompt, answer (when given) and the row's other scalar fields."""
    row = {"prompt": prompt, **meta}
    if answer is not None:
        row["answer"] = answer
    return row


def describe(cfg: RewardSourcesConfig) -> str:
    """E.g. "1 x judge + 0.5 x mypkg.mod:score" (the log line of a run)."""
    weights = list(cfg.weights) or [1.0] * len(cfg.sources)
    return " + ".join(f"{w:g} x {cfg.function if s == 'function' else s}" for w, s in zip(weights, cfg.sources))


def _judgeable(row: dict) -> bool:
    if row.get("answer") is not None:
        return True
    try:
        parse_prompt(row["prompt"])
        return True
    except ValueError:
        return False


def check_rows(sources: Sequence[str], rows: Sequence[dict], where: str) -> None:
    """ConfigError unless every prompt row in `rows` (from `where`, e.g. "data.path=...") can be
    scored by the text sources in `sources`: `answer` needs an answer field, `judge` a judge."""
    for name, ok, why in (("answer", lambda r: r.get("answer") is not None, "has no `answer` field"),
                          ("judge", _judgeable, "has no `answer` field and is not a prompt of the embedded task "
                                                "(rlhf/core/task.py), so no judge can score it")):
        if name in sources:
            bad = [i for i, r in enumerate(rows) if not ok(r)]
            if bad:
                raise ConfigError(f"reward.sources has {name!r} but {len(bad)} of {len(rows)} prompt rows of {where} "
                                  f"{why} (first: {rows[bad[0]]['prompt']!r}); use reward.sources=[model] or data "
                                  f"with an `answer` field")


# ----------------------------------------------------------------------------- sources


class TextReward:
    """A reward computed from text: `fn(prompt, response, row)` for each decoded response.

    `rows[g]` is the prompt row of group index g. With `guarded`, an exception or a result that is
    not a finite number gives NaN for that row (counted in `errors`, the first kept in `first_error`);
    unguarded, it propagates (the built-in judges, which a failure would make a bug)."""

    def __init__(self, name: str, fn: RewardFn, tokenizer: Any, rows: Sequence[dict], *, guarded: bool = False,
                 key: str | None = None):
        self.name, self.fn, self.tok, self.rows, self.guarded = name, fn, tokenizer, rows, guarded
        self.key = key or f"reward.sources=[{name}]"  # the config key an error names
        self.errors, self.first_error = 0, None

    def texts(self, rollout) -> list[str]:
        """This rank's responses as text: real tokens only, special tokens (EOS) dropped; of a multi-turn
        episode, its last model turn (`Rollout.text_mask`)."""
        ids = rollout.responses.masked_fill(text_mask(rollout) == 0, self.tok.pad_token_id)
        return self.tok.batch_decode(ids.tolist(), skip_special_tokens=True)

    def score(self, rollout) -> torch.Tensor:
        self.errors, self.first_error = 0, None
        out = []
        for g, response in zip(rollout.group.tolist(), self.texts(rollout)):
            row = self.rows[g]
            out.append(self._call(row["prompt"], response, row) if self.guarded else
                       float(self.fn(row["prompt"], response, row)))
        return torch.tensor(out, dtype=torch.float32, device=rollout.sequences.device)

    def _call(self, prompt: str, response: str, row: dict) -> float:
        try:
            return as_score(self.fn(prompt, response, dict(row)))  # a copy: the function may not change the table
        except Exception as e:
            return self._fail(e, prompt, response)

    def _fail(self, e: Exception, prompt: str, response: str, rows: int = 1) -> float:
        """`rows` rows failed with `e`: counted, the first kept (on one line); their score is NaN."""
        self.errors += rows
        if self.first_error is None:
            why = " ".join(f"{type(e).__name__}: {e}".split())
            self.first_error = f"{self.name}: {why} (prompt {prompt!r}, response {response!r})"
        return math.nan


PER_ROW, BATCHED = "per row", "batched"
CONVENTIONS = ("fn(prompt, response, row) -> float, called once per response, or TRL's batched "
               "fn(prompts, completions, **kwargs) -> list[float] (keyword lists; a parameter named `completions`)")


def calling_convention(fn: Callable, spec: str) -> str:
    """PER_ROW or BATCHED, from `fn`'s signature: a parameter named `completions`, or only keyword
    parameters (`**kwargs`), is TRL's batched call; one that takes (prompt, response, row) positionally
    is called per row (also a callable without a readable signature, as always). ConfigError naming
    reward.function for a signature that fits neither."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return PER_ROW
    params = sig.parameters.values()
    if "completions" in sig.parameters:
        return BATCHED
    try:
        sig.bind("prompt", "response", {})
        return PER_ROW
    except TypeError:
        pass
    if any(p.kind is p.VAR_KEYWORD for p in params) and not any(
            p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params):
        return BATCHED
    raise ConfigError(f"reward.function={spec}: its signature {sig} fits neither way a reward function is called: "
                      f"{CONVENTIONS}")


class FunctionReward(TextReward):
    """`reward.function`: the user's function, per row or batched (`calling_convention`), guarded: a
    failure is NaN for its rows, counted (see TextReward)."""

    def __init__(self, spec: str, fn: Callable, tokenizer: Any, rows: Sequence[dict]):
        super().__init__(spec, fn, tokenizer, rows, guarded=True, key=f"reward.function={spec}")
        self.convention = calling_convention(fn, spec)
        sig = None if self.convention == PER_ROW else inspect.signature(fn)
        self.accepts = None if sig is None or any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()) else \
            set(sig.parameters)  # the keywords it names (None: all, it takes **kwargs)

    def score(self, rollout) -> torch.Tensor:
        self.errors, self.first_error = 0, None
        rows = [self.rows[g] for g in rollout.group.tolist()]
        ids = [] if self.convention == PER_ROW else [
            r[m.bool()].tolist() for r, m in zip(rollout.responses, text_mask(rollout))]
        out = self.call(rows, self.texts(rollout), ids)
        return torch.tensor(out, dtype=torch.float32, device=rollout.sequences.device)

    def call(self, rows: Sequence[dict], responses: Sequence[str], ids: Sequence[list[int]]) -> list[float]:
        """One score per (prompt row, response): NaN where the function failed (counted in `errors`)."""
        if self.convention == PER_ROW:
            return [self._call(row["prompt"], response, row) for row, response in zip(rows, responses)]
        kwargs = batched_kwargs(rows, responses, ids)
        if self.accepts is not None:
            kwargs = {k: v for k, v in kwargs.items() if k in self.accepts}
        n = len(rows)
        try:
            out = self.fn(**kwargs)
            if isinstance(out, (str, bytes, dict)) or not hasattr(out, "__len__"):
                raise TypeError(f"returned {type(out).__name__} {out!r:.80}, not a list of {n} numbers")
            if len(out) != n:
                raise ValueError(f"returned {len(out)} scores for {n} completions")
        except Exception as e:
            self._fail(e, rows[0]["prompt"], responses[0], rows=n)
            return [math.nan] * n
        scores = []
        for row, response, value in zip(rows, responses, list(out)):
            try:
                scores.append(as_score(value))
            except Exception as e:
                scores.append(self._fail(e, row["prompt"], response))
        return scores


def batched_kwargs(rows: Sequence[dict], responses: Sequence[str], ids: Sequence[list[int]]) -> dict[str, list]:
    """TRL's keyword lists for a batched reward function: prompts, completions, completion_ids, and
    every other field of the prompt rows (None where a row lacks it)."""
    kwargs: dict[str, list] = {"prompts": [r["prompt"] for r in rows], "completions": list(responses),
                               "completion_ids": [list(i) for i in ids]}
    for column in sorted({k for r in rows for k in r} - {"prompt"}):
        kwargs.setdefault(column, [r.get(column) for r in rows])
    return kwargs


PROBE_ROWS = 8


def check_function(cfg: RewardSourcesConfig, tokenizer: Any, rows: Sequence[dict], where: str) -> None:
    """Call reward.function on the first PROBE_ROWS prompt rows (from `where`, e.g. "data.path=..."), each
    with its `answer` as the response (else an empty one), before any model loads: ConfigError naming
    reward.function when its signature fits neither convention, or it scores none of them (it raises,
    returns a non-number, NaN, or, batched, not one number per completion). A function that fails on
    some rows only runs, those rows counted as errors each step."""
    source = FunctionReward(cfg.function, load_function(cfg.function), tokenizer, rows)
    probe = list(rows[:PROBE_ROWS])
    if not probe:
        return
    responses = [str(r["answer"]) if r.get("answer") is not None else "" for r in probe]
    ids = [] if source.convention == PER_ROW else [
        tokenizer(t, add_special_tokens=False)["input_ids"] for t in responses]
    scores = source.call(probe, responses, ids)
    if all(math.isnan(x) for x in scores):
        how = "fn(prompt, response, row)" if source.convention == PER_ROW else \
            "fn(prompts=[...], completions=[...], **columns)"
        raise ConfigError(f"reward.function={cfg.function}: called as {how} on the first {len(probe)} prompt rows "
                          f"of {where} (the row's answer, else '', as the response), it scored none of them: "
                          f"{source.first_error.removeprefix(source.name + ': ')}")


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A short hash of a tokenizer's vocabulary and special ids: equal on both ends of an http source
    means token ids mean the same there (the client then sends them)."""
    vocab = sorted(tokenizer.get_vocab().items())
    special = [tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id]
    return hashlib.sha256(json.dumps([vocab, special]).encode()).hexdigest()[:16]


def wire_fields(row: dict) -> dict:
    """A prompt row's fields sent with each of its responses (answer, task, ...): scalars only, no prompt."""
    return {k: v for k, v in row.items() if k != "prompt" and (v is None or isinstance(v, (str, int, float, bool)))}


class HttpReward(TextReward):
    """`reward.sources=[http]`: the scores of a reward server at reward.url (rlhf/rl/remote.py). `begin(rollout)`
    sends the rows and returns at once; `score(rollout)` collects them (sending them first if not begun).
    A row unscored after the retries is NaN, counted in `errors` (reward_errors); a server refusing
    connections for longer than reward.down_timeout_s raises RewardServerDown (a TrainingError)."""

    def __init__(self, cfg: RewardSourcesConfig, tokenizer: Any, rows: Sequence[dict], *, seed: int | None = None):
        super().__init__(f"http {cfg.url}", None, tokenizer, rows, guarded=True, key=f"reward.url={cfg.url}")
        self.client = RewardClient(cfg.url, api_key=os.environ.get(API_KEY_ENV) or None, timeout_s=cfg.timeout_s,
                                   max_concurrency=cfg.max_concurrency, retries=cfg.retries, backoff_s=cfg.backoff_s,
                                   request_rows=cfg.request_rows, down_timeout_s=cfg.down_timeout_s, seed=seed)
        self.send_ids: bool | None = None  # decided by the first /health answer
        self.pending: tuple[Any, Any] | None = None  # (rollout, Pending) of a `begin`

    def _ids_ok(self) -> bool:
        """Whether the server's tokenizer is ours (its /health); unknown while it is unreachable (text only)."""
        if self.send_ids is None:
            try:
                health = self.client.health()
            except Exception as e:  # noqa: BLE001 - unreachable now: text this time, asked again next time
                if isinstance(e, ConfigError):
                    raise
                logger.warning("reward server %s: /health failed (%s: %s)", self.client.url, type(e).__name__, e)
                return False
            self.send_ids = health.get("tokenizer") == tokenizer_fingerprint(self.tok)
            logger.info("reward server %s: %s; sending %s", self.client.url, health.get("source"),
                        "token ids and text (same tokenizer)" if self.send_ids else "text only (another tokenizer)")
        return self.send_ids

    def wire_rows(self, rollout) -> list[dict]:
        """This rank's rows as sent: prompt, response text, the prompt row's fields, and the real tokens."""
        ids = rollout.sequences[rollout.attention_mask.bool()].split(rollout.attention_mask.sum(1).tolist()) \
            if self._ids_ok() else None
        out = []
        for i, (g, response) in enumerate(zip(rollout.group.tolist(), self.texts(rollout))):
            row = self.rows[g]
            wire = {"prompt": row["prompt"], "response": response, "fields": wire_fields(row)}
            if ids is not None:
                wire["ids"] = ids[i].tolist()
            out.append(wire)
        return out

    def begin(self, rollout) -> None:
        rows = self.wire_rows(rollout)
        self.client.first_error = None  # the previous call's requests have all been collected
        self.pending = (rollout, self.client.submit(rows))

    def score(self, rollout) -> torch.Tensor:
        if self.pending is None or self.pending[0] is not rollout:
            self.begin(rollout)
        pending, self.pending = self.pending[1], None
        scores = pending.result()
        self.errors = sum(math.isnan(x) for x in scores)  # every NaN is a row the server did not score
        self.first_error = f"{self.name}: {self.client.first_error}" if self.errors else None
        self.client.check()  # a refused key, or a server down too long: the run stops
        return torch.tensor(scores, dtype=torch.float32, device=rollout.sequences.device)


def check_http(cfg: RewardSourcesConfig) -> dict:
    """reward.sources has http: GET /health once, before any model loads (RewardClient.check_server); the
    server's description, or RewardServiceError (a ConfigError) naming reward.url."""
    client = RewardClient(cfg.url, api_key=os.environ.get(API_KEY_ENV) or None, timeout_s=cfg.timeout_s,
                          max_concurrency=1, request_rows=cfg.request_rows)
    try:
        return client.check_server()
    finally:
        client.close()


class RewardsStopped(TrainingError):
    """A step (or held-out evaluation) none of whose rows got a finite reward: the run stops."""


# What stops a run for want of rewards; the RL stage writes a checkpoint of the state before the step first.
STOPS = (RewardsStopped, RewardServerDown, RewardServiceError)


def source_key(source: RewardSource) -> tuple[str, str | None]:
    """(the config key that names what failed, its first error) for the last `score` call: the first part
    with failed rows (reward.url=..., reward.function=...), else the reward model's sources."""
    for _, part in getattr(source, "parts", [(1.0, source)]):
        if getattr(part, "errors", 0):
            return part.key, part.first_error
    names = getattr(source, "names", None) or ["model"]
    return f"reward.sources=[{','.join(names)}]", None


def check_step(source: RewardSource, scores: torch.Tensor, what: str) -> None:
    """The run-level rule (module docstring): RewardsStopped when no row of `what` (e.g. "step 3"), on any rank,
    has a finite score in `scores` [B]. Collective: every rank reads the same sums, so every rank stops."""
    bad = all_reduce_sum(torch.tensor([float((~torch.isfinite(scores)).sum()), float(scores.numel())],
                                      device=scores.device))
    if bad[1] > 0 and bad[0] == bad[1]:
        key, first = source_key(source)
        why = f" (first: {' '.join(first.split())})" if first else " (every score NaN or infinite)"
        raise RewardsStopped(f"{key}: none of the {int(bad[1])} rows of {what} got a reward{why}; a step without "
                             "rewards teaches nothing, so the run stops: fix the reward source, then resume with "
                             "train.resume=true")


def begin(source: RewardSource, rollout) -> None:
    """Start the sources that work in the background (http) on `rollout`, before the other forwards."""
    for part in getattr(source, "parts", [(1.0, source)]):
        if hasattr(part[1], "begin"):
            part[1].begin(rollout)


def http_stats(source: RewardSource, reset: bool = True) -> dict[str, float]:
    """The http source's request figures since the last call (empty without one): http_requests, http_rows,
    http_retries, http_timeouts, http_p50_ms, http_p99_ms."""
    for _, part in getattr(source, "parts", [(1.0, source)]):
        if isinstance(part, HttpReward):
            s = part.client.stats(reset=reset)
            return {f"http_{k}": v for k, v in s.items() if k != "failed_rows"}
    return {}


class WeightedSum:
    """`sum_k weight_k * source_k.score(rollout)`; `errors` / `first_error` gathered from the parts."""

    def __init__(self, parts: Sequence[tuple[float, RewardSource]], names: Sequence[str] = ()):
        self.parts = list(parts)
        self.names = list(names) or [f"source{i}" for i in range(len(self.parts))]
        self.last_scores: dict[str, torch.Tensor] = {}  # each source's unweighted scores [B] of the last call

    def score(self, rollout) -> torch.Tensor:
        total = None
        self.last_scores = {}
        for name, (w, src) in zip(self.names, self.parts):
            raw = src.score(rollout).float()
            self.last_scores[name] = raw
            total = w * raw if total is None else total + w * raw
        return total

    @property
    def errors(self) -> int:
        return sum(getattr(s, "errors", 0) for _, s in self.parts)

    @property
    def first_error(self) -> str | None:
        return next((s.first_error for _, s in self.parts if getattr(s, "first_error", None)), None)


def build(cfg: RewardSourcesConfig, tokenizer: Any, rows: Sequence[dict],
          reward_model: RewardSource | None = None) -> RewardSource:
    """The configured source over the prompt rows `rows` (`rollout.group` indexes them). `reward_model`:
    the reward model's source, needed iff "model" is in `cfg.sources`. A single source of weight 1 is
    returned as it is (so `reward.sources=[model]` scores exactly as the reward model alone)."""
    makers: dict[str, Callable[[], RewardSource]] = {
        "model": lambda: reward_model,
        "judge": lambda: TextReward("judge", judge_reward, tokenizer, rows),
        "answer": lambda: TextReward("answer", answer_reward, tokenizer, rows),
        "function": lambda: FunctionReward(cfg.function, load_function(cfg.function), tokenizer, rows),
        "http": lambda: HttpReward(cfg, tokenizer, rows),
    }
    if ("model" in cfg.sources) != (reward_model is not None):
        raise ValueError("build() needs the reward model's source exactly when 'model' is a source")
    weights = list(cfg.weights) or [1.0] * len(cfg.sources)
    parts = [(float(w), makers[name]()) for w, name in zip(weights, cfg.sources)]
    return parts[0][1] if len(parts) == 1 and parts[0][0] == 1.0 else WeightedSum(parts, cfg.sources)


def report_errors(source: RewardSource, step: int) -> int:
    """This rank's failed rows of the last `score` call; one WARN line naming the function when any."""
    n = getattr(source, "errors", 0)
    if n:
        kind = "server" if (source.first_error or "").startswith("http ") else "function"
        logger.warning("step %d: reward %s failed on %d row(s) of this rank, dropped from the update "
                       "(first: %s)", step, kind, n, source.first_error)
    return n
