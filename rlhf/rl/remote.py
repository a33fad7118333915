"""The client side of rewards over HTTP: requests to a `python -m rlhf.serve` server (rlhf/rl/service.py),
sent concurrently, retried, counted.

    client = RewardClient("http://127.0.0.1:8000", timeout_s=30, max_concurrency=4, retries=3)
    pending = client.submit(rows)          # rows: [{"prompt", "response", "ids"?, "fields"?}]; returns at once
    scores = pending.result()              # one float per row, NaN where the row could not be scored

The wire format (one JSON object each way):

    POST /score   {"request_id": "<hex>", "rows": [{"prompt": str, "response": str,
                                                   "ids": [int, ...]?,       # prompt + response tokens, as scored
                                                   "fields": {...}?}]}       # the prompt row's answer, task, ...
         200      {"request_id": ..., "scores": [float | null, ...], "errors": {index: message}}
         4xx      {"error": message}   (400 malformed, 401 wrong or missing key, 413 too big)
    GET /health   {"status": "ok", "source": ..., "tokenizer": fingerprint | null, "max_rows": n, ...}
    GET /metrics  request counts, p50/p99 latency, batch sizes, rows scored, memory

What the client does with what comes back, per request of at most `request_rows` rows:
  - a timeout, a refused or reset connection, a 5xx or 429, or a 200 whose body is not the scores of
    its rows (not JSON, wrong length, a score that is not a number) is retried up to `retries` times,
    waiting backoff_s x 2^attempt x a jitter in [0.5, 1.5) between tries, under the same request_id:
    the server answers a request_id it has seen (or is scoring) with those same scores, so a retry
    never scores a row twice;
  - after the last retry its rows are NaN, counted (`errors`), the first cause kept (`first_error`);
  - a null or non-finite score in a good answer is NaN for that row alone (counted);
  - 401/403 raise `RewardServiceError` at once: a wrong key is a configuration error, not a flaky row;
    so do the answers no retry can change: another 4xx but 400 (a bad row), 408 and 429 (a 404: the URL is
    not a reward server's) and a failed TLS handshake (an https:// URL for a plain-HTTP server);
  - connections refused since `down_since` for longer than `down_timeout_s` raise `RewardServerDown`
    (naming the URL) at the end of the call that notices: the RL stage checkpoints and stops.
`check_server()` asks GET /health once before a run loads any model: nothing listening, a TLS error, an
answer that is not a reward server's, or a server taking fewer rows per request than `request_rows`
raise `RewardServiceError` naming reward.url (a run never starts against a reward that cannot arrive).
Figures (`stats()`): requests, rows, retries, timeouts, failed rows, and latency p50/p99 of the
successful requests, since the last `stats(reset=True)`.
"""
from __future__ import annotations

import logging
import math
import random
import ssl
import threading
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import httpx

from rlhf.core.errors import ConfigError, TrainingError

logger = logging.getLogger("rlhf.remote")

API_KEY_ENV = "RLHF_REWARD_API_KEY"  # both sides read the key from here when the config does not name one


class RewardServiceError(ConfigError):
    """The server refused this client (a wrong or missing API key): not retried."""


class RewardServerDown(TrainingError):
    """The reward server was unreachable for longer than reward.down_timeout_s."""


# Statuses a retry cannot change, beyond the key's 401/403: the rows of a 400 alone fail (counted), a 408 or
# 429 is retried; any other 4xx (404: not a reward server's URL, 405, 413: rows over server.max_rows ...) stops.
RETRIED_4XX = (408, 429)


