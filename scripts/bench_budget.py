"""Row-count micro-batches against token budgets (rollout.micro_batch_tokens) in a GRPO step's scoring and
update, on a ~25M-parameter Llama shape with responses whose lengths spread between 10% and 100% of
max_new_tokens: the two phases' time and the process's peak RSS, in one run, the variants interleaved.

    PYTHONPATH=. python scripts/bench_budget.py                                  # 128 and 512 new tokens
    PYTHONPATH=. python scripts/bench_budget.py --max-new-tokens 128 --reps 2 --rows 16
    python scripts/bench_budget.py --small --max-new-tokens 32 --rows 8 --group 4   # the tests' smoke form

Each variant is a subprocess of this script (`--worker`, OMP_NUM_THREADS=1), so its peak RSS is its own:
a seeded Llama (hidden 512, 8 layers, 8 heads, 2 KV heads, MLP 1408, vocabulary 4096: the shape of
scripts/bench_rl.py's FLOP count, random weights) as the actor (engine.stage=0, fp32) and a copy as the
reference; `--rows` rows (prompts of `--group` samples each, rollout.shared_prompt_forward off) with prompts
of 20-48 tokens left-padded to 48 and responses of uniformly spread lengths in [0.1, 1] x max_new_tokens.
Timed: `score_rollout` (the actor's and the reference's no-grad forwards) and `update` (one mini-batch of every
row, the actor's forward + backward + AdamW step), the real functions of rlhf/rl/. Variants:
    rows     rollout.micro_batch_size=M rows per forward (scoring: 2M, score_batch_size's default), every
             forward at the full padded width [M, 48 + max_new_tokens]: today's default
    tokens   rollout.micro_batch_tokens = M x (48 + max_new_tokens): the same largest forward (scoring: twice
             the budget), rows grouped by length and trimmed to their own width
`--small`: the tests' small Llama (hidden 32, 2 layers, vocabulary 64) instead, for a smoke run.
Printed: seconds per phase, the tokens computed per real token, micro-batches, peak RSS, and the tokens/rows
ratios of the step time and the RSS.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
PROMPT = 48


def worker(args: argparse.Namespace) -> None:
    sys.path.insert(0, ROOT)
    from types import SimpleNamespace

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine import EngineConfig, OptimConfig, TrainEngine, init_distributed
    from rlhf.config import PPOConfig
    from rlhf.modeling.roles import Policy
    from rlhf.rl.experience import build_experience
    from rlhf.rl.rollout import batching_counts, score_rollout
    from rlhf.rl.update import make_actor_loss, update

    T, B, M = args.max_new_tokens, args.rows, args.micro_batch_size
    budget = M * (PROMPT + T) if args.variant == "tokens" else None
    vocab = 64 if args.small else 4096
    shape = (dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4) if args.small else
             dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8))
    cfg = LlamaConfig(vocab_size=vocab, num_key_value_heads=2, pad_token_id=0, **shape)
    torch.manual_seed(0)
    actor_lm = LlamaForCausalLM(cfg)
    ref = Policy(LlamaForCausalLM(cfg).eval())
    ref.load_state_dict(Policy(actor_lm).state_dict())
    info = init_distributed()
    actor = TrainEngine(Policy(actor_lm), EngineConfig(stage=0, precision="fp32"), OptimConfig(lr=1e-5),
                        total_steps=10, info=info)
    g = torch.Generator().manual_seed(1)
    plen = torch.randint(20, PROMPT + 1, (B // args.group,), generator=g).repeat_interleave(args.group)
    rlen = torch.randint(max(T // 10, 1), T + 1, (B,), generator=g)
    cols = torch.arange(PROMPT + T)
    attn = ((cols >= PROMPT - plen[:, None]) & (cols < PROMPT + rlen[:, None])).long()
    seqs = torch.randint(1, vocab, (B, PROMPT + T), generator=g) * attn
    group = torch.arange(B) // args.group
    batching: dict = {}
    t0 = time.perf_counter()
    scored = score_rollout(seqs, attn, PROMPT, actor=actor.model, reference=ref, critic=None, micro_batch_size=2 * M,
                           temperature=1.0, micro_batch_tokens=None if budget is None else 2 * budget, group=group,
                           batching=batching)
    t1 = time.perf_counter()
    scored["score"] = torch.randn(B, generator=g)
    exp = build_experience(seqs, attn, attn[:, PROMPT:], PROMPT, scored, kl_coef=0.0, kl_estimator="k1",
                           clip_reward_value=5.0, gamma=1.0, lam=1.0, estimator="grpo", group=group)
    ppo = PPOConfig()
    ppo.rollout.prompts_per_step, ppo.rollout.n_samples_per_prompt = B // args.group, args.group
    ppo.rollout.mini_batch_size, ppo.rollout.micro_batch_size, ppo.rollout.micro_batch_tokens = B, M, budget
    models = SimpleNamespace(actor=actor, critic=None, ema=None, info=info, pack_length=None,
                             shared_prompts_update=False)
    loss = make_actor_loss(0.2, 1.0, 0.0, loss_agg="seq_mean_token_mean", horizon=T, kl_loss_coef=0.01)
    t2 = time.perf_counter()
    a_stats, _ = update(models, exp, ppo, (loss, None), None, SimpleNamespace(check=lambda *s: None))
    t3 = time.perf_counter()
    counts = a_stats[0] if budget else batching_counts(attn, PROMPT, [list(range(i, i + M)) for i in range(0, B, M)],
                                                       trimmed=False)  # row counts log none: the same figures here
    print(json.dumps({"score_s": t1 - t0, "update_s": t3 - t2, "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                      "score_micro_batches": batching["micro_batches"],
                      "score_computed_per_real": batching["computed_tokens"] / batching["real_tokens"],
                      "update_micro_batches": counts["micro_batches"],
                      "update_computed_per_real": counts["computed_tokens"] / counts["real_tokens"],
                      "loss": a_stats[0]["loss"]}))


def run(variant: str, args: argparse.Namespace, T: int) -> dict:
    cmd = [sys.executable, __file__, "--worker", "--variant", variant, "--max-new-tokens", str(T), "--rows",
           str(args.rows), "--group", str(args.group), "--micro-batch-size", str(args.micro_batch_size),
           *(["--small"] if args.small else [])]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if out.returncode:
        raise SystemExit(f"{' '.join(cmd)} exited {out.returncode}:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--variant", choices=("rows", "tokens"), help=argparse.SUPPRESS)
    ap.add_argument("--max-new-tokens", type=int, nargs="+", default=[128, 512])
    ap.add_argument("--rows", type=int, default=16, help="rows of the step (prompts x --group)")
    ap.add_argument("--group", type=int, default=8, help="samples per prompt")
    ap.add_argument("--micro-batch-size", type=int, default=4, help="rows per update forward (rows variant)")
    ap.add_argument("--reps", type=int, default=1, help="rounds, the variants' order alternating")
    ap.add_argument("--small", action="store_true", help="the tests' small Llama (a smoke run)")
    args = ap.parse_args()
    if args.worker:
        args.max_new_tokens = args.max_new_tokens[0]
        return worker(args)
    for T in args.max_new_tokens:
        runs: dict[str, list[dict]] = {"rows": [], "tokens": []}
        for rep in range(args.reps):
            for variant in (("rows", "tokens") if rep % 2 == 0 else ("tokens", "rows")):
                runs[variant].append(run(variant, args, T))
        print(f"\nmax_new_tokens={T}, {args.rows} rows (responses {max(T // 10, 1)}-{T} tokens), prompt width "
              f"{PROMPT}, micro_batch_size={args.micro_batch_size} vs micro_batch_tokens="
              f"{args.micro_batch_size * (PROMPT + T)}, {args.reps} round(s), medians")
        med = {v: {k: sorted(r[k] for r in rs)[len(rs) // 2] for k in rs[0]} for v, rs in runs.items()}
        print("| variant | score s | update s | step s | score mb | update mb | computed/real (update) | peak RSS MB |")
        print("|---|---|---|---|---|---|---|---|")
        for v, m in med.items():
            print(f"| {v} | {m['score_s']:.1f} | {m['update_s']:.1f} | {m['score_s'] + m['update_s']:.1f} | "
                  f"{m['score_micro_batches']} | {m['update_micro_batches']} | {m['update_computed_per_real']:.2f} | "
                  f"{m['rss_mb']:.0f} |")
        r, t = med["rows"], med["tokens"]
        print(f"tokens / rows: step time {(t['score_s'] + t['update_s']) / (r['score_s'] + r['update_s']):.2f}x, "
              f"score {t['score_s'] / r['score_s']:.2f}x, update {t['update_s'] / r['update_s']:.2f}x, "
              f"peak RSS {t['rss_mb'] / r['rss_mb']:.2f}x; loss rows {r['loss']:.6e} tokens {t['loss']:.6e}")


if __name__ == "__main__":
    main()
