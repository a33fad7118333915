"""Rewards over HTTP (#34): `python -m rlhf.serve` as a real process on 127.0.0.1 (a free port), the
client's retries and counts against a misbehaving FastAPI app in this process, and PPO with
reward.sources=[http] against the same reward model in-process. Every wait is bounded."""
from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import httpx
import pytest
import torch

from conftest import ROOT, SMALL_MODEL, cli_env, comparable, metrics, run_stage, summary

pytest.importorskip("fastapi", reason="rlhf.serve needs the serve extra (fastapi, uvicorn)")

import uvicorn  # noqa: E402
from fastapi import FastAPI, Request  # noqa: E402
from fastapi.responses import JSONResponse, PlainTextResponse  # noqa: E402

from rlhf.config import compose, to_config, SCHEMAS  # noqa: E402
from rlhf.config.validate import validate_http_source, validate_serve  # noqa: E402
from rlhf.core.errors import ConfigError  # noqa: E402
from rlhf.core.task import judge  # noqa: E402
from rlhf.rl.remote import RewardClient, RewardServerDown, RewardServiceError  # noqa: E402
from scripts.bench_serve import random_reward_model  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(log_path, *overrides, port: int | None = None, key: str | None = None):
    """`python -m rlhf.serve overrides...` on 127.0.0.1:port; returns (process, url) once /health answers."""
    port = port or free_port()
    log = open(log_path, "a")
    proc = subprocess.Popen([sys.executable, "-m", "rlhf.serve", f"output_dir={os.path.dirname(log_path)}",
                             f"server.port={port}", *overrides], cwd=ROOT, env=cli_env(), stdout=log,
                            stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 180
    while time.time() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"rlhf.serve exited {proc.returncode}:\n{open(log_path).read()[-3000:]}")
        try:
            r = httpx.get(f"{url}/health", timeout=2, headers={"Authorization": f"Bearer {key}"} if key else {})
            if r.status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    pytest.fail(f"rlhf.serve did not answer /health in 180 s:\n{open(log_path).read()[-3000:]}")


def stop(proc) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    """A tiny reward model (the tests' small shape, the shipped tokenizer) whose head is random, so that rows
    score far apart: scripts/bench_serve.py's builder."""
    shape = {k.removeprefix("model.config."): int(v) for k, v in (o.split("=") for o in SMALL_MODEL)}
    return random_reward_model(str(tmp_path_factory.mktemp("rm") / "model"), shape)


@pytest.fixture(scope="module")
def model_server(rm_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve_model") / "serve.log"
    proc, url = start_server(log, f"reward.model={rm_dir}", "engine.precision=fp32", "server.max_rows=4096")
    yield url
    stop(proc)


ROWS = [("Human: Reverse the word 'abc'.\n\nAssistant:", " cba"), ("Human: Reverse the word 'abc'.\n\nAssistant:", " abc"),
        ("Human: Sort the letters of 'dcba'.\n\nAssistant:", " abcd"), ("Human: Count the letters of 'xyz'.\n\nAssistant:", " 3"),
        ("Human: Uppercase 'kq'.\n\nAssistant:", " KQ"), ("Human: hi", "")]


@dataclass
class Batch:  # what RewardModelScore reads of a rollout
    sequences: torch.Tensor
    attention_mask: torch.Tensor


def in_process_scores(rm_dir, seqs: list[list[int]]) -> list[float]:
    """The RL stage's reward model (RewardModelScore on a FrozenEngine) on left-padded rows, as a rollout has them."""
    from engine import FrozenEngine, init_distributed
    from rlhf.config import ModelConfig
    from rlhf.config.validate import engine_config
    from rlhf.modeling.load import disable_dropout, load_tokenizer, load_value_model
    from rlhf.modeling.roles import ValueModel
    from rlhf.rl.rewards import RewardModelScore

    info = init_distributed()
    mcfg = ModelConfig(name_or_path=str(rm_dir))
    tok = load_tokenizer(mcfg)
    model = ValueModel(disable_dropout(load_value_model(mcfg, tok, seed=0, lora=False)))
    cfg = to_config(compose("serve", ["engine.precision=fp32"]), SCHEMAS["serve"])
    engine = FrozenEngine(model, engine_config(cfg.engine, info, frozen=True), info)
    width = max(map(len, seqs))
    ids = torch.tensor([[tok.pad_token_id] * (width - len(s)) + s for s in seqs])
    mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in seqs])
    return RewardModelScore(engine, 4).score(Batch(ids, mask)).tolist()


