"""Sub-batches by length in a shared-prompt forward (rollout.length_buckets; rlhf/modeling/roles.py length_buckets):
the time of one forward (no gradient, as the scoring's) and one forward + backward (as the update's) of GRPO-like
rows, run whole at their width against cut into sub-batches by response length at several fixed costs, with the
largest log-prob difference on the real positions.

    OMP_NUM_THREADS=1 python scripts/bench_buckets.py                      # ~25M Llama, 32 rows, 128 new tokens
    python scripts/bench_buckets.py --small --rows 8 --prompts 2 --new 16 --repeat 1   # a smoke run

The rows: `--rows` rows sharing `--prompts` prompts of 31-40 tokens (left-padded to 40), responses ending uniformly
between 10% and 100% of `--new` tokens (bench_rl.py's --eos-spread rule), bf16 autocast as the stages'
precision=auto on a bf16 CPU. The model: the ~25M shape (hidden 512, 8 layers, 8 heads, 2 KV heads, MLP 1408, 4,096
tokens of vocabulary; `--small`: hidden 64, 2 layers; `--embedded`: conf/model/tiny.yaml's shape), random weights.
The times: the process's CPU seconds, the median of `--repeat` repetitions after an untimed warm-up, each mode run
in turn within a repetition. `whole` is the forward before sub-batches (every row at the full width); a number is
BUCKET_FORWARD_TOKENS, the fixed cost a cut must save (at most 8 sub-batches, the CPU's auto).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))

from rlhf.modeling import roles  # noqa: E402
from rlhf.modeling.roles import Policy  # noqa: E402


def rows(a: argparse.Namespace, vocab: int, gen: torch.Generator):
    P, T, G, B = 40, a.new, a.prompts, a.rows
    group = torch.arange(B) % G
    plen = torch.randint(31, P + 1, (G,), generator=gen)
    prompts = torch.randint(3, vocab, (G, P), generator=gen)
    pmask = (torch.arange(P)[None] >= P - plen[:, None]).long()
    extent = torch.randint(max(1, T // 10), T + 1, (B,), generator=gen)
    rmask = (torch.arange(T)[None] < extent[:, None]).long()
    ids = torch.cat([prompts[group], torch.randint(3, vocab, (B, T), generator=gen)], 1)
    mask = torch.cat([pmask[group], rmask], 1)
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0), rmask, P


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=32, help="rows per forward (the update's default micro-batch)")
    ap.add_argument("--prompts", type=int, default=8, help="distinct prompts among them")
    ap.add_argument("--new", type=int, default=128, help="response width (rollout.max_new_tokens)")
    ap.add_argument("--costs", nargs="+", type=int, default=[0, 16, 64, 256], help="BUCKET_FORWARD_TOKENS values")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--small", action="store_true", help="a tiny model (a smoke run)")
    ap.add_argument("--embedded", action="store_true", help="the embedded default's shape (conf/model/tiny.yaml: "
                    "hidden 192, 3 layers, 6 heads, eager attention)")
    a = ap.parse_args()
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2) if a.small else \
        dict(hidden_size=192, intermediate_size=512, num_hidden_layers=3, num_attention_heads=6,
             num_key_value_heads=6) if a.embedded else \
        dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2)
    cfg = LlamaConfig(vocab_size=4096, max_position_embeddings=1024, **shape)
    cfg._attn_implementation = "eager" if a.embedded else "sdpa"
    policy = Policy(LlamaForCausalLM(cfg))
    policy.length_buckets = 8
    ids, mask, pos, rmask, P = rows(a, cfg.vocab_size, torch.Generator().manual_seed(1))
    whole = lambda tail, k, f: [(torch.arange(tail.shape[0]), tail.shape[1])]  # noqa: E731
    cut = roles.length_buckets

    def run(mode: str, grad: bool):
        roles.length_buckets = whole if mode == "whole" else cut
        roles.BUCKET_FORWARD_TOKENS = 0 if mode == "whole" else int(mode)
        policy.zero_grad(set_to_none=True)
        t = time.process_time()
        with torch.autocast("cpu", dtype=torch.bfloat16), torch.set_grad_enabled(grad):
            logp, _ = policy(ids, mask, pos, targets=ids[:, P:], start=P - 1, prompt_len=P)
            if grad:
                (logp * rmask).sum().backward()
        return time.process_time() - t, logp.detach()

    modes = ["whole", *map(str, a.costs)]
    print(f"{a.rows} rows, {a.prompts} prompts, {a.new} new tokens: real response tokens "
          f"{rmask.sum().item() / rmask.numel():.2f} of the padded; sub-batches (rows, width) per fixed cost:")
    for f in a.costs:
        print(f"  {f}: {[(len(r), w) for r, w in cut(rmask, 8, f)]}")
    print("| forward | " + " | ".join(modes) + " |")
    print("|---" * (len(modes) + 1) + "|")
    for grad in (False, True):
        times: dict[str, list[float]] = {m: [] for m in modes}
        gap = 0.0
        run("whole", grad)  # warm-up, untimed
        for _ in range(a.repeat):
            ref = None
            for m in modes:
                dt, logp = run(m, grad)
                times[m].append(dt)
                ref = logp if ref is None else ref
                gap = max(gap, ((logp - ref) * rmask).abs().max().item())
        base = statistics.median(times["whole"])
        cells = [f"{statistics.median(times[m]):.3f} s" + ("" if m == "whole" else
                                                            f" ({base / statistics.median(times[m]):.2f}x)")
                 for m in modes]
        print(f"| {'forward + backward' if grad else 'no gradient'} | " + " | ".join(cells) + " |")
        print(f"  largest log-prob difference from whole on the real positions (bf16): {gap:.2e}")
    roles.length_buckets = cut


if __name__ == "__main__":
    main()
