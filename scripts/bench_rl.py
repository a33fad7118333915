"""The RL step phase by phase (generate, score, advantages, update, overhead): this tree against a baseline
commit in the same run, interleaved, medians; and the machine's limit beside it: a plain fp32/bf16 matmul's
FLOP rate, and the step's achieved FLOP rate on a ~25M-parameter model shape.

    PYTHONPATH=. python scripts/bench_rl.py                                 # GRPO + PPO defaults vs 103a0e2 (docs/engine.md)
    PYTHONPATH=. python scripts/bench_rl.py --reps 5 --steps 6 --algos grpo --baseline HEAD~3
    python scripts/bench_rl.py --baseline none --steps 2 --reps 1 --algos grpo --small --flops-model none
    PYTHONPATH=. python scripts/bench_rl.py --profile outputs/bench_rl/profile.txt --steps 4  # ops + Python per phase
    PYTHONPATH=. python scripts/bench_rl.py --generation hf injected vllm --algos grpo --baseline none  # vLLM installed
    PYTHONPATH=. python scripts/bench_rl.py --baseline none --algos grpo --shape 25m --eos-spread --flops-model none -- rollout.max_new_tokens=128 engine.generation=injected

1. Stage outputs built once in `--work`: an SFT model and a reward model of a few steps each, on the
   default (the tiny model, the shipped data; their learning does not matter to the timing).
2. The baseline commit checked out with `git worktree add --detach` into a temporary directory (removed
   at the end); `--baseline none` measures this tree alone.
3. For each of `--reps` rounds and each algorithm of `--algos` (grpo: `algorithm=grpo`, ppo: the default),
   one stage run per tree, the order alternating between rounds (machine load hits both alike). Each run
   is a subprocess of this script (`--worker`), importing `rlhf` from its tree and running
   `python -m rlhf.ppo` in-process with timers around the step's phases, the same functions in both
   trees: generate = `rlhf.ppo.generate`, score = `Models.score` (every scoring forward and the reward
   source), advantages = `rlhf.ppo.build_experience`, update = `rlhf.ppo.update`, overhead = the rest of
   the step (from one step's start to the next: metrics, alarms, logging, host syncs). The first step of
   each run (warm-up: the generation layout built, allocators filled) is left out.
4. The limit: `torch.matmul` of two n x n matrices (`--matmul-n`) in fp32 and bf16, 2n^3 FLOPs per call,
   median of a few calls, measured between the rounds.
5. `--flops-model 25m` (default): a ~25M-parameter Llama shape (hidden 512, 8 layers, 8 heads, 2 KV
   heads, MLP 1408, the shipped 4k vocabulary), SFT/RM of one step in that shape, then this tree's step
   (`--algos`' first) with every forward counted: 2 x (parameters less the input embedding) FLOPs per
   real token of each forward (generation: each token of the final sequences once; training forwards x 3
   for the backward); attention's own FLOPs are left out (short rows). Achieved = those FLOPs / the
   phase's time, printed as a fraction of the measured matmul rate in the run's precision (measured
   again right after this run; the larger of the two).
6. `--profile FILE` (instead of 3-5): one run of this tree per algorithm, each phase of the steps after the
   first under torch.profiler and cProfile (started and stopped at the phase's bounds, the overhead's
   segments between them); FILE gets per phase the top torch ops by self CPU time and the top Python
   functions by own time (cProfile's table), summed over the steps. The profilers slow the step: read
   the tables for where time goes, the timed rounds for how much.
`--shape 25m` runs the timed rounds on the ~25M-parameter shape of 5 (positions up to 512, for long responses);
`--small` (= `--shape small`) on the tests' tiny one; default: the embedded default's model.
`--eos-spread` (with `rollout.max_new_tokens=N` among the overrides): responses end between 10% and 100% of N,
as an RL step's do, where a barely trained model would rarely say EOS. Every generation path of both trees gets
the same rule, applied from outside (this script patches the tree's engine): the token a row draws at response
index t becomes EOS when u < 1 / (N - t) for t >= N/10 - 1, u in [0, 1) a hash of (the row's previous token, t)
(`row_noise`): a uniform length on [N/10, N] for rows whose tokens vary. The injected decoder's step
(`decode_step`, inside its CUDA graph too) replaces the drawn token; transformers `generate` gets a logits
processor that leaves only EOS; vLLM, which schedules its rows itself, gets each request's length drawn uniformly
on [N/10, N] (its min = max tokens). The runs' mean response length over N is printed with the medians.
`--generation PATH...` (instead of a baseline): this tree once per `engine.generation` path in each round, the
first path the reference of the ratios (vllm needs vLLM: scripts/vllm_cpu_venv.sh on CPU).
After each round but the last the medians so far are printed (and written to --json), so that a run cut at a
time limit (a short lease on a GPU machine) still leaves its figures.
Ratios are what a shared machine measures well; absolute seconds move with its load.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
PHASES = ("generate", "score", "advantages", "update", "overhead")
QUIET = ["train.eval_every=0", "train.save_every=0", "data.num_eval_prompts=4"]
ALGOS = {"grpo": ["algorithm=grpo"], "ppo": []}
# the tests' small model (tests/conftest.py SMALL_MODEL): --small builds the timed runs' SFT/RM in it
SHAPE_SMALL = ["model.config.hidden_size=32", "model.config.intermediate_size=64", "model.config.num_hidden_layers=2",
               "model.config.num_attention_heads=4", "model.config.num_key_value_heads=2"]
SHAPE_25M = ["model.config.hidden_size=512", "model.config.intermediate_size=1408", "model.config.num_hidden_layers=8",
             "model.config.num_attention_heads=8", "model.config.num_key_value_heads=2"]
# --shape: the timed runs' SFT/RM shape (25m: SHAPE_25M with positions for prompts + 128 to 512 new tokens)
SHAPES = {"default": [], "small": SHAPE_SMALL, "25m": [*SHAPE_25M, "model.config.max_position_embeddings=1024"]}


# ----------------------------------------------------------------------------- the worker (one stage run)


def worker(args: argparse.Namespace) -> None:
    """One `rlhf.ppo` run in this process, with the step's phases timed (and, with --count-flops, every
    forward's FLOPs counted); writes {"steps": [{phase: seconds}], "flops": [{phase: FLOPs}] (per step),
    "actor_params": N}. A step runs from its generation's start to the next one's (the last: to the final
    evaluation); the evaluations outside the steps are not timed."""
    sys.path.insert(0, args.tree)
    import torch

    import rlhf.ppo as ppo
    from rlhf.rl import models as rl_models, rewards as rl_rewards, rollout as rl_rollout, update as rl_update
    from rlhf.run import app, stage

    cuda = torch.cuda.is_available()
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    prof = Profiler(cuda) if args.profile else None
    steps: list[dict] = []   # per step: {phase: seconds, "_start": t}
    flops: list[dict] = []   # per step: {phase: FLOPs}
    state: dict = {"phase": None, "in_step": False}

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def close_step(now: float) -> None:
        if state["in_step"]:
            if prof:
                prof.switch(None)
            last = steps[-1]
            last["overhead"] = now - last["_start"] - sum(last[p] for p in PHASES if p != "overhead")
            state["in_step"] = False

    def timed(name: str, fn):
        def wrapper(*a, **k):
            if name != "generate" and not state["in_step"]:  # an evaluation's scoring: not a step's
                return fn(*a, **k)
            sync()
            start = clock()
            if name == "generate":  # a step starts with its generation
                close_step(start)
                steps.append({"_start": start, **{p: 0.0 for p in PHASES}})
                flops.append({p: 0.0 for p in PHASES})
                state["in_step"] = True
            state["phase"] = name
            if prof:  # the first step (warm-up) is left out of the profile as of the timings
                prof.switch(name if len(steps) > 1 else None)
                if name == "score" and len(steps) > 1:  # the rollout's real tokens / its padded positions
                    prof.real[0] += float(a[1].attention_mask.sum())
                    prof.real[1] += a[1].attention_mask.numel()
            out = fn(*a, **k)
            sync()
            if prof:
                prof.switch("overhead" if len(steps) > 1 else None)
            steps[-1][name] += clock() - start
            if name == "generate":
                state["params"] = sum(p.numel() for p in a[0].unwrapped.parameters())
                if args.count_flops:
                    flops[-1][name] += 2 * compute_params(a[0].unwrapped) * float(out.attention_mask.sum())
            state["phase"] = None
            return out
        return wrapper

    def counted(fn, factor: int):
        def wrapper(model, batch, *a, **k):
            if args.count_flops and state["in_step"] and state["phase"] in PHASES:
                tokens = float(batch["attention_mask"].sum())
                flops[-1][state["phase"]] += 2 * factor * compute_params(model) * tokens
            return fn(model, batch, *a, **k)
        return wrapper

    def evaluate_after(fn):
        def wrapper(*a, **k):
            sync()
            close_step(clock())
            return fn(*a, **k)
        return wrapper

    if args.plant:
        plant_eos(args.plant, strict=args.plant_strict, low=args.plant_low)
    lengths: list[float] = []  # per step: mean response length / max_new_tokens (--eos-spread)

    def generated(fn):
        def wrapper(*a, **k):
            out = fn(*a, **k)
            if args.plant and state["in_step"]:
                lengths.append(float(out.response_mask.sum(1).float().mean()) / args.plant)
            return out
        return wrapper

    ppo.generate = timed("generate", generated(ppo.generate))
    ppo.build_experience = timed("advantages", ppo.build_experience)
    ppo.update = timed("update", ppo.update)
    rl_models.Models.score = timed("score", rl_models.Models.score)
    stage.Run.evaluate_after = evaluate_after(stage.Run.evaluate_after)
    rl_rollout.token_logprobs = counted(rl_rollout.token_logprobs, 1)
    rl_rollout.token_values = counted(rl_rollout.token_values, 1)
    rl_rewards.row_values = counted(rl_rewards.row_values, 1)
    rl_update.token_logprobs = counted(rl_update.token_logprobs, 3)  # forward + backward (2x)
    rl_update.token_values = counted(rl_update.token_values, 3)

    def finish() -> None:
        if prof:
            prof.switch(None)
            prof.write(args.profile, f"{' '.join(args.overrides)}; {len(steps) - 1} steps after the first")
        done = [i for i, s in enumerate(steps) if "overhead" in s]
        with open(args.result, "w") as f:
            json.dump({"steps": [{p: steps[i][p] for p in PHASES} for i in done], "flops": [flops[i] for i in done],
                       "actor_params": state.get("params"), "lengths": [lengths[i] for i in done if i < len(lengths)]},
                      f)

    exit_process = app.exit_process  # a run with a process group ends by exiting the process: write first
    app.exit_process = lambda code: (finish(), exit_process(code))
    sys.argv = ["rlhf.ppo", *args.overrides]
    ppo.main()
    finish()


def plant_eos(n: int, strict: bool = False, low: float = 0.1):
    """--eos-spread: responses of up to `n` tokens end uniformly between n/10 and n (see the module doc), on
    the injected decoder and on transformers `generate` alike, patched into the tree's modules from here
    (`low`: the shortest end as a fraction of n; 1 = every response n tokens). Returns the undo."""
    import torch
    import transformers

    import importlib

    inj = importlib.import_module("engine.inference.generate")  # the module (the package's `generate`: the function)
    from engine.inference.sampling import row_noise

    first = max(1, int(n * low)) - 1  # the first response index that may end a row

    def ends(prev: torch.Tensor, t) -> torch.Tensor:
        """[B] bool: the row whose previous token is prev [B] ends with its token t (an int or a [1] tensor)."""
        t = torch.as_tensor(t, device=prev.device)
        u = row_noise(prev, t, 1)[:, 0]
        return (t >= first) & (u * (n - t).clamp(min=1) < 1)

    decode_step = inj.decode_step

    def planted_step(model, st, *a, **k):  # tensor ops only: a CUDA graph captures it with the step
        prev, t = st.tokens[:, 0].clone(), st.step.clone()
        if strict and st.eos.numel():  # the model's own EOS never drawn: only the rule ends a row
            forward = model.forward
            model.forward = lambda *fa, **fk: forward(*fa, **fk).index_fill(-1, st.eos, float("-inf"))
            try:
                decode_step(model, st, *a, **k)
            finally:
                model.forward = forward
        else:
            decode_step(model, st, *a, **k)
        if st.eos.numel() == 0:  # no EOS asked for (a probe): nothing to plant
            return
        end = st.out_active & ends(prev, t)
        tokens = torch.where(end, st.eos[:1], st.out_tokens)
        st.out_tokens.copy_(tokens)
        st.tokens.copy_(tokens[:, None])
        st.done |= end

    inj.decode_step = planted_step

    class PlantedEOS:
        """A transformers logits processor: where `ends`, only EOS stays finite (after the others)."""

        def __init__(self, eos: int):
            self.eos, self.prompt = eos, None

        def __call__(self, input_ids, scores):
            if self.prompt is None:
                self.prompt = input_ids.shape[1]
            end = ends(input_ids[:, -1], input_ids.shape[1] - self.prompt)
            only = torch.full_like(scores, float("-inf"))
            only[:, self.eos] = 0.0
            if strict:  # the model's own EOS never drawn: only the rule ends a row
                scores = scores.index_fill(-1, torch.tensor([self.eos], device=scores.device), float("-inf"))
            return torch.where(end[:, None], only, scores)

    generate = transformers.GenerationMixin.generate

    def planted_generate(self, *a, logits_processor=None, generation_config=None, **k):
        eos = generation_config.eos_token_id if generation_config is not None else self.generation_config.eos_token_id
        eos = eos[0] if isinstance(eos, list) else eos
        processors = transformers.LogitsProcessorList([*(logits_processor or []), PlantedEOS(eos)])
        return generate(self, *a, logits_processor=processors, generation_config=generation_config, **k)

    transformers.GenerationMixin.generate = planted_generate
    # vLLM (engine.generation=vllm) schedules its rows itself: each request gets its length, uniform on [n/10, n]
    # (seeded by the batch), as its min = max tokens (vllm_backend's `lengths`): the same distribution of lengths
    vb = importlib.import_module("engine.vllm_backend")
    vllm_generate = vb.VLLMRollout.generate

    def planted_vllm(self, prompts, params, *, lengths=None, **k):
        if lengths is None and params.max_new_tokens == n:
            g = torch.Generator().manual_seed(len(prompts) * 7919 + sum(len(p) for p in prompts))
            lengths = torch.randint(max(1, n // 10), n + 1, (len(prompts),), generator=g).tolist()
        return vllm_generate(self, prompts, params, lengths=lengths, **k)

    vb.VLLMRollout.generate = planted_vllm

    def undo() -> None:
        inj.decode_step, transformers.GenerationMixin.generate = decode_step, generate
        vb.VLLMRollout.generate = vllm_generate

    return undo


class Profiler:
    """`--profile`: each phase of the step (and the overhead between them) under torch.profiler (ops by
    self CPU time) and cProfile (Python functions by own time), the segments of one phase summed over the
    steps. `switch(phase)` ends the running segment and starts the next (None: none)."""

    def __init__(self, cuda: bool):
        import cProfile
        import pstats

        self.cuda, self.cprofile, self.pstats = cuda, cProfile, pstats
        self.ops: dict[str, dict[str, list[float]]] = {p: {} for p in PHASES}  # phase: {op: [calls, self us, total us]}
        self.py: dict[str, object] = {}   # phase: pstats.Stats
        self.wall: dict[str, float] = {p: 0.0 for p in PHASES}
        self.real = [0.0, 0]  # the scored rollouts' real tokens, positions (padded rows)
        self.current = None

    def switch(self, phase: str | None) -> None:
        import torch

        if self.current is not None:
            name, torch_prof, py_prof, start = self.current
            if self.cuda:
                torch.cuda.synchronize()
            self.wall[name] += time.perf_counter() - start
            py_prof.disable()
            torch_prof.__exit__(None, None, None)
            for e in torch_prof.key_averages():
                row = self.ops[name].setdefault(e.key, [0, 0.0, 0.0])
                row[0] += e.count
                row[1] += e.self_cpu_time_total
                row[2] += e.cpu_time_total
            stats = self.pstats.Stats(py_prof)
            if name in self.py:
                self.py[name].add(stats)
            else:
                self.py[name] = stats
            self.current = None
        if phase is not None:
            acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if self.cuda else [])
            torch_prof = torch.profiler.profile(activities=acts)
            torch_prof.__enter__()
            py_prof = self.cprofile.Profile()
            py_prof.enable()
            self.current = (phase, torch_prof, py_prof, time.perf_counter())

    def write(self, path: str, title: str, top: int = 25) -> None:
        import io

        with open(path, "a") as f:
            f.write(f"==== {title}\n")
            if self.real[1]:
                f.write(f"the rollouts' real tokens: {self.real[0] / self.real[1]:.1%} of their padded rows' positions "
                        "(what packing would save in the scoring and update forwards' linear layers: the rest)\n")
            for phase in PHASES:
                ops = self.ops[phase]
                total = sum(r[1] for r in ops.values())
                f.write(f"\n--- {phase}: {self.wall[phase]:.3f} s wall under the profilers; torch ops by self CPU "
                        f"time ({total / 1e6:.3f} s in all)\n")
                f.write(f"{'op':60s} {'calls':>8s} {'self ms':>10s} {'self %':>7s} {'total ms':>10s}\n")
                for key, (calls, own, tot) in sorted(ops.items(), key=lambda kv: -kv[1][1])[:top]:
                    f.write(f"{key[:60]:60s} {calls:8d} {own / 1e3:10.2f} {own / max(total, 1):7.1%} {tot / 1e3:10.2f}\n")
                if phase in self.py:
                    buf = io.StringIO()
                    stats = self.py[phase]
                    stats.stream = buf
                    stats.sort_stats("tottime").print_stats(top)
                    f.write(f"\n{phase}: Python functions by own time (cProfile)\n")
                    f.write("\n".join(line for line in buf.getvalue().splitlines()
                                       if line.strip() and not line.startswith(("Ordered by", "   List reduced"))))
                    f.write("\n")
            f.write("\n")


_PARAMS: dict[int, int] = {}


def compute_params(model) -> int:
    """The parameters a token's forward multiplies by: all but the input embedding (a lookup), the output
    head counted also when it is tied to the input embedding (one tensor, two uses). 2 x this many FLOPs
    per token forward."""
    import torch

    key = id(model)
    if key not in _PARAMS:
        embeddings = [m.weight for m in model.modules() if isinstance(m, torch.nn.Embedding)]
        tied = sum(m.weight.numel() for m in model.modules()
                   if isinstance(m, torch.nn.Linear) and any(m.weight is w for w in embeddings))
        _PARAMS[key] = sum(p.numel() for p in model.parameters()) - sum(w.numel() for w in embeddings) + tied
    return _PARAMS[key]


# ----------------------------------------------------------------------------- the driver


def run_stage(tree: str, module: str, out: str, *overrides: str) -> None:
    env = {**os.environ, "PYTHONPATH": tree}
    cmd = [sys.executable, "-m", f"rlhf.{module}", f"output_dir={out}", *overrides]
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")


def run_worker(tree: str, out: str, overrides: list[str], count_flops: bool = False, clock: str = "wall",
               profile: str | None = None, plant: int = 0, plant_strict: bool = False, plant_low: float = 0.1,
               wrap: list[str] = ()) -> dict:
    """`wrap`: a script (and its arguments) that runs the worker in its process, e.g. scripts/cuda_peak.py."""
    result = out + ".json"
    cmd = [sys.executable, *wrap, os.path.abspath(__file__), "--worker", "--tree", tree, "--result", result, "--clock", clock,
           "--plant", str(plant), *(["--plant-strict"] if plant_strict else []), "--plant-low", str(plant_low),
           *(["--count-flops"] if count_flops else []), *(["--profile", profile] if profile else []),
           "--", f"output_dir={out}", *overrides]
    proc = subprocess.run(cmd, cwd=tree, env={**os.environ, "PYTHONPATH": tree}, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    with open(result) as f:
        return json.load(f)


def matmul_rate(n: int, dtype_name: str, calls: int = 5) -> float:
    """FLOP/s of a plain n x n matmul in `dtype_name` on this machine's device (median of `calls`)."""
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    times = []
    for i in range(calls + 1):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        torch.matmul(a, b)
        if device == "cuda":
            torch.cuda.synchronize()
        if i:  # the first call warms up
            times.append(time.perf_counter() - start)
    return 2 * n**3 / statistics.median(times)