def tls_error(e: BaseException) -> bool:
    """Whether an httpx error was a failed TLS handshake (e.g. https:// to a plain-HTTP server)."""
    seen = 0
    while e is not None and seen < 8:
        if isinstance(e, ssl.SSLError):
            return True
        e, seen = e.__cause__ or e.__context__, seen + 1
    return False


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) by the nearest-rank rule; NaN for no values."""
    if not values:
        return math.nan
    s = sorted(values)
    return s[max(0, min(len(s) - 1, math.ceil(q / 100 * len(s)) - 1))]


class Pending:
    """The scores of one `submit`: `result()` waits for every request of it."""

    def __init__(self, parts: list[tuple[int, Future]], n: int):
        self.parts, self.n = parts, n

    def result(self) -> list[float]:
        out = [math.nan] * self.n
        for start, fut in self.parts:
            scores = fut.result()
            out[start:start + len(scores)] = scores
        return out


class RewardClient:
    """Concurrent, retried POST /score requests to one reward server (see the module docstring)."""

    def __init__(self, url: str, *, api_key: str | None = None, timeout_s: float = 30.0, max_concurrency: int = 4,
                 retries: int = 3, backoff_s: float = 0.5, request_rows: int = 64, down_timeout_s: float = 120.0,
                 seed: int | None = None):
        self.url = url.rstrip("/")
        self.timeout_s, self.retries, self.backoff_s = timeout_s, retries, backoff_s
        self.request_rows, self.down_timeout_s = request_rows, down_timeout_s
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(timeout=httpx.Timeout(timeout_s), headers=headers,
                                 limits=httpx.Limits(max_connections=max_concurrency,
                                                     max_keepalive_connections=max_concurrency))
        self.pool = ThreadPoolExecutor(max_concurrency, thread_name_prefix="reward-http")
        self.rng = random.Random(seed)  # the backoff's jitter
        self.lock = threading.Lock()
        self.down_since: float | None = None  # the first refused connection since the last answer
        self.refused: BaseException | None = None  # a 401/403, raised by the next `check`
        self.stats(reset=True)

    # ------------------------------------------------------------------ figures

    def stats(self, reset: bool = False) -> dict[str, float]:
        """Counts since the last reset: requests (answered), rows (sent), retries, timeouts, failed_rows
        (NaN after the retries or a bad score), latency p50/p99 (ms, answered requests)."""
        with self.lock:
            lat = getattr(self, "latencies", [])
            out = {"requests": getattr(self, "requests", 0), "rows": getattr(self, "rows", 0),
                   "retries": getattr(self, "retries_done", 0), "timeouts": getattr(self, "timeouts", 0),
                   "failed_rows": getattr(self, "failed_rows", 0),
                   "p50_ms": percentile(lat, 50) * 1e3, "p99_ms": percentile(lat, 99) * 1e3}
            if reset:
                self.requests = self.rows = self.retries_done = self.timeouts = self.failed_rows = 0
                self.latencies: list[float] = []
                self.first_error: str | None = None
        return out

    def _count(self, **kw) -> None:
        with self.lock:
            for k, v in kw.items():
                setattr(self, k, getattr(self, k) + v)

    def _error(self, rows: int, why: str) -> None:
        with self.lock:
            self.failed_rows += rows
            if self.first_error is None:
                self.first_error = why

    # ------------------------------------------------------------------ requests

    def health(self) -> dict:
        """GET /health (no retries): the server's description; raises httpx errors or RewardServiceError."""
        r = self.http.get(f"{self.url}/health")
        if r.status_code in (401, 403):
            raise RewardServiceError(self._refusal(r))
        r.raise_for_status()
        return r.json()

    def check_server(self) -> dict:
        """GET /health before a run: the server's description, or RewardServiceError naming reward.url when
        nothing answers there, it answers other than a reward server, or takes fewer rows than request_rows."""
        where = f"reward.url={self.url}"
        try:
            r = self.http.get(f"{self.url}/health")
        except httpx.TimeoutException:
            raise RewardServiceError(f"{where}: GET /health got no answer within reward.timeout_s={self.timeout_s:g} "
                                     "s; is the server up (python -m rlhf.serve ...)?") from None
        except httpx.TransportError as e:
            raise RewardServiceError(self._transport(e)) from None
        if r.status_code in (401, 403):
            raise RewardServiceError(self._refusal(r))
        try:
            body = r.json() if r.status_code == 200 else None
        except ValueError:
            body = None
        if not isinstance(body, dict) or body.get("status") != "ok":
            got = f"HTTP {r.status_code}" + (f": {_message(r)[:80]}" if r.text.strip() else "")
            raise RewardServiceError(f"{where} is not a reward server: GET /health answered {got}, not a reward "
                                     "server's {\"status\": \"ok\", ...} (python -m rlhf.serve); check the URL")
        most = body.get("max_rows")
        if isinstance(most, int) and most < self.request_rows:
            raise RewardServiceError(f"reward.request_rows={self.request_rows} is more than the server at {self.url} "
                                     f"takes per request (server.max_rows={most}): lower reward.request_rows")
        return body

    def _transport(self, e: httpx.TransportError) -> str:
        """The one line for a connection that failed before any answer: a TLS mismatch, or nothing there."""
        if tls_error(e):
            return (f"reward.url={self.url}: the TLS handshake failed ({' '.join(str(e).split())}): an https:// URL "
                    "for a server that speaks plain HTTP? (python -m rlhf.serve serves http://)")
        return (f"reward.url={self.url}: nothing answers there ({type(e).__name__}: {e}); start the server first "
                "(python -m rlhf.serve ...) or fix reward.url")

    def submit(self, rows: Sequence[dict]) -> Pending:
        """Send `rows` as requests of at most request_rows rows, concurrently; returns at once."""
        parts = []
        for start in range(0, len(rows), self.request_rows):
            chunk = list(rows[start:start + self.request_rows])
            parts.append((start, self.pool.submit(self._post, chunk, uuid.uuid4().hex)))
        return Pending(parts, len(rows))

    def score(self, rows: Sequence[dict]) -> list[float]:
        scores = self.submit(rows).result()
        self.check()
        return scores

    def check(self) -> None:
        """Raise what the last requests found fatal: a refused key, an answer no retry changes, or a server
        down for too long."""
        if self.refused is not None:
            raise self.refused
        down = self.down_since
        if down is not None and time.monotonic() - down > self.down_timeout_s:
            raise RewardServerDown(
                f"the reward server at {self.url} (reward.url) has refused connections for "
                f"{time.monotonic() - down:.1f} s, longer than reward.down_timeout_s={self.down_timeout_s:g}: start it "
                f"again (python -m rlhf.serve ...) and resume the run (train.resume=true)")

    def _refusal(self, r: httpx.Response) -> str:
        return (f"the reward server at {self.url} (reward.url) refused the API key (HTTP {r.status_code}: "
                f"{_message(r)}); set the server's key in the environment variable {API_KEY_ENV}")

    def _post(self, rows: list[dict], request_id: str) -> list[float]:
        """One request with its retries: the rows' scores, NaN for those that could not be had."""
        n, why = len(rows), "no attempt"
        self._count(rows=n)
        for attempt in range(self.retries + 1):
            if attempt:
                self._count(retries_done=1)
                wait = self.backoff_s * 2 ** (attempt - 1) * (0.5 + self.rng.random())
                time.sleep(wait)
            if self.refused is not None:
                break
            t0 = time.perf_counter()
            try:
                r = self.http.post(f"{self.url}/score", json={"request_id": request_id, "rows": rows})
            except httpx.TimeoutException as e:
                self._count(timeouts=1)
                why = f"timed out after reward.timeout_s={self.timeout_s:g} s ({type(e).__name__})"
                continue
            except httpx.TransportError as e:  # refused, reset, unreachable
                if tls_error(e):  # the same handshake fails every time: the URL's scheme is wrong
                    self.refused = RewardServiceError(self._transport(e))
                    why = "TLS handshake failed"
                    break
                with self.lock:
                    self.down_since = self.down_since or time.monotonic()
                why = f"{type(e).__name__}: {e}"
                if self.down_since and time.monotonic() - self.down_since > self.down_timeout_s:
                    break  # the run stops at `check`: no point in more tries
                continue
            with self.lock:
                self.down_since = None  # it answered
            if r.status_code in (401, 403):
                self.refused = RewardServiceError(self._refusal(r))
                why = f"HTTP {r.status_code}"
                break
            if r.status_code in RETRIED_4XX or r.status_code >= 500:
                why = f"HTTP {r.status_code}: {_message(r)}"
                continue
            if r.status_code != 400 and r.status_code != 200:  # no request to this URL will get better
                why = f"HTTP {r.status_code}: {_message(r)}"
                self.refused = RewardServiceError(
                    f"reward.url={self.url}: POST /score answered {why[:160]}; every request would (not a reward "
                    "server's URL, or rows beyond its server.max_rows): check reward.url and reward.request_rows")
                break
            if r.status_code != 200:  # a 400: these rows will not get better
                why = f"HTTP {r.status_code}: {_message(r)}"
                break
            scores, bad = _scores(r, n)
            if scores is None:
                why = bad
                continue
            with self.lock:
                self.requests += 1
                self.latencies.append(time.perf_counter() - t0)
            for i, s in enumerate(scores):
                if math.isnan(s):
                    self._error(1, f"the server gave no score for a row ({bad.get(i, 'null or not finite')}): "
                                   f"{rows[i]['prompt']!r} -> {rows[i]['response']!r}")
            return scores
        self._error(n, f"{n} row(s) unscored after {self.retries} retries: {why}")
        return [math.nan] * n

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        self.http.close()


