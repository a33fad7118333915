"""The server side of rewards over HTTP (`python -m rlhf.serve`, rlhf/serve.py): a FastAPI app on uvicorn
that scores {prompt, response} rows in dynamic micro-batches. The wire format: rlhf/rl/remote.py.

    scorer = ModelScorer(engine, tok, data_cfg, max_batch)      # or TextScorer("judge", judge_reward)
    app = make_app(scorer, Limits(...), api_key=None)          # POST /score, GET /health, GET /metrics
    uvicorn.run(app, host="127.0.0.1", port=8000)

Dynamic batching (`Batcher`): each request's rows join one queue; a single worker takes the first
waiting request, then keeps taking requests until the batch holds `max_batch` rows or `max_wait_ms`
has passed since it began waiting, scores the batch (in `max_batch`-row forwards, on a worker thread
so the event loop keeps accepting requests) and answers each request with its own rows' scores. While
one batch is scored the next one fills, so 8 clients sending 16 rows each are scored as 64-row forwards.

Answers: 200 {"request_id", "scores": [float | null], "errors": {index: why}} (null: that row could not
be scored, e.g. a function that raised); 400 a malformed request (what is wrong and where); 401 a
missing or wrong key; 413 a body over server.max_body_mb (read from Content-Length, before the body)
or more rows than server.max_rows; never a 500 with a traceback (an unexpected failure of the scorer
answers 500 {"error": one line} and is logged). A request_id seen recently (the last 4096) is
answered with the scores it got, awaiting them if still in flight: a retried request never scores its
rows twice. /metrics: requests and rows by outcome, latency p50/p99 (ms, the last 10,000 requests),
batch sizes (rows per forward: count, mean, p50, max), rows scored, the process's RSS.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from engine.memory import process_memory
from rlhf.algos.reward_model import sequence_scores
from rlhf.config import DataConfig
from rlhf.core.plugins import as_score
from rlhf.modeling.forward import position_ids_from_mask, row_values
from rlhf.rl.remote import percentile

logger = logging.getLogger("rlhf.serve")

MAX_TEXT = 100_000  # characters of one prompt or response (longer: 400; the tokenization cuts far sooner)


# ----------------------------------------------------------------------------- scorers


class ModelScorer:
    """A reward model (a FrozenEngine of a ValueModel) scoring rows: their `ids` when given (the client's
    tokens, same tokenizer), else [bos] + prompt + response + [eos] tokenized as the reward stage does
    its pairs, cut to data.max_prompt_len / data.max_len by data.overlong=truncate."""

    def __init__(self, engine: Any, tokenizer: Any, data: DataConfig, max_batch: int, vocab_size: int):
        self.engine, self.tok, self.data, self.max_batch, self.vocab = engine, tokenizer, data, max_batch, vocab_size
        self.device = engine.info.device
        bos = tokenizer.bos_token_id if data.add_bos else None
        self.bos = [] if bos is None else [bos]

    def check_row(self, row: dict) -> str | None:
        ids = row.get("ids")
        if ids is None:
            return None
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            return "ids must be a non-empty list of token ids (integers)"
        if min(ids) < 0 or max(ids) >= self.vocab:
            return f"ids must be token ids in [0, {self.vocab}) (this server's tokenizer), got {min(ids)}..{max(ids)}"
        if len(ids) > self.data.max_len * 8:
            return f"ids has {len(ids)} tokens, more than this server takes ({self.data.max_len * 8})"
        return None

    def tokens(self, row: dict) -> list[int]:
        if row.get("ids") is not None:
            return row["ids"]
        d = self.data
        p = self.bos + self.tok(row["prompt"], add_special_tokens=False)["input_ids"]
        p = p[-d.max_prompt_len:] if len(p) > d.max_prompt_len else p  # the prompt's end stays (its question)
        r = self.tok(row["response"], add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
        return (p + r)[: d.max_len]

    @torch.no_grad()
    def score(self, rows: Sequence[dict]) -> tuple[list[float | None], dict[int, str]]:
        seqs = [self.tokens(r) for r in rows]
        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), self.tok.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, s in enumerate(seqs):  # right-padded: positions 0..n-1, as the RL stage's rows have them
            ids[i, : len(s)] = torch.tensor(s)
            mask[i, : len(s)] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        values = row_values(self.engine.model, {"sequences": ids, "attention_mask": mask,
                                                "position_ids": position_ids_from_mask(mask), "pack_length": None})
        out = sequence_scores(values.float(), mask).tolist()
        return [x if math.isfinite(x) else None for x in out], {i: "the model's score is not finite"
                                                               for i, x in enumerate(out) if not math.isfinite(x)}


class TextScorer:
    """A text reward (the judge, a function): per row `fn(prompt, response, row)`, or a batched
    `call(rows, responses)` (rlhf/rl/rewards.py FunctionReward.call). A row it fails on is null."""

    def __init__(self, name: str, per_row: Callable | None = None, batched: Callable | None = None):
        self.name, self.per_row, self.batched = name, per_row, batched

    def check_row(self, row: dict) -> str | None:
        return None

    def score(self, rows: Sequence[dict]) -> tuple[list[float | None], dict[int, str]]:
        tables = [{"prompt": r["prompt"], **(r.get("fields") or {})} for r in rows]
        responses = [r["response"] for r in rows]
        errors: dict[int, str] = {}
        if self.batched is not None:
            values = self.batched(tables, responses)
        else:
            values = []
            for i, (t, resp) in enumerate(zip(tables, responses)):
                try:
                    values.append(as_score(self.per_row(t["prompt"], resp, dict(t))))
                except Exception as e:  # noqa: BLE001 - a row the reward cannot score is null, with why
                    errors[i] = " ".join(f"{type(e).__name__}: {e}".split())[:200]
                    values.append(math.nan)
        out = [v if isinstance(v, float) and math.isfinite(v) else None for v in map(float, values)]
        errors.update({i: "not a finite score" for i, v in enumerate(out) if v is None and i not in errors})
        return out, errors


# ----------------------------------------------------------------------------- figures


class Meter:
    """Request counts by outcome, latencies, batch sizes and rows scored (what /metrics and the log show)."""

    def __init__(self) -> None:
        self.t0 = time.time()
        self.requests: dict[str, int] = {}
        self.rows_requested = self.rows_scored = self.duplicate_requests = 0
        self.latencies: deque[float] = deque(maxlen=10_000)
        self.batches: deque[int] = deque(maxlen=10_000)
        self.n_batches = 0

    def count(self, outcome: str) -> None:
        self.requests[outcome] = self.requests.get(outcome, 0) + 1

    def snapshot(self) -> dict[str, Any]:
        lat, b = list(self.latencies), list(self.batches)
        return {"uptime_s": round(time.time() - self.t0, 1), "requests": dict(self.requests),
                "requests_total": sum(self.requests.values()), "rows_requested": self.rows_requested,
                "rows_scored": self.rows_scored, "duplicate_requests": self.duplicate_requests,
                "latency_p50_ms": _ms(percentile(lat, 50)), "latency_p99_ms": _ms(percentile(lat, 99)),
                "batches": self.n_batches, "batch_rows_mean": round(sum(b) / len(b), 2) if b else None,
                "batch_rows_p50": percentile(b, 50) if b else None, "batch_rows_max": max(b) if b else None,
                "rss_mib": rss_mib()}

    def line(self) -> str:
        s = self.snapshot()
        return (f"{s['requests_total']} requests ({', '.join(f'{k}: {v}' for k, v in sorted(s['requests'].items()))}), "
                f"{s['rows_scored']} rows scored, latency p50 {s['latency_p50_ms']} ms / p99 {s['latency_p99_ms']} ms, "
                f"{s['batches']} batches of {s['batch_rows_mean']} rows on average (max {s['batch_rows_max']}), "
                f"RSS {s['rss_mib']} MiB")


def _ms(seconds: float) -> float | None:
    return None if math.isnan(seconds) else round(seconds * 1e3, 2)


def rss_mib() -> float | None:
    """This process's resident memory in MiB (Linux /proc; None elsewhere)."""
    rss = process_memory("VmRSS")
    return None if rss is None else round(rss / 2**20, 1)


