"""Multi-turn rollouts: the policy acts over several turns, an environment (a tool) answers each turn.

    runner = make_runner(load_environment(cfg.rollout.env), workers, timeout_s)   # rlhf/rl/environments
    glue = template_glue(tok)                                    # the chat template's tool-role glue, as ids
    rollout, stats = generate_episodes(actor, prompts, group, rows, sampling, tok, runner, settings, glue)

One step's episodes run together: model turn (every open episode in one batched generate) -> the runner
(`runner.step(episodes, texts)`, one Reply each) -> each continuing episode's observation ids appended ->
the next model turn over the episodes still open (the done ones drop out of the batch). A model turn
ends at EOS, at a `rollout.turn_stop` string, or at its token limit (`rollout.max_new_tokens`, and what is
left of the episode's budget `rollout.max_episode_tokens`). An episode ends when the environment says so
(observation None), at `rollout.max_turns`, when the next observation would not fit in its budget, or
when the environment faults (`Reply.error`: the row is masked out of the update and counted).

Token-in, token-out: the response region of each row is the concatenation, in order, of the ids the
sampler drew (every turn's, its EOS / stop token included) and the ids inserted after each turn (the
glue + the observation's ids); nothing is decoded and re-encoded, and each next turn is generated from
exactly those ids. A generator that resumes (`gen.resumes`: the injected decoder) continues each open
episode from its KV cache, fed only the ids not in it yet (the turn's last sampled token, the glue, the
observation; `Cached`): the episodes that ended leave the cache's batch, and tokens cut after a turn's
limit are never attended again. Any other (transformers generate, the batch-invariant deterministic mode)
takes the whole transcript again each turn (re-prefill); both give the same tokens
(tests/test_multiturn.py). The environment sees each turn as text (decoded, special tokens dropped); only
the observation's text is encoded. `Rollout.response_mask` is 1 on the sampler's tokens
only: observations and glue are out of the policy loss, the KL, the critic's targets (GAE and the
returns skip the masked-out columns, rlhf/algos/rl.py) and the score's position (the last policy token).

Glue: with a chat template that has a tool role (`template_glue`), an observation goes in as the template
writes a tool message after an assistant turn: the assistant turn's end (less the EOS the model already
drew), the tool header, the observation, the tool turn's end and the next generation prompt; computed
once by rendering a conversation with placeholders, as ids. Without one, the observation's ids alone.
Episodes that ended cleanly are checked against `apply_chat_template` of their whole conversation:
a row whose ids differ is counted (`template_mismatch`) and the first one is named in a WARN line
with its first differing position.

Rewards: the environment's reward parts, summed per episode (`EpisodeStats.env_reward`), are added to
the `reward.sources` score by the caller; the text sources read the last model turn
(`Rollout.answer_mask`), the reward model the whole transcript.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from engine.distributed import all_reduce_sum
from engine.generation import SamplingParams
from engine.inference import Resume, stream_seed
from rlhf.data import collate_prompts
from rlhf.core.errors import TrainingError
from rlhf.rl.environments.base import ERROR_TIMEOUT, Reply
from rlhf.rl.rollout import Rollout, empty_responses

logger = logging.getLogger("rlhf.ppo")

# Placeholders rendered through the chat template to find its glue (any text the template copies as is).
ASSISTANT_SLOT, TOOL_SLOT = "@@ASSISTANT_TURN@@", "@@TOOL_OUTPUT@@"


@dataclass(frozen=True)
class Settings:
    """The multi-turn keys of `rollout.*` (rlhf/config/schema.py RolloutConfig)."""

    max_turns: int
    max_new_tokens: int
    max_episode_tokens: int | None = None  # null: max_turns x max_new_tokens
    turn_stop: tuple[str, ...] = ()
    max_failure_fraction: float = 0.5
    env_name: str = "the environment"  # rollout.env, for messages

    @property
    def budget(self) -> int:
        return self.max_episode_tokens or self.max_turns * self.max_new_tokens

    @classmethod
    def of(cls, r) -> Settings:
        return cls(max_turns=r.max_turns, max_new_tokens=r.max_new_tokens, max_episode_tokens=r.max_episode_tokens,
                   turn_stop=tuple(r.turn_stop), max_failure_fraction=r.max_env_failure_fraction,
                   env_name=str(r.env))


@dataclass(frozen=True)
class Glue:
    """Ids inserted around an observation. Before it: the template's end of the assistant turn and the tool
    header, less what the turn already ended with (`before[ending]`, ending = the EOS token's text, a
    turn_stop string, or "" for a turn cut at its token limit). After it (`after_obs`): the end of the tool
    turn and the next generation prompt. `source`: "chat template" or "none" (no glue)."""

    before: dict[str, tuple[int, ...]] = field(default_factory=dict)
    after_obs: tuple[int, ...] = ()
    source: str = "none"

    def before_obs(self, ending: str) -> tuple[int, ...]:
        return self.before.get(ending, ())


def _encode(tok: Any, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False)["input_ids"]) if text else []


def template_glue(tok: Any, turn_stop: tuple[str, ...] = ()) -> Glue:
    """The chat template's tool-role glue as ids, from one rendering of [user, assistant, tool] with the
    generation prompt; Glue() (no glue) when the tokenizer has no template or it has no tool role. A turn
    that ended with the EOS token or a `turn_stop` string the template's turn end begins with (ChatML's
    `<|im_end|>`) gets the rest of it."""
    messages = [{"role": "user", "content": "u"}, {"role": "assistant", "content": ASSISTANT_SLOT},
                {"role": "tool", "content": TOOL_SLOT}]
    try:
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception:  # no template, or one that refuses a tool message (jinja's raise_exception, ...)
        return Glue()
    if not isinstance(text, str) or ASSISTANT_SLOT not in text or TOOL_SLOT not in text:
        return Glue()
    a, t = text.index(ASSISTANT_SLOT) + len(ASSISTANT_SLOT), text.index(TOOL_SLOT)
    if t < a:
        return Glue()
    before, after = text[a:t], text[t + len(TOOL_SLOT):]
    endings = {"", *(x for x in (tok.eos_token, *turn_stop) if x)}
    return Glue(before={x: tuple(_encode(tok, before[len(x):] if x and before.startswith(x) else before))
                        for x in endings},
                after_obs=tuple(_encode(tok, after)), source="chat template")


@dataclass
class Episode:
    """One episode's transcript so far (response side) and what happened in it."""

    prompt: list[int]
    ids: list[int] = field(default_factory=list)        # everything after the prompt, as inserted
    policy: list[bool] = field(default_factory=list)    # True on the sampler's tokens
    logp: list[float] = field(default_factory=list)     # the sampler's log-prob (0 on inserted tokens)
    turns: list[tuple[int, int]] = field(default_factory=list)  # (start, end) of each model turn in ids
    texts: list[str] = field(default_factory=list)      # each model turn as the environment saw it
    observations: list[str] = field(default_factory=list)
    reward: dict[str, float] = field(default_factory=dict)
    done: bool = False
    empty: bool = False       # the first turn said nothing (dropped, as a single-turn empty response)
    truncated: bool = False   # ended by a limit (tokens, turns) rather than by EOS + the environment
    ended_by: str = ""        # how the last model turn ended: eos | stop | length
    ending: str = ""          # the text it ended with: the EOS token's, a turn_stop string, "" (length)
    error: str | None = None  # Reply.error kind of a fault
    message: str = ""
    env_s: float = 0.0


