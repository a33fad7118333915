"""Load test of `python -m rlhf.serve` on the loopback address, against in-process scoring in the same run.

    python scripts/bench_serve.py                         # 1, 8, 32 clients x 10 s each, the default-size reward model
    python scripts/bench_serve.py --duration 2 --clients 1 8 --rows 64   # a quick look
    python scripts/bench_serve.py --ppo --sft outputs/sft  # + the RL step: reward model over HTTP vs in-process

(--model outputs/reward serves your reward model instead; --duration 60 and more shows whether the
server's memory stays flat.)

What it does, all bounded (--duration seconds per client count, --timeout per request):
  1. the reward model: --model, else one of the embedded default's size (conf/model/tiny.yaml) with random
     weights and the shipped tokenizer, written to a temporary directory;
  2. the rows: the held-out pairs' prompt + chosen response (data/default/pairs_eval.jsonl), --rows of them;
     their in-process scores (the server's own scorer, rlhf/rl/service.py ModelScorer, built the same way) are
     the reference, and the in-process batched rate (rows/s in --max-batch forwards) is measured before and
     after the HTTP phases (their mean is the baseline: the machine's load moves during the run);
  3. the server as a real process (`python -m rlhf.serve`, fp32) on a free port; per client count, that many
     threads each send requests of --rows-per-request rows (cycling through the rows) for --duration s:
     rows scored per second, p50/p99 latency, the server's RSS (its /metrics) before and after, and every
     returned score checked against the reference of its row (|diff| <= 1e-5): "lost" counts rows without a
     score or with another row's, "dup" the server's rows_scored beyond the rows sent;
  4. with --ppo: two PPO runs of --ppo-steps steps, same seed, reward.sources=[model] vs [http] (the same
     reward model served), their per-step rewards compared and their step times as a ratio.
Prints one table; ratios, not absolute times, are the figures to compare across machines.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import torch

from rlhf.config import SCHEMAS, compose, to_config
from rlhf.core.paths import ROOT
from rlhf.rl.remote import percentile
from rlhf.serve import build_scorer

from engine import init_distributed


# the embedded default's model shape (conf/model/tiny.yaml)
DEFAULT_SHAPE = {"hidden_size": 192, "intermediate_size": 512, "num_hidden_layers": 3, "num_attention_heads": 6,
                 "num_key_value_heads": 6}


def random_reward_model(path: str, shape: dict[str, int] = DEFAULT_SHAPE) -> str:
    """A Llama reward model of `shape` (LlamaConfig's size keys) with random weights and a random head of std 1
    (so rows score far apart), seed 0, and the shipped tokenizer, saved to `path` (tests/test_serve.py builds
    its tiny one here too)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForSequenceClassification

    tok = AutoTokenizer.from_pretrained(os.path.join(ROOT, "data", "tokenizer"))
    cfg = LlamaConfig(vocab_size=len(tok), **shape, max_position_embeddings=128, num_labels=1,
                      pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForSequenceClassification(cfg)
    with torch.no_grad():
        model.score.weight.normal_(0, 1.0)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def rows_of(n: int) -> list[dict]:
    with open(os.path.join(ROOT, "data", "default", "pairs_eval.jsonl")) as f:
        pairs = [json.loads(line) for line in f]
    rows = [{"prompt": p["prompt"], "response": p[side]} for p in pairs for side in ("chosen", "rejected")]
    return rows[:n]


def in_process(scorer, rows: list[dict], max_batch: int, seconds: float) -> tuple[list[float], float]:
    """The reference scores, and the batched in-process rate (rows/s) over at least `seconds`."""
    ref = []
    for s in range(0, len(rows), max_batch):
        ref += scorer.score(rows[s:s + max_batch])[0]
    done, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for s in range(0, len(rows), max_batch):
            scorer.score(rows[s:s + max_batch])
            done += len(rows[s:s + max_batch])
    return ref, done / (time.perf_counter() - t0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, max_batch: int, log: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "HF_ENDPOINT": "http://127.0.0.1:9", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen([sys.executable, "-m", "rlhf.serve", f"reward.model={model}", "engine.precision=fp32",
                             f"server.port={port}", f"server.max_batch={max_batch}",
                             f"output_dir={os.path.dirname(log)}"], cwd=ROOT, env=env, stdout=open(log, "w"),
                            stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while time.time() < deadline:
        if proc.poll() is not None:
            sys.exit(f"rlhf.serve exited {proc.returncode}:\n{open(log).read()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.3)
    proc.kill()
    sys.exit("rlhf.serve did not answer in 300 s")


def load(url: str, rows: list[dict], ref: list[float], clients: int, per_request: int, seconds: float,
         timeout: float) -> dict:
    """`clients` threads sending requests for `seconds`; rows/s, latencies, wrong or missing scores."""
    lock = threading.Lock()
    out = {"rows": 0, "sent": 0, "lost": 0, "errors": 0, "lat": []}
    counter = [0]
    stop_at = time.perf_counter() + seconds

    def client():
        with httpx.Client(timeout=timeout) as http:
            while time.perf_counter() < stop_at:
                with lock:
                    start = counter[0]
                    counter[0] += per_request
                idx = [(start + k) % len(rows) for k in range(per_request)]
                t0 = time.perf_counter()
                try:
                    r = http.post(f"{url}/score", json={"rows": [rows[i] for i in idx]})
                    scores = r.json()["scores"] if r.status_code == 200 else None
                except (httpx.HTTPError, ValueError, KeyError):
                    scores = None
                dt = time.perf_counter() - t0
                with lock:
                    out["sent"] += len(idx)
                    if scores is None or len(scores) != len(idx):
                        out["errors"] += 1
                        out["lost"] += len(idx)
                        continue
                    out["lat"].append(dt)
                    out["rows"] += len(idx)
                    # another row's score is off by O(1); batch composition moves a score by float rounding only
                    rel = [abs(s - ref[i]) / max(1.0, abs(ref[i])) if s is not None else math.inf
                           for s, i in zip(scores, idx)]
                    out["lost"] += sum(r > 1e-3 for r in rel)
                    out["max_rel"] = max([out.get("max_rel", 0.0), *rel])

    threads = [threading.Thread(target=client) for _ in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=seconds + timeout + 30)
    out["elapsed"] = time.perf_counter() - t0
    return out


def ppo_compare(args, model: str, url: str, tmp: str) -> list[str]:
    """Two PPO runs, same seed: the reward model in-process vs served; per-step rewards and step times."""
    common = [f"actor.model={args.sft}", f"reward_model.model={model}", f"train.max_steps={args.ppo_steps}",
              "train.eval_every=0", "train.save_every=0", "data.num_eval_prompts=8", "alarms.enabled=false",
              "engine.precision=fp32", "algorithm=grpo", "rollout.n_samples_per_prompt=4"]
    env = {**os.environ, "HF_ENDPOINT": "http://127.0.0.1:9", "WANDB_MODE": "disabled"}
    lines = [f"PPO (grpo, 4 samples per prompt), {args.ppo_steps} steps, same seed, {args.ppo_repeats} pair(s) "
             "run interleaved (in-process, http, in-process, http, ...):"]
    step_ratios, scoring_ratios = [], []
    for rep in range(args.ppo_repeats):
        recs = {}
        for name, extra in (("in-process", ["reward.sources=[model]"]),
                            ("http", ["reward.sources=[http]", f"reward.url={url}"])):
            out = os.path.join(tmp, f"ppo_{name}_{rep}")
            p = subprocess.run([sys.executable, "-m", "rlhf.ppo", f"output_dir={out}", *common, *extra], cwd=ROOT,
                               env=env, capture_output=True, text=True, timeout=args.ppo_timeout)
            if p.returncode:
                sys.exit(f"PPO ({name}) exited {p.returncode}:\n{p.stderr[-3000:]}")
            with open(os.path.join(out, "metrics.jsonl")) as f:
                recs[name] = [r for r in map(json.loads, f) if r["kind"] == "train"]
        a, b = recs["in-process"], recs["http"]
        diff = max(abs(x["reward"] - y["reward"]) for x, y in zip(a, b))
        step = {k: statistics.mean(r["generation_s"] + r["scoring_s"] + r["training_s"] for r in v)
                for k, v in recs.items()}
        scoring = {k: statistics.mean(r["scoring_s"] for r in v) for k, v in recs.items()}
        step_ratios.append(step["http"] / step["in-process"])
        scoring_ratios.append(scoring["http"] / scoring["in-process"])
        lines.append(f"  pair {rep + 1}: per-step reward max |diff| {diff:.2e} over {len(a)} steps "
                     f"({'equal' if diff <= 1e-5 else 'DIFFERENT'}; rewards {[round(r['reward'], 5) for r in b]}); "
                     f"step time http / in-process {step_ratios[-1]:.3f} ({step['http']:.3f} s / "
                     f"{step['in-process']:.3f} s), scoring phase {scoring_ratios[-1]:.3f} ({scoring['http']:.3f} s / "
                     f"{scoring['in-process']:.3f} s)")
    lines.append(f"  median step-time ratio {statistics.median(step_ratios):.3f}, scoring-phase ratio "
                 f"{statistics.median(scoring_ratios):.3f}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="reward model directory (default: the embedded default's size, random weights)")
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--duration", type=float, default=10.0, help="seconds per client count")
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--rows-per-request", type=int, default=16)
    ap.add_argument("--max-batch", type=int, default=64)
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--ppo", action="store_true", help="also compare a PPO step over HTTP with in-process")
    ap.add_argument("--sft", default="outputs/sft", help="--ppo: the actor")
    ap.add_argument("--ppo-steps", type=int, default=3)
    ap.add_argument("--ppo-repeats", type=int, default=2, help="--ppo: interleaved pairs of runs")
    ap.add_argument("--ppo-timeout", type=float, default=1200)
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    tmp = tempfile.mkdtemp(prefix="bench_serve_")
    model = args.model or random_reward_model(os.path.join(tmp, "rm"))
    cfg = to_config(compose("serve", [f"reward.model={model}", "engine.precision=fp32",
                                      f"server.max_batch={args.max_batch}"]), SCHEMAS["serve"])
    scorer, _ = build_scorer(cfg, "model", init_distributed())
    rows = rows_of(args.rows)
    ref, rate0 = in_process(scorer, rows, args.max_batch, max(3.0, args.duration / 2))
    inproc = [rate0]  # measured before every HTTP phase and after the last: each phase vs its two neighbours
    proc, url = start_server(model, args.max_batch, os.path.join(tmp, "serve.log"))
    lines = [f"load: {os.getloadavg()[0]:.1f} (1-min load average at start, {os.cpu_count()} CPUs); model {model}; "
             f"{len(rows)} rows, {args.rows_per_request} per request, server.max_batch={args.max_batch}",
             f"{'clients':>7} {'rows/s':>9} {'in-proc':>9} {'ratio':>6} {'p50 ms':>8} {'p99 ms':>8} {'p99/p50':>7} "
             f"{'lost':>5} {'dup':>4} {'err':>4} {'max rel diff':>12} {'RSS MiB before->after':>22}"]
    phases: list[dict] = []
    try:
        for k, n in enumerate(args.clients):
            if k:
                inproc.append(in_process(scorer, rows, args.max_batch, max(3.0, args.duration / 2))[1])
            before = httpx.get(f"{url}/metrics").json()
            res = load(url, rows, ref, n, args.rows_per_request, args.duration, args.timeout)
            after = httpx.get(f"{url}/metrics").json()
            dup = max(0, (after["rows_scored"] - before["rows_scored"]) - (after["rows_requested"] - before["rows_requested"]))
            res.update(n=n, dup=dup, before=before, after=after)
            phases.append(res)
        inproc.append(in_process(scorer, rows, args.max_batch, max(3.0, args.duration / 2))[1])
        for k, res in enumerate(phases):
            base = (inproc[k] + inproc[k + 1]) / 2  # the in-process rate just before and just after this phase
            rate = res["rows"] / res["elapsed"]
            p50, p99 = percentile(res["lat"], 50) * 1e3, percentile(res["lat"], 99) * 1e3
            b, a = res["before"], res["after"]
            lines.append(f"{res['n']:>7} {rate:>9.1f} {base:>9.1f} {rate / base:>6.2f} {p50:>8.1f} {p99:>8.1f} "
                         f"{p99 / p50:>7.2f} {res['lost']:>5} {res['dup']:>4} {res['errors']:>4} "
                         f"{res.get('max_rel', math.nan):>12.1e} {b['rss_mib']:>10} -> {a['rss_mib']:<9}"
                         f"  (server batches: {a['batch_rows_mean']} rows on average; {res['sent']} rows sent)")
        lines.append("in-proc: the in-process batched rate, the mean of its measurements just before and after the "
                     f"phase ({', '.join(f'{r:.1f}' for r in inproc)} rows/s in order); ratio = rows/s / in-proc; "
                     "lost = rows without a score or off their own row's by > 1e-3 (relative)")
        if args.ppo:
            lines += ppo_compare(args, model, url, tmp)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
