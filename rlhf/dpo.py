"""Offline preference optimisation: DPO, IPO, hinge (SLiC), robust DPO, SimPO (+ RPO's NLL) on pairs; KTO
on rows labelled desirable/undesirable.

    python -m rlhf.dpo                                       # from outputs/sft, shipped pairs, CPU
    python -m rlhf.dpo dpo.loss_type=ipo dpo.beta=0.5 model.lora.r=8 dpo.reference=online
    python -m rlhf.dpo dpo.loss_type=kto data.path=feedback.jsonl   # {prompt, completion, label} rows
    torchrun --nproc_per_node 2 -m rlhf.dpo engine=zero3 train.micro_batch_size=16

The alternative to reward model + PPO: the policy (from the SFT output) learns from the pairs
directly. Data: every pair shape and the over-long rule of the reward stage (rlhf/data), its
`data_split` share. A pair's log-prob is the sum over its response tokens (eos included) under a
`Policy` role, so engine.kernels=true applies; chosen and rejected go through one [2B, L] forward.
The loss is `rlhf.algos.preference.dpo_loss` (`dpo.*`), averaged over pairs.
The reference is the starting model, scored without dropout (disabled in the policy):
  dpo.reference=precompute: one pass of the untrained policy (with LoRA: adapters disabled) over the
      train pairs the run will read and the held-out pairs, before the first step; the [N, 2] tables
      are kept in every checkpoint, so no second model is ever loaded;
  dpo.reference=online: each batch is scored by the reference as it is used: with LoRA the policy's
      base with its adapters disabled (peft `disable_adapter`), else a second, frozen copy of the model.
  dpo.loss_type=simpo needs no reference at all.
Evaluation (before, every `train.eval_every`, after): the loss, implicit rewards, margin and
preference accuracy on the held-out pairs (data.eval_path, else data.eval_size of data.path); the gold
score of greedy generations on `data.eval_prompts_path` where a judge applies (rlhf/evaluation/gold.py).
KTO (dpo.loss_type=kto, `rlhf.algos.preference.kto_loss`) is this stage with rows instead of pairs
(rlhf/data: {prompt, completion|response, label}; pairs are split into a desirable and an undesirable
row). Each row carries its mismatched row (its prompt + another row's response, fixed per row as TRL
fixes them) for the reference point z0; a batch is the pair layout, [B own rows; B mismatched rows] in
one [2B, L] forward, the mismatched half detached, so precompute/online/LoRA references, packing and
resume are DPO's. z0 is the mean over the micro-batch's mismatched rows summed over the ranks (all-
reduced: 2 ranks = 1 process at the same micro-batch count), clamped at 0.
Writes to `output_dir`: config.yaml, metrics.jsonl, dpo.png, checkpoints/, model/ (HF), eval_rows.jsonl
(the held-out pairs), summary.json (with the process's peak RSS, to compare the reference modes).
"""
from __future__ import annotations

import contextlib
import logging
import os
import resource
from typing import Any

import torch

from engine import FrozenEngine, TrainEngine
from engine.checkpoint import published, read_meta
from engine.distributed import all_gather_object, all_reduce_sum
from rlhf.algos.preference import (
    NEEDS_REFERENCE, dpo_loss, kto_loss, kto_means, kto_stats, kto_weight_advice, pair_stats, sequence_logps,
)
from rlhf.config import DPOAlgoConfig, DPOConfig
from rlhf.config.validate import SHARED_LINE, engine_config, optim_config, pair_shared_prompts, validate_dpo
from rlhf.core.errors import ConfigError
from rlhf.data import collate_pairs, collate_shared_pairs
from rlhf.data.packing import is_packed, pack_pairs, packed_row_sums, pair_layout, widest_row
from rlhf.data.stage import stage_data
from rlhf.data.tokenize import IGNORE_INDEX
from rlhf.evaluation.gold import eval_line, gold_of, gold_set, gold_summary
from rlhf.modeling.export import export_model
from rlhf.modeling.load import (
    check_causal_lm, check_context, check_generation_backend, disable_dropout, load_causal_lm, load_tokenizer,
    packing_support, stage_pack_length,
)
from rlhf.modeling.roles import Policy
from rlhf.run.app import stage_main
from rlhf.run.stage import Run

logger = logging.getLogger("rlhf.dpo")
TABLES = "reference_logps.pt"  # in each checkpoint: {"train": [N, 2], "eval": [M, 2]} (chosen, rejected)