@dataclass
class EpisodeStats:
    """One rank's episodes of a step: per-row figures and the counts the step's metrics sum."""

    env_reward: torch.Tensor                  # [B] the environment's reward parts summed
    turns: torch.Tensor                       # [B] model turns
    tool_calls: torch.Tensor                  # [B] observations inserted
    obs_tokens: torch.Tensor                  # [B] ids inserted (observations + glue)
    env_s: float = 0.0                        # seconds in the runner's reset/step calls
    overhead_s: float = 0.0                   # seconds of the episodes outside the model's generate calls:
                                              # env_s + observation insertion, batching, the template check
    errors: int = 0                           # faults other than timeouts (raised, garbage, worker died)
    timeouts: int = 0
    template_checked: int = 0
    template_mismatch: int = 0
    first_error: str = ""
    episodes: list[Episode] = field(default_factory=list)


def stop_ids(tok: Any, turn_stop: tuple[str, ...]) -> tuple[list[int], list[str]]:
    """The turn_stop strings that are one token (passed to the sampler as extra stop ids) and the
    others (found in the decoded turn after generation; the turn is cut after the first token that
    completes one)."""
    single, multi = [], []
    for s in turn_stop:
        ids = _encode(tok, s)
        (single if len(ids) == 1 else multi).append(ids[0] if len(ids) == 1 else s)
    return single, multi