def test_scores_over_http_equal_in_process_scores(model_server, rm_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(rm_dir)
    # text rows: the server tokenizes [bos] + prompt + response + [eos] (the reward stage's pairs)
    seqs = [[tok.bos_token_id] + tok(p, add_special_tokens=False)["input_ids"] + tok(r, add_special_tokens=False)[
        "input_ids"] + [tok.eos_token_id] for p, r in ROWS]
    want = in_process_scores(rm_dir, seqs)
    assert max(want) - min(want) > 0.1  # rows far apart: a row answered with another's score would show
    client = RewardClient(model_server, request_rows=2, max_concurrency=3, timeout_s=60)
    text = client.score([{"prompt": p, "response": r} for p, r in ROWS])
    ids = client.score([{"prompt": p, "response": r, "ids": s} for (p, r), s in zip(ROWS, seqs)])
    assert text == pytest.approx(want, abs=1e-5) and ids == pytest.approx(want, abs=1e-5)
    health = httpx.get(f"{model_server}/health").json()
    from rlhf.rl.rewards import tokenizer_fingerprint
    assert health["tokenizer"] == tokenizer_fingerprint(tok) and health["source"] == f"model {rm_dir}"
    m = httpx.get(f"{model_server}/metrics").json()
    assert m["requests"]["200"] >= 6 and m["batch_rows_max"] <= 64 and m["latency_p50_ms"] > 0


def test_bad_and_oversized_requests_get_a_4xx_with_a_message(model_server):
    post = lambda body, **kw: httpx.post(f"{model_server}/score", content=body, timeout=60, **kw)  # noqa: E731
    cases = [
        (b"not json", 400, "the body is not JSON"),
        (json.dumps({"rows": "x"}).encode(), 400, 'the body must be a JSON object {"rows"'),
        (json.dumps({"rows": []}).encode(), 400, "rows is empty"),
        (json.dumps({"rows": [{"prompt": "a"}]}).encode(), 400, "rows[0].response must be a string, got None"),
        (json.dumps({"rows": [{"prompt": "a", "response": "b", "ids": [1, 10**6]}]}).encode(), 400,
         "rows[0]: ids must be token ids in [0, "),
        (json.dumps({"rows": [{"prompt": "a", "response": "b"}] * 5000}).encode(), 413,
         "the request has 5000 rows; this server takes at most 4096 per request (server.max_rows)"),
    ]
    for body, status, message in cases:
        r = post(body)
        assert (r.status_code, r.json()["error"][:len(message)]) == (status, message)
    # 10^6 rows: refused from its Content-Length, before the body is read
    huge = json.dumps({"rows": [{"prompt": "a", "response": "b"}] * 10**6}).encode()
    r = post(huge)
    assert r.status_code == 413 and r.json()["error"] == (
        f"the body has {len(huge)} bytes; this server takes at most {16 * 2**20} (server.max_body_mb=16): send the "
        "rows in several requests")
    assert httpx.get(f"{model_server}/health").status_code == 200  # still serving


def test_wrong_api_key_is_refused_with_a_clear_message(tmp_path):
    key = "s3cret-key-for-tests"
    proc, url = start_server(tmp_path / "serve.log", "reward.source=judge", f"server.api_key={key}", key=key)
    try:
        rows = [{"prompt": "Human: Uppercase wyqvv.\n\nAssistant:", "response": "WYQVV"}]
        for wrong in (None, "another-key-123"):
            client = RewardClient(url, api_key=wrong, retries=2, backoff_s=0.01)
            with pytest.raises(RewardServiceError) as e:
                client.score(rows)
            assert str(e.value).startswith(f"the reward server at {url} (reward.url) refused the API key (HTTP 401: "
                                           "missing or wrong API key: send the server's key as the header "
                                           "'Authorization: Bearer <key>'); set the server's key in the environment "
                                           "variable RLHF_REWARD_API_KEY")
            assert client.stats()["retries"] == 0  # a refused key is not retried
        assert RewardClient(url, api_key=key).score(rows) == [judge(rows[0]["prompt"], "WYQVV", None)] == [1.0]
    finally:
        stop(proc)
    out = summary(tmp_path)  # a stopped server writes its counts
    assert out["requests"] == {"401": 2, "200": 1} and out["rows_scored"] == 1


def test_killed_and_restarted_mid_run_counts_the_gap_and_scores_no_row_twice(tmp_path):
    """A client "run" of 6 calls of 8 rows: the server SIGKILLed after call 2 and restarted after call 4 on the
    same port. Calls 3-4 are NaN (counted), the others the judge's scores, each row scored once."""
    port = free_port()
    proc, url = start_server(tmp_path / "a.log", "reward.source=judge", port=port)
    client = RewardClient(url, retries=1, backoff_s=0.05, request_rows=3, max_concurrency=2, down_timeout_s=600)
    prompts = [json.loads(line) for line in open(ROOT / "data" / "default" / "eval_prompts.jsonl")][:48]
    # the odd rows answer right; no answer field sent, so the judge is the embedded task's own
    rows = [{"prompt": p["prompt"], "response": p["answer"] if i % 2 else "wrong"} for i, p in enumerate(prompts)]
    calls = [rows[i:i + 8] for i in range(0, 48, 8)]
    got = []
    try:
        for n, rows in enumerate(calls):
            if n == 2:
                scored_before = httpx.get(f"{url}/metrics").json()["rows_scored"]
                proc.kill()
                proc.wait(timeout=30)
            if n == 4:
                proc, _ = start_server(tmp_path / "b.log", "reward.source=judge", port=port)
            got.append(client.score(rows))
        after = httpx.get(f"{url}/metrics").json()
    finally:
        stop(proc)
    for n, (rows, scores) in enumerate(zip(calls, got)):
        if n in (2, 3):
            assert all(math.isnan(s) for s in scores)
        else:
            assert scores == [judge(r["prompt"], r["response"], None) for r in rows] == [0.0, 1.0] * 4
    s = client.stats()
    assert s["failed_rows"] == 16 and s["rows"] == 48 and s["requests"] == 12  # 3 requests of <= 3 rows per call
    assert scored_before == 16 and after["rows_scored"] == 16 and after["duplicate_requests"] == 0


# ----------------------------------------------------------------------------- a misbehaving server


class Fake:
    """A FastAPI app in a thread whose /score misbehaves as `mode` says."""

    def __init__(self):
        self.mode, self.calls, self.seen, self.inflight, self.most = "ok", 0, [], 0, 0
        self.health: dict | None = None  # what GET /health answers (None: 404, as a service that is no reward server)
        app = FastAPI()

        @app.get("/health")
        async def health():
            return JSONResponse({"detail": "Not Found"}, status_code=404) if self.health is None else self.health

        @app.post("/score")
        async def score(request: Request):
            body = await request.json()
            n, self.calls, first = len(body["rows"]), self.calls + 1, body["request_id"] not in self.seen
            self.seen.append(body["request_id"])
            mode = self.mode
            if mode == "flaky" and first:
                return JSONResponse({"error": "boom"}, status_code=500)
            if mode == "500":
                return PlainTextResponse("Internal Server Error", status_code=500)
            if mode == "garbage":
                return PlainTextResponse("<html>oops</html>")
            if mode == "short":
                return {"scores": [1.0] * (n - 1)}
            if mode == "strings":
                return {"scores": ["1.0"] * n}
            if mode == "gate":  # holds each request 0.2 s without blocking the loop: counts requests in flight
                self.inflight += 1
                self.most = max(self.most, self.inflight)
                await asyncio.sleep(0.2)
                self.inflight -= 1
            if mode == "slow":
                time.sleep(1.0)  # blocks this server's loop: every concurrent request waits too
            if mode == "nan":  # one NaN and one null: those rows alone fail
                return PlainTextResponse(json.dumps({"scores": [float("nan"), None] + [2.0] * (n - 2)}),
                                         media_type="application/json")
            return {"scores": [float(len(r["response"])) for r in body["rows"]]}

        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started and time.time() < deadline:
            time.sleep(0.05)
        assert self.server.started

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture(scope="module")
def fake():
    f = Fake()
    yield f
    f.server.should_exit = True
    f.thread.join(timeout=10)


ROWS4 = [{"prompt": "p", "response": "x" * i} for i in range(1, 5)]


@pytest.mark.parametrize("mode, why", [
    ("500", "HTTP 500: Internal Server Error"),
    ("garbage", "the answer is not JSON: '<html>oops</html>'"),
    ("short", "the answer has 3 scores for 4 rows"),
    ("strings", "a score is not a number: '1.0'"),
])
def test_a_server_that_misbehaves_gives_counted_masked_rows(fake, mode, why):
    fake.mode, fake.calls, fake.seen = mode, 0, []
    client = RewardClient(fake.url, retries=2, backoff_s=0.01, request_rows=4)
    scores = client.score(ROWS4)
    assert all(math.isnan(s) for s in scores)
    s = client.stats()
    assert (s["failed_rows"], s["retries"], s["requests"], fake.calls) == (4, 2, 0, 3)
    assert client.first_error == f"4 row(s) unscored after 2 retries: {why}"
    assert len(set(fake.seen)) == 1  # every try of a request under its one request_id


def test_nan_null_and_a_flaky_500_then_good_answers(fake):
    fake.mode, fake.calls = "nan", 0
    client = RewardClient(fake.url, retries=2, backoff_s=0.01, request_rows=4)
    scores = client.score(ROWS4)
    assert math.isnan(scores[0]) and math.isnan(scores[1]) and scores[2:] == [2.0, 2.0]
    assert client.stats()["failed_rows"] == 2 and client.stats()["retries"] == 0
    fake.mode, fake.calls = "flaky", 0  # each request's first try a 500, its retry answers
    client = RewardClient(fake.url, retries=1, backoff_s=0.01, request_rows=2)
    assert client.score(ROWS4) == [1.0, 2.0, 3.0, 4.0]
    s = client.stats()
    assert (s["failed_rows"], s["retries"], s["requests"]) == (0, 2, 2)


def test_max_concurrency_bounds_the_requests_in_flight_and_backoff_s_the_wait(fake):
    fake.mode, fake.most = "gate", 0
    rows = [{"prompt": "p", "response": "x" * i} for i in range(1, 9)]
    client = RewardClient(fake.url, max_concurrency=2, request_rows=1)
    assert client.score(rows) == [float(i) for i in range(1, 9)]  # each answer in its row's place
    assert fake.most == 2 and client.stats()["requests"] == 8
    fake.mode = "flaky"  # one retry, after backoff_s x [0.5, 1.5)
    t0 = time.perf_counter()
    assert RewardClient(fake.url, retries=1, backoff_s=0.4, request_rows=4).score(ROWS4) == [1.0, 2.0, 3.0, 4.0]
    assert time.perf_counter() - t0 >= 0.2


def test_a_slow_server_counts_timeouts(fake):
    fake.mode, fake.calls = "slow", 0
    client = RewardClient(fake.url, retries=1, backoff_s=0.01, timeout_s=0.3, request_rows=4)
    scores = client.score(ROWS4)
    s = client.stats()
    assert all(math.isnan(x) for x in scores) and (s["timeouts"], s["retries"], s["failed_rows"]) == (2, 1, 4)
    assert client.first_error.startswith("4 row(s) unscored after 1 retries: timed out after reward.timeout_s=0.3 s")
    time.sleep(1.2)  # the fake's loop is free again


def test_a_server_down_longer_than_down_timeout_stops_naming_the_url():
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens
    client = RewardClient(url, retries=2, backoff_s=0.1, down_timeout_s=0.05)
    with pytest.raises(RewardServerDown) as e:
        client.score(ROWS4)
    assert str(e.value).startswith(f"the reward server at {url} (reward.url) has refused connections for ")
    assert "longer than reward.down_timeout_s=0.05: start it again" in str(e.value)


def test_a_reward_that_cannot_arrive_is_refused_at_start_naming_the_url(fake):
    """GET /health before a run: nothing listening, https:// to a plain-HTTP server, a URL that is not a reward
    server's (404) and a server taking fewer rows than request_rows are one line each naming reward.url."""
    closed = f"http://127.0.0.1:{free_port()}"
    for url, rows, message in [
        (closed, 4, f"reward.url={closed}: nothing answers there (ConnectError: "),
        (f"https://127.0.0.1:{fake.port}", 4, f"reward.url=https://127.0.0.1:{fake.port}: the TLS handshake failed ("),
        (fake.url, 4, f"reward.url={fake.url} is not a reward server: GET /health answered HTTP 404: Not Found, not "
                      "a reward server's"),
    ]:
        with pytest.raises(RewardServiceError) as e:
            RewardClient(url, request_rows=rows).check_server()
        assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)
    fake.health = {"status": "ok", "source": "judge", "max_rows": 2}
    try:
        assert RewardClient(fake.url, request_rows=2).check_server()["source"] == "judge"
        with pytest.raises(RewardServiceError) as e:
            RewardClient(fake.url, request_rows=3).check_server()
        assert str(e.value) == (f"reward.request_rows=3 is more than the server at {fake.url} takes per request "
                                "(server.max_rows=2): lower reward.request_rows")
    finally:
        fake.health = None


