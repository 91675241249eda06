// tail-ray dashboard. The selected job's metrics arrive as server-sent events (one stream per
// page: GET /v1/jobs/{id}/metrics/stream, read with fetch so the API token can go in a header,
// resumed with Last-Event-ID after a drop); only the job list is polled, and the bits heat map
// (bits.js) is refetched when the stream says the metrics changed. No build step, no network
// beyond this service: Chart.js is vendored under /static/vendor.
"use strict";

const params = new URLSearchParams(location.search);
const POLL_MS = Math.max(250, Number(params.get("poll_ms")) || 3000); // the job list
const RETRY_MS = 3000; // reconnect delay after the stream drops
const MAX_POINTS = 5000;
// The bits heat map is refetched when the stream says the metrics changed, at most this often
// (one query over the job's layer records; ?bits_ms= to change).
const BITS_MS = Math.max(250, Number(params.get("bits_ms")) || 5000);
const BITS_POINTS = 200; // step windows per layer

const state = {
  // The API token lives for this tab only (sessionStorage): asked once, never written to disk.
  token: sessionStorage.getItem("tailRayToken") || "",
  jobId: null,
  jobs: new Map(), // id -> JobPublic, from the job list
  steps: new Map(), // step -> StepPoint
  lastStep: -1, // the newest final step received (the stream's Last-Event-ID)
  summary: null,
  stream: null, // AbortController of the open stream
  events: { step: 0, newest: 0, summary: 0, layers: 0, end: 0 }, // received, for the tests
  stepsDirty: false,
  bits: { timer: null, inFlight: false, pending: false, lastAt: 0, history: null, fetches: 0 },
  ended: false,
  timer: null,
};

function $(id) { return document.getElementById(id); }