def _cut_at_stop(tok: Any, toks: list[int], stops: list[str]) -> int | None:
    """The length of `toks` up to and including the token that completes the first stop string, or None."""
    if not stops or not any(s in tok.decode(toks) for s in stops):
        return None
    for k in range(1, len(toks) + 1):
        if any(s in tok.decode(toks[:k]) for s in stops):
            return k
    return None


@torch.no_grad()
def generate_episodes(actor, prompts: dict, group: torch.Tensor, rows: list[dict], sampling, tok: Any, runner,
                      settings: Settings, glue: Glue, row_seeds: torch.Tensor | None = None,
                      check_template: bool = True) -> tuple[Rollout, EpisodeStats]:
    """Run one episode per prompt row (`prompts`: collated, left-padded; `rows`: each row's prompt-row dict,
    given to the environment's reset) over up to `settings.max_turns` model turns, in the actor engine's
    generation mode (gathered once for every turn). Returns the Rollout (response region = the turns and
    the inserted ids; response_mask = the sampler's tokens) and the episodes' stats."""
    device = actor.info.device
    eos, pad = tok.eos_token_id, tok.pad_token_id
    single, multi = stop_ids(tok, settings.turn_stop)
    eos_arg: int | list[int] = [eos, *single] if single else eos
    ends = {eos, *single}
    B = prompts["input_ids"].shape[0]
    eps = [Episode(prompt=p[m.bool()].tolist()) for p, m in zip(prompts["input_ids"], prompts["attention_mask"])]
    ids_ = list(range(B))
    stats_s = model_s = 0.0
    start = t = time.perf_counter()
    for e, reply in zip(eps, runner.reset(ids_, rows)):
        _apply_reset(e, reply, tok)
    stats_s += time.perf_counter() - t
    cached: Cached | None = None  # what the KV cache holds after a call a generator can resume
    try:
        with actor.generation() as gen:
            if gen.resumes:  # room for every turn's tokens at once: a resumed call may not grow the cache
                gen.reserve(B, prompts["input_ids"].shape[1] + max((len(e.ids) for e in eps), default=0)
                            + settings.max_turns * settings.max_new_tokens + (settings.max_turns - 1) * settings.budget)
            for turn in range(settings.max_turns):
                active = [b for b in range(B) if not eps[b].done]
                if not active:
                    break
                room = {b: settings.budget - len(eps[b].ids) for b in active}
                params = replace(sampling, max_new_tokens=max(1, min(settings.max_new_tokens, max(room.values()))))
                resume = cached.resume(eps, active, device) if cached is not None else None
                if resume is not None:  # only each episode's tokens that are not in the KV cache yet
                    batch = collate_prompts([{"input_ids": eps[b].ids[cached.upto[b]:]} for b in active], pad)
                    in_ids, in_mask = batch["input_ids"], batch["attention_mask"]
                elif turn == 0 and len(active) == B and all(not e.ids for e in eps):
                    in_ids, in_mask = prompts["input_ids"], prompts["attention_mask"]  # exactly today's first call
                else:  # the whole transcript again (re-prefill)
                    batch = collate_prompts([{"input_ids": eps[b].prompt + eps[b].ids} for b in active], pad)
                    in_ids, in_mask = batch["input_ids"], batch["attention_mask"]
                seeds = {"resume": resume} if resume is not None else {}
                if row_seeds is not None:
                    rs = row_seeds[active].tolist()
                    seeds["row_seeds"] = torch.tensor(rs if turn == 0 else [stream_seed(s, turn) for s in rs],
                                                      dtype=torch.long, device=device)
                t = time.perf_counter()
                g = gen.generate(in_ids.to(device), in_mask.to(device), params, eos_token_id=eos_arg,
                                 pad_token_id=pad, return_logprobs=True, **seeds)
                responses, rmask = g.responses.cpu(), g.response_mask.cpu()
                logprobs = g.logprobs.cpu() if g.logprobs is not None else torch.zeros(responses.shape)
                model_s += time.perf_counter() - t
                if turn == 0:
                    empty = empty_responses(responses, rmask, [eos])
                texts = []
                # a response's columns up to the second last were fed to the model (their K/V are in the cache)
                slot0 = (resume.slot if resume is not None else 0) + in_ids.shape[1]
                cached = Cached(rows=active, slot=slot0 + responses.shape[1] - 1) if gen.resumes else None
                for i, b in enumerate(active):
                    e = eps[b]
                    n = int(rmask[i].sum())
                    toks, lps = responses[i, :n].tolist(), logprobs[i, :n].tolist()
                    ended = "eos" if toks and toks[-1] == eos else "stop" if toks and toks[-1] in ends else "length"
                    ending = tok.decode(toks[-1:]) if ended != "length" else ""
                    cut = _cut_at_stop(tok, toks, multi) if multi else None
                    if cut is not None:  # a multi-token stop string: the turn ends after its last token
                        toks, lps, ended = toks[:cut], lps[:cut], "stop"
                        ending = next((x for x in multi if tok.decode(toks).endswith(x)), "")
                    if len(toks) > room[b]:
                        toks, lps, ended, ending = toks[: room[b]], lps[: room[b]], "length", ""
                    if cached is not None:  # the kept tokens in the cache; after them, stale slots
                        fed = min(len(toks), responses.shape[1] - 1)
                        cached.upto[b], cached.stale[b] = len(e.ids) + fed, slot0 + fed
                    e.turns.append((len(e.ids), len(e.ids) + len(toks)))
                    e.ids += toks
                    e.policy += [True] * len(toks)
                    e.logp += lps
                    e.ended_by, e.ending = ended, ending
                    if turn == 0 and (bool(empty[i]) or not toks):
                        e.empty = e.done = True  # nothing said: no environment call, dropped as today
                    texts.append(tok.decode(toks, skip_special_tokens=True))
                    e.texts.append(texts[-1])
                stepping = [b for b in active if not eps[b].done]
                t = time.perf_counter()
                replies = runner.step(stepping, [texts[active.index(b)] for b in stepping]) if stepping else []
                stats_s += time.perf_counter() - t
                for b, reply in zip(stepping, replies):
                    _apply_step(eps[b], reply, tok, glue, last_turn=turn == settings.max_turns - 1,
                                budget=settings.budget)
    finally:
        runner.close(ids_)
    rollout = _rollout(eps, prompts, group, pad, device)
    stats = _stats(eps, stats_s, rollout.sequences.device)
    if check_template and glue.source == "chat template":
        check_transcripts(eps, rows, tok, stats)
    stats.overhead_s = time.perf_counter() - start - model_s
    return rollout, stats


