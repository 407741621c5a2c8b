"""What `packfeed serve` shows on its metrics port (`--metrics-port`), beside Prometheus's `/metrics`:

- `/status`: an operator's page (`status_page`), refreshing itself every 2 s: each job's state (live: a rank
  streams, or a trainer still works through steps it was sent; idle; finished: every rank acknowledged the
  job's last step; failed; closed ones listed below), step k of N (each epoch's own count, summed; marked when
  a windowed job's count is an estimate) with a bar per rank, each rank's acknowledged and streamed step, the current run's lag and queue and the
  data wait its trainer reports, throughput and data wait over the last ten minutes as small charts, the plan's
  balance, samples skipped by reason, and the server's memory budget held.
- `/status.json`: the same as JSON, for scripts ("-" on the page is null here).

Reads only. With an auth token set, `/status.json` needs it, as gRPC calls do: `Authorization: Bearer <token>`,
never in the address (proxies and servers keep addresses in their access logs: a `?token=` is refused). The page
itself holds no figures and opens without it; it asks for the token, or takes it from the address's fragment
(`/status#token=<token>`, which a browser never sends), keeps it in the tab's session storage, drops it from the
address and sends it as the header. `/metrics` stays open for Prometheus. The HTTP server and the history's
sampler run in threads of their own and read the service's state as it stands (plain values, copied); they never
block the event loop.
"""

from __future__ import annotations

import collections
import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qs, urlsplit

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from packfeed.server.serve.mixture_weights import mixture_status
from packfeed.server.serve.observe import log
from packfeed.server.serve.status_page import PAGE

REFRESH_S = 2.0
HISTORY_S = 600.0  # the charts show the last ten minutes, a point every REFRESH_S
READ_TIMEOUT_S = 10.0  # a connection that sends no complete request within this is closed
MAX_CONNECTIONS = 32  # connections served at once (a thread each); more are closed at once, and counted
MAX_PER_CLIENT = 8  # of them from one client address: one client holding connections open never blocks the others


def _position(step: tuple[int, int]) -> list[int] | None:
    return list(step) if step >= (0, 0) else None  # None: nothing yet (the page shows "-")