def test_answers_no_retry_changes_stop_at_once_naming_the_url(fake):
    """A 404 on POST /score (the URL of another service) and a TLS mismatch are not retried: the call raises."""
    fake.mode, fake.calls = "ok", 0
    for url, start in [(f"{fake.url}/elsewhere", f"reward.url={fake.url}/elsewhere: POST /score answered HTTP 404: "
                                                 "Not Found; every request would"),
                       (f"https://127.0.0.1:{fake.port}", f"reward.url=https://127.0.0.1:{fake.port}: the TLS "
                                                          "handshake failed")]:
        client = RewardClient(url, retries=3, backoff_s=0.5, request_rows=4)
        t0 = time.perf_counter()
        with pytest.raises(RewardServiceError) as e:
            client.score(ROWS4)
        assert str(e.value).startswith(start), str(e.value)
        assert client.stats()["retries"] == 0 and client.stats()["failed_rows"] == 4
        assert time.perf_counter() - t0 < 0.5  # no backoff waited
    assert fake.calls == 0  # the 404 came from the missing route, the TLS one never reached the app


def test_a_step_without_any_reward_stops_naming_the_source():
    """The run-level rule (rewards.check_step): every row non-finite stops, naming the failing part's key and its
    first error; one finite row is enough to go on."""
    from rlhf.rl.rewards import RewardsStopped, WeightedSum, check_step

    class Part:
        def __init__(self, key, errors, first):
            self.key, self.errors, self.first_error = key, errors, first

    nan = float("nan")
    check_step(Part("reward.url=http://x", 3, "down"), torch.tensor([nan, 1.0, nan, nan]), "step 2")
    source = WeightedSum([(1.0, Part("reward.sources=[judge]", 0, None)),
                          (0.5, Part("reward.url=http://127.0.0.1:9", 4, "http http://127.0.0.1:9: 4 row(s) "
                                                                         "unscored after 3 retries: ConnectError"))],
                         ["judge", "http"])
    with pytest.raises(RewardsStopped) as e:
        check_step(source, torch.tensor([nan, nan, float("inf"), nan]), "step 2")
    assert str(e.value) == ("reward.url=http://127.0.0.1:9: none of the 4 rows of step 2 got a reward (first: http "
                            "http://127.0.0.1:9: 4 row(s) unscored after 3 retries: ConnectError); a step without "
                            "rewards teaches nothing, so the run stops: fix the reward source, then resume with "
                            "train.resume=true")
    with pytest.raises(RewardsStopped, match=r"^reward.sources=\[model\]: none of the 2 rows of the held-out "
                                             r"evaluation got a reward \(every score NaN or infinite\)"):
        check_step(object(), torch.tensor([nan, nan]), "the held-out evaluation")