function fmtBytes(n) {
  if (n == null) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (Math.abs(n) >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}

function fmt(x, digits = 3) {
  return x == null || Number.isNaN(x) ? "–" : Number(x).toFixed(digits);
}

async function api(path) {
  const headers = state.token ? { Authorization: `Bearer ${state.token}` } : {};
  const resp = await fetch(path, { headers });
  if (resp.status === 401 || resp.status === 403) {
    $("token-form").hidden = false;
    throw new Error(state.token ? "the API token was not accepted: enter it again"
                                : "this service guards reads: enter the API token");
  }
  if (!resp.ok) throw new Error(`${path}: HTTP ${resp.status}`);
  return resp.json();
}

function makeChart(id, config) {
  return new Chart($(id), {
    ...config,
    options: { animation: false, responsive: true, maintainAspectRatio: false, ...config.options },
  });
}

const charts = {
  layer: makeChart("layer-chart", {
    type: "bar",
    data: { labels: [], datasets: [
      { label: "ratio (raw / encoded)", data: [], yAxisID: "y", backgroundColor: "#2563eb" },
      { label: "bits", data: [], yAxisID: "y1", backgroundColor: "#f59e0b" },
    ] },
    options: { scales: {
      y: { position: "left", title: { display: true, text: "ratio" }, beginAtZero: true },
      y1: { position: "right", title: { display: true, text: "bits" }, beginAtZero: true, grid: { drawOnChartArea: false } },
      x: { ticks: { autoSkip: false, maxRotation: 60, minRotation: 30 } },
    } },
  }),
  traffic: makeChart("traffic-chart", {
    type: "line",
    data: { labels: [], datasets: [
      { label: "raw", data: [], borderColor: "#9ca3af", pointRadius: 0 },
      { label: "sent", data: [], borderColor: "#2563eb", pointRadius: 0 },
    ] },
    options: { scales: { y: { beginAtZero: true, ticks: { callback: (v) => fmtBytes(v) } } } },
  }),
  loss: makeChart("loss-chart", {
    type: "line",
    data: { labels: [], datasets: [{ label: "loss", data: [], borderColor: "#dc2626", pointRadius: 0 }] },
  }),
  world: makeChart("world-chart", {
    type: "line",
    data: { labels: [], datasets: [{ label: "workers", data: [], borderColor: "#059669", pointRadius: 0, stepped: true }] },
    options: { scales: { y: { beginAtZero: true, ticks: { precision: 0 } } } },
  }),
};

const bitsChart = new BitsHeatmap($("bits-chart"), $("bits-status"));

// Exposed for the browser tests and for poking at from the devtools console.
window.tailDashboard = { state, charts, bitsChart };

function renderJobs(page) {
  const tbody = $("jobs-table").querySelector("tbody");
  tbody.replaceChildren();
  $("jobs-empty").hidden = page.items.length > 0;
  for (const job of page.items) {
    state.jobs.set(job.id, job);
    const tr = document.createElement("tr");
    tr.dataset.jobId = job.id;
    if (job.id === state.jobId) tr.classList.add("selected");
    const method = job.spec?.method ?? (job.spec ? "(own code)" : "(ray job submit)");
    for (const [text, cls] of [[job.name, ""], [method, ""], [job.status, `status-${job.status}`]]) {
      const td = document.createElement("td");
      td.textContent = text;
      if (cls) td.className = cls;
      tr.append(td);
    }
    tr.title = job.id;
    tr.addEventListener("click", () => selectJob(job.id));
    tbody.append(tr);
  }
  if (!state.jobId && page.items.length) selectJob(page.items[0].id);
  else if (state.summary) renderSummary(state.summary); // the job's status may have changed
}

function selectJob(jobId) {
  if (state.jobId === jobId) return;
  if (state.stream) state.stream.abort();
  state.jobId = jobId;
  state.steps.clear();
  state.lastStep = -1;
  state.summary = null;
  state.ended = false;
  clearTimeout(state.bits.timer);
  Object.assign(state.bits, { timer: null, pending: false, lastAt: 0, history: null });
  bitsChart.clear("waiting for layer metrics");
  history.replaceState(null, "", `#job=${encodeURIComponent(jobId)}`);
  for (const tr of $("jobs-table").querySelectorAll("tbody tr")) {
    tr.classList.toggle("selected", tr.dataset.jobId === jobId);
  }
  $("job-pane").hidden = false;
  follow(jobId);
}

function renderLayers(layers) {
  const c = charts.layer;
  c.data.labels = layers.map((l) => l.layer);
  c.data.datasets[0].data = layers.map((l) => l.ratio);
  c.data.datasets[1].data = layers.map((l) => l.bits);
  c.update();
  const tbody = $("layer-table").querySelector("tbody");
  tbody.replaceChildren();
  for (const l of layers) {
    const tr = document.createElement("tr");
    tr.dataset.layer = l.layer;
    for (const v of [l.layer, l.step, l.ranks, fmt(l.bits, 1), fmt(l.density), fmt(l.ratio, 2), fmt(l.rel_error, 4), l.code ?? ""]) {
      const td = document.createElement("td");
      td.textContent = String(v);
      tr.append(td);
    }
    tbody.append(tr);
  }
}

// The heat map follows the stream: a `layers` event (the metrics changed) schedules one fetch,
// throttled to BITS_MS; a change that arrives while a fetch is in flight makes one more.
function scheduleBits() {
  const b = state.bits;
  if (b.timer) return; // the fetch it will make reads the newest metrics
  if (b.inFlight) { b.pending = true; return; } // that fetch may predate the change
  b.timer = setTimeout(loadBits, Math.max(0, b.lastAt + BITS_MS - Date.now()));
}

async function loadBits() {
  const b = state.bits;
  const jobId = state.jobId;
  Object.assign(b, { timer: null, pending: false, inFlight: true, lastAt: Date.now() });
  try {
    const history = await api(`/v1/jobs/${encodeURIComponent(jobId)}/metrics/layers/bits?max_points=${BITS_POINTS}`);
    if (jobId === state.jobId) {
      b.history = history;
      b.fetches += 1;
      bitsChart.draw(history);
    }
  } catch (err) {
    if (jobId === state.jobId) $("bits-status").textContent = String(err.message || err);
  } finally {
    b.inFlight = false;
    if (b.pending && jobId === state.jobId) scheduleBits();
  }
}

function renderSteps() {
  const points = [...state.steps.values()].sort((a, b) => a.step - b.step).slice(-MAX_POINTS);
  const labels = points.map((p) => p.step);
  charts.traffic.data.labels = labels;
  charts.traffic.data.datasets[0].data = points.map((p) => p.raw_bytes);
  charts.traffic.data.datasets[1].data = points.map((p) => p.bytes_sent);
  charts.loss.data.labels = labels;
  charts.loss.data.datasets[0].data = points.map((p) => p.loss);
  charts.world.data.labels = labels;
  charts.world.data.datasets[0].data = points.map((p) => p.world_size);
  for (const c of [charts.traffic, charts.loss, charts.world]) c.update();
  const last = points[points.length - 1];
  $("world-size").textContent = last ? last.world_size : "–";
}

function renderSummary(summary) {
  const job = state.jobs.get(summary.job_id);
  if (job) {
    $("job-title").textContent = `${job.name} · ${job.status}`;
    const method = job.spec?.method ? `${job.spec.method} on ${job.spec.model}/${job.spec.dataset}` : job.entrypoint;
    $("job-meta").textContent = `${job.id} · ${method}`;
  }
  $("last-step").textContent = summary.last_step ?? "–";
  $("ratio").textContent = summary.bytes_sent ? `${fmt(summary.ratio, 2)}×` : "–";
  $("saved").textContent = summary.raw_bytes
    ? `${fmtBytes(summary.traffic_saved_bytes)} (${fmt(100 * summary.traffic_saved_fraction, 1)}%)` : "–";
  $("loss").textContent = fmt(summary.last_loss, 4);
}

// One server-sent event: true once the stream said `end`.
function handleEvent(ev) {
  if (!(ev.event in state.events)) return false;
  state.events[ev.event] += 1;
  const data = JSON.parse(ev.data);
  if (ev.event === "step" || ev.event === "newest") {
    state.steps.set(data.step, data);
    if (ev.event === "step") state.lastStep = Math.max(state.lastStep, data.step);
    state.stepsDirty = true;
  } else if (ev.event === "summary") {
    state.summary = data;
    renderSummary(data);
  } else if (ev.event === "layers") {
    renderLayers(data);
    scheduleBits();
  } else if (ev.event === "end") {
    state.ended = true;
    scheduleBits(); // the drained job's final history
  }
  return ev.event === "end";
}

function parseEvent(block) {
  const ev = { event: "message", data: [], id: null };
  for (const line of block.split("\n")) {
    if (!line || line.startsWith(":")) continue; // a comment (keep-alive)
    const i = line.indexOf(":");
    const field = i < 0 ? line : line.slice(0, i);
    const value = i < 0 ? "" : line.slice(i + 1).replace(/^ /, "");
    if (field === "data") ev.data.push(value);
    else if (field === "event") ev.event = value;
    else if (field === "id") ev.id = value;
  }
  if (!ev.data.length) return null;
  ev.data = ev.data.join("\n");
  return ev;
}

// Read one stream until it ends (true) or drops (false).
async function readStream(jobId, signal) {
  const headers = { Accept: "text/event-stream" };
  if (state.token) headers.Authorization = `Bearer ${state.token}`;
  if (state.lastStep >= 0) headers["Last-Event-ID"] = String(state.lastStep);
  const resp = await fetch(`/v1/jobs/${encodeURIComponent(jobId)}/metrics/stream`, { headers, signal });
  if (resp.status === 401 || resp.status === 403) {
    $("token-form").hidden = false;
    throw new Error("this service guards reads: enter the API token");
  }
  if (!resp.ok) throw new Error(`metrics stream: HTTP ${resp.status}`);
  $("conn").textContent = "live";
  const reader = resp.body.pipeThrough(new TextDecoderStream()).getReader();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return false;
    buf += value.replace(/\r\n?/g, "\n");
    let ended = false;
    let cut;
    while ((cut = buf.indexOf("\n\n")) >= 0) {
      const ev = parseEvent(buf.slice(0, cut));
      buf = buf.slice(cut + 2);
      if (ev && jobId === state.jobId) ended = handleEvent(ev) || ended;
    }
    if (state.stepsDirty) { state.stepsDirty = false; renderSteps(); }
    $("conn").textContent = `live · updated ${new Date().toLocaleTimeString()}`;
    if (ended) return true;
  }
}

async function follow(jobId) {
  const ctrl = new AbortController();
  state.stream = ctrl;
  while (state.jobId === jobId && !ctrl.signal.aborted) {
    try {
      if (await readStream(jobId, ctrl.signal)) {
        $("conn").textContent = "job ended; all metrics shown";
        return;
      }
    } catch (err) {
      if (ctrl.signal.aborted) return;
      $("conn").textContent = String(err.message || err);
    }
    await new Promise((resolve) => setTimeout(resolve, RETRY_MS));
  }
}

async function tick() {
  try {
    renderJobs(await api("/v1/jobs?limit=100"));
  } catch (err) {
    $("conn").textContent = String(err.message || err);
  } finally {
    state.timer = setTimeout(tick, POLL_MS);
  }
}

$("token-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  state.token = $("token").value.trim();
  sessionStorage.setItem("tailRayToken", state.token);
  $("token-form").hidden = true;
  clearTimeout(state.timer);
  tick();
});

const fromHash = new URLSearchParams(location.hash.slice(1)).get("job");
if (fromHash) selectJob(fromHash);
tick();