@dataclass
class Cached:
    """After a call of a generator that resumes (`gen.resumes`): the call's rows (episode indices, in the
    cache's row order), the first cache slot not written, and per episode how many of its `ids` are in the
    cache (`upto`) and the first slot after them (`stale`: the turn's tokens cut after sampling, or fed after
    its EOS, sit from there on)."""

    rows: list[int]
    slot: int
    upto: dict[int, int] = field(default_factory=dict)
    stale: dict[int, int] = field(default_factory=dict)

    def resume(self, eps: list[Episode], active: list[int], device) -> Resume | None:
        """The next call's `Resume` for the still active episodes (a subset of `rows`: episodes only end), or
        None when one has no new token to feed (an empty observation after a turn whose last token was fed:
        the turn is prefilled whole instead)."""
        if any(len(eps[b].ids) <= self.upto[b] for b in active):
            return None
        long = {"dtype": torch.long, "device": device}
        return Resume(rows=torch.tensor([self.rows.index(b) for b in active], **long), slot=self.slot,
                      positions=torch.tensor([len(eps[b].prompt) + self.upto[b] for b in active], **long),
                      stale=torch.tensor([self.stale[b] for b in active], **long))


def _apply_reset(e: Episode, reply: Reply, tok: Any) -> None:
    e.env_s += reply.seconds
    if reply.error:
        e.error, e.message, e.done = reply.error, reply.message, True
        return
    if reply.observation:  # a first observation: its ids alone, before the first model turn
        obs = _encode(tok, reply.observation)
        e.ids += obs
        e.policy += [False] * len(obs)
        e.logp += [0.0] * len(obs)
        e.observations.append(reply.observation)