# ----------------------------------------------------------------------------- configuration


def test_http_source_and_serve_options_are_validated_by_value():
    def rw(**kw):
        c = to_config(compose("ppo", ["reward.sources=[http]", "reward.url=http://127.0.0.1:8000"]), SCHEMAS["ppo"]).reward
        for k, v in kw.items():
            setattr(c, k, v)
        return c

    validate_http_source(rw())
    for kw, msg in [({"url": "127.0.0.1:8000"}, "reward.url must be the reward server's base URL"),
                    ({"timeout_s": 0}, "reward.timeout_s must be a finite number of seconds > 0, got 0"),
                    ({"down_timeout_s": float("inf")}, "reward.down_timeout_s must be a finite number"),
                    ({"max_concurrency": 0}, "reward.max_concurrency must be an integer >= 1, got 0"),
                    ({"retries": -1}, "reward.retries must be an integer >= 0, got -1"),
                    ({"request_rows": 0}, "reward.request_rows must be an integer >= 1, got 0")]:
        with pytest.raises(ConfigError, match=msg.replace("(", r"\(").replace(".", r"\.")):
            validate_http_source(rw(**kw))

    from engine import init_distributed
    info = init_distributed()

    def serve(*overrides, key=None):
        return validate_serve(to_config(compose("serve", list(overrides)), SCHEMAS["serve"]), info, key)

    assert serve("reward.source=judge") == "judge"
    assert serve("reward.function=math:fabs") == "function"
    for overrides, key, msg in [
        (["reward.source=judge", "server.host=0.0.0.0"], None, "server.host=0.0.0.0 serves beyond this machine: set "
         "an API key"),
        (["reward.source=judge", "server.host=0.0.0.0"], "short", "server.api_key (or RLHF_REWARD_API_KEY) must be "
         "at least 8 characters"),
        (["reward.source=judge", "server.max_batch=0"], None, "server.max_batch must be an integer >= 1, got 0"),
        (["reward.source=judge", "server.port=70000"], None, "server.port must be in [0, 65535]"),
        (["reward.source=judge", "server.max_wait_ms=-1"], None, "server.max_wait_ms must be a finite number >= 0"),
        (["reward.source=judge", "reward.function=math:fabs"], None, "reward.function='math:fabs' is set but "
         "reward.source=judge serves judge"),
        (["reward.source=other"], None, "reward.source must be one of"),
        (["reward.source=judge", "server.max_rows=0"], None, "server.max_rows must be an integer >= 1, got 0"),
        (["reward.source=judge", "server.max_body_mb=0"], None, "server.max_body_mb must be a finite number > 0"),
        (["reward.source=judge", "server.log_every_s=0"], None, "server.log_every_s must be a finite number > 0"),
        (["reward.source=function"], None, "reward.source=function needs reward.function=module:function"),
        (["reward.model=null"], None, "reward.model must be set: the reward model to serve"),
    ]:
        with pytest.raises(ConfigError) as e:
            serve(*overrides, key=key)
        assert str(e.value).startswith(msg), str(e.value)
    assert serve("reward.source=judge", "server.host=0.0.0.0", key="long-enough-key") == "judge"


