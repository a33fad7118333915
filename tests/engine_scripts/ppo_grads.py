"""One PPO mini-batch's role outputs and actor and critic gradients under ZeRO-3, for tests/test_ppo.py.

    torchrun --nproc_per_node 2 ppo_grads.py <out>   2 ranks (gloo), each takes half of the mini-batch
    python ppo_grads.py <out>                        1 process, the whole mini-batch; + plain autograd

For engine.kernels false and true: a tiny seeded Llama actor (causal LM as an rlhf.modeling.roles.Policy) and
critic (a sequence-classification Llama as an rlhf.modeling.roles.ValueModel): the roles' outputs through the
sharded engine (log-probs, entropy, values of every row, gathered to rank 0), then one `TrainEngine.train_step` each
(engine.stage=3, fp32) with rlhf/ppo.py's actor and critic losses on a fixed left-padded mini-batch
of GLOBAL rows in micro-batches of MICRO, each row's prompt shared with one other row of its
micro-batch (GRPO's samples of one prompt), the forwards run whole and with rollout.shared_prompt_forward
(each shared prompt once, `mb["shared_prompts"]`). The full (unsharded) gradients are read in an optimizer
step pre-hook (clipping off, so they are exactly what the step would apply) and saved by rank 0 to
<out>/grads_w<world>.pt, with every "view tensor" warning that any rank's forwards raised. The
single process also saves the plain-autograd gradients of the same global masked means.
"""
from __future__ import annotations

import os
import sys
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from engine import EngineConfig, OptimConfig, TrainEngine, init_distributed  # noqa: E402
from engine.kernel_injection import inject_kernels  # noqa: E402
from rlhf.modeling.forward import position_ids_from_mask, token_logprobs, token_values
from rlhf.modeling.roles import Policy, ValueModel
from rlhf.rl.update import make_actor_loss, make_critic_loss

VOCAB, P, T, GLOBAL, MICRO = 64, 5, 6, 8, 2
CLIPRANGE, CLIPRANGE_VALUE, TEMPERATURE = 0.2, 0.2, 0.7


def hf_models():
    """The seeded tiny transformers actor and critic (plain, no role)."""
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, num_labels=1, pad_token_id=0)
    torch.manual_seed(0)
    actor = LlamaForCausalLM(cfg)
    torch.manual_seed(1)
    return actor, LlamaForSequenceClassification(cfg)


def models(kernels: bool = False, inject: bool = False):
    """The actor and critic roles (`kernels`: fused log-probs); `inject`: the fused kernels injected
    here (for the plain reference: the engine injects them itself when EngineConfig.kernels is set)."""
    actor, critic = hf_models()
    if inject:
        inject_kernels(actor)
        inject_kernels(critic)
    return Policy(actor, fused=kernels), ValueModel(critic)