def _apply_step(e: Episode, reply: Reply, tok: Any, glue: Glue, *, last_turn: bool, budget: int) -> None:
    e.env_s += reply.seconds
    for k, v in reply.reward.items():
        e.reward[k] = e.reward.get(k, 0.0) + v
    if reply.error:
        e.error, e.message, e.done = reply.error, reply.message, True
        return
    if reply.done or reply.observation is None:
        e.done = True
        e.truncated = e.ended_by == "length"
        return
    obs = [*glue.before_obs(e.ending), *_encode(tok, reply.observation), *glue.after_obs]
    if last_turn or len(e.ids) + len(obs) >= budget:  # the environment would go on: out of turns / tokens
        e.done = e.truncated = True
        return
    e.ids += obs
    e.policy += [False] * len(obs)
    e.logp += [0.0] * len(obs)
    e.observations.append(reply.observation)


def _rollout(eps: list[Episode], prompts: dict, group: torch.Tensor, pad: int, device) -> Rollout:
    B, T = len(eps), max(1, max(len(e.ids) for e in eps))
    responses = torch.full((B, T), pad, dtype=torch.long)
    real = torch.zeros((B, T), dtype=torch.long)
    policy = torch.zeros((B, T), dtype=torch.long)
    answer = torch.zeros((B, T), dtype=torch.long)
    logp = torch.zeros((B, T), dtype=torch.float32)
    for b, e in enumerate(eps):
        n = len(e.ids)
        if n:
            responses[b, :n] = torch.tensor(e.ids, dtype=torch.long)
            real[b, :n] = 1
            policy[b, :n] = torch.tensor(e.policy, dtype=torch.long)
            logp[b, :n] = torch.tensor(e.logp, dtype=torch.float32)
        if e.turns:
            s, t = e.turns[-1]
            answer[b, s:t] = 1
    empty = torch.tensor([e.empty for e in eps], dtype=torch.bool)
    failed = torch.tensor([e.error is not None for e in eps], dtype=torch.bool)
    truncated = torch.tensor([e.truncated and not e.empty for e in eps], dtype=torch.bool)
    logp = torch.where(policy.bool(), logp, 0.0)
    response_mask = policy.masked_fill((empty | failed)[:, None], 0)
    on = lambda x: x.to(device)  # noqa: E731
    return Rollout(sequences=on(torch.cat([prompts["input_ids"].cpu(), responses], 1)),
                   attention_mask=on(torch.cat([prompts["attention_mask"].cpu().long(), real], 1)),
                   response_mask=on(response_mask), responses=on(responses), prompt_len=prompts["input_ids"].shape[1],
                   group=on(group), empty=on(empty), truncated=on(truncated), logp_gen=on(logp),
                   answer_mask=on(answer), env_failed=on(failed))


def _stats(eps: list[Episode], env_s: float, device) -> EpisodeStats:
    faults = [e for e in eps if e.error is not None]
    return EpisodeStats(
        env_reward=torch.tensor([sum(e.reward.values()) for e in eps], dtype=torch.float32, device=device),
        turns=torch.tensor([len(e.turns) for e in eps], dtype=torch.float32),
        tool_calls=torch.tensor([len(e.observations) for e in eps], dtype=torch.float32),
        obs_tokens=torch.tensor([len(e.policy) - sum(e.policy) for e in eps], dtype=torch.float32),
        env_s=env_s, errors=sum(e.error != ERROR_TIMEOUT for e in faults),
        timeouts=sum(e.error == ERROR_TIMEOUT for e in faults),
        first_error=next((f"{e.error}: {e.message}" for e in faults), ""), episodes=eps)