# ----------------------------------------------------------------------------- dynamic batching


@dataclass
class Job:
    rows: list[dict]
    future: asyncio.Future


class Batcher:
    """Rows of concurrent requests scored together: up to `max_batch` rows, the first waiting at most
    `max_wait_s` for others (see the module docstring). One worker thread runs the scorer."""

    def __init__(self, scorer: Any, max_batch: int, max_wait_s: float, meter: Meter):
        self.scorer, self.max_batch, self.max_wait_s, self.meter = scorer, max_batch, max_wait_s, meter
        self.queue: asyncio.Queue[Job] | None = None
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="scorer")
        self.task: asyncio.Task | None = None

    def start(self) -> None:
        self.queue = asyncio.Queue()
        self.task = asyncio.get_running_loop().create_task(self.run())

    def submit(self, rows: list[dict]) -> asyncio.Future:
        """Queue `rows` now (no await between parsing a request and queueing it); the future of their
        (scores, errors)."""
        fut = asyncio.get_running_loop().create_future()
        self.queue.put_nowait(Job(rows, fut))
        return fut

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            jobs = [await self.queue.get()]
            n, deadline = len(jobs[0].rows), loop.time() + self.max_wait_s
            while n < self.max_batch:
                try:
                    job = self.queue.get_nowait() if loop.time() >= deadline else \
                        await asyncio.wait_for(self.queue.get(), deadline - loop.time())
                except (asyncio.QueueEmpty, asyncio.TimeoutError):
                    break
                jobs.append(job)
                n += len(job.rows)
            rows = [r for j in jobs for r in j.rows]
            try:
                scores, errors = await loop.run_in_executor(self.pool, self.score_all, rows)
            except Exception as e:  # noqa: BLE001 - every request of the batch gets the one-line error
                logger.exception("scoring a batch of %d rows failed", len(rows))
                for j in jobs:
                    if not j.future.done():
                        j.future.set_exception(e)
                continue
            start = 0
            for j in jobs:
                k = len(j.rows)
                if not j.future.done():
                    j.future.set_result((scores[start:start + k],
                                         {i - start: why for i, why in errors.items() if start <= i < start + k}))
                start += k

    def score_all(self, rows: list[dict]) -> tuple[list[float | None], dict[int, str]]:
        """`rows` in forwards of at most max_batch rows (each counted as a batch)."""
        scores: list[float | None] = []
        errors: dict[int, str] = {}
        for s in range(0, len(rows), self.max_batch):
            part = rows[s:s + self.max_batch]
            out, errs = self.scorer.score(part)
            scores += out
            errors.update({s + i: why for i, why in errs.items()})
            self.meter.batches.append(len(part))
            self.meter.n_batches += 1
            self.meter.rows_scored += len(part)
        return scores, errors