def build_models(work: str, shape: list[str]) -> tuple[str, str]:
    sft, reward = os.path.join(work, "sft"), os.path.join(work, "reward")
    if not os.path.exists(os.path.join(sft, "summary.json")):
        run_stage(ROOT, "sft", sft, "train.max_steps=1", *shape, *QUIET)
    if not os.path.exists(os.path.join(reward, "summary.json")):
        run_stage(ROOT, "reward", reward, f"model.name_or_path={sft}", "train.max_steps=1", *QUIET)
    return sft, reward


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default="outputs/bench_rl", help="stage outputs (SFT/reward built once) and runs")
    ap.add_argument("--baseline", default="103a0e2", help="the commit to compare with, or a directory holding "
                    "a checkout of it ('none': this tree alone)")
    ap.add_argument("--algos", default="grpo,ppo", help="grpo (algorithm=grpo) and/or ppo (the default)")
    ap.add_argument("--reps", type=int, default=3, help="interleaved rounds (one run per tree and algorithm each)")
    ap.add_argument("--steps", type=int, default=5, help="RL steps per run (the first is left out as warm-up)")
    ap.add_argument("--matmul-n", type=int, default=1024, help="the limit's matmul size (n x n @ n x n)")
    ap.add_argument("--flops-model", default="25m", choices=("25m", "small", "none"),
                    help="the achieved-FLOP-rate run's shape (small: the tests' tiny one)")
    ap.add_argument("--flops-steps", type=int, default=3, help="RL steps of the achieved-FLOP-rate run (its first "
                    "left out when there are more)")
    ap.add_argument("--clock", default="wall", choices=("wall", "cpu"),
                    help="wall: seconds; cpu: this process's CPU seconds (one thread: OMP_NUM_THREADS=1), which "
                         "other jobs on a shared machine barely move")
    ap.add_argument("--small", action="store_true", help="the timed runs on the tests' tiny model shape (a smoke run)")
    ap.add_argument("--shape", choices=tuple(SHAPES), default=None, help="the timed runs' model shape (default: the "
                    "embedded default's; small = --small; 25m: the ~25M-parameter Llama of --flops-model 25m)")
    ap.add_argument("--eos-spread", action="store_true", help="responses end between 10%% and 100%% of "
                    "rollout.max_new_tokens (an override): see above")
    ap.add_argument("--json", help="also write the medians, the matmul rates and the FLOP table to this file")
    ap.add_argument("--profile", help="instead of the timed rounds: one run of this tree per algorithm under "
                    "torch.profiler and cProfile, the top ops and Python functions of each phase written to this file")
    ap.add_argument("--baseline-overrides", default="", help="overrides for the baseline tree's runs only, after "
                    "the common ones (space-separated), e.g. 'engine.generation=hf'")
    ap.add_argument("--this-overrides", default="", help="overrides for this tree's runs only (space-separated), e.g. "
                    "keys the baseline does not have yet")
    ap.add_argument("--generation", nargs="+", help="compare these engine.generation paths of this tree (hf, injected, "
                    "vllm) instead of a baseline tree; the first is the ratios' reference")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--tree", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--count-flops", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--plant", type=int, default=0, help=argparse.SUPPRESS)  # the worker's --eos-spread: N
    ap.add_argument("--plant-low", type=float, default=0.1, help=argparse.SUPPRESS)  # the shortest end / N
    ap.add_argument("--plant-strict", action="store_true", help=argparse.SUPPRESS)  # and the model's own EOS never
    ap.add_argument("overrides", nargs="*", help="extra rlhf.ppo overrides for every run (after --)")
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    if args.steps < 2:
        raise SystemExit("--steps must be >= 2: the first step of each run is left out as warm-up")
    work = os.path.abspath(args.work)
    os.makedirs(work, exist_ok=True)
    shape = args.shape or ("small" if args.small else "default")
    plant = 0
    if args.eos_spread:
        given = [o.split("=", 1)[1] for o in args.overrides if o.startswith("rollout.max_new_tokens=")]
        if not given:
            raise SystemExit("--eos-spread needs rollout.max_new_tokens=N among the overrides (after --)")
        plant = int(given[-1])
    sft, reward = build_models(os.path.join(work, shape), SHAPES[shape])
    if args.profile:
        return profile(work, sft, reward, args)
    trees = {"this": ROOT}
    extra: dict[str, list[str]] = {"this": args.this_overrides.split()}  # each arm's own overrides
    tmp = None
    if args.generation:  # arms: this tree on each generation path
        trees = {g: ROOT for g in args.generation}
        extra = {g: [f"engine.generation={g}"] for g in args.generation}
    elif os.path.isdir(args.baseline):  # a checkout already made (e.g. `git archive <commit>` on a machine without git)
        trees["baseline"] = os.path.abspath(args.baseline)
        extra["baseline"] = args.baseline_overrides.split()
    elif args.baseline != "none":
        tmp = tempfile.mkdtemp(prefix="bench_rl_baseline_")
        subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", tmp, args.baseline], check=True,
                       capture_output=True)
        trees["baseline"] = tmp
        extra["baseline"] = args.baseline_overrides.split()
    algos = args.algos.split(",")
    phases: dict = {(t, a): {p: [] for p in (*PHASES, "step")} for t in trees for a in algos}
    limit: dict[str, list[float]] = {"fp32": [], "bf16": []}
    try:
        for rep in range(args.reps):
            for algo in algos:
                order = list(trees) if rep % 2 == 0 else list(reversed(trees))
                for name in order:
                    out = os.path.join(work, f"{algo}_{name}_{rep}")
                    shutil.rmtree(out, ignore_errors=True)
                    res = run_worker(trees[name], out, [f"actor.model={sft}", f"critic.model={reward}",
                                                        f"train.max_steps={args.steps}", *ALGOS[algo], *QUIET,
                                                        *args.overrides, *extra.get(name, [])], clock=args.clock,
                                     plant=plant)
                    for s in res["steps"][1:]:  # the first step warms up
                        for p in PHASES:
                            phases[(name, algo)][p].append(s[p])
                        phases[(name, algo)]["step"].append(sum(s[p] for p in PHASES))
                    spread = (f"; mean response length / max_new_tokens {statistics.mean(res['lengths']):.2f}"
                              if res.get("lengths") else "")
                    print(f"  round {rep} {algo:4s} {name:8s} steps "
                          f"{[round(sum(s[p] for p in PHASES), 3) for s in res['steps']]}{spread}", flush=True)
            for dtype in limit:
                limit[dtype].append(matmul_rate(args.matmul_n, dtype))
            if rep + 1 < args.reps:  # a run cut short (a time-limited lease) still leaves its medians so far
                medians_table(phases, trees, algos, limit, args, rep + 1)
    finally:
        if tmp:
            subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", tmp], capture_output=True)
    report = medians_table(phases, trees, algos, limit, args, args.reps)
    if args.flops_model != "none":
        report["achieved"] = achieved(work, algos[0], args, report["matmul_flops_per_s"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


def medians_table(phases: dict, trees: dict, algos: list[str], limit: dict, args: argparse.Namespace,
                  rounds: int) -> dict:
    """Prints the per-phase medians of the `rounds` rounds so far (and baseline / this), and the matmul
    limit; writes them to --json; returns the report."""
    med = {k: {p: statistics.median(v) if v else float("nan") for p, v in d.items()} for k, d in phases.items()}
    print(f"\nRL step phases, median {'CPU ' if args.clock == 'cpu' else ''}seconds over {rounds} rounds x "
          f"{args.steps - 1} steps "
          f"(device {device_name()}; baseline {args.baseline}):")
    print(f"{'algo':5s} {'tree':9s} " + " ".join(f"{p:>10s}" for p in (*PHASES, "step")))
    for algo in algos:
        for name in trees:
            print(f"{algo:5s} {name:9s} " + " ".join(f"{med[(name, algo)][p]:10.4f}" for p in (*PHASES, "step")))
        if args.generation:
            ref = args.generation[0]
            for name in args.generation[1:]:
                print(f"{algo:5s} {ref + '/' + name:9s} " + " ".join(
                    f"{med[(ref, algo)][p] / med[(name, algo)][p]:10.2f}" if med[(name, algo)][p] > 0 else
                    f"{'-':>10s}" for p in (*PHASES, "step")) + f"   ({ref} / {name}: > 1 = {name} faster)")
        if "baseline" in trees:
            print(f"{algo:5s} {'ratio':9s} " + " ".join(
                f"{med[('baseline', algo)][p] / med[('this', algo)][p]:10.2f}" if med[("this", algo)][p] > 0 else
                f"{'-':>10s}" for p in (*PHASES, "step")) + "   (baseline / this: > 1 = faster)")
    rates = {d: statistics.median(v) for d, v in limit.items()}
    print(f"\nmatmul {args.matmul_n}x{args.matmul_n}: fp32 {rates['fp32'] / 1e9:.1f} GFLOP/s, "
          f"bf16 {rates['bf16'] / 1e9:.1f} GFLOP/s (median of {len(limit['fp32'])} measurements)", flush=True)
    report = {"rounds": rounds, "medians": {f"{algo}/{name}": med[(name, algo)] for algo in algos for name in trees},
              "matmul_flops_per_s": rates}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return report


def profile(work: str, sft: str, reward: str, args: argparse.Namespace) -> None:
    """--profile: one run of this tree per algorithm, each phase profiled (Profiler), the tables appended
    to args.profile."""
    path = os.path.abspath(args.profile)
    open(path, "w").close()
    for algo in args.algos.split(","):
        out = os.path.join(work, f"{algo}_profile")
        shutil.rmtree(out, ignore_errors=True)
        run_worker(ROOT, out, [f"actor.model={sft}", f"critic.model={reward}", f"train.max_steps={args.steps}",
                               *ALGOS[algo], *QUIET, *args.overrides], clock=args.clock, profile=path)
    print(f"profile of {args.algos} ({args.steps - 1} steps each after the first) written to {path}")


def achieved(work: str, algo: str, args: argparse.Namespace, rates: dict[str, float]) -> dict:
    """This tree's step on the ~25M-parameter shape (or the small one): counted FLOPs per phase / its
    median time; returns {phase: {"s", "flops"}}."""
    shape = SHAPE_25M if args.flops_model == "25m" else SHAPE_SMALL
    sft, reward = build_models(os.path.join(work, args.flops_model), shape)  # "small": the timed runs' models
    out = os.path.join(work, f"{algo}_{args.flops_model}")
    shutil.rmtree(out, ignore_errors=True)
    res = run_worker(ROOT, out, [f"actor.model={sft}", f"critic.model={reward}", f"train.max_steps={args.flops_steps}",
                                 *ALGOS[algo], *QUIET, *args.overrides], count_flops=True, clock=args.clock)
    precision = engine_precision(args.overrides)
    params = res["actor_params"]
    # NOTE: the limit measured again right after the run: on a shared machine the rate between the
    # rounds can be another load's (a 3x swing was seen), the larger of the two is the limit
    rates = {**rates, precision: max(rates[precision], matmul_rate(args.matmul_n, precision))}
    first = 1 if len(res["steps"]) > 1 else 0  # the first step warms up
    steps, step_flops = res["steps"][first:], res["flops"][first:]
    print(f"\n{algo} step on the {args.flops_model} shape ({params / 1e6:.1f}M parameters in the actor; {precision}; "
          f"limit = the {precision} matmul rate, {rates[precision] / 1e9:.1f} GFLOP/s):")
    print(f"{'phase':11s} {'s':>9s} {'GFLOP':>9s} {'GFLOP/s':>9s} {'of limit':>9s}")
    total_f = total_t = 0.0
    table = {}
    for p in PHASES:
        t = statistics.median([s[p] for s in steps])
        f = statistics.median([x[p] for x in step_flops])
        total_f, total_t = total_f + f, total_t + t
        table[p] = {"s": t, "flops": f}
        print(f"{p:11s} {t:9.4f} {f / 1e9:9.3f} {f / t / 1e9 if t else 0:9.2f} {f / t / rates[precision] if t else 0:9.1%}")
    print(f"{'step':11s} {total_t:9.4f} {total_f / 1e9:9.3f} {total_f / total_t / 1e9:9.2f} "
          f"{total_f / total_t / rates[precision]:9.1%}")
    return {"phases": table, "actor_params": params, "precision": precision}


def engine_precision(overrides: list[str]) -> str:
    """The runs' precision: engine.precision= of the overrides, else what "auto" resolves to here."""
    import torch

    sys.path.insert(0, ROOT)
    from engine.config import EngineConfig, resolve_precision

    given = [o.split("=", 1)[1] for o in overrides if o.startswith("engine.precision=")]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    precision = resolve_precision(EngineConfig(precision=given[-1] if given else "auto"), device).precision
    return "bf16" if precision == "bf16" else "fp32"


def device_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else f"cpu, {torch.get_num_threads()} threads"


if __name__ == "__main__":
    main()