# ----------------------------------------------------------------------------- the RL stage over HTTP


PPO = ["train.max_steps=2", "train.eval_every=0", "train.save_every=0", "rollout.prompts_per_step=8",
       "rollout.mini_batch_size=8", "rollout.micro_batch_size=8", "rollout.max_new_tokens=6",
       "eval.max_new_tokens=6", "data.num_eval_prompts=4", "alarms.enabled=false", "engine.precision=fp32",
       "algorithm=grpo", "rollout.n_samples_per_prompt=2", "rollout.prompts_per_step=4"]


def ppo(stages, out, *extra, check=True):
    return run_stage("ppo", f"output_dir={out}", f"actor.model={stages / 'sft'}", *PPO, *extra, check=check,
                     timeout=300)


def test_ppo_over_http_equals_in_process_and_combines_with_the_judge(tiny_stages, rm_dir, model_server, tmp_path):
    """Same seed: the served reward model + 0.5 x judge gives each step the scores the in-process one does."""
    local = ppo(tiny_stages, tmp_path / "local", f"reward_model.model={rm_dir}", "reward.sources=[model,judge]",
                "reward.weights=[1,0.5]")
    remote = ppo(tiny_stages, tmp_path / "http", f"reward_model.model={rm_dir}", "reward.sources=[http,judge]",
                 "reward.weights=[1,0.5]", f"reward.url={model_server}", "reward.request_rows=3")
    a, b = metrics(tmp_path / "local", "train"), metrics(tmp_path / "http", "train")
    assert len(a) == len(b) == 2
    # requests since the last record, in requests of 3 rows: step 1 also has the "before" evaluation's 4 rows
    for x, y, requests, rows in zip(a, b, (2 + 3, 3), (4 + 8, 8)):
        assert y["reward"] == pytest.approx(x["reward"], abs=1e-5) and y["kl"] == pytest.approx(x["kl"], abs=1e-5)
        assert (y["reward_errors"], y["http_requests"], y["http_rows"]) == (0, requests, rows)
        assert y["http_p99_ms"] >= y["http_p50_ms"] > 0 and y["http_retries"] == y["http_timeouts"] == 0
    assert summary(tmp_path / "http")["reward_after"] == pytest.approx(summary(tmp_path / "local")["reward_after"],
                                                                       abs=1e-5)
    assert "sending token ids and text (same tokenizer)" in remote.stderr + remote.stdout
    assert local.returncode == 0