def minibatch() -> dict:
    """GLOBAL rows: prompts LEFT-padded to P, responses right-padded to T (some cut short); old
    log-probs and values near the models' own (so some ratios clip and some do not)."""
    g = torch.Generator().manual_seed(1234)
    prompt_len = torch.randint(2, P + 1, (GLOBAL // 2,), generator=g).repeat_interleave(2)  # rows 2k, 2k + 1 share
    response_len = torch.randint(1, T + 1, (GLOBAL,), generator=g)
    cols = torch.arange(P + T)
    attention_mask = ((cols >= P - prompt_len[:, None]) & (cols < P + response_len[:, None])).long()
    sequences = torch.randint(1, VOCAB, (GLOBAL, P + T), generator=g)
    sequences[:, :P] = sequences[::2, :P].repeat_interleave(2, 0)
    sequences = sequences * attention_mask
    mb = {"sequences": sequences, "attention_mask": attention_mask, "position_ids": position_ids_from_mask(attention_mask),
          "response_mask": attention_mask[:, P:].float(), "prompt_len": P}
    actor, critic = models()
    with torch.no_grad():
        logp = token_logprobs(actor, mb, TEMPERATURE)
        values = token_values(critic, mb)
    mb["logp_old"] = logp + 0.2 * torch.randn(GLOBAL, T, generator=g)
    mb["advantages"] = torch.randn(GLOBAL, T, generator=g)
    mb["values"] = values + 0.3 * torch.randn(GLOBAL, T, generator=g)
    mb["returns"] = torch.randn(GLOBAL, T, generator=g)
    return mb


def rows(mb: dict, start: int, stop: int) -> dict:
    return {k: v[start:stop] if torch.is_tensor(v) else v for k, v in mb.items()}


def engine_grads(model, loss_fn, micro: list[dict], info, kernels: bool) -> tuple[dict, dict]:
    """The role's outputs on this rank's rows (gathered to every rank, in row order) and the full
    gradients of one train_step (every rank calls; the gathers are collective)."""
    engine = TrainEngine(model, EngineConfig(stage=3, kernels=kernels), OptimConfig(grad_clip=0.0),
                         total_steps=1, info=info)
    with torch.no_grad():
        if isinstance(model, Policy):
            pairs = [token_logprobs(engine.model, mb, TEMPERATURE, with_entropy=True) for mb in micro]
            outs = {"logp": torch.cat([a for a, _ in pairs]), "entropy": torch.cat([b for _, b in pairs])}
        else:
            outs = {"values": torch.cat([engine.model(mb["sequences"], mb["attention_mask"], mb["position_ids"],
                                                      prompt_len=P if mb.get("shared_prompts") else None)
                                         for mb in micro])}
    every = [None] * info.world_size
    dist.all_gather_object(every, outs)
    outs = {k: torch.cat([o[k] for o in every]) for k in outs}
    grads = {}

    def capture(optimizer, args, kwargs):
        for name, p in engine.unwrapped.named_parameters():
            g = p.grad
            grads[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()

    engine.optimizer.register_step_pre_hook(capture)
    engine.train_step(micro, loss_fn)
    return outs, grads


def plain_grads(model, loss_fn, micro: list[dict]) -> dict[str, torch.Tensor]:
    """The same global mean without the engine: sum of the micro-batches' loss sums / total weight."""
    parts = [loss_fn(model, mb)[:2] for mb in micro]
    loss = sum(s for s, _ in parts) / sum(w for _, w in parts)
    loss.backward()
    return {name: p.grad.detach().clone() for name, p in model.named_parameters()}


@torch.no_grad()
def plain_outputs(mb: dict) -> dict[str, torch.Tensor]:
    """The roles' outputs computed with plain transformers: log_softmax of the causal LM's logits,
    and the sequence classifier's per-token head output (caught with a hook before its pooling)."""
    actor, critic = hf_models()
    seqs, mask, pos = mb["sequences"], mb["attention_mask"], mb["position_ids"]
    logits = actor(input_ids=seqs, attention_mask=mask, position_ids=pos).logits[:, P - 1 : -1].float() / TEMPERATURE
    logp = torch.log_softmax(logits, -1)
    out = {"logp": logp.gather(-1, seqs[:, P:, None]).squeeze(-1), "entropy": -(logp.exp() * logp).sum(-1)}
    caught = []
    critic.score.register_forward_hook(lambda m, args, o: caught.append(o))
    critic(input_ids=seqs, attention_mask=mask, position_ids=pos)
    out["values"] = caught[0].squeeze(-1)
    return out


def main(out_dir: str) -> None:
    torch.use_deterministic_algorithms(True)
    info = init_distributed()
    mb = minibatch()
    per_rank = GLOBAL // info.world_size
    mine = rows(mb, info.rank * per_rank, (info.rank + 1) * per_rank)
    micro = [rows(mine, i, i + MICRO) for i in range(0, per_rank, MICRO)]
    losses = {"actor": make_actor_loss(CLIPRANGE, TEMPERATURE, 0.0), "critic": make_critic_loss(CLIPRANGE_VALUE)}
    result, plain = {}, {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for kernels in (False, True):
            for shared in (False, True):
                actor, critic = models(kernels)
                key = f"kernels={kernels}" + (" shared" if shared else "")
                result[key], result[f"outputs {key}"] = {}, {}
                batches = [{**mb, "shared_prompts": shared} for mb in micro]
                for role, m in (("actor", actor), ("critic", critic)):
                    outs, result[key][role] = engine_grads(m, losses[role], batches, info, kernels)
                    result[f"outputs {key}"].update(outs)
            if info.world_size == 1:
                actor, critic = models(kernels, inject=kernels)
                plain[f"kernels={kernels}"] = {role: plain_grads(m, losses[role], micro) for role, m in (("actor", actor), ("critic", critic))}
    mine_warnings = [f"rank {info.rank}: {w.category.__name__}: {w.message}" for w in caught if "view tensor" in str(w.message)]
    every = [None] * info.world_size
    dist.all_gather_object(every, mine_warnings)
    if info.is_main:
        result["view_warnings"] = [w for ws in every for w in ws]
        torch.save(result, os.path.join(out_dir, f"grads_w{info.world_size}.pt"))
        if plain:
            plain["outputs"] = plain_outputs(mb)
            # the real positions: a shared-prompt forward computes no column past its rows' longest response
            plain["masks"] = {"logp": mb["response_mask"], "entropy": mb["response_mask"],
                              "values": mb["attention_mask"].float()}
            torch.save(plain, os.path.join(out_dir, "grads_plain.pt"))
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1])
    from engine import exit_process

    exit_process(0)  # not a plain exit: see engine.distributed.exit_process