def conversation(e: Episode, row: dict) -> list[dict[str, str]]:
    """The episode as chat messages: the prompt row's (its `messages`, else one user message of its prompt
    text), then each model turn (an assistant message, its text stripped) and each observation (a tool message)."""
    messages = [dict(m) for m in row["messages"]] if row.get("messages") else [{"role": "user", "content": row["prompt"]}]
    for k, text in enumerate(e.texts):
        messages.append({"role": "assistant", "content": text.strip()})
        if k < len(e.observations):
            messages.append({"role": "tool", "content": e.observations[k]})
    return messages


def template_ids(tok: Any, messages: list[dict[str, str]], n_prefix: int) -> list[int] | None:
    """apply_chat_template of the whole conversation, as ids, less the ids of its first `n_prefix` messages
    rendered with the generation prompt (None when those are not a prefix of the whole, in ids)."""
    head = _encode(tok, tok.apply_chat_template(messages[:n_prefix], tokenize=False, add_generation_prompt=True))
    whole = _encode(tok, tok.apply_chat_template(messages, tokenize=False))
    return whole[len(head):] if whole[: len(head)] == head else None


_warned = {"template": False}


def check_transcripts(eps: list[Episode], rows: list[dict], tok: Any, stats: EpisodeStats) -> None:
    """Each cleanly ended episode with observations (last turn on EOS or a stop, the environment done, no fault,
    no reset observation)
    against apply_chat_template of its conversation: its response ids must equal the template's, position by
    position (the template may write more after the last EOS). Counts in `stats`; one WARN line per process
    for the first mismatch, naming the position and both tokens."""
    for e, row in zip(eps, rows):
        if (e.error or e.empty or e.truncated or e.ended_by == "length" or not e.observations
                or len(e.observations) != len(e.texts) - 1):
            continue
        messages = conversation(e, row)
        n_prefix = len(messages) - len(e.texts) - len(e.observations)
        try:
            expected = template_ids(tok, messages, n_prefix)
        except Exception as ex:  # a template that cannot render the conversation: a mismatch, said once
            expected, why = None, f"the template fails on it ({type(ex).__name__}: {ex})"
        else:
            why = "the prompt's rendering is not a prefix of the whole conversation's"
        stats.template_checked += 1
        pos = first_difference(e.ids, expected) if expected is not None else 0
        if pos is None:
            continue
        stats.template_mismatch += 1
        if not _warned["template"]:
            _warned["template"] = True
            if expected is None:
                logger.warning("multi-turn transcript vs apply_chat_template: %s (counted in template_mismatch)", why)
            else:
                got = tok.convert_ids_to_tokens(e.ids[pos]) if pos < len(e.ids) else "(end)"
                want = tok.convert_ids_to_tokens(expected[pos]) if pos < len(expected) else "(end)"
                logger.warning("multi-turn transcript differs from apply_chat_template of the same conversation at "
                               "response position %d: %r inserted/generated vs %r from the template (counted in "
                               "template_mismatch; further rows not named)", pos, got, want)


def first_difference(ours: list[int], expected: list[int]) -> int | None:
    """The first position where `ours` differs from `expected` (or runs past it), None when ours is a prefix."""
    for k, x in enumerate(ours):
        if k >= len(expected) or expected[k] != x:
            return k
    return None


def step_env_metrics(stats: EpisodeStats, device) -> dict[str, float]:
    """The step's environment figures over every rank (a collective): per-episode means of turns,
    tool_calls and obs_tokens; env_s and env_overhead_s (seconds in the runner's calls, and everything the
    episodes cost outside the model's generate calls; the slowest rank's share is not separated: summed
    seconds / ranks), env_errors, env_timeouts, template_mismatch (rows)."""
    n = float(len(stats.turns))
    s = all_reduce_sum(torch.tensor([n, float(stats.turns.sum()), float(stats.tool_calls.sum()),
                                     float(stats.obs_tokens.sum()), stats.env_s, float(stats.errors),
                                     float(stats.timeouts), float(stats.template_checked),
                                     float(stats.template_mismatch), 1.0, stats.overhead_s], dtype=torch.float64,
                                    device=device)).tolist()
    eps = max(s[0], 1.0)
    return {"turns": s[1] / eps, "tool_calls": s[2] / eps, "obs_tokens": s[3] / eps, "env_s": s[4] / s[9],
            "env_overhead_s": s[10] / s[9], "env_errors": int(s[5]), "env_timeouts": int(s[6]),
            "template_checked": int(s[7]), "template_mismatch": int(s[8]), "episodes": int(s[0])}


