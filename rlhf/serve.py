"""Serve a reward over HTTP, for `python -m rlhf.ppo reward.sources=[http] reward.url=...` or any client.

    python -m rlhf.serve                                          # outputs/reward's model on 127.0.0.1:8000
    python -m rlhf.serve reward.model=/runs/rm server.port=8100 server.max_batch=128
    python -m rlhf.serve reward.source=judge                      # the gold judge (rows send their answer)
    python -m rlhf.serve reward.function=mypkg.rewards:score      # your function, per row or batched (TRL)
    RLHF_REWARD_API_KEY=... python -m rlhf.serve server.host=0.0.0.0   # beyond loopback: a key is required

A FastAPI app on uvicorn (rlhf/rl/service.py): POST /score {rows: [{prompt, response, ids?, fields?}]} ->
{scores}, rows of concurrent requests scored together (server.max_batch rows, server.max_wait_ms);
GET /health (the source, the tokenizer's fingerprint), GET /metrics (requests, p50/p99 latency, batch
sizes, RSS). Bad requests get a 4xx with a message; bodies over server.max_body_mb and requests of
more than server.max_rows rows a 413. The reward model loads as the RL stage loads its reward model
(the same engine and precision), so a row's score here equals the in-process one. Ctrl-C (SIGINT) or
SIGTERM stops it: it logs its counts and writes them to output_dir/summary.json.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import signal
import socket
import time
from typing import Any

import torch

from engine import FrozenEngine, hf_base_model, init_distributed, set_deterministic
from rlhf.config import ServeConfig
from rlhf.config.validate import engine_config, validate_serve
from rlhf.core.errors import ConfigError
from rlhf.core.hub import check_local
from rlhf.core.plugins import load_function
from rlhf.modeling.load import check_reward_model, disable_dropout, load_tokenizer, load_value_model
from rlhf.modeling.roles import ValueModel
from rlhf.rl.remote import API_KEY_ENV
from rlhf.rl.rewards import FunctionReward, judge_reward, tokenizer_fingerprint
from rlhf.run.app import save_config, seed_everything, setup_logging, stage_main
from rlhf.run.runlog import format_summary, write_summary

# The serve extra (pip install -e ".[serve]"): without it the command stops with one line naming it (`run`),
# as a logger's missing package does, rather than an ImportError's traceback.
SERVE_EXTRA = ("fastapi", "uvicorn", "starlette")
try:
    import uvicorn

    from rlhf.rl.service import Limits, ModelScorer, TextScorer, make_app
    MISSING: str | None = None
except ModuleNotFoundError as e:
    if (e.name or "").split(".")[0] not in SERVE_EXTRA:
        raise
    MISSING = e.name.split(".")[0]

logger = logging.getLogger("rlhf.serve")


def build_scorer(cfg: ServeConfig, source: str, info) -> tuple[Any, dict[str, Any]]:
    """The scorer of `source` and what /health says of it."""
    if source == "judge":
        return TextScorer("judge", per_row=judge_reward), {"source": "judge", "tokenizer": None}
    if source == "function":
        fr = FunctionReward(cfg.reward.function, load_function(cfg.reward.function, "reward.function"), None, [])
        return (TextScorer(cfg.reward.function, batched=lambda rows, responses: fr.call(rows, responses, [[]] * len(rows))),
                {"source": f"function {cfg.reward.function} ({fr.convention})", "tokenizer": None})
    check_local(cfg.reward.model, "reward.model")
    check_reward_model(cfg.reward.model, "reward.model")  # a policy would serve a random head's scores
    mcfg = dataclasses.replace(cfg.model, name_or_path=cfg.reward.model)
    tok = load_tokenizer(mcfg, key="reward")
    model = ValueModel(disable_dropout(load_value_model(mcfg, tok, seed=cfg.seed, key="reward", lora=False)))
    if hf_base_model(model).config.num_labels != 1:
        raise ConfigError(f"reward.model={cfg.reward.model} must be a reward model with one output (num_labels=1)")
    engine = FrozenEngine(model, engine_config(cfg.engine, info, frozen=True), info)
    engine.eval()
    scorer = ModelScorer(engine, tok, cfg.data, cfg.server.max_batch, hf_base_model(model).config.vocab_size)
    return scorer, {"source": f"model {cfg.reward.model}", "tokenizer": tokenizer_fingerprint(tok),
                    "precision": engine_config(cfg.engine, info, frozen=True).precision}


def run(cfg: ServeConfig) -> dict[str, Any]:
    if MISSING:
        raise ConfigError(f"python -m rlhf.serve needs the {MISSING} package (the serve extra), which is not "
                          f"installed: pip install -e \".[serve]\" (or pip install fastapi uvicorn)")
    set_deterministic(cfg.engine.deterministic)
    info = init_distributed(timeout_s=cfg.engine.timeout_s)
    setup_logging(info.is_main)
    api_key = cfg.server.api_key or os.environ.get(API_KEY_ENV) or None
    source = validate_serve(cfg, info, api_key)
    if info.world_size != 1:
        raise ConfigError("python -m rlhf.serve runs as one process (not under torchrun)")
    seed_everything(cfg.seed)
    save_config(cfg.output_dir, dataclasses.replace(cfg, server=dataclasses.replace(cfg.server, api_key=None)))
    scorer, describe = build_scorer(cfg, source, info)
    s = cfg.server
    limits = Limits(max_batch=s.max_batch, max_wait_ms=s.max_wait_ms, max_rows=s.max_rows, max_body_mb=s.max_body_mb)
    app = make_app(scorer, limits, api_key=api_key, describe=describe, log_every_s=s.log_every_s)
    sock = socket.socket(socket.AF_INET6 if ":" in s.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((s.host, s.port))
    except OSError as e:
        raise ConfigError(f"server.host={s.host} server.port={s.port}: cannot bind ({e.strerror}); choose another "
                          f"port (server.port=0 picks a free one)") from None
    port = sock.getsockname()[1]
    torch.set_grad_enabled(False)
    print(f"serving {describe['source']} at http://{s.host}:{port} (POST /score, GET /health, GET /metrics; "
          f"{'API key required' if api_key else 'no API key'}; batches of up to {s.max_batch} rows, "
          f"max wait {s.max_wait_ms:g} ms)", flush=True)
    t0 = time.time()
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=5))
    # uvicorn shuts down gracefully on SIGINT/SIGTERM, then raises the signal again: as KeyboardInterrupt here
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    meter = app.state.meter
    logger.info("serve: %s", meter.line())
    summary = {"stage": "serve", "source": describe["source"], "url": f"http://{s.host}:{port}",
               "time_s": round(time.time() - t0, 1), **meter.snapshot()}
    write_summary(cfg.output_dir, summary)
    print(f"server stopped ({cfg.output_dir}):\n{format_summary(summary)}", flush=True)
    return summary


def main() -> None:
    stage_main("serve", ServeConfig, run)


if __name__ == "__main__":
    main()
