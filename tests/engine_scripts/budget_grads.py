"""One RL mini-batch's loss and gradients through rlhf/rl/update.py `update`, however its rows are micro-batched,
for tests/test_token_budget.py.

    python budget_grads.py <out>                          1 process: one micro-batch of every row, row counts,
                                                          token budgets (rollout.micro_batch_tokens)
    torchrun --nproc_per_node 2 budget_grads.py <out>     2 ranks (gloo), each half of the rows: token budgets

For each actor loss (clip with each ppo.loss_agg, gspo, cispo; each with a KL-loss term and a ptx term) a
tiny seeded Llama actor and critic (engine.stage=3, fp32, clipping off) take one `update` of GLOBAL rows
(ragged left-padded prompts, responses of several lengths, an empty one, a multi-turn row with an
observation inside its response, rows 2k and 2k+1 sharing a prompt). The full gradients are read in an
optimizer pre-hook; rank 0 saves {case: {batching: {"actor": grads, "critic": grads, "loss": float,
"critic_loss": float, "micro_batches": int, "computed": int, "stats": {stat: float}}}, "local_bins": [each
rank's {batching: micro-batches before equalising}]} to <out>/budget_w<world>.pt.
"""
from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from engine import EngineConfig, OptimConfig, TrainEngine, init_distributed  # noqa: E402
from rlhf.config import PPOConfig  # noqa: E402
from rlhf.data.microbatch import row_extents, token_budget_bins  # noqa: E402
from rlhf.modeling.forward import position_ids_from_mask  # noqa: E402
from rlhf.modeling.roles import Policy, ValueModel  # noqa: E402
from rlhf.rl.experience import Experience  # noqa: E402
from rlhf.rl.update import make_actor_loss, make_critic_loss, update  # noqa: E402

VOCAB, P, T, GLOBAL = 64, 6, 9, 8
STATS = ("entropy", "clipfrac", "approx_kl", "ratio_mean", "kl_loss", "ptx_loss")
CASES = {"clip token_mean": ("clip", "token_mean"), "clip seq_mean_token_mean": ("clip", "seq_mean_token_mean"),
         "clip seq_mean_token_sum": ("clip", "seq_mean_token_sum"), "gspo": ("gspo", "token_mean"),
         "cispo": ("cispo", "token_mean")}
# (name, rollout.micro_batch_tokens, rollout.micro_batch_size, shared prompts, packed); micro_batch_size 2 sizes
# the ptx batches (GLOBAL / 2 of one SFT row each, dealt to the micro-batches) in every batching
ONE = [("one micro-batch", 10_000, 2, False, False), ("rows of 2", None, 2, False, False),
       ("budget 45", 45, 2, False, False), ("budget 30", 30, 2, False, False),
       ("budget 60 shared", 60, 2, True, False), ("budget 40 packed", 40, 2, False, True)]
TWO = [("budget 45", 45, 2, False, False), ("budget 20", 20, 2, False, False),
       ("budget 60 shared", 60, 2, True, False)]


def hf_models():
    """ppo_grads.py's seeded tiny actor and critic (the same vocabulary), in their roles."""
    from ppo_grads import hf_models as plain  # this directory is on sys.path (run as a script)

    actor, critic = plain()
    return Policy(actor), ValueModel(critic)


