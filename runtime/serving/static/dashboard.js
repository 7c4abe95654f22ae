// dspark live dashboard: polls dashboard/data and draws small canvas charts. No dependencies, works offline.
"use strict";

const POLL_MS = 500;
const WINDOW_S = 60;
const COLORS = ["#4fa3f7", "#f5a623", "#7ed321", "#e86ee8", "#ef6f6c"];
const pct = (v) => (100 * v).toFixed(1) + "%";
const num = (d) => (v) => v.toFixed(d);

// One entry per chart: the panel it sits in, its title, and the series (field of data.series, label).
const CHARTS = [
  { panel: "quality", id: "accepted-length", title: "Accepted length (tokens per request per step, bonus incl.)",
    series: [["accepted_length", "accepted length"]], min: 0, fmt: num(2) },
  { panel: "quality", id: "acceptance", title: "Drafts: accepted / verified, verified / proposed",
    series: [["acceptance_rate", "acceptance"], ["verified_fraction", "verified share"]], min: 0, max: 1, fmt: pct },
  { panel: "quality", id: "positions", kind: "bars", title: "Per block position (since start)" },
  { panel: "quality", id: "ece", title: "ECE of calibrated confidences",
    series: [["ece", "since start"], ["ece_recent", "recent"]], min: 0, fmt: num(3) },
  { panel: "load", id: "requests", title: "Requests",
    series: [["running", "running"], ["waiting", "waiting"]], min: 0, fmt: num(0) },
  { panel: "load", id: "throughput", title: "Throughput",
    series: [["tokens_per_s", "tokens/s"], ["steps_per_s", "steps/s"]], min: 0, fmt: num(1) },
  { panel: "load", id: "verification", title: "Per step: verified tokens B, scheduler's draft budget Σℓ",
    series: [["verified_per_step", "B"], ["budget_per_step", "Σℓ"]], min: 0, fmt: num(1) },
  { panel: "load", id: "latency", title: "Latency (ms, requests ended in the interval)",
    series: [["ttft_ms", "TTFT"], ["itl_ms", "inter-token"]], min: 0, fmt: num(1) },
  { panel: "resources", id: "utilisation", title: "Utilisation (%)",
    series: [["cpu_percent", "host CPU"], ["process_cpu_percent", "serving processes"], ["gpu_percent", "GPU"],
             ["host_memory_percent", "host memory"]], min: 0, floor: 100, fmt: num(0) },
  { panel: "resources", id: "memory", title: "Memory (MiB)",
    series: [["rss_mb", "serving processes RSS"], ["gpu_memory_mb", "GPU"]], min: 0, fmt: num(0) },
  { panel: "resources", id: "kv", title: "KV cache",
    series: [["kv_used", "tokens used"], ["kv_reserved", "tokens reserved"], ["slots_used", "slots"]],
    min: 0, max: 1, fmt: pct },
];

function build() {
  for (const chart of CHARTS) {
    const box = document.createElement("div");
    box.className = "chart";
    box.id = "chart-" + chart.id;
    box.innerHTML = '<div class="title"><span></span></div><div class="values"></div><canvas></canvas>';
    box.querySelector(".title span").textContent = chart.title;
    document.querySelector(`#panel-${chart.panel} .charts`).appendChild(box);
    chart.canvas = box.querySelector("canvas");
    chart.canvas.dataset.points = "0";
    chart.values = box.querySelector(".values");
  }
}

function setupCanvas(canvas) {
  const ratio = window.devicePixelRatio || 1;
  const w = canvas.clientWidth, h = canvas.clientHeight;
  if (canvas.width !== Math.round(w * ratio) || canvas.height !== Math.round(h * ratio)) {
    canvas.width = Math.round(w * ratio);
    canvas.height = Math.round(h * ratio);
  }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.clearRect(0, 0, w, h);
  ctx.font = "10px system-ui, sans-serif";
  return { ctx, w, h };
}

function niceMax(v) {
  if (!(v > 0)) return 1;
  const p = Math.pow(10, Math.floor(Math.log10(v)));
  for (const m of [1, 2, 2.5, 5, 10]) if (v <= m * p) return m * p;
  return 10 * p;
}

function frame(ctx, w, h, lo, hi, fmt, pad) {
  ctx.strokeStyle = "#2a323c";
  ctx.fillStyle = "#8b96a3";
  ctx.lineWidth = 1;
  for (let i = 0; i <= 2; i++) {
    const y = pad.t + (h - pad.t - pad.b) * (i / 2);
    ctx.beginPath(); ctx.moveTo(pad.l, y); ctx.lineTo(w - pad.r, y); ctx.stroke();
    ctx.fillText(fmt(hi - (hi - lo) * (i / 2)), 2, y + 3);
  }
}

