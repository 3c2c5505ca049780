"use strict";
// The walkway view: one panel per source of step records. Live, the source is the server's
// /dashboard/stream; in a replay, records recorded by `travelator bench compare`, played back
// on their own clock. A record is described in travelator/dashboard/walkway.py.

const COLUMNS = 300;     // steps drawn
const WINDOW_S = 60;     // rates and percentiles: over the last minute
const PROMPTS_KEPT = 2000;

function hue(id) {  // a stable colour per request
  let h = 2166136261;
  for (let i = 0; i < id.length; i++) { h ^= id.charCodeAt(i); h = Math.imul(h, 16777619); }
  return (h >>> 0) % 360;
}
function quantile(values, q) {
  if (!values.length) return null;
  const s = [...values].sort((a, b) => a - b);
  return s[Math.min(s.length - 1, Math.floor(q * s.length))];
}
function fmt(x, digits = 0, unit = "") {
  return x === null || x === undefined || !isFinite(x) ? "–" : x.toFixed(digits) + unit;
}
function ms(seconds) { return seconds === null ? null : seconds * 1000; }

const PANEL_HTML = `
<h2><span data-field="title"></span> <span class="sub" data-field="subtitle"></span></h2>
<div class="row">
  <div class="walkway">
    <canvas></canvas>
    <div class="axis"><span data-field="first-step"></span><span>
      busy seats <b data-field="seats-busy">0</b> / <b data-field="seats-total">0</b> ·
      bands <b data-field="bands">0</b> · step <b data-field="step">–</b></span><span data-field="last-step"></span></div>
  </div>
  <div class="side">
    <div class="box"><h3>KV pool (blocks)</h3>
      <div class="bar"><div class="used"></div><div class="cached"></div><div class="free"></div></div>
      <div class="kv legend">
        <span class="figure"><i style="background:#e8a33d"></i>used <b data-field="kv-used">0</b></span>
        <span class="figure"><i style="background:#4f86c6"></i>cached <b data-field="kv-cached">0</b></span>
        <span class="figure"><i style="background:#33404f"></i>free <b data-field="kv-free">0</b></span>
        <span class="figure">of <b data-field="kv-total">0</b></span>
      </div></div>
    <div class="box"><h3>Queue</h3>
      <span class="figure">waiting <b data-field="waiting">0</b></span>,
      oldest <b data-field="oldest">–</b> ·
      admitted <b data-field="admitted">0</b> · rejected <b data-field="rejected">0</b> ·
      preempted <b data-field="preempted">0</b>
      <div class="queue" data-field="queue"></div></div>
    <div class="box"><h3>Last minute</h3><table>
      <tr><td>tokens/s</td><td data-field="tok-s">–</td><td>requests/s</td><td data-field="req-s">–</td></tr>
      <tr><td>step (p50)</td><td data-field="step-ms">–</td><td>steps/s</td><td data-field="steps-s">–</td></tr>
      <tr><td>TTFT p50</td><td data-field="ttft50">–</td><td>p99</td><td data-field="ttft99">–</td></tr>
      <tr><td>TPOT p50</td><td data-field="tpot50">–</td><td>p99</td><td data-field="tpot99">–</td></tr>
    </table></div>
  </div>
</div>`;