def pair_batch(feats: list[dict], idx: list[int], pad_id: int, table: torch.Tensor | None = None,
               pack_length: int | None = None, only_if_saves: bool = False, shared: bool | None = False) -> dict:
    """Pairs `feats[idx]` as collate_pairs' [2B, L] batch (chosen rows first) + labels [2B, L]
    (IGNORE_INDEX on bos, prompt and padding) + with a reference table [N, 2] "ref" [2B]. With
    `pack_length` (not None) the rows may be packed instead (rlhf/data/packing.py; with `only_if_saves`,
    data.packing=auto, only where that computes fewer slots), with `shared` (data.shared_prompts resolved)
    laid out by collate_shared_pairs, each pair's prompt run once: `pair_layout` chooses."""
    rows = [feats[i] for i in idx]
    layout = pair_layout(rows, pack_length, only_if_saves, shared)
    if layout == "shared":
        b = collate_shared_pairs(rows, pad_id, labels=True)
    elif layout == "packed":
        b = pack_pairs(rows, pad_id, pack_length, labels=True)
    else:
        b = collate_pairs(rows, pad_id)
        b["labels"] = b["input_ids"].masked_fill(b["attention_mask"] == 0, IGNORE_INDEX)
        for i, f in enumerate(rows + rows):
            b["labels"][i, : f["prompt_len"]] = IGNORE_INDEX
    if table is not None:
        b["ref"] = torch.cat([table[idx, 0], table[idx, 1]])
    return b


def kto_pairs(feats: list[dict]) -> list[dict]:
    """KTO rows in the pair machinery's layout (pair_batch, table_of, packing): a row's own sequence
    where a pair's chosen goes, its mismatched KL sequence (the same prompt part) where the rejected
    goes; so a batch is [B own rows; B mismatched rows] and a reference table [N, 2] (own, mismatched)."""
    return [{"chosen_ids": f["input_ids"], "rejected_ids": f["kl_ids"], "prompt_len": f["prompt_len"],
             "label": f["label"]} for f in feats]


def kto_batch(feats: list[dict], idx: list[int], pad_id: int, table: torch.Tensor | None = None,
              pack_length: int | None = None, only_if_saves: bool = False, shared: bool | None = False) -> dict:
    """`pair_batch` of `kto_pairs` rows + "desirable" [B] bool (the rows' labels)."""
    b = pair_batch(feats, idx, pad_id, table, pack_length, only_if_saves, shared)
    b["desirable"] = torch.tensor([feats[i]["label"] for i in idx], dtype=torch.bool)
    return b