class StatusReport:
    """Snapshots of a service for the status page. `sample()` (every REFRESH_S, from the status server's thread)
    records each job's totals; throughput and data wait are measured between those points, the first from the
    job's open (so a job that sends everything within one interval still shows its throughput)."""

    def __init__(self, service):
        self.service = service
        self.started = time.time()
        self._balance: dict[str, dict[str, Any]] = {}
        # job -> (the Job it counts, its points: (time, samples, packs, data wait of all ranks) since it opened)
        self._history: dict[str, tuple[Any, collections.deque]] = {}
        self._lock = threading.Lock()

    def sample(self) -> None:
        now = time.monotonic()
        held = [job for job in list(self.service.registry.jobs.values()) if job.ready.is_set()]
        with self._lock:  # jobs closed or evicted since: forget their figures
            names = {job.spec.job for job in held}
            self._balance = {name: value for name, value in self._balance.items() if name in names}
            self._history = {name: value for name, value in self._history.items() if name in names}
            for job in held:
                counted, points = self._history.get(job.spec.job, (None, None))
                if counted is not job:  # a job new here, or an id opened again: its counts start at its open
                    points = collections.deque([(job.opened, 0, 0, 0.0)], maxlen=int(HISTORY_S / REFRESH_S) + 1)
                    self._history[job.spec.job] = (job, points)
                points.append((now, sum(job.delivered.values()), job.packs_sent,
                               sum(rank.data_wait_s for rank in list(job.ranks))))

    def snapshot(self) -> dict[str, Any]:
        service = self.service
        budget = service.budget
        held = [job for job in list(service.registry.jobs.values()) if job.ready.is_set()]
        closed = [{**entry, "state": "closed", "closed_s_ago": round(time.time() - entry["closed_at"], 1)}
                  for entry in list(service.registry.closed)]
        return {"server": service.server_id, "uptime_s": round(time.time() - self.started, 1),
                "memory": {"held_bytes": budget.held, "budget_bytes": budget.limit},
                "loader": service.loader_use.snapshot(),
                "refresh_s": REFRESH_S, "history_s": HISTORY_S, "jobs": [self._job(job) for job in held],
                "closed_jobs": closed}

    def _job(self, job) -> dict[str, Any]:
        name = job.spec.job
        plan = job.spec.plan_config
        counts, estimated = job.step_counts() if job.failure is None else ([0] * job.spec.epochs, False)
        steps = sum(counts)
        ranks = _progress_rows(job.ranks, counts)
        done = min((rank["done_steps"] for rank in ranks), default=0)
        now = time.monotonic()
        working = job.open_streams or any(rank.working(now) for rank in list(job.ranks))  # trainers on steps sent
        state = "failed" if job.failure else "finished" if steps and not estimated and done >= steps else \
            "live" if working else "idle"
        reasons: dict[str, int] = {}
        for _, reason, _, _ in list(job.skipped):
            reasons[reason] = reasons.get(reason, 0) + 1
        history = self._rates(name, max(1, plan.dp))
        return {
            "job": name, "dataset": job.spec.dataset, "state": state,
            "failed": str(job.failure) if job.failure else None,
            "plan": {"dp": plan.dp, "microbatches": plan.microbatches, "strategy": plan.strategy.value,
                     "epochs": job.spec.epochs, "window": plan.window, "epoch_steps": counts, "steps": steps,
                     "steps_estimated": estimated},
            "done_steps": done,
            "balance": self._plan_balance(job),
            "ranks": ranks,
            "encoder_ranks": _progress_rows(job.encoders, counts),
            "throughput": {"packs_per_s": history[-1][3] if history else 0.0,
                           "samples_per_s": history[-1][1] if history else 0.0,
                           "packs": self._counter("packfeed_packs_total", name),
                           "samples": self._counter("packfeed_samples_total", name)},
            "history": [point[:3] for point in history],
            "samples_by_dataset": dict(job.delivered),
            "skipped": {"count": job.skipped_count, "recent_by_reason": reasons},
            "live": {**job.live.status(), "waiting_for": job.live.waiting_for(),
                     "producers_gone": job.live.producers_gone()} if job.live is not None else None,
            "mixture": mixture_status(job) if job.failure is None else None,
        }

    def _rates(self, name: str, ranks: int) -> list[list[float]]:
        """[seconds ago, samples/s, share of the time trainers waited for data, packs/s] between points."""
        with self._lock:
            points = list(self._history.get(name, (None, ()))[1])
        now = time.monotonic()
        rates = []
        for (t0, s0, p0, w0), (t1, s1, p1, w1) in zip(points, points[1:]):
            span = max(t1 - t0, 1e-6)
            rates.append([round(now - t1, 1), round((s1 - s0) / span, 2), round(min(1.0, (w1 - w0) / (span * ranks)), 4),
                          round((p1 - p0) / span, 2)])
        return rates

    def _counter(self, metric: str, job: str) -> float:
        return self.service.metrics.registry.get_sample_value(metric, {"job": job}) or 0.0

    def _plan_balance(self, job) -> dict[str, Any]:
        """Epoch 0's ViT and LLM Dist over its packs, computed once per job (a windowed plan's: not known until
        its epoch is planned whole)."""
        name = job.spec.job
        if name not in self._balance:
            plan = job.epoch_plan(0) if job.failure is None else None
            if plan is None or not plan.packs_known:
                return {"known": False}
            vit_dist, llm_dist = plan.dists(job.dataset.planned_loads(plan))
            self._balance[name] = {"known": True, "steps": plan.n_steps, "vit_dist": round(vit_dist, 6),
                                   "llm_dist": round(llm_dist, 6)}
        return self._balance[name]


def _progress_rows(states: list, epoch_steps: list[int]) -> list[dict[str, Any]]:
    """Each rank's (or encoder rank's) position (None before its first), steps done in the whole job (epochs
    plan different step counts: `epoch_steps`), the lag (steps sent, not acknowledged: the current run's, or
    after the job's last step was sent the trainer's work still to do) and queue, and the data wait its trainer
    reports."""
    rows = []
    for r, state in enumerate(list(states)):
        acked = _position(state.acked)
        done = sum(epoch_steps[:acked[0]]) + acked[1] + 1 if acked else 0
        rows.append({"rank": r, "acked": acked, "streamed": _position(state.streamed), "done_steps": done,
                     "queued_steps": state.queued, "lag_steps": state.lag, "data_wait_s": round(state.data_wait_s, 3)})
    return rows