class Panel {
  constructor(parent, title) {
    this.root = document.createElement("section");
    this.root.className = "panel";
    this.root.innerHTML = PANEL_HTML;
    parent.appendChild(this.root);
    this.field("title").textContent = title;
    this.canvas = this.root.querySelector("canvas");
    this.info = null;
    this.now = () => null;  // the source's clock, in records' seconds (null: the newest record's)
    this.reset();
    this.canvas.addEventListener("mousemove", (ev) => this.hover(ev));
    this.canvas.addEventListener("mouseleave", () => { tooltip.hidden = true; });
  }
  reset() {
    this.records = [];   // the last COLUMNS steps, oldest first
    this.recent = [];    // the last WINDOW_S seconds of steps
    this.prompts = new Map();
    this.dropped = 0;
    this.dirty = true;
  }
  field(name) { return this.root.querySelector(`[data-field="${name}"]`); }
  setInfo(info) {
    this.info = info;
    this.field("subtitle").textContent =
      `${info.model} · ${info.batching} batching · ${info.max_num_seqs} seats · ${info.num_blocks} KV blocks of ${info.block_size}`;
    this.field("seats-total").textContent = info.max_num_seqs;
    this.dirty = true;
  }
  push(rec) {
    this.records.push(rec);
    if (this.records.length > COLUMNS) this.records.shift();
    this.recent.push(rec);
    for (const [id, text] of Object.entries(rec.prompts || {})) {
      this.prompts.set(id, text);
      if (this.prompts.size > PROMPTS_KEPT) this.prompts.delete(this.prompts.keys().next().value);
    }
    this.dirty = true;
  }
  geometry() {
    const seats = this.info ? this.info.max_num_seqs : 1;
    const rowH = Math.max(3, Math.min(24, Math.floor(420 / seats)));
    return { seats, rowH, width: this.canvas.clientWidth || 800, height: seats * rowH };
  }
  render() {
    if (!this.dirty || !this.info) return;
    this.dirty = false;
    this.draw();
    this.updateFigures();
  }
  draw() {
    const { seats, rowH, width, height } = this.geometry();
    const dpr = window.devicePixelRatio || 1;
    if (this.canvas.width !== Math.round(width * dpr) || this.canvas.height !== Math.round(height * dpr)) {
      this.canvas.width = Math.round(width * dpr);
      this.canvas.height = Math.round(height * dpr);
      this.canvas.style.height = height + "px";
    }
    const g = this.canvas.getContext("2d");
    g.setTransform(dpr, 0, 0, dpr, 0, 0);
    g.clearRect(0, 0, width, height);
    g.fillStyle = "#121922";
    for (let s = 1; s < seats; s += 2) g.fillRect(0, s * rowH, width, rowH);
    const colW = width / COLUMNS, n = this.records.length;
    this.records.forEach((rec, i) => {
      const x = width - (n - i) * colW, w = colW + 0.6;  // a hair wider: no seams between steps
      for (const [seat, id, kind] of rec.seats) {
        const y = seat * rowH, h = hue(id);
        if (kind === "p") { g.fillStyle = `hsl(${h} 60% 36%)`; g.fillRect(x, y, w, rowH - 1); }
        else if (kind === "d") { g.fillStyle = `hsl(${h} 70% 62%)`; g.fillRect(x, y + rowH * 0.25, w, rowH * 0.5); }
        else { g.fillStyle = `hsl(${h} 30% 40% / 0.45)`; g.fillRect(x, y + rowH * 0.4, w, rowH * 0.2); }
      }
      g.fillStyle = "#ff5a5a";
      for (const [, seat, why] of rec.left) {
        if (why !== "preempted") continue;
        const y = seat * rowH;
        g.beginPath(); g.moveTo(x - 3, y); g.lineTo(x + 3, y); g.lineTo(x, y + Math.min(rowH, 7)); g.fill();
      }
    });
  }
  updateFigures() {
    const last = this.records[this.records.length - 1];
    if (!last) return;
    const set = (name, text) => { this.field(name).textContent = text; };
    const bands = new Set();
    for (const rec of this.records) for (const s of rec.seats) bands.add(s[1]);
    set("bands", bands.size);
    set("seats-busy", last.seats.length);
    set("step", last.step);
    set("first-step", `step ${this.records[0].step}`);
    set("last-step", `step ${last.step}`);
    const kv = last.kv;
    set("kv-used", kv.used); set("kv-cached", kv.cached_free); set("kv-free", kv.free); set("kv-total", kv.total);
    const bar = this.root.querySelector(".bar");
    bar.querySelector(".used").style.width = (100 * kv.used / kv.total) + "%";
    bar.querySelector(".cached").style.width = (100 * kv.cached_free / kv.total) + "%";
    bar.querySelector(".free").style.width = (100 * kv.free / kv.total) + "%";
    set("waiting", last.waiting);
    set("oldest", last.waiting ? fmt(last.oldest_wait_s, 1, " s") : "–");
    set("admitted", last.admitted_total); set("rejected", last.rejected_total);
    set("preempted", last.preemptions_total);
    const queue = this.field("queue");
    queue.textContent = last.queue.slice(0, 8).map(([id, waited, prio]) =>
      `${waited.toFixed(1)} s${prio ? " · priority " + prio : ""} · ${id}`).join("\n");
    // Rates over the records of the last minute, by the source's clock: they fall to nothing
    // when the engine idles, not stay at their last values.
    const now = this.now() ?? last.t;
    while (this.recent.length && now - this.recent[0].t > WINDOW_S) this.recent.shift();
    const r = this.recent, span = r.length ? Math.max(now - r[0].t, 1e-3) : 0;
    const per = (x) => span > 0 ? x / span : null;
    const sum = (f) => r.reduce((a, rec) => a + f(rec), 0);
    set("tok-s", fmt(per(sum((rec) => rec.generated)), 0));
    set("req-s", fmt(per(sum((rec) => rec.finished.length)), 2));
    const stepped = r.filter((rec) => !rec.idle);  // an idle record marks the walkway empty: no step
    set("steps-s", fmt(per(stepped.length - 1), 1));
    set("step-ms", fmt(quantile(stepped.map((rec) => rec.ms), 0.5), 1, " ms"));
    const done = r.flatMap((rec) => rec.finished);
    const ttft = done.map((f) => f[1]).filter((v) => v !== null);
    const tpot = done.map((f) => f[2]).filter((v) => v !== null);
    set("ttft50", fmt(ms(quantile(ttft, 0.5)), 0, " ms")); set("ttft99", fmt(ms(quantile(ttft, 0.99)), 0, " ms"));
    set("tpot50", fmt(ms(quantile(tpot, 0.5)), 1, " ms")); set("tpot99", fmt(ms(quantile(tpot, 0.99)), 1, " ms"));
  }
  hover(ev) {
    const { rowH, width } = this.geometry();
    const box = this.canvas.getBoundingClientRect();
    const x = ev.clientX - box.left, y = ev.clientY - box.top;
    const i = this.records.length - 1 - Math.floor((width - x) / (width / COLUMNS));
    const rec = this.records[i], seat = Math.floor(y / rowH);
    const here = rec && rec.seats.find((s) => s[0] === seat);
    if (!here) { tooltip.hidden = true; return; }
    const [, id, kind, tokens] = here;
    const info = rec.requests[id] || [];
    const what = { p: "prefill chunk", d: "decode", i: "seated, not scheduled" }[kind];
    let text = `${id}\nstep ${rec.step}: ${what}, ${tokens} token${tokens === 1 ? "" : "s"}\n` +
      `prompt ${info[0]} tokens · output ${info[1]} so far\nstate ${info[2]}` +
      (info[3] === null ? "" : ` · priority ${info[3]}`) + ` · ${info[4]} KV blocks`;
    if (this.prompts.has(id)) text += `\n\n${this.prompts.get(id)}`;
    tooltip.textContent = text;
    tooltip.hidden = false;
    tooltip.style.left = ev.clientX + 14 + "px";
    tooltip.style.top = ev.clientY + 14 + "px";
  }
}