function drawLines(chart, data) {
  const { ctx, w, h } = setupCanvas(chart.canvas);
  const pad = { l: 38, r: 6, t: 6, b: 14 };
  // The last WINDOW_S seconds, or less while the history is shorter (at least 10 s).
  const t = data.series.t, right = data.now;
  const span = Math.min(WINDOW_S, Math.max(10, t.length ? right - t[0] : 0)), left = right - span;
  let hi = chart.max, count = 0;
  if (hi === undefined) {
    hi = 0;
    for (const [field] of chart.series) for (const v of data.series[field] || []) if (v !== null && v > hi) hi = v;
    hi = Math.max(niceMax(hi * 1.1), chart.floor || 0);
  }
  const lo = chart.min || 0;
  frame(ctx, w, h, lo, hi, chart.fmt, pad);
  ctx.fillText(`-${Math.round(span)}s`, pad.l, h - 2);
  ctx.fillText("now", w - pad.r - 18, h - 2);
  const x = (s) => pad.l + (w - pad.l - pad.r) * ((s - left) / span);
  const y = (v) => h - pad.b - (h - pad.t - pad.b) * ((Math.min(Math.max(v, lo), hi) - lo) / (hi - lo));
  chart.values.innerHTML = "";
  chart.series.forEach(([field, label], i) => {
    const values = data.series[field] || [];
    ctx.strokeStyle = COLORS[i % COLORS.length];
    ctx.lineWidth = 1.6;
    ctx.beginPath();
    let pen = false, last = null, drawn = 0;
    for (let k = 0; k < values.length; k++) {
      const v = values[k];
      if (v === null || t[k] < left) { pen = false; continue; }
      if (pen) ctx.lineTo(x(t[k]), y(v)); else ctx.moveTo(x(t[k]), y(v));
      pen = true; last = v; drawn++;
    }
    ctx.stroke();
    if (i === 0) count = drawn;
    const item = document.createElement("span");
    item.className = "v";
    item.innerHTML = `<span class="sw" style="background:${COLORS[i % COLORS.length]}"></span>`;
    item.appendChild(document.createTextNode(`${label} ${last === null ? "–" : chart.fmt(last)}`));
    chart.values.appendChild(item);
  });
  chart.canvas.dataset.points = String(count);
}

function drawBars(chart, data) {
  const { ctx, w, h } = setupCanvas(chart.canvas);
  const pad = { l: 38, r: 6, t: 6, b: 14 };
  const pos = data.positions, n = pos.verified.length, drafts = pos.drafts;
  frame(ctx, w, h, 0, 1, pct, pad);
  const slot = (w - pad.l - pad.r) / Math.max(n, 1), bar = Math.max(2, slot * 0.36);
  const y = (v) => h - pad.b - (h - pad.t - pad.b) * Math.min(Math.max(v, 0), 1);
  let shown = 0;
  for (let j = 0; j < n; j++) {
    const verified = drafts ? pos.verified[j] / drafts : 0;
    const accepted = pos.verified[j] ? pos.accepted[j] / pos.verified[j] : 0;
    const x0 = pad.l + slot * j + slot * 0.12;
    ctx.fillStyle = COLORS[1];
    ctx.fillRect(x0, y(verified), bar, h - pad.b - y(verified));
    ctx.fillStyle = COLORS[0];
    ctx.fillRect(x0 + bar, y(accepted), bar, h - pad.b - y(accepted));
    ctx.fillStyle = "#8b96a3";
    ctx.fillText(String(j), x0 + bar - 3, h - 2);
    if (pos.verified[j]) shown++;
  }
  chart.values.innerHTML = "";
  [["accepted / verified", COLORS[0]], ["verified / drafts", COLORS[1]]].forEach(([label, color]) => {
    const item = document.createElement("span");
    item.className = "v";
    item.innerHTML = `<span class="sw" style="background:${color}"></span>`;
    item.appendChild(document.createTextNode(label));
    chart.values.appendChild(item);
  });
  chart.canvas.dataset.points = String(shown);
}

function render(data) {
  for (const chart of CHARTS) (chart.kind === "bars" ? drawBars : drawLines)(chart, data);
  const main = document.getElementById("dashboard");
  main.dataset.updates = String(Number(main.dataset.updates) + 1);
  main.dataset.steps = String(data.totals.steps);
  document.querySelector("#chart-ece .title span").textContent = data.calibrated
    ? "ECE of STS-calibrated confidences" : "ECE of raw confidences (the engine has no STS temperatures)";
  const status = document.getElementById("status");
  status.className = "status";
  status.textContent = `γ=${data.block_size} · ${data.calibrated ? "STS-calibrated" : "uncalibrated"} · ` +
    `${data.totals.steps} steps · ${data.load.finished}/${data.load.submitted} requests done · ` +
    `ECE samples ${data.ece_samples}`;
}

async function poll() {
  try {
    const response = await fetch("dashboard/data", { cache: "no-store" });
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    render(await response.json());
  } catch (err) {
    const status = document.getElementById("status");
    status.className = "status down";
    status.textContent = `disconnected (${err.message})`;
  }
  setTimeout(poll, POLL_MS);
}

build();
poll();