def response_logps(policy: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed log-probs of the response tokens of each row [2B] and their counts [2B]."""
    if batch.get("shared_prompts"):  # collate_shared_pairs: the prompt part is columns :P, run once per pair
        P = batch["prompt_len"]
        labels = batch["labels"][:, P:]  # response token t is predicted at position P - 1 + t
        logp, _ = policy(batch["input_ids"], batch["attention_mask"], batch["position_ids"], targets=labels,
                         start=P - 1, prompt_len=P)
        return sequence_logps(logp, labels != IGNORE_INDEX)
    labels = batch["labels"][:, 1:]  # token t+1 is predicted at position t
    logp, _ = policy(batch["input_ids"], batch["attention_mask"], batch.get("position_ids"), targets=labels)
    if is_packed(batch):
        return packed_row_sums(logp, labels != IGNORE_INDEX, batch)
    return sequence_logps(logp, labels != IGNORE_INDEX)


def adapters_off(engine: TrainEngine | FrozenEngine, off: bool):
    """The base model of a peft policy (its LoRA adapters disabled) for the duration, when `off`."""
    return engine.inner.disable_adapter() if off else contextlib.nullcontext()


@torch.no_grad()
def table_of(engine: TrainEngine | FrozenEngine, feats: list[dict], pad_id: int, batch_size: int,
             base: bool = False, rows: list[int] | None = None, shared: bool | None = False) -> torch.Tensor:
    """[N, 2] summed response log-probs (chosen, rejected) of the pairs `rows` (None: all; the others
    are NaN) under `engine`'s model (`base`: its adapters disabled), on the gathered model with the
    pairs split over the ranks, all-gathered (`shared`: each pair's prompt run once)."""
    info, out = engine.info, []
    rows = list(range(len(feats))) if rows is None else rows
    mine = rows[info.rank :: info.world_size]
    with engine.gathered_parameters(), adapters_off(engine, base):
        for s in range(0, len(mine), batch_size):
            idx = mine[s : s + batch_size]
            b = {k: v.to(info.device) if isinstance(v, torch.Tensor) else v
                 for k, v in pair_batch(feats, idx, pad_id, shared=shared).items()}
            c, r = response_logps(engine.unwrapped, b)[0].cpu().chunk(2)
            out += zip(idx, c.tolist(), r.tolist())
    table = torch.full((len(feats), 2), float("nan"))
    for part in all_gather_object(out):
        for i, c, r in part:
            table[i] = torch.tensor([c, r])
    return table


def loss_settings(p: DPOAlgoConfig) -> dict:
    if p.loss_type == "kto":
        return dict(beta=p.beta, desirable_weight=p.desirable_weight, undesirable_weight=p.undesirable_weight,
                    sft_coef=p.sft_coef)
    return dict(loss_type=p.loss_type, beta=p.beta, label_smoothing=p.label_smoothing, gamma=p.gamma, sft_coef=p.sft_coef)


def kl_over_ranks(total: torch.Tensor) -> torch.Tensor:
    """[sum, count] of the mismatched rows' log-ratios summed over the ranks (KTO's z0 over the world)."""
    return all_reduce_sum(total.clone())


def make_loss(p: DPOAlgoConfig, reference):
    """The engine's loss: summed `dpo_loss` over the B pairs of a batch (kto: summed `kto_loss` over its
    B rows, z0 all-reduced over the ranks). The reference log-probs are the batch's "ref"
    (precomputed), else `reference(batch)` [2B] (online), else none (simpo)."""
    def dpo_step_loss(model: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, int, dict]:
        ref = batch.get("ref")
        if ref is None and reference is not None:
            with torch.no_grad():
                ref = reference(batch)
        logps, lens = response_logps(model, batch)
        (pc, pr), (nc, nr) = logps.chunk(2), lens.chunk(2)
        rc, rr = ref.chunk(2) if ref is not None else (None, None)
        if p.loss_type == "kto":  # (pc, rc): the rows; (pr, rr): their mismatched rows, detached in kto_loss
            losses, rewards, kl = kto_loss(pc, rc, batch["desirable"], pr, rr, lengths=nc, kl_reduce=kl_over_ranks,
                                           **loss_settings(p))
            return losses.sum(), pc.shape[0], kto_stats(rewards, batch["desirable"], kl)
        losses, chosen, rejected = dpo_loss(pc, pr, rc, rr, nc, nr, **loss_settings(p))
        return losses.sum(), pc.shape[0], pair_stats(chosen, rejected)

    return dpo_step_loss


class PolicyState:
    """The policy engine + the precomputed reference tables, checkpointed and resumed together."""

    def __init__(self, engine: TrainEngine):
        self.engine, self.tables = engine, {}

    def save_checkpoint(self, path: str, extra_state: dict) -> None:
        with published(path, {"step": extra_state["step"], "extra_state": extra_state}, self.engine.info.is_main) as tmp:
            self.engine.write_state(tmp)
            if self.engine.info.is_main and self.tables:
                torch.save(self.tables, os.path.join(tmp, TABLES))

    def load_checkpoint(self, path: str) -> dict:
        self.engine.read_state(path)
        if os.path.exists(os.path.join(path, TABLES)):
            self.tables = torch.load(os.path.join(path, TABLES))
        return read_meta(path)["extra_state"]


def evaluate(engine, ref_of, feats: list[dict], prompts: list, tok: Any, cfg: DPOConfig,
             shared: bool | None = False) -> dict[str, Any]:
    """Held-out loss, implicit rewards, margin and accuracy (`ref_of(feats)`: their reference table or
    None); the gold score of greedy generations."""
    out = {}
    if feats:
        pol, ref = table_of(engine, feats, tok.pad_token_id, cfg.train.micro_batch_size, shared=shared), ref_of(feats)
        lens = torch.tensor([[len(f["chosen_ids"]) - f["prompt_len"], len(f["rejected_ids"]) - f["prompt_len"]]
                             for f in feats], dtype=torch.float32)
        rc, rr = (None, None) if ref is None else ref.unbind(1)
        if cfg.dpo.loss_type == "kto":  # z0 over every held-out row's mismatched row
            desirable = torch.tensor([f["label"] for f in feats], dtype=torch.bool)
            losses, rewards, kl = kto_loss(pol[:, 0], rc, desirable, pol[:, 1], rr, lengths=lens[:, 0],
                                           **loss_settings(cfg.dpo))
            stats = {k: v.item() for k, v in kto_stats(rewards, desirable, kl).items()}
            return {"loss": losses.mean().item(), **kto_means(stats), **gold_of(engine, prompts, tok, cfg.eval)}
        losses, c, r = dpo_loss(pol[:, 0], pol[:, 1], rc, rr, lens[:, 0], lens[:, 1], **loss_settings(cfg.dpo))
        out.update({"loss": losses.mean().item(), **{k: v.item() for k, v in pair_stats(c, r).items()}})
    return {**out, **gold_of(engine, prompts, tok, cfg.eval)}


def run(cfg: DPOConfig) -> dict[str, Any]:
    run, accum = Run.open("dpo", "DPO", cfg, cfg.train, validate_dpo)
    info, p, d = run.info, cfg.dpo, cfg.data
    kto = p.loss_type == "kto"
    check_causal_lm(cfg.model.name_or_path, "model")  # a reward model's directory: refused before the data
    tok = load_tokenizer(cfg.model)
    check_generation_backend(cfg.engine.generation, cfg.model, tok, "model", info.device.type)  # its evaluations
    pad, mb = tok.pad_token_id, cfg.train.micro_batch_size
    # the reward stage's pairs and data_split share (kto: labelled rows, pairs split)
    data = stage_data(d, cfg.train, cfg.seed, tok, 1, "KTO" if kto else "DPO", unpaired=kto)
    held_out = run.held_out(data.eval_rows, len(data.eval), data.unit, data.eval_source)
    prompts, gold = gold_set(d, tok, cfg.eval)
    if kto:
        counts = {k: data.stats[k] for k in ("desirable", "undesirable")}
        if not all(counts.values()):  # its figures compare the two kinds; one kind alone has no margin to learn
            missing = "undesirable (label false)" if counts["desirable"] else "desirable (label true)"
            raise ConfigError(f"dpo.loss_type=kto needs rows of both kinds: the training rows of data.path={d.path} "
                              f"have {counts['desirable']} desirable and {counts['undesirable']} undesirable; add "
                              f"{missing} rows (or pairs, which give one of each)")
        if advice := kto_weight_advice(counts["desirable"], counts["undesirable"], p.desirable_weight,
                                       p.undesirable_weight):
            logger.warning(advice)
        data.train, data.eval = kto_pairs(data.train), kto_pairs(data.eval)
    unit = data.unit

    # ---- policy (+ reference) and engines
    model = Policy(disable_dropout(load_causal_lm(cfg.model, tok, seed=cfg.seed)), fused=cfg.engine.kernels, max_logits_mb=cfg.engine.max_logits_mb)
    check_context(model, d.max_len, "data.max_len")
    # the training batches are packed (data.packing); the reference tables and held-out figures are
    # computed on padded batches (equal to rounding: tests/test_packing.py)
    shared = pair_shared_prompts(d, cfg.engine)  # data.shared_prompts: each pair's prompt run once per forward
    pack_len = stage_pack_length(d, packing_support(model), shared)
    if shared is not False:
        logger.info(SHARED_LINE[shared])
    engine = TrainEngine(model, engine_config(cfg.engine, info), optim_config(cfg.train), total_steps=data.total,
                         info=info, row_tokens=widest_row(d, pack_len))
    state, lora = PolicyState(engine), cfg.model.lora.r > 0
    needs_ref, online = NEEDS_REFERENCE[p.loss_type], p.reference == "online"
    ref_engine = None
    if needs_ref and online:  # with LoRA the policy's own base; else a frozen copy of the starting model
        ref_engine = engine if lora else FrozenEngine(
            Policy(disable_dropout(load_causal_lm(cfg.model, tok, seed=cfg.seed, key="model", lora=False)),
                   fused=cfg.engine.kernels, max_logits_mb=cfg.engine.max_logits_mb), engine_config(cfg.engine, info, frozen=True), info)
    elif needs_ref and run.resume_path is None:  # the untrained policy is the reference, on the pairs the run reads
        used = sorted({i for s in range(data.total) for i in data.order.global_rows(s)})
        state.tables = {"train": table_of(engine, data.train, pad, mb, base=lora, rows=used, shared=shared),
                        "eval": table_of(engine, data.eval, pad, mb, base=lora, shared=shared)}
        logger.info("reference log-probs precomputed for %d train + %d held-out %s", len(used), len(data.eval), unit)

    def ref_of(feats: list[dict]) -> torch.Tensor | None:
        if ref_engine is not None:
            return table_of(ref_engine, feats, pad, mb, base=lora, shared=shared)
        return state.tables["eval"] if needs_ref else None

    run.begin(state, data.total, lambda: evaluate(engine, ref_of, data.eval, prompts, tok, cfg, shared),
              _kto_eval_line if kto else _eval_line, memory=engine)
    if needs_ref and not online and "train" not in state.tables:
        raise ConfigError(f"{run.resume_path} holds no precomputed reference log-probs (written with "
                          "dpo.reference=online or dpo.loss_type=simpo?): resume with the same dpo.* settings")

    # ---- train
    def reference(batch: dict) -> torch.Tensor:  # online: [2B] (precomputed: the batch's "ref")
        with adapters_off(ref_engine, lora):
            return response_logps(ref_engine.unwrapped, batch)[0]

    table, auto = state.tables.get("train"), d.packing == "auto"
    batch_of = kto_batch if kto else pair_batch
    keys, postfix, derive = (
        (KTO_KEYS, {"loss": ("loss", ".3f"), "kl": ("kl", ".3f"), "margin": ("margin", ".2f")}, kto_record) if kto else
        (("loss", "reward_chosen", "reward_rejected", "margin", "accuracy", "lr", "grad_norm"),
         {"loss": ("loss", ".3f"), "acc": ("accuracy", ".2f"), "margin": ("margin", ".2f")}, None))
    last = run.loop(engine, data.order, accum, lambda idx: batch_of(data.train, idx, pad, table, pack_len, auto, shared),
                    make_loss(p, reference if ref_engine is not None else None), keys, postfix, derive=derive)

    before, after = run.before, run.evaluate_after()
    if kto:
        figures = {
            "train_rows": len(data.train), **counts,
            "final_train_loss": last.get("loss"), "final_train_kl": last.get("kl"),
            **{f"eval_{k}_{when}": ev.get(k) for k in ("loss", "margin", "kl") for when, ev in
               (("before", before), ("after", after))},
            "eval_reward_desirable_after": after.get("reward_desirable"),
            "eval_reward_undesirable_after": after.get("reward_undesirable"),
        }
    else:
        figures = {
            "train_pairs": len(data.train),
            "eval_pairs": len(data.eval),
            "final_train_loss": last.get("loss"),
            "final_train_accuracy": last.get("accuracy"),
            **{f"eval_{k}_{when}": ev.get(k) for k in ("loss", "accuracy", "margin") for when, ev in
               (("before", before), ("after", after))},
            "eval_reward_chosen_after": after.get("reward_chosen"),
            "eval_reward_rejected_after": after.get("reward_rejected"),
        }
    return run.finish({
        "loss_type": p.loss_type,
        "reference": "none" if not needs_ref else p.reference,
        **held_out,
        **gold,
        **figures,
        **gold_summary(before, after),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),  # rank 0, Linux KiB
        "skipped_steps": engine.skipped_steps,
    }, export_model(engine, tok, cfg.output_dir, cfg.model, add_bos=d.add_bos), KTO_PLOT if kto else PLOT,
        after.get("samples", []))


PLOT = [
    ("loss", [("train", "train", "loss"), ("held-out", "eval", "loss")]),
    ("implicit reward", [("chosen (train)", "train", "reward_chosen"), ("rejected (train)", "train", "reward_rejected"),
                         ("margin (held-out)", "eval", "margin")]),
    ("preference accuracy", [("train", "train", "accuracy"), ("held-out", "eval", "accuracy")]),
    ("gold score (% exact)", [("held-out (greedy)", "eval", "gold_score")]),
]
KTO_KEYS = ("loss", "reward_desirable", "reward_undesirable", "margin", "kl", "desirable_share", "lr", "grad_norm")
KTO_PLOT = [
    ("loss", [("train", "train", "loss"), ("held-out", "eval", "loss")]),
    ("implicit reward", [("desirable (train)", "train", "reward_desirable"),
                         ("undesirable (train)", "train", "reward_undesirable"), ("margin (held-out)", "eval", "margin")]),
    ("KL estimate (z0 / beta)", [("train", "train", "kl"), ("held-out", "eval", "kl")]),
    ("gold score (% exact)", [("held-out (greedy)", "eval", "gold_score")]),
]


def kto_record(out: dict[str, Any]) -> dict[str, Any]:
    """An engine step's averages of `kto_stats` -> + the per-kind mean rewards and margin (`kto_means`)."""
    return {**out, **kto_means(out)}


def _eval_line(ev: dict) -> str:
    own = (f"held-out loss {ev['loss']:.4f}, accuracy {ev['accuracy']:.3f}, margin {ev['margin']:.3f}"
           if ev.get("loss") is not None else None)
    return eval_line(own, ev, "no held-out pairs or prompts")


def _kto_eval_line(ev: dict) -> str:
    margin = "n/a" if ev.get("margin") is None else f"{ev['margin']:.3f}"
    own = (f"held-out loss {ev['loss']:.4f}, margin {margin}, kl {ev['kl']:.4f}" if ev.get("loss") is not None
           else None)
    return eval_line(own, ev, "no held-out rows or prompts")


def main() -> None:
    stage_main("dpo", DPOConfig, run)


if __name__ == "__main__":
    main()
