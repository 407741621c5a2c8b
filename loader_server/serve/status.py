"""What `packfeed serve` shows on its metrics port (`--metrics-port`), beside Prometheus's `/metrics`:

- `/status`: a page for people, refreshing itself every 2 s: each job with its plan and balance, each rank's
  position (acknowledged and streamed step), lag, steps queued and the data wait its trainer reports, the
  job's throughput, samples skipped with their reasons, and the server's memory budget held.
- `/status.json`: the same as JSON, for scripts.

Reads only. With an auth token set, `/status.json` needs it, as gRPC calls do: `Authorization: Bearer <token>`,
never in the address (proxies and servers keep addresses in their access logs: a `?token=` is refused). The page
itself holds no figures and opens without it; it asks for the token, or takes it from the address's fragment
(`/status#token=<token>`, which a browser never sends), keeps it in the tab's session storage, drops it from the
address and sends it as the header. `/metrics` stays open for Prometheus. The HTTP server runs in a thread of its own and
reads the service's state as it stands (plain values, copied); it never blocks the event loop.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qs, urlsplit

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from packfeed.server.plan.windows import WindowedPlan
from packfeed.server.serve.observe import log

REFRESH_S = 2.0


class StatusReport:
    """Snapshots of a service for the status page; throughput is measured between two snapshots."""

    def __init__(self, service):
        self.service = service
        self.started = time.time()
        self._balance: dict[str, dict[str, Any]] = {}
        self._last: dict[str, tuple[float, float, float]] = {}  # job -> (time, packs, samples)
        self._lock = threading.Lock()

    def snapshot(self) -> dict[str, Any]:
        service = self.service
        budget = service.budget
        held = list(service.registry.jobs.values())
        with self._lock:  # jobs closed or evicted since: forget their figures
            names = {job.spec.job for job in held}
            self._balance = {name: value for name, value in self._balance.items() if name in names}
            self._last = {name: value for name, value in self._last.items() if name in names}
        jobs = [self._job(job) for job in held if job.ready.is_set()]
        return {"server": service.server_id, "uptime_s": round(time.time() - self.started, 1),
                "memory": {"held_bytes": budget.held, "budget_bytes": budget.limit},
                "refresh_s": REFRESH_S, "jobs": jobs}

    def _job(self, job) -> dict[str, Any]:
        name = job.spec.job
        packs, samples = self._counter("packfeed_packs_total", name), self._counter("packfeed_samples_total", name)
        now = time.monotonic()
        with self._lock:
            then = self._last.get(name)
            self._last[name] = (now, packs, samples)
        rates = {"packs_per_s": 0.0, "samples_per_s": 0.0}
        if then and now > then[0]:
            rates = {"packs_per_s": round((packs - then[1]) / (now - then[0]), 2),
                     "samples_per_s": round((samples - then[2]) / (now - then[0]), 2)}
        plan = job.spec.plan_config
        reasons: dict[str, int] = {}
        for _, reason, _, _ in list(job.skipped):
            reasons[reason] = reasons.get(reason, 0) + 1
        return {
            "job": name, "dataset": job.spec.dataset, "failed": str(job.failure) if job.failure else None,
            "plan": {"dp": plan.dp, "microbatches": plan.microbatches, "strategy": plan.strategy.value,
                     "epochs": job.spec.epochs, "window": plan.window},
            "balance": self._plan_balance(job),
            "ranks": _progress_rows(job.ranks),
            "encoder_ranks": _progress_rows(job.encoders),
            "throughput": {**rates, "packs": packs, "samples": samples},
            "samples_by_dataset": dict(job.delivered),
            "skipped": {"count": job.skipped_count, "recent_by_reason": reasons},
        }

    def _counter(self, metric: str, job: str) -> float:
        return self.service.metrics.registry.get_sample_value(metric, {"job": job}) or 0.0

    def _plan_balance(self, job) -> dict[str, Any]:
        """Epoch 0's ViT and LLM Dist over its packs, computed once per job (a windowed plan's: not known until
        its epoch is planned whole)."""
        name = job.spec.job
        if name not in self._balance:
            plan = job.epoch_plan(0) if job.failure is None else None
            if plan is None or isinstance(plan, WindowedPlan):
                return {"known": False}
            vit_dist, llm_dist = plan.dists(job.dataset.planned_loads(plan))
            self._balance[name] = {"known": True, "steps": plan.n_steps, "vit_dist": round(vit_dist, 6),
                                   "llm_dist": round(llm_dist, 6)}
        return self._balance[name]


def _progress_rows(states: list) -> list[dict[str, Any]]:
    """Each rank's (or encoder rank's) position, lag and reported data wait."""
    return [{"rank": r, "acked": list(state.acked), "streamed": list(state.streamed), "queued_steps": state.queued,
             "lag_steps": state.lag, "data_wait_s": round(state.data_wait_s, 3)} for r, state in enumerate(list(states))]


def start_status_server(host: str, port: int, registry, report: StatusReport,
                        authorized: Callable[[str], bool] | None = None) -> ThreadingHTTPServer:
    """Serve /metrics, /status and /status.json on (host, port) in a daemon thread; `authorized(header)` checks
    an `Authorization` value for the status (None: open). Raises OSError when the port is taken."""

    class Handler(BaseHTTPRequestHandler):
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

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="packfeed-status", daemon=True).start()
    return server


PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>Packfeed status</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
body { font: 14px system-ui, sans-serif; margin: 1.5em; color: #222; }
h1 { font-size: 1.3em; } h2 { font-size: 1.1em; margin-top: 1.5em; }
table { border-collapse: collapse; margin: .5em 0; } td, th { padding: .2em .8em; border-bottom: 1px solid #ddd; text-align: right; }
th { background: #f4f4f4; } td:first-child, th:first-child { text-align: left; }
.muted { color: #777; } .bad { color: #b00; }
</style></head>
<body>
<h1>Packfeed <span id="server" class="muted"></span></h1>
<p id="summary" class="muted">loading...</p>
<form id="login" hidden><label>This server needs its token: <input id="token" type="password" autocomplete="off"></label>
<button>show the status</button></form>
<div id="jobs"></div>
<noscript><meta http-equiv="refresh" content="5">This page needs JavaScript to show the status; /status.json has it.</noscript>
<script>
const KEY = "packfeed-status-token";
const given = new URLSearchParams(location.hash.slice(1)).get("token");
if (given) {  // from the fragment (never sent to the server) into this tab's storage, and out of the address
  sessionStorage.setItem(KEY, given);
  history.replaceState(null, "", location.pathname + location.search);
}
document.getElementById("login").addEventListener("submit", event => {
  event.preventDefault();
  sessionStorage.setItem(KEY, document.getElementById("token").value);
  document.getElementById("login").hidden = true;
  refresh();
});
const esc = s => String(s).replace(/[&<>"']/g, c => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"}[c]));
const mib = b => (b / 1048576).toFixed(1) + " MiB";
function table(head, rows) {
  return "<table><tr>" + head.map(h => "<th>" + esc(h) + "</th>").join("") + "</tr>" +
    rows.map(r => "<tr>" + r.map(c => "<td>" + esc(c) + "</td>").join("") + "</tr>").join("") + "</table>";
}
function render(s) {
  document.getElementById("server").textContent = s.server;
  document.getElementById("summary").textContent = s.jobs.length + " job(s); memory held " +
    mib(s.memory.held_bytes) + " of " + mib(s.memory.budget_bytes) + "; up " + Math.round(s.uptime_s) + " s; " +
    "updated " + new Date().toLocaleTimeString();
  document.getElementById("jobs").innerHTML = s.jobs.map(j => {
    const b = j.balance.known ? "ViT Dist " + j.balance.vit_dist +
      ", LLM Dist " + j.balance.llm_dist + ", " + j.balance.steps + " steps per epoch" : "balance known once planned";
    const skipped = Object.entries(j.skipped.recent_by_reason).map(([r, n]) => [r, n]);
    return '<section class="job" data-job="' + esc(j.job) + '"><h2>' + esc(j.job) + ' <span class="muted">' +
      esc(j.dataset) + "</span></h2>" + (j.failed ? '<p class="bad">' + esc(j.failed) + "</p>" : "") +
      "<p>" + esc(j.plan.strategy) + ", DP " + j.plan.dp + " x M " + j.plan.microbatches + ", " + j.plan.epochs +
      " epoch(s); " + esc(b) + "</p>" +
      '<p class="throughput">' + j.throughput.packs_per_s + " packs/s, " + j.throughput.samples_per_s +
      " samples/s; " + j.throughput.packs + " packs, " + j.throughput.samples + " samples sent</p>" +
      table(["rank", "acknowledged", "streamed", "queued steps", "lag (steps)", "trainer data wait s"],
            j.ranks.map(r => [r.rank, r.acked.join(":"), r.streamed.join(":"), r.queued_steps, r.lag_steps, r.data_wait_s])) +
      (j.encoder_ranks.length ? table(["encoder rank", "acknowledged", "streamed", "queued steps", "lag (steps)",
            "trainer data wait s"], j.encoder_ranks.map(r => [r.rank, r.acked.join(":"), r.streamed.join(":"),
            r.queued_steps, r.lag_steps, r.data_wait_s])) : "") +
      "<p>" + j.skipped.count + " sample(s) skipped</p>" + (skipped.length ? table(["reason", "recent"], skipped) : "") +
      "</section>";
  }).join("");
}
async function refresh() {
  try {
    const token = sessionStorage.getItem(KEY);
    const response = await fetch("status.json", {cache: "no-store",
                                                 headers: token ? {Authorization: "Bearer " + token} : {}});
    if (response.status === 401) {
      document.getElementById("summary").textContent = token ? "that token was refused" : "";
      document.getElementById("login").hidden = false;
      return;  // until a token is typed in
    }
    if (!response.ok) throw new Error(response.status + " " + await response.text());
    const s = await response.json();
    render(s);
    setTimeout(refresh, s.refresh_s * 1000);
  } catch (error) {
    document.getElementById("summary").textContent = "cannot read the status: " + error.message;
    setTimeout(refresh, 5000);
  }
}
refresh();
</script>
</body></html>
"""