class EpisodesFailed(TrainingError):
    """A step whose episodes faulted beyond rollout.max_env_failure_fraction (or all of them): the run stops."""


def check_failures(rec: dict[str, Any], stats: EpisodeStats, settings: Settings) -> None:
    """Stop the run (EpisodesFailed naming rollout.env) when more than max_env_failure_fraction of the step's
    episodes faulted, or every one did (whatever the fraction: a step without one whole episode teaches
    nothing, as a step without rewards; every rank reads the same summed figures, so every rank stops)."""
    failed = rec["env_errors"] + rec["env_timeouts"]
    if rec["episodes"] and (failed / rec["episodes"] > settings.max_failure_fraction or failed == rec["episodes"]):
        raise EpisodesFailed(
            f"rollout.env={settings.env_name}: {failed} of {rec['episodes']} episodes of the step faulted "
            f"({rec['env_errors']} errors, {rec['env_timeouts']} timeouts), more than "
            f"rollout.max_env_failure_fraction={settings.max_failure_fraction}; first on this rank: "
            f"{stats.first_error or '(none on this rank)'}")


def transcript(e: Episode, tok: Any) -> str:
    """An episode's response side as text (every turn and observation, as inserted), for samples."""
    return tok.decode(e.ids, skip_special_tokens=False)


@torch.no_grad()
def tool_eval(actor, prompts: list, rows: list[dict], tok: Any, runner, settings: Settings, glue: Glue,
              judge, batch_size: int, n_samples: int | None = None) -> dict[str, Any]:
    """Greedy episodes with the environment on the held-out prompts (rank r takes prompts[r::world]), the
    last model turn judged (`judge(prompt, response) -> float | None`): gold_score_tool (100 x mean),
    turns_eval, tool_calls_eval, env_errors_eval (over every rank), and `tool_samples` (this rank's first
    `n_samples`, None: all: prompt, transcript, answer, gold, turns, tool_calls, error)."""
    info = actor.info
    idx = list(range(info.rank, len(prompts), info.world_size))
    params = SamplingParams(max_new_tokens=settings.max_new_tokens, greedy=True)
    width = max((len(p.ids) for p in prompts), default=0)
    totals = torch.zeros(5, dtype=torch.float64)  # judged, gold sum, episodes, turns, tool calls (+ errors below)
    errors, samples = 0, []
    for s in range(0, len(idx), batch_size):
        chunk = idx[s : s + batch_size]
        batch = collate_prompts([{"input_ids": prompts[i].ids} for i in chunk], tok.pad_token_id, width)
        _, stats = generate_episodes(actor, batch, torch.tensor(chunk), [rows[i] for i in chunk], params, tok,
                                     runner, settings, glue, check_template=False)
        for i, e in zip(chunk, stats.episodes):
            answer = e.texts[-1] if e.texts and not e.error else ""
            gold = None if e.error else judge(prompts[i], answer)
            if gold is not None:
                totals[0] += 1
                totals[1] += gold
            totals[2:] += torch.tensor([1.0, len(e.turns), len(e.observations)], dtype=torch.float64)
            errors += e.error is not None
            if n_samples is None or len(samples) < n_samples:
                samples.append({"prompt": prompts[i].text, "transcript": transcript(e, tok), "answer": answer,
                                "gold": gold, "turns": len(e.turns), "calls": len(e.observations),
                                "error": e.error and f"{e.error}: {e.message}"})
    t = all_reduce_sum(torch.cat([totals, torch.tensor([float(errors)], dtype=torch.float64)]).to(info.device)).tolist()
    n = max(t[2], 1.0)
    return {"gold_score_tool": 100.0 * t[1] / t[0] if t[0] else None, "turns_eval": t[3] / n,
            "tool_calls_eval": t[4] / n, "env_errors_eval": int(t[5]), "tool_samples": samples}