def test_ppo_with_its_server_gone_checkpoints_and_stops_naming_the_url(tiny_stages, tmp_path):
    """The server dies once step 1 is logged: step 2 cannot be scored past reward.down_timeout_s, so the run
    writes the checkpoint of step 1 and exits 2 naming the URL."""
    port = free_port()
    proc, url = start_server(tmp_path / "serve.log", "reward.source=judge", port=port)
    out = tmp_path / "ppo"
    killer_done = threading.Event()

    def kill_after_step_1():
        deadline = time.time() + 240
        while time.time() < deadline:
            try:
                if metrics(out, "train"):
                    break
            except (OSError, ValueError):  # not written yet, or a line being written
                pass
            time.sleep(0.02)
        proc.kill()
        killer_done.set()

    t = threading.Thread(target=kill_after_step_1, daemon=True)
    t.start()
    try:
        p = ppo(tiny_stages, out, "reward.sources=[http]", f"reward.url={url}", "reward.retries=2",
                "reward.backoff_s=0.2", "reward.down_timeout_s=0.1", check=False)
    finally:
        t.join(timeout=30)
        proc.kill()
    assert killer_done.is_set()
    assert p.returncode == 2, p.stderr[-3000:]
    assert f"error (training): the reward server at {url} (reward.url) has refused connections for" in p.stderr
    assert len(metrics(out, "train")) == 1 and os.listdir(out / "checkpoints") == ["step_0000001"]
    assert not os.path.exists(out / "summary.json")
    assert f"step 2 cannot train (no reward, or its episodes faulted): checkpoint {out / 'checkpoints' / 'step_0000001'} written" in p.stdout + p.stderr