def experience() -> Experience:
    """GLOBAL rows: prompts LEFT-padded to P (rows 2k, 2k + 1 share one), responses right-padded to T."""
    g = torch.Generator().manual_seed(99)
    plen = torch.tensor([2, 6, 3, 5])[torch.arange(GLOBAL) // 2]
    rlen = torch.tensor([9, 2, 5, 1, 3, 7, 4, 2])
    cols = torch.arange(P + T)
    attn = ((cols >= P - plen[:, None]) & (cols < P + rlen[:, None])).long()
    seqs = torch.randint(1, VOCAB, (GLOBAL, P + T), generator=g)
    seqs[:, :P] = seqs[::2, :P].repeat_interleave(2, 0)
    seqs = seqs * attn
    rmask = attn[:, P:].float()
    rmask[3] = 0  # an empty response: in no weight
    rmask[5, 2:4] = 0  # a multi-turn observation inside the response: attended, out of the loss
    f = lambda s: torch.randn(GLOBAL, T, generator=g) * s  # noqa: E731
    return Experience(sequences=seqs, attention_mask=attn, position_ids=position_ids_from_mask(attn),
                      response_mask=rmask, logp_old=f(0.3) - 4.2, logp_ref=f(0.3) - 4.2, values=f(1.0),
                      score=torch.randn(GLOBAL, generator=g), group=torch.arange(GLOBAL) // 2, rewards=f(1.0),
                      kl=f(0.1), advantages=f(1.0), returns=f(1.0), prompt_len=P)


def ptx_source(info):
    """The k-th call on rank r: SFT row k x world + r (one row, its own length), so the ranks' calls together
    read the same rows at any world size."""
    calls = iter(range(10_000))

    def next_batch():
        i = next(calls) * info.world_size + info.rank
        g = torch.Generator().manual_seed(1000 + i)
        n = 4 + i % 3
        ids = torch.randint(1, VOCAB, (1, n), generator=g)
        labels = ids.clone()
        labels[:, :2] = -100
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    return next_batch


def run(info, exp_rows: Experience, case: tuple[str, str], batching: tuple) -> dict:
    _, budget, micro, shared, packed = batching
    actor_role, critic_role = hf_models()
    opt = OptimConfig(grad_clip=0.0)
    actor = TrainEngine(actor_role, EngineConfig(stage=3), opt, total_steps=1, info=info)
    critic = TrainEngine(critic_role, EngineConfig(stage=3), opt, total_steps=1, info=info)
    out = {}
    for role, engine in (("actor", actor), ("critic", critic)):
        grads = out.setdefault(role, {})

        def capture(optimizer, args, kwargs, engine=engine, grads=grads):
            for name, p in engine.unwrapped.named_parameters():
                g = p.grad
                grads[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()
        engine.optimizer.register_step_pre_hook(capture)
    cfg = PPOConfig()
    cfg.rollout.prompts_per_step, cfg.rollout.n_samples_per_prompt = GLOBAL // 2, 2
    cfg.rollout.mini_batch_size, cfg.rollout.micro_batch_size, cfg.rollout.micro_batch_tokens = GLOBAL, micro, budget
    models = SimpleNamespace(actor=actor, critic=critic, ema=None, info=info, pack_length=32 if packed else None,
                             shared_prompts_update=shared)
    policy_loss, agg = case
    losses = (make_actor_loss(0.2, 0.7, 0.5, loss_agg=agg, horizon=T, kl_loss_coef=0.3, policy_loss=policy_loss),
              make_critic_loss(0.2))
    a, c = update(models, exp_rows, cfg, losses, ptx_source(info), SimpleNamespace(check=lambda *s: None))
    # row counts log no batching figures: GLOBAL / world / micro forwards of the full width
    rows = len(exp_rows.group)
    out.update(loss=a[0]["loss"], critic_loss=c[0]["loss"], micro_batches=a[0].get("micro_batches", rows // micro),
               computed=a[0].get("computed_tokens", rows * (P + T)), stats={k: a[0][k] for k in STATS})
    return out


def local_bins(exp: Experience, budget: int) -> int:
    """This rank's micro-batches by first-fit decreasing alone, before the ranks' counts are equalised."""
    prompt, extent = row_extents(exp.attention_mask, exp.prompt_len)
    return len(token_budget_bins(prompt, extent, budget))


def main(out_dir: str) -> None:
    torch.use_deterministic_algorithms(True)
    info = init_distributed()
    exp = experience()
    half = GLOBAL // info.world_size
    mine = exp.rows(list(range(info.rank * half, (info.rank + 1) * half)))
    mine = Experience(**mine)
    result = {}
    for name, case in CASES.items():
        result[name] = {b[0]: run(info, mine, case, b) for b in (ONE if info.world_size == 1 else TWO)}
    every = [None] * info.world_size
    dist.all_gather_object(every, {b[0]: local_bins(mine, b[1]) for b in TWO if not b[3]})
    result["local_bins"] = every
    if info.is_main:
        torch.save(result, os.path.join(out_dir, f"budget_w{info.world_size}.pt"))


if __name__ == "__main__":
    main(sys.argv[1])
    from engine import exit_process

    exit_process(0)  # not a plain exit: see engine.distributed.exit_process
