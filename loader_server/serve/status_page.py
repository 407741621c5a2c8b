"""The status page (`/status`): one self-contained HTML document, no external assets. It reads `/status.json`
every `refresh_s` with the token as a header (asked for, or taken from the address's fragment into the tab's
session storage) and draws each job: its state, step k of N with a bar per rank, the current run's lag, the
throughput and data wait of the last minutes as small inline SVG charts, the plan's balance, a live job's
arrivals, pending samples, steps formed, stale drops and spool size, a moving mixture's weights over the epoch,
and the samples skipped by reason; recently closed jobs below. "-" wherever there is nothing yet."""

PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>Packfeed status</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
body { font: 14px system-ui, sans-serif; margin: 1.5em; color: #222; max-width: 75em; }
h1 { font-size: 1.3em; } h2 { font-size: 1.1em; margin: 0 0 .4em; }
table { border-collapse: collapse; margin: .5em 0; } td, th { padding: .2em .8em; border-bottom: 1px solid #ddd; text-align: right; }
th { background: #f4f4f4; } td:first-child, th:first-child { text-align: left; }
.muted { color: #777; } .bad { color: #b00; }
section.job { border: 1px solid #ddd; border-radius: 6px; padding: .8em 1em; margin: 1em 0; }
.state { display: inline-block; padding: .05em .6em; border-radius: 1em; font-size: .8em; color: #fff; vertical-align: middle; }
.state-live { background: #2a7a3a; } .state-idle { background: #8a8a8a; } .state-finished { background: #2f5fb3; }
.state-closed { background: #555; } .state-failed { background: #b00; }
.bar { display: inline-block; width: 10em; height: .7em; background: #e6e6e6; border-radius: 3px; vertical-align: middle; }
.bar > span { display: block; height: 100%; background: #2f5fb3; border-radius: 3px; }
.charts { display: flex; gap: 2em; flex-wrap: wrap; margin: .5em 0; }
figure { margin: 0; } figcaption { font-size: .85em; color: #555; }
svg.chart { background: #fafafa; border: 1px solid #e3e3e3; }
svg.chart polyline { fill: none; stroke: #2f5fb3; stroke-width: 1.5; }
</style></head>
<body>
<h1>Packfeed <span id="server" class="muted"></span></h1>
<p id="summary" class="muted">loading...</p>
<form id="login" hidden><label>This server needs its token: <input id="token" type="password" autocomplete="off"></label>
<button>show the status</button></form>
<div id="jobs"></div>
<div id="closed"></div>
<noscript><meta http-equiv="refresh" content="5">This page needs JavaScript to show the status; /status.json has it.</noscript>
<script>
const KEY = "packfeed-status-token";
let timer = null;  // the one pending refresh: a new token replaces it rather than starting a second loop
function schedule(ms) { clearTimeout(timer); timer = setTimeout(refresh, ms); }
function takeToken() {  // from the fragment (never sent to the server) into this tab's storage, out of the address
  const given = new URLSearchParams(location.hash.slice(1)).get("token");
  if (!given) return false;
  sessionStorage.setItem(KEY, given);
  history.replaceState(null, "", location.pathname + location.search);
  return true;
}
takeToken();
window.addEventListener("hashchange", () => { if (takeToken()) { document.getElementById("login").hidden = true; schedule(0); } });
document.getElementById("login").addEventListener("submit", event => {
  event.preventDefault();
  sessionStorage.setItem(KEY, document.getElementById("token").value);
  document.getElementById("login").hidden = true;
  schedule(0);
});
const esc = s => String(s).replace(/[&<>"']/g, c => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"}[c]));
const dash = v => v === null || v === undefined ? "-" : v;
const mib = b => (b / 1048576).toFixed(1) + " MiB";
const num = (v, digits) => Number(v).toLocaleString(undefined, {maximumFractionDigits: digits});
const position = p => p ? "epoch " + p[0] + ", step " + p[1] : "-";
const of = (done, total, estimated) => (done ? num(done, 0) : "-") + " of " + (total ? (estimated ? "about " : "") +
  num(total, 0) : "-");
function table(head, rows, cls) {
  return '<table class="' + (cls || "") + '"><tr>' + head.map(h => "<th>" + esc(h) + "</th>").join("") + "</tr>" +
    rows.map(r => "<tr>" + r.map(c => "<td>" + c + "</td>").join("") + "</tr>").join("") + "</table>";
}
function bar(done, total) {
  const share = total ? Math.min(1, done / total) : 0;
  return '<span class="bar" title="' + esc(of(done, total)) + '"><span style="width:' + (100 * share).toFixed(1) +
    '%"></span></span>';
}
function chart(points, column, caption, format, window_s) {  // points: [seconds ago, samples/s, wait share]
  const w = 280, h = 64, values = points.map(p => p[column]);
  const top = Math.max(...values, 1e-9);
  const span = Math.min(window_s, Math.max(60, ...points.map(p => p[0] + 2)));  // a minute at least, ten at most
  const xy = points.map(p => ((1 - p[0] / span) * w).toFixed(1) + "," + (h - 4 - (p[column] / top) * (h - 10)).toFixed(1));
  const last = values.length ? format(values[values.length - 1]) : "-";
  const period = span < 120 ? Math.round(span) + " s" : Math.round(span / 60) + " min";
  return '<figure><svg class="chart" data-points="' + xy.length + '" width="' + w + '" height="' + h + '">' +
    (xy.length ? '<polyline points="' + xy.join(" ") + '"/>' : "") + "</svg><figcaption>" + esc(caption) +
    ", last " + period + ": now " + esc(last) + ", peak " + esc(values.length ? format(top) : "-") +
    "</figcaption></figure>";
}
const COLORS = ["#2f5fb3", "#d0661c", "#2a7a3a", "#8e44ad", "#b00", "#16a2a2", "#7a6a2a", "#555"];
function weightsChart(m) {  // a mixture whose weights move: each dataset's weight per window, over the epoch
  const w = 280, h = 64, names = Object.keys(m.windows[0].weights).sort();
  const x = p => (p * w).toFixed(1), y = v => (h - 4 - v * (h - 10)).toFixed(1);
  const lines = names.map((name, k) => '<polyline data-dataset="' + esc(name) + '" style="stroke:' +
    COLORS[k % COLORS.length] + '" points="' + m.windows.map(v => x(v.progress) + "," + y(v.weights[name])).join(" ") + '"/>');
  const now = m.windows.find(v => v.window === m.window) || m.windows[m.windows.length - 1];
  const marker = '<line x1="' + x(now.progress) + '" x2="' + x(now.progress) + '" y1="0" y2="' + h + '" stroke="#999"/>';
  const legend = names.map((name, k) => '<span style="color:' + COLORS[k % COLORS.length] + '">' + esc(name) + " " +
    num(now.weights[name], 3) + "</span>").join(", ");
  return '<figure class="weights"><svg class="chart" data-windows="' + m.windows.length + '" width="' + w +
    '" height="' + h + '">' + marker + lines.join("") + "</svg><figcaption>mixture weights over epoch " + m.epoch +
    " (" + m.windows.length + " window(s) planned); in force, window " + now.window + ": " + legend + "</figcaption></figure>";
}
function rankRows(ranks, total) {
  return ranks.map(r => [r.rank, bar(r.done_steps, total) + " " + esc(of(r.done_steps, total)), esc(position(r.acked)),
    esc(position(r.streamed)), r.lag_steps, r.queued_steps, num(r.data_wait_s, 1)]);
}
function job(j, window_s) {
  const p = j.plan, total = p.steps;
  const balance = j.balance.known ? "ViT Dist " + num(j.balance.vit_dist, 4) + ", LLM Dist " + num(j.balance.llm_dist, 4)
    : "balance: known once planned";
  const skipped = Object.entries(j.skipped.recent_by_reason).map(([r, n]) => [esc(r), n]);
  const head = ["rank", "progress", "acknowledged", "streamed", "lag (steps)", "queued", "data wait s"];
  return '<section class="job" data-job="' + esc(j.job) + '" data-state="' + esc(j.state) + '"><h2>' + esc(j.job) +
    ' <span class="state state-' + esc(j.state) + '">' + esc(j.state) + '</span> <span class="muted">' +
    esc(j.dataset) + "</span></h2>" + (j.failed ? '<p class="bad">' + esc(j.failed) + "</p>" : "") +
    '<p class="progress">step ' + esc(of(j.done_steps, total, p.steps_estimated)) + " " + bar(j.done_steps, total) +
    (total ? " (" + p.epochs + " epoch(s) of " + p.epoch_steps.map(n => num(n, 0)).join(", ") + " steps" +
      (p.steps_estimated ? ": an estimate until every window is planned" : "") + ")" : "") + "</p>" +
    (j.live ? '<p class="live">live: ' + num(j.live.arrived, 0) + " samples arrived, " + num(j.live.pending, 0) +
      " pending, " + num(j.live.steps_formed, 0) + " steps formed, " + num(j.live.dropped_stale, 0) +
      " dropped as stale, " + num(j.live.refused, 0) + " refused; spool " + mib(j.live.spool_bytes) +
      (j.live.ended ? "; ended" : "") + "</p>" +
      (j.live.policy_version !== undefined ? '<p class="live-async">policy version ' + num(j.live.policy_version, 0) +
        "; trained by age in versions " + (Object.entries(j.live.trained_age).map(([a, n]) => a + ": " + num(n, 0))
        .join(", ") || "none yet") + "; producers alive " + num(j.live.producers_alive, 0) + " of " +
        num(j.live.producers.length, 0) + ", " + num(j.live.reservations, 0) + " reservations, " +
        num(j.live.partials, 0) + " unfinished rollouts (" + num(j.live.partials_claimed, 0) + " claimed), " +
        num(j.live.groups_filtered, 0) + " groups filtered, " + num(j.live.groups_short, 0) + " taken short, " +
        num(j.live.trained_stale, 0) + " trained beyond max_staleness" +
        (j.live.waiting_for ? "; " + esc(j.live.waiting_for) : "") +
        (j.live.producers_gone ? '</p><p class="bad">' + esc(j.live.producers_gone) : "") + "</p>" : "") : "") +
    "<p>" + esc(p.strategy) + ", DP " + p.dp + " x M " + p.microbatches + "; " + esc(balance) + "</p>" +
    '<p class="throughput">' + num(j.throughput.samples_per_s, 1) + " samples/s, " + num(j.throughput.packs_per_s, 1) +
    " packs/s now; " + num(j.throughput.samples, 0) + " samples in " + num(j.throughput.packs, 0) + " packs sent</p>" +
    '<div class="charts">' + chart(j.history, 1, "samples/s", v => num(v, 1), window_s) +
    chart(j.history, 2, "time trainers waited for data", v => num(100 * v, 1) + "%", window_s) +
    (j.mixture && j.mixture.windows.length ? weightsChart(j.mixture) : "") + "</div>" +
    table(head, rankRows(j.ranks, total), "ranks") +
    (j.encoder_ranks.length ? table(["encoder rank"].concat(head.slice(1)), rankRows(j.encoder_ranks, total), "encoders") : "") +
    "<p>" + num(j.skipped.count, 0) + " sample(s) skipped" + (skipped.length ? ", recently:" : "") + "</p>" +
    (skipped.length ? table(["reason", "samples"], skipped, "skipped") : "") + "</section>";
}
function render(s) {
  document.getElementById("server").textContent = s.server;
  document.getElementById("summary").textContent = s.jobs.length + " job(s); memory held " +
    mib(s.memory.held_bytes) + " of " + mib(s.memory.budget_bytes) + "; loader cores used " +
    s.loader.cores_used.toFixed(2) + " (" + (s.loader.cores_per_gpu === null ? "-" : s.loader.cores_per_gpu.toFixed(2)) +
    " per GPU, " + s.loader.gpus_fed + " GPUs fed in the last minute); up " + Math.round(s.uptime_s) + " s; " +
    "updated " + new Date().toLocaleTimeString();
  document.getElementById("jobs").innerHTML = s.jobs.map(j => job(j, s.history_s)).join("");
  document.getElementById("closed").innerHTML = s.closed_jobs.length ? "<h2>Closed recently</h2>" +
    table(["job", "state", "dataset", "closed", "last acknowledged, per rank"], s.closed_jobs.map(c =>
      [esc(c.job), '<span class="state state-closed">closed</span>', esc(c.dataset), Math.round(c.closed_s_ago) + " s ago",
       esc(c.acked.map(a => a[0] < 0 ? "-" : a[0] + ":" + a[1]).join(", "))]), "closed") : "";
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
    schedule(s.refresh_s * 1000);
  } catch (error) {
    document.getElementById("summary").textContent = "cannot read the status: " + error.message;
    schedule(5000);
  }
}
schedule(0);
</script>
</body></html>
"""