def _message(r: httpx.Response) -> str:
    try:
        body = r.json()
        msg = body.get("error") or body.get("detail") if isinstance(body, dict) else None
    except ValueError:
        msg = None
    return " ".join(str(msg or r.text[:200]).split())


def _scores(r: httpx.Response, n: int) -> tuple[list[float] | None, object]:
    """The n scores of a 200 answer (NaN for a null / non-finite one, with the server's reason by index),
    or (None, why) when the body is not the scores of this request."""
    try:
        body = r.json()
    except ValueError:
        return None, f"the answer is not JSON: {r.text[:80]!r}"
    scores = body.get("scores") if isinstance(body, dict) else None
    if not isinstance(scores, list):
        return None, f"the answer has no list of scores: {str(body)[:80]!r}"
    if len(scores) != n:
        return None, f"the answer has {len(scores)} scores for {n} rows"
    out = []
    for s in scores:
        if s is None:
            out.append(math.nan)
        elif isinstance(s, (int, float)) and not isinstance(s, bool):
            out.append(float(s) if math.isfinite(s) else math.nan)
        else:
            return None, f"a score is not a number: {s!r:.40}"
    errors = body.get("errors") or {}
    return out, {int(k): str(v) for k, v in errors.items()} if isinstance(errors, dict) else {}
