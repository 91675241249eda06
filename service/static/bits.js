// Bits over steps per layer: a heat map (layers down, step windows across, one colour per
// bit-width) drawn on a plain canvas, from GET /v1/jobs/{id}/metrics/layers/bits. Chart.js has
// no matrix chart without a plugin, and a grid of rectangles needs none.
"use strict";

// viridis at 7 evenly spaced points, 2 (dark) .. 8 bits (light): what jobs/report.py plots.
const BIT_COLOURS = { 2: "#440154", 3: "#443983", 4: "#31688e", 5: "#21918c", 6: "#35b779", 7: "#90d743", 8: "#fde725" };
const RAW_COLOUR = "#d1d5db"; // 16/32 bits: the layer went raw (or all-reduced), no quantization
// Sent as low-rank factors in most of the window's records: their "bits" are the factors' 8,
// not the layer's, so the cell gets a colour of its own (report.py's red) instead of 8's yellow.
const LOWRANK_COLOUR = "#d62728";
const MIXED_DOT = "#dc2626";
const MIXED_DOT_ON_LOWRANK = "#ffffff"; // the red dot would vanish on the low-rank red

function cellColour(cell) {
  if (cell.lowrank >= 0.5) return LOWRANK_COLOUR;
  const bits = cell.bits;
  if (bits >= 16) return RAW_COLOUR;
  const b = Math.min(8, Math.max(2, Math.round(bits)));
  return BIT_COLOURS[b];
}

// The window held more than one choice: bits changed, ranks differed, or the layer went low-rank
// in some of its records and quantized in others.
function mixed(cell) {
  return cell.min !== cell.max || (cell.lowrank > 0 && cell.lowrank < 1);
}

class BitsHeatmap {
  constructor(canvas, status) {
    this.canvas = canvas;
    this.status = status;
    this.model = null; // what was drawn last: { layers, columns, cells, box }, for tests and tooltips
    canvas.addEventListener("mousemove", (ev) => this.hover(ev));
  }

  clear(text) {
    this.model = null;
    const ctx = this.canvas.getContext("2d");
    ctx.clearRect(0, 0, this.canvas.width, this.canvas.height);
    this.status.textContent = text;
  }

  // history: a LayerBitsHistory. One column per window, aligned at step 0 (window k holds steps
  // k*w .. k*w+w-1), so layers that skipped windows still line up.
  draw(history) {
    const w = history.step_width;
    const layers = history.layers;
    if (!layers.length) return this.clear("no layer metrics yet");
    const key = (step) => Math.floor(Math.max(step, 0) / w);
    let first = Infinity;
    let last = -Infinity;
    for (const l of layers) for (const s of l.steps) { first = Math.min(first, key(s)); last = Math.max(last, key(s)); }
    const columns = last - first + 1;
    const cells = layers.map((l) => {
      const row = new Array(columns).fill(null);
      l.steps.forEach((s, i) => {
        const lowrank = l.lowrank_share[i];
        row[key(s) - first] = { step: s, bits: l.bits[i], min: l.min_bits[i], max: l.max_bits[i], lowrank };
      });
      return row;
    });

    const ctx = this.canvas.getContext("2d");
    ctx.font = "11px system-ui, sans-serif";
    const labelW = Math.min(240, 8 + Math.max(...layers.map((l) => ctx.measureText(l.layer).width)));
    const rowH = Math.max(8, Math.min(22, Math.floor(420 / layers.length)));
    const cssW = this.canvas.clientWidth || 600;
    const box = { x: labelW, y: 4, w: Math.max(50, cssW - labelW - 8), h: rowH * layers.length };
    const cssH = box.y + box.h + 20;
    const dpr = window.devicePixelRatio || 1;
    this.canvas.style.height = `${cssH}px`;
    this.canvas.width = Math.round(cssW * dpr);
    this.canvas.height = Math.round(cssH * dpr);
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, cssW, cssH);
    ctx.font = "11px system-ui, sans-serif";
    const colW = box.w / columns;
    ctx.textBaseline = "middle";
    layers.forEach((l, r) => {
      ctx.fillStyle = "#1d2430";
      ctx.textAlign = "right";
      ctx.fillText(l.layer, box.x - 6, box.y + (r + 0.5) * rowH, labelW - 8);
      cells[r].forEach((c, k) => {
        if (!c) return;
        ctx.fillStyle = cellColour(c);
        // +0.5 px overlap: no hairline gaps between neighbouring cells
        ctx.fillRect(box.x + k * colW, box.y + r * rowH, colW + 0.5, rowH + 0.5);
        if (mixed(c) && colW >= 4 && rowH >= 8) {
          ctx.fillStyle = c.lowrank >= 0.5 ? MIXED_DOT_ON_LOWRANK : MIXED_DOT;
          ctx.fillRect(box.x + (k + 0.5) * colW - 1, box.y + (r + 0.5) * rowH - 1, 2, 2);
        }
      });
    });
    // Step axis: the first and last window, and the middle one.
    ctx.fillStyle = "#6b7280";
    ctx.textBaseline = "top";
    for (const k of new Set([0, Math.floor((columns - 1) / 2), columns - 1])) {
      ctx.textAlign = k === 0 ? "left" : k === columns - 1 ? "right" : "center";
      const x = k === 0 ? box.x : k === columns - 1 ? box.x + box.w : box.x + (k + 0.5) * colW;
      ctx.fillText(`step ${(first + k) * w}`, x, box.y + box.h + 4);
    }
    this.model = { layers: layers.map((l) => l.layer), columns, width: w, first, cells, box, colW, rowH };
    const changed = cells.reduce((n, row) => n + row.filter((c) => c && mixed(c)).length, 0);
    const lowrank = cells.reduce((n, row) => n + row.filter((c) => c && c.lowrank >= 0.5).length, 0);
    this.status.textContent = `steps ${history.first_step}–${history.last_step}, ${w} step(s) per column; `
      + `${changed} cell(s) where bits or kind changed or ranks differed (dot); ${lowrank} low-rank cell(s)`;
    return this.model;
  }

  // CSS pixel at the centre of a cell, for tests.
  cellCentre(row, column) {
    const m = this.model;
    return { x: m.box.x + (column + 0.5) * m.colW, y: m.box.y + (row + 0.5) * m.rowH };
  }

  hover(ev) {
    const m = this.model;
    if (!m) return;
    const rect = this.canvas.getBoundingClientRect();
    const k = Math.floor((ev.clientX - rect.left - m.box.x) / m.colW);
    const r = Math.floor((ev.clientY - rect.top - m.box.y) / m.rowH);
    const c = m.cells[r]?.[k];
    if (!c) { this.canvas.title = ""; return; }
    const lo = (m.first + k) * m.width;
    const range = m.width > 1 ? `steps ${lo}–${lo + m.width - 1}` : `step ${lo}`;
    const spread = c.min === c.max ? `${c.min} bits` : `${c.bits.toFixed(2)} bits (${c.min}–${c.max})`;
    const kind = c.lowrank >= 1 ? " · low-rank factors"
      : c.lowrank > 0 ? ` · low-rank factors in ${Math.round(100 * c.lowrank)}% of records` : "";
    this.canvas.title = `${m.layers[r]} · ${range} · ${spread}${kind}`;
  }
}