# ----------------------------------------------------------------------------- the app


@dataclass
class Limits:
    max_batch: int = 64
    max_wait_ms: float = 5.0
    max_rows: int = 4096
    max_body_mb: float = 16.0


class BadRequest(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def parse_rows(body: bytes, limits: Limits, check_row: Callable[[dict], str | None]) -> tuple[str | None, list[dict]]:
    """The request's (request_id, rows), or BadRequest saying what is wrong and where."""
    try:
        req = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise BadRequest(400, f"the body is not JSON ({e})") from None
    if not isinstance(req, dict) or not isinstance(req.get("rows"), list):
        raise BadRequest(400, 'the body must be a JSON object {"rows": [{"prompt": ..., "response": ...}, ...]}')
    rows, rid = req["rows"], req.get("request_id")
    if rid is not None and (not isinstance(rid, str) or len(rid) > 128):
        raise BadRequest(400, "request_id must be a string of at most 128 characters")
    if len(rows) > limits.max_rows:
        raise BadRequest(413, f"the request has {len(rows)} rows; this server takes at most {limits.max_rows} per "
                              f"request (server.max_rows): send them in several requests")
    if not rows:
        raise BadRequest(400, "rows is empty: send at least one {prompt, response}")
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise BadRequest(400, f"rows[{i}] must be an object with prompt and response, got {type(row).__name__}")
        for key in ("prompt", "response"):
            if not isinstance(row.get(key), str):
                raise BadRequest(400, f"rows[{i}].{key} must be a string, got {row.get(key)!r:.60}")
            if len(row[key]) > MAX_TEXT:
                raise BadRequest(413, f"rows[{i}].{key} has {len(row[key])} characters, more than {MAX_TEXT}")
        fields = row.get("fields")
        if fields is not None and not (isinstance(fields, dict) and all(
                v is None or isinstance(v, (str, int, float, bool)) for v in fields.values())):
            raise BadRequest(400, f"rows[{i}].fields must be an object of scalar values (answer, task, ...)")
        why = check_row(row)
        if why:
            raise BadRequest(400, f"rows[{i}]: {why}")
    return rid, rows


def make_app(scorer: Any, limits: Limits, *, api_key: str | None, describe: dict[str, Any],
             log_every_s: float = 30.0) -> FastAPI:
    """The reward server: POST /score, GET /health, GET /metrics (module docstring). `describe`: what
    /health says besides its status (source, tokenizer fingerprint, ...)."""
    meter = Meter()
    batcher = Batcher(scorer, limits.max_batch, limits.max_wait_ms / 1e3, meter)
    seen: OrderedDict[str, asyncio.Future] = OrderedDict()  # request_id -> its answer (idempotent retries)

    async def logs() -> None:
        last = -1
        while True:
            await asyncio.sleep(log_every_s)
            if meter.rows_requested != last:
                last = meter.rows_requested
                logger.info("serve: %s", meter.line())

    async def lifespan(app: FastAPI):
        batcher.start()
        ticker = asyncio.get_running_loop().create_task(logs())
        yield
        ticker.cancel()
        batcher.task.cancel()
        batcher.pool.shutdown(wait=False)

    app = FastAPI(title="rlhf reward server", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.meter = meter

    def refuse(status: int, message: str) -> JSONResponse:
        meter.count(str(status))
        return JSONResponse({"error": message}, status_code=status)

    def authorised(request: Request) -> bool:
        if api_key is None:
            return True
        got = request.headers.get("authorization", "")
        return hmac.compare_digest(got.encode(), f"Bearer {api_key}".encode())

    KEY = "missing or wrong API key: send the server's key as the header 'Authorization: Bearer <key>'"

    @app.exception_handler(Exception)
    async def unexpected(request: Request, e: Exception) -> JSONResponse:  # one line, never a traceback
        logger.exception("unexpected error on %s", request.url.path)
        return refuse(500, f"internal error: {type(e).__name__}: {' '.join(str(e).split())[:200]}")

    @app.get("/health")
    async def health(request: Request):
        if not authorised(request):
            return refuse(401, KEY)
        return {"status": "ok", **describe, "max_rows": limits.max_rows, "max_batch": limits.max_batch}

    @app.get("/metrics")
    async def metrics(request: Request):
        if not authorised(request):
            return refuse(401, KEY)
        return meter.snapshot()

    @app.post("/score")
    async def score(request: Request):
        t0 = time.perf_counter()
        if not authorised(request):
            return refuse(401, KEY)
        size, cap = request.headers.get("content-length"), int(limits.max_body_mb * 2**20)
        if size is None or not size.isdigit():
            return refuse(411, "send the body with a Content-Length header")
        if int(size) > cap:
            return refuse(413, f"the body has {int(size)} bytes; this server takes at most {cap} "
                               f"(server.max_body_mb={limits.max_body_mb:g}): send the rows in several requests")
        body = await request.body()
        try:
            rid, rows = parse_rows(body, limits, scorer.check_row)
        except BadRequest as e:
            return refuse(e.status, str(e))
        meter.rows_requested += len(rows)
        if rid is not None and rid in seen:  # a retry: the first answer (or the one being computed)
            meter.duplicate_requests += 1
            fut = seen[rid]
        else:
            fut = batcher.submit(rows)
            if rid is not None:
                seen[rid] = fut
                while len(seen) > 4096:
                    seen.popitem(last=False)
        try:
            scores, errors = await asyncio.shield(fut)
        except Exception as e:  # noqa: BLE001 - the scorer failed on this batch: one line, logged above
            if rid is not None:
                seen.pop(rid, None)  # a retry may be scored afresh
            return refuse(500, f"scoring failed: {type(e).__name__}: {' '.join(str(e).split())[:200]}")
        meter.count("200")
        meter.latencies.append(time.perf_counter() - t0)
        return {"request_id": rid, "scores": scores, "errors": {str(k): v for k, v in errors.items()}}

    return app