def start_status_server(host: str, port: int, registry, report: StatusReport,
                        authorized: Callable[[str], bool] | None = None) -> ThreadingHTTPServer:
    """Serve /metrics, /status and /status.json on (host, port) in a daemon thread; `authorized(header)` checks
    an `Authorization` value for the status (None: open). Raises OSError when the port is taken."""

    class Handler(BaseHTTPRequestHandler):
        timeout = READ_TIMEOUT_S  # the socket's: a half-open or trickling connection does not hold its thread

        def do_GET(self):
            url = urlsplit(self.path)
            if url.path == "/metrics":
                return self._send(200, CONTENT_TYPE_LATEST, generate_latest(registry))
            if url.path not in ("/status", "/status.json"):
                return self._send(404, "text/plain", b"not found: /metrics, /status or /status.json\n")
            if "token" in parse_qs(url.query):
                return self._send(400, "text/plain", b"the token does not go in the address (access logs keep it): "
                                                     b"send Authorization: Bearer <token>; in a browser, open "
                                                     b"/status#token=<token> or type it into the page\n")
            if url.path == "/status.json" and authorized is not None and not authorized(
                    self.headers.get("Authorization", "")):
                return self._send(401, "text/plain", b"unauthenticated: give Authorization: Bearer <token>\n")
            if url.path == "/status.json":
                try:
                    body = json.dumps(report.snapshot(), default=str).encode()
                except Exception as error:  # a status bug must not look like a dead server
                    log.error("status page failed", exc_info=True)
                    return self._send(500, "text/plain", f"status unavailable: {error}\n".encode())
                return self._send(200, "application/json", body)
            return self._send(200, "text/html; charset=utf-8", PAGE.encode())

        def _send(self, code: int, kind: str, body: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:  # requests are not worth a log line each
            pass

    server = BoundedHTTPServer((host, port), Handler)
    threading.Thread(target=server.serve_forever, name="packfeed-status", daemon=True).start()
    threading.Thread(target=_sample_forever, args=(report,), name="packfeed-status-history", daemon=True).start()
    return server


class BoundedHTTPServer(ThreadingHTTPServer):
    """A thread per connection, at most MAX_CONNECTIONS at once and MAX_PER_CLIENT from one address: a connection
    beyond is closed unserved (a client retries; the page refreshes itself), so a client holding its connections
    half open costs the other scrapers nothing. A client that goes away mid-answer (a broken pipe, a reset, a
    timeout) is expected: counted, and logged once per kind as one line, never as a traceback per request."""

    daemon_threads = True
    request_queue_size = 128  # the listen backlog (socketserver's 5 drops connections in a burst: 1 s retries)

    def __init__(self, address, handler):
        super().__init__(address, handler)
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._lock = threading.Lock()
        self._per_client: collections.Counter = collections.Counter()  # address -> connections being served
        self.dropped: collections.Counter = collections.Counter()  # kind -> connections

    def process_request(self, request, client_address) -> None:
        host = client_address[0]
        with self._lock:
            crowded = self._per_client[host] >= MAX_PER_CLIENT
            if not crowded:
                self._per_client[host] += 1
        if crowded or not self._slots.acquire(blocking=False):
            if not crowded:
                self._leave(host)
            self._count("over the per-client connection limit" if crowded else "over the connection limit")
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            self._leave(host)
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()
            self._leave(client_address[0])

    def _leave(self, host: str) -> None:
        with self._lock:
            self._per_client[host] -= 1
            if not self._per_client[host]:
                del self._per_client[host]

    def handle_error(self, request, client_address) -> None:
        error = sys.exc_info()[1]
        if isinstance(error, (ConnectionError, TimeoutError)):
            self._count(type(error).__name__)
        else:
            log.error("status request failed", exc_info=True)

    def _count(self, kind: str) -> None:
        with self._lock:
            self.dropped[kind] += 1
            first = self.dropped[kind] == 1
        if first:
            log.warning("status connections dropped (logged once per kind)", extra={
                "kind": kind, "max_connections": MAX_CONNECTIONS, "max_per_client": MAX_PER_CLIENT,
                "read_timeout_s": READ_TIMEOUT_S})


def _sample_forever(report: StatusReport) -> None:
    while True:
        try:
            report.sample()
        except Exception:  # a status bug must not end the history: the next point tries again
            log.error("status history failed", exc_info=True)
        time.sleep(REFRESH_S)
