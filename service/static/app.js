// tail-ray dashboard: polls the read API and redraws. No build step, no network beyond this
// service: Chart.js is vendored under /static/vendor.
"use strict";

const params = new URLSearchParams(location.search);
const POLL_MS = Math.max(250, Number(params.get("poll_ms")) || 3000);
const MAX_POINTS = 5000;

const state = {
  // The API token lives for this tab only (sessionStorage): asked once, never written to disk.
  token: sessionStorage.getItem("tailRayToken") || "",
  jobId: null,
  steps: new Map(), // step -> StepPoint
  lastStep: -1,
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

// Exposed for the browser tests and for poking at from the devtools console.
window.tailDashboard = { state, charts };

function renderJobs(page) {
  const tbody = $("jobs-table").querySelector("tbody");
  tbody.replaceChildren();
  $("jobs-empty").hidden = page.items.length > 0;
  for (const job of page.items) {
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
}

function selectJob(jobId) {
  if (state.jobId === jobId) return;
  state.jobId = jobId;
  state.steps.clear();
  state.lastStep = -1;
  history.replaceState(null, "", `#job=${encodeURIComponent(jobId)}`);
  for (const tr of $("jobs-table").querySelectorAll("tbody tr")) {
    tr.classList.toggle("selected", tr.dataset.jobId === jobId);
  }
  $("job-pane").hidden = false;
  refreshJob();
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

function renderSummary(job, summary) {
  $("job-title").textContent = `${job.name} · ${job.status}`;
  const method = job.spec?.method ? `${job.spec.method} on ${job.spec.model}/${job.spec.dataset}` : job.entrypoint;
  $("job-meta").textContent = `${job.id} · ${method}`;
  $("last-step").textContent = summary.last_step ?? "–";
  $("ratio").textContent = summary.bytes_sent ? `${fmt(summary.ratio, 2)}×` : "–";
  $("saved").textContent = summary.raw_bytes
    ? `${fmtBytes(summary.traffic_saved_bytes)} (${fmt(100 * summary.traffic_saved_fraction, 1)}%)` : "–";
  $("loss").textContent = fmt(summary.last_loss, 4);
}

async function refreshJob() {
  const jobId = state.jobId;
  if (!jobId) return;
  const base = `/v1/jobs/${encodeURIComponent(jobId)}`;
  // Re-read the newest step we hold: ranks that had not reported it yet may have since.
  const after = Math.max(-1, state.lastStep - 1);
  const [job, layers, steps, summary] = await Promise.all([
    api(base), api(`${base}/metrics/layers`), api(`${base}/metrics/steps?after_step=${after}&limit=5000`),
    api(`${base}/metrics/summary`),
  ]);
  if (jobId !== state.jobId) return; // the user picked another job meanwhile
  for (const p of steps.items) state.steps.set(p.step, p);
  if (steps.items.length) state.lastStep = Math.max(state.lastStep, steps.next_after_step);
  renderSummary(job, summary);
  renderLayers(layers);
  renderSteps();
}

async function tick() {
  try {
    renderJobs(await api("/v1/jobs?limit=100"));
    await refreshJob();
    $("conn").textContent = `updated ${new Date().toLocaleTimeString()}`;
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