const tooltip = document.getElementById("tooltip");
const statusLine = document.getElementById("status");
const panelsRoot = document.getElementById("panels");
const panels = [];

function renderLoop() {
  for (const p of panels) p.render();
  requestAnimationFrame(renderLoop);
}

function startLive() {
  const panel = new Panel(panelsRoot, "live");
  panels.push(panel);
  let count = 0, since = performance.now(), instance = null;
  // The server's clock: the newest record's time plus what passed here since it came.
  let lastT = null, lastArrival = 0;
  panel.now = () => lastT === null ? null : lastT + (performance.now() - lastArrival) / 1000;
  const source = new EventSource("/dashboard/stream");
  source.addEventListener("info", (ev) => {
    const info = JSON.parse(ev.data);
    if (instance !== null && info.instance !== instance) panel.reset();  // a restarted server
    instance = info.instance;
    panel.setInfo(info);
  });
  source.addEventListener("dropped", (ev) => { panel.dropped += Number(ev.data); });
  source.onmessage = (ev) => {
    const rec = JSON.parse(ev.data);
    lastT = rec.t; lastArrival = performance.now();
    panel.push(rec);
    count++;
  };
  source.onerror = () => {
    statusLine.textContent = source.readyState === EventSource.CLOSED
      ? "disconnected: reload the page (and log in again if the server has a key)"
      : "connection lost: reconnecting…";
  };
  setInterval(() => {
    const now = performance.now(), rate = count * 1000 / (now - since);
    count = 0; since = now;
    panel.dirty = true;  // the last minute moves on even when no step comes
    if (source.readyState === EventSource.OPEN)
      statusLine.textContent = `live · ${rate.toFixed(0)} steps/s` + (panel.dropped ? ` · ${panel.dropped} records dropped` : "");
  }, 1000);
}