def test_rewards_that_stop_mid_run_checkpoint_and_a_resume_continues_exactly(tiny_stages, tmp_path):
    """The run-level rule on a real server: killed once step 1 is logged, the next step gets no reward at all, so
    the run writes the checkpoint of the step before (its RNG as that step began), exits 2 naming reward.url and
    leaves no model or summary. With the server back, train.resume=true ends with the metrics of a run that was
    never interrupted (the in-process judge: the same scores)."""
    steps = [a for a in PPO if not a.startswith("train.max_steps")] + ["train.max_steps=3"]
    run = lambda out, *extra, check=True: run_stage(  # noqa: E731
        "ppo", f"output_dir={out}", f"actor.model={tiny_stages / 'sft'}", *steps, *extra, check=check, timeout=300)
    run(tmp_path / "whole", "reward.sources=[judge]")
    port = free_port()
    proc, url = start_server(tmp_path / "serve.log", "reward.source=judge", port=port)
    out, http = tmp_path / "cut", ["reward.sources=[http]", f"reward.url={url}", "reward.retries=1",
                                   "reward.backoff_s=0.05", "reward.down_timeout_s=600"]
    killer = threading.Thread(target=lambda: (_wait_for_a_train_record(out), proc.kill()), daemon=True)
    killer.start()
    try:
        cut = run(out, *http, check=False)
    finally:
        killer.join(timeout=60)
        proc.kill()
    assert cut.returncode == 2, cut.stderr[-3000:]
    done = len(metrics(out, "train"))  # 1, or 2 when step 2 was scored before the kill landed
    last = cut.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error (training): reward.url={url}: none of the 8 rows of step {done + 1} got a reward "
                           "(first: http "), last
    assert os.listdir(out / "checkpoints") == [f"step_{done:07d}"]
    assert not (out / "summary.json").exists() and not (out / "model").exists()
    proc, _ = start_server(tmp_path / "serve2.log", "reward.source=judge", port=port)
    try:
        run(out, *http, "train.resume=true")
    finally:
        stop(proc)
    drop = lambda rows: [{k: v for k, v in r.items() if not k.startswith("http_")} for r in comparable(rows)]  # noqa: E731
    assert drop(metrics(out)) == drop(metrics(tmp_path / "whole"))
    assert [r["step"] for r in metrics(out, "train")] == [1, 2, 3]
    assert summary(out)["gold_score_after"] == summary(tmp_path / "whole")["gold_score_after"]


def _wait_for_a_train_record(out, limit_s: float = 240) -> None:
    deadline = time.time() + limit_s
    while time.time() < deadline:
        try:
            if metrics(out, "train"):
                return
        except (OSError, ValueError):  # not written yet, or a line being written
            pass
        time.sleep(0.02)