function startReplay(replay) {
  document.title = "travelator · replay";
  let speed = replay.speed || 1, playing = true, clock = 0, wall = performance.now();
  const runs = replay.panels.map((p) => {
    const panel = new Panel(panelsRoot, p.name);
    panel.setInfo(p.info);
    panels.push(panel);
    const run = { panel, records: p.records, next: 0, t0: p.t0 !== undefined ? p.t0 : (p.records[0] || { t: 0 }).t };
    panel.now = () => run.t0 + clock;
    return run;
  });
  const controls = document.getElementById("controls");
  controls.innerHTML = `<button data-act="play">pause</button>
    <select>${[1, 4, 16, 64].map((s) => `<option value="${s}">${s}× speed</option>`).join("")}</select>
    <button data-act="restart">restart</button>`;
  controls.querySelector("select").value = String(speed);
  controls.querySelector("select").onchange = (ev) => { speed = Number(ev.target.value); };
  controls.querySelector("[data-act=play]").onclick = (ev) => {
    playing = !playing; ev.target.textContent = playing ? "pause" : "play";
  };
  controls.querySelector("[data-act=restart]").onclick = () => {
    clock = 0;
    for (const run of runs) { run.next = 0; run.panel.reset(); }
  };
  const end = Math.max(...runs.map((run) => run.records.length ? run.records[run.records.length - 1].t - run.t0 : 0));
  setInterval(() => {
    const now = performance.now();
    if (playing) clock = Math.min(end, clock + (now - wall) / 1000 * speed);  // stops at the end
    wall = now;
    for (const run of runs) {
      while (run.next < run.records.length && run.records[run.next].t - run.t0 <= clock) run.panel.push(run.records[run.next++]);
      run.panel.dirty = true;
    }
    const done = runs.every((run) => run.next >= run.records.length);
    // "done" is said once the panels show the last records, not a frame before (a short run
    // ends within one tick, before the next animation frame has drawn anything).
    if (done) for (const run of runs) run.panel.render();
    statusLine.textContent = `${replay.title || "replay"} · ${clock.toFixed(1)} s` + (done ? " · done" : "");
  }, 50);
}

if (window.TRAVELATOR_REPLAY) startReplay(window.TRAVELATOR_REPLAY); else startLive();
requestAnimationFrame(renderLoop);
