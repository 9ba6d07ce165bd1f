// The baton dashboard: reads the job model's JSON API (/api/plan, /api/state, /api/history,
// /api/timeline) and the live event stream (/api/events), and draws the actor graph (SVG), the
// charts and the pipeline timeline (canvas) and the tables. No libraries, no network beyond
// this server: clusters are often offline.
'use strict';

const STATES = ['busy', 'starved', 'backpressured', 'transferring'];
const ROLES = ['data', 'update', 'forward', 'backward', 'collective', 'transfer', 'other'];
const COLORS = {
  busy: '#2f9e55', starved: '#8fa8c8', backpressured: '#e58a2b', transferring: '#8b5cc9',
  retired: '#cfd3d8', unknown: '#e6e9ee', forward: '#3b7dd8', backward: '#e0a030',
  collective: '#17a2b8',
};
const SERIES = ['#3b7dd8', '#e0a030', '#2f9e55', '#d62828', '#8b5cc9', '#17a2b8', '#7a5230', '#e377c2',
                '#6c757d', '#bcbd22', '#1f4e79', '#ff7f0e', '#2ca02c', '#9467bd', '#8c564b', '#17becf'];

const view = {
  plan: null,        // /api/plan
  state: null,       // /api/state
  history: null,     // /api/history
  timeline: null,    // /api/timeline
  sort: {},          // table id -> {key, asc}
  graphKey: '',      // the plan the SVG was laid out for
  layout: null,      // actor index -> {x, y, w, h}
  lastSlow: 0,       // when history and timeline were last fetched
};

// --- formatting -------------------------------------------------------------------------------

function fmtNum(x) {
  const digits = 3;
  if (x === null || x === undefined || !isFinite(x)) return '–';
  const a = Math.abs(x);
  if (a >= 1e9) return (x / 1e9).toPrecision(digits) + 'G';
  if (a >= 1e6) return (x / 1e6).toPrecision(digits) + 'M';
  if (a >= 1e4) return (x / 1e3).toPrecision(digits) + 'k';
  if (a >= 100) return x.toFixed(0);
  if (a === 0) return '0';
  if (a < 0.01) return x.toExponential(1);
  return x.toPrecision(digits);
}
function fmtBytes(x) {
  if (x === null || x === undefined || !isFinite(x)) return '–';
  const units = ['B', 'KB', 'MB', 'GB', 'TB'];
  let u = 0;
  while (Math.abs(x) >= 1000 && u < units.length - 1) { x /= 1000; u++; }
  return (u === 0 ? x.toFixed(0) : x.toPrecision(3)) + ' ' + units[u];
}
function fmtPct(x) { return x === null || x === undefined || !isFinite(x) ? '–' : (100 * x).toFixed(1) + '%'; }
function fmtSeconds(s) {
  if (s === null || s === undefined || !isFinite(s) || s <= 0) return '–';
  if (s < 1e-3) return (s * 1e6).toFixed(0) + ' µs';
  if (s < 1) return (s * 1e3).toPrecision(3) + ' ms';
  return s.toPrecision(3) + ' s';
}
function el(tag, attrs = {}, text) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}
function svg(tag, attrs = {}, text) {
  const e = document.createElementNS('http://www.w3.org/2000/svg', tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}

// --- fetching -------------------------------------------------------------------------------

async function getJSON(path) {
  const r = await fetch(path, {cache: 'no-store'});
  if (!r.ok) throw new Error(path + ': HTTP ' + r.status);
  return r.json();
}

async function refreshPlan() {
  try {
    view.plan = await getJSON('/api/plan');
  } catch (e) { /* the next state tries again */ }
}

async function refreshSlow() {
  view.lastSlow = Date.now();
  try {
    const [h, t] = await Promise.all([getJSON('/api/history?points=600'), getJSON('/api/timeline')]);
    view.history = h;
    view.timeline = t;
    drawCharts();
    drawTimeline();
  } catch (e) { /* keep the last ones */ }
}

async function onState(state) {
  view.state = state;
  if (!view.plan || (state.plan_complete && !view.plan.complete) ||
      (view.plan.actors.length === 0 && state.actors.length > 0)) {
    await refreshPlan();
  }
  render();
  if (Date.now() - view.lastSlow > 900) refreshSlow();
}

function connect() {
  const live = document.getElementById('live');
  if (!window.EventSource) return poll();
  const es = new EventSource('/api/events');
  es.addEventListener('state', (ev) => {
    live.textContent = '● live';
    live.className = 'live on';
    try { onState(JSON.parse(ev.data)); } catch (e) { /* a torn event: the next one comes */ }
  });
  es.onerror = () => {
    live.textContent = '○ reconnecting';
    live.className = 'live';
  };
  // The stream sends only changes: a job that has ended still needs one first picture.
  getJSON('/api/state').then(onState).catch(() => {});
}

function poll() {
  const live = document.getElementById('live');
  live.textContent = '◌ polling';
  const tick = () => getJSON('/api/state').then(onState).catch(() => {}).finally(() => setTimeout(tick, 1000));
  tick();
}

// --- the page -------------------------------------------------------------------------------

function render() {
  const s = view.state;
  document.getElementById('title').textContent = s.title;
  document.title = 'baton · ' + s.title;
  const badge = document.getElementById('status');
  badge.textContent = s.status;
  badge.className = 'badge ' + s.status;
  const t = s.training || {};
  document.getElementById('s-step').textContent = t.step !== undefined ? t.step : '–';
  document.getElementById('s-loss').textContent = t.loss !== undefined && t.loss !== null ? t.loss.toPrecision(4) : '–';
  document.getElementById('s-lr').textContent = t.lr !== undefined && t.lr !== null ? t.lr.toPrecision(3) : '–';
  document.getElementById('s-sps').textContent = fmtNum(t.samples_per_s);
  document.getElementById('s-step-time').textContent = fmtSeconds(t.step_time_s);
  document.getElementById('s-ranks').textContent = s.ranks.length + ' / ' + s.world_size;
  document.getElementById('s-actors').textContent = s.actors.length;
  const hint = document.getElementById('hint');
  if (s.bottleneck) {
    hint.hidden = false;
    document.getElementById('hint-text').textContent = s.bottleneck.text;
  } else {
    hint.hidden = s.status !== 'running';
    document.getElementById('hint-text').textContent =
        'none: no actor is busy at least 20% of the time without being held up by back-pressure.';
  }
  const error = document.getElementById('error');
  error.hidden = !s.error;
  error.textContent = s.error || '';
  const left = document.getElementById('left');
  left.hidden = !s.left || s.left.length === 0;
  left.textContent = (s.left || []).join('\n');
  drawGraph();
  renderTables();
}

// --- the actor graph --------------------------------------------------------------------------

const NODE_W = 158, NODE_H = 20, GAP_Y = 4, COL_GAP = 84, ROW_GAP = 18, LEFT = 92, TOP = 30;

/// Columns by (rank, stage, device), rows by role; actors stacked in each cell in plan order.
function layoutGraph(plan) {
  const colKey = (a) => [a.rank, a.stage, a.device];
  const keys = new Map();
  for (const a of plan.actors) keys.set(colKey(a).join('|'), colKey(a));
  const cols = [...keys.values()].sort((x, y) => x[0] - y[0] || x[1] - y[1] || (x[2] < y[2] ? -1 : x[2] > y[2] ? 1 : 0));
  const colIndex = new Map(cols.map((k, i) => [k.join('|'), i]));
  const roleOf = (a) => (ROLES.includes(a.role) ? a.role : 'other');
  const cells = new Map();  // role -> col -> [actor]
  for (const a of plan.actors) {
    const r = roleOf(a), c = colIndex.get(colKey(a).join('|'));
    if (!cells.has(r)) cells.set(r, new Map());
    const m = cells.get(r);
    if (!m.has(c)) m.set(c, []);
    m.get(c).push(a);
  }
  const pos = [];
  const bands = [];
  let y = TOP;
  for (const role of ROLES) {
    if (!cells.has(role)) continue;
    const m = cells.get(role);
    let rows = 0;
    for (const list of m.values()) rows = Math.max(rows, list.length);
    for (const [c, list] of m) {
      list.forEach((a, k) => {
        pos[a.i] = {x: LEFT + c * (NODE_W + COL_GAP), y: y + k * (NODE_H + GAP_Y), w: NODE_W, h: NODE_H};
      });
    }
    const h = rows * (NODE_H + GAP_Y) - GAP_Y;
    bands.push({role, y: y - 6, h: h + 12});
    y += h + ROW_GAP;
  }
  return {pos, cols, bands, width: LEFT + cols.length * (NODE_W + COL_GAP), height: y};
}

function drawGraph() {
  const plan = view.plan, state = view.state;
  const root = document.getElementById('graph');
  if (!plan || !plan.actors.length) return;
  const key = plan.hash + ':' + plan.actors.length;
  if (view.graphKey !== key) {
    view.graphKey = key;
    view.layout = layoutGraph(plan);
    buildGraph(root, plan, view.layout);
  }
  // Colours and labels from the latest state.
  const byIndex = new Map(state.actors.map((a) => [a.i, a]));
  const hot = state.bottleneck ? state.bottleneck.i : -1;
  for (const g of root.querySelectorAll('g.node')) {
    const i = Number(g.dataset.i);
    const a = byIndex.get(i);
    const dominant = a ? a.dominant : 'unknown';
    const rect = g.firstChild;
    rect.setAttribute('fill', COLORS[dominant] || COLORS.unknown);
    g.classList.toggle('light', dominant === 'starved' || dominant === 'retired' || dominant === 'unknown');
    g.classList.toggle('bottleneck', i === hot);
    g.dataset.state = dominant;
    g.dataset.rate = a ? a.acts_per_s : 0;
    const title = g.lastChild;
    title.textContent = a
      ? `${a.name} (${a.op || a.kind}, ${a.role}, rank ${a.rank} ${a.device || ''})\n` +
        `${fmtNum(a.acts_per_s)} acts/s, ${a.acts} acts\n` +
        STATES.map((s) => `${s} ${fmtPct(a[s])}`).join(', ')
      : plan.actors[i].name;
  }
  const regRate = new Map(state.registers.map((r) => [String(r.i), r.bytes_per_s]));
  for (const label of root.querySelectorAll('text.edge-label')) {
    const rate = regRate.get(label.dataset.reg);
    label.textContent = rate ? fmtBytes(rate) + '/s' : '';
  }
  for (const path of root.querySelectorAll('path.edge')) {
    const rate = regRate.get(path.dataset.reg) || 0;
    path.lastChild.textContent = `${path.dataset.name}: ${fmtBytes(rate)}/s`;
  }
}

function buildGraph(root, plan, layout) {
  while (root.firstChild) root.removeChild(root.firstChild);
  root.setAttribute('width', layout.width);
  root.setAttribute('height', layout.height);
  root.setAttribute('viewBox', `0 0 ${layout.width} ${layout.height}`);
  for (const b of layout.bands) {
    root.appendChild(svg('rect', {class: 'band', x: 0, y: b.y, width: layout.width, height: b.h}));
    root.appendChild(svg('text', {class: 'row-label', x: 8, y: b.y + 16}, b.role));
  }
  layout.cols.forEach((k, c) => {
    const label = `rank ${k[0]} · ${k[1] >= 0 ? 'stage ' + k[1] : 'no stage'} · ${k[2]}`;
    root.appendChild(svg('text', {class: 'col-label', x: LEFT + c * (NODE_W + COL_GAP), y: 18}, label));
  });
  const edges = svg('g', {class: 'edges'});
  const labels = svg('g', {class: 'edge-labels'});
  for (const r of plan.registers) {
    const from = layout.pos[r.producer];
    if (!from) continue;
    // One label per register, just right of its producer: every consumer reads the same bytes.
    if (r.consumers.length) {
      labels.appendChild(svg('text', {class: 'edge-label', x: from.x + from.w + 3, y: from.y + 8, 'data-reg': r.i}));
    }
    for (const c of r.consumers) {
      const to = layout.pos[c];
      if (!to) continue;
      const forward = to.x >= from.x + from.w;
      const x1 = forward ? from.x + from.w : from.x, y1 = from.y + from.h / 2;
      const x2 = forward ? to.x : to.x + to.w, y2 = to.y + to.h / 2;
      const sameColumn = Math.abs(from.x - to.x) < 1;
      let d;
      if (sameColumn) {
        // Within a column: a loop out to the right.
        const bulge = from.x + from.w + 18 + Math.min(40, Math.abs(y2 - y1) / 6);
        d = `M${from.x + from.w},${y1} C${bulge},${y1} ${bulge},${y2} ${to.x + to.w},${y2}`;
      } else {
        const mid = (x1 + x2) / 2;
        d = `M${x1},${y1} C${mid},${y1} ${mid},${y2} ${x2},${y2}`;
      }
      const path = svg('path', {class: 'edge' + (sameColumn ? '' : ' cross'), d, 'data-reg': r.i, 'data-name': r.name});
      path.appendChild(svg('title', {}, r.name));
      edges.appendChild(path);
    }
  }
  root.appendChild(edges);
  const nodes = svg('g', {class: 'nodes'});
  for (const a of plan.actors) {
    const p = layout.pos[a.i];
    const g = svg('g', {class: 'node', 'data-i': a.i, 'data-actor': a.name});
    g.appendChild(svg('rect', {x: p.x, y: p.y, width: p.w, height: p.h, rx: 3, fill: COLORS.unknown}));
    const name = a.name.length > 24 ? a.name.slice(0, 23) + '…' : a.name;
    g.appendChild(svg('text', {x: p.x + 6, y: p.y + 14}, name));
    g.appendChild(svg('title', {}, a.name));
    nodes.appendChild(g);
  }
  root.appendChild(nodes);
  root.appendChild(labels);
}

// --- charts ------------------------------------------------------------------------------------

/// A line chart on a canvas: x values, series [{name, values, color, dash}]. Returns the points drawn.
function lineChart(canvas, xs, series, opts = {}) {
  const dpr = window.devicePixelRatio || 1;
  const w = canvas.clientWidth || 400, h = canvas.clientHeight || 200;
  canvas.width = Math.round(w * dpr);
  canvas.height = Math.round(h * dpr);
  const ctx = canvas.getContext('2d');
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.clearRect(0, 0, w, h);
  ctx.font = '11px system-ui, sans-serif';
  const pad = {l: 56, r: opts.right ? 56 : 12, t: 10, b: 34};
  const pw = w - pad.l - pad.r, ph = h - pad.t - pad.b;
  const finite = (v) => v !== null && v !== undefined && isFinite(v);
  const left = series.filter((s) => !s.right), right = series.filter((s) => s.right);
  const range = (list) => {
    let lo = Infinity, hi = -Infinity;
    for (const s of list) for (const v of s.values) if (finite(v)) { lo = Math.min(lo, v); hi = Math.max(hi, v); }
    if (!isFinite(lo)) return null;
    if (opts.zero !== false) lo = Math.min(lo, 0);
    if (hi === lo) hi = lo + (lo === 0 ? 1 : Math.abs(lo));
    return [lo, hi];
  };
  let xlo = Infinity, xhi = -Infinity;
  for (const x of xs) if (finite(x)) { xlo = Math.min(xlo, x); xhi = Math.max(xhi, x); }
  const yl = range(left), yr = range(right);
  ctx.strokeStyle = '#dfe3e8';
  ctx.fillStyle = '#6b7380';
  ctx.strokeRect(pad.l, pad.t, pw, ph);
  if (!isFinite(xlo) || !yl) {
    ctx.fillText('waiting for data…', pad.l + 10, pad.t + 20);
    canvas.dataset.points = 0;
    return 0;
  }
  if (xhi === xlo) xhi = xlo + 1;
  const X = (x) => pad.l + (x - xlo) / (xhi - xlo) * pw;
  const Y = (y, r) => pad.t + ph - (y - r[0]) / (r[1] - r[0]) * ph;
  // Grid and ticks.
  ctx.textAlign = 'right';
  for (let k = 0; k <= 4; k++) {
    const v = yl[0] + (yl[1] - yl[0]) * k / 4;
    const y = Y(v, yl);
    ctx.beginPath(); ctx.moveTo(pad.l, y); ctx.lineTo(pad.l + pw, y); ctx.stroke();
    ctx.fillText(opts.fmtY ? opts.fmtY(v) : fmtNum(v), pad.l - 4, y + 4);
    if (yr) {
      ctx.textAlign = 'left';
      const vr = yr[0] + (yr[1] - yr[0]) * k / 4;
      ctx.fillText(fmtNum(vr), pad.l + pw + 4, y + 4);
      ctx.textAlign = 'right';
    }
  }
  ctx.textAlign = 'center';
  for (let k = 0; k <= 4; k++) {
    const v = xlo + (xhi - xlo) * k / 4;
    ctx.fillText(opts.fmtX ? opts.fmtX(v) : fmtNum(v), X(v), pad.t + ph + 14);
  }
  if (opts.xLabel) ctx.fillText(opts.xLabel, pad.l + pw / 2, h - 4);
  let drawn = 0;
  for (const s of series) {
    const r = s.right ? yr : yl;
    ctx.strokeStyle = s.color;
    ctx.lineWidth = 1.6;
    ctx.setLineDash(s.dash ? [5, 4] : []);
    ctx.beginPath();
    let pen = false;
    s.values.forEach((v, k) => {
      if (!finite(v) || !finite(xs[k])) { pen = false; return; }
      const px = X(xs[k]), py = Y(v, r);
      if (pen) ctx.lineTo(px, py); else ctx.moveTo(px, py);
      pen = true;
      drawn++;
    });
    ctx.stroke();
  }
  ctx.setLineDash([]);
  // Legend, wrapping onto more lines as needed.
  ctx.textAlign = 'left';
  let lx = pad.l + 6, ly = pad.t + 10;
  for (const s of series) {
    const label = s.name.length > 22 ? s.name.slice(0, 21) + '…' : s.name;
    const tw = ctx.measureText(label).width;
    if (lx + tw + 16 > pad.l + pw && lx > pad.l + 6) { lx = pad.l + 6; ly += 13; }
    ctx.fillStyle = 'rgba(255,255,255,0.8)';
    ctx.fillRect(lx - 2, ly - 10, tw + 18, 13);
    ctx.fillStyle = s.color;
    ctx.fillRect(lx, ly - 5, 10, 3);
    ctx.fillStyle = '#46505e';
    ctx.fillText(label, lx + 13, ly);
    lx += tw + 24;
  }
  canvas.dataset.points = drawn;
  return drawn;
}

function drawCharts() {
  const h = view.history;
  if (!h) return;
  const t0 = h.t.length ? h.t[0] : 0;
  const xs = h.t.map((t) => t - t0);
  const spanS = xs.length ? xs[xs.length - 1] : 0;
  const fmtX = (v) => (spanS < 10 ? v.toFixed(1) : v.toFixed(0)) + ' s';
  lineChart(document.getElementById('chart-samples'), xs,
            [{name: 'samples/s', values: h.samples_per_s, color: SERIES[0]}], {fmtX, xLabel: 'seconds'});
  lineChart(document.getElementById('chart-actors'), xs,
            h.actors.slice(0, 6).map((a, k) => ({name: a.name, values: a.acts_per_s, color: SERIES[k % SERIES.length]})),
            {fmtX, xLabel: 'seconds'});
  lineChart(document.getElementById('chart-loss'), h.loss.step,
            [{name: 'loss', values: h.loss.loss, color: SERIES[3]},
             {name: 'learning rate', values: h.loss.lr, color: SERIES[4], dash: true, right: true}],
            {xLabel: 'step', zero: false, right: true});
}

// --- the pipeline timeline ----------------------------------------------------------------------

function drawTimeline() {
  const tl = view.timeline;
  const canvas = document.getElementById('timeline');
  if (!tl) return;
  const span = Number(document.getElementById('timeline-span').value);
  const lanes = tl.lanes.filter((l) => l.boxes.length);
  // A row per phase a lane has: forward, backward, and with --dp the gradients' all-reduce (2).
  const rowH = 16, top = 8, labelW = 170, bottom = 26;
  const rowsOf = (l) => (l.boxes.some((b) => b[0] === 2) ? 3 : 2);
  const laneTop = [];
  let lanesH = 0;
  for (const l of lanes) { laneTop.push(top + lanesH); lanesH += 4 + rowsOf(l) * rowH; }
  const dpr = window.devicePixelRatio || 1;
  const w = canvas.clientWidth || 800;
  const h = Math.max(60, top + lanesH + bottom);
  canvas.style.height = h + 'px';
  canvas.width = Math.round(w * dpr);
  canvas.height = Math.round(h * dpr);
  const ctx = canvas.getContext('2d');
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.clearRect(0, 0, w, h);
  ctx.font = '11px system-ui, sans-serif';
  if (!lanes.length) {
    ctx.fillStyle = '#6b7380';
    ctx.fillText('waiting for forward and backward acts…', 10, 24);
    canvas.dataset.boxes = 0;
    return;
  }
  // The window: the last `span` micro-batches of the most recent lane's boxes, over all lanes.
  let end = -Infinity;
  for (const l of lanes) for (const b of l.boxes) end = Math.max(end, b[3]);
  let start = Infinity;
  for (const l of lanes) {
    const boxes = l.boxes.slice().sort((a, b) => a[3] - b[3]);
    const k = Math.max(0, boxes.length - 2 * span);
    start = Math.min(start, boxes[k][2]);
  }
  if (!(end > start)) end = start + 1e-3;
  const pw = w - labelW - 12;
  const X = (t) => labelW + (t - start) / (end - start) * pw;
  let drawn = 0;
  const PHASE = [['F', COLORS.forward], ['B', COLORS.backward], ['AR', COLORS.collective]];
  lanes.forEach((l, k) => {
    const y = laneTop[k], laneH = 4 + rowsOf(l) * rowH;
    ctx.fillStyle = k % 2 ? '#f7f9fb' : '#ffffff';
    ctx.fillRect(0, y, w, laneH);
    ctx.fillStyle = '#1d2430';
    ctx.textAlign = 'left';
    ctx.fillText(l.label, 6, y + 14);
    // Idle share in the window: what the forward and backward boxes do not cover.
    const spans = l.boxes.filter((b) => b[0] < 2 && b[3] > start).map((b) => [Math.max(b[2], start), b[3]]).sort((a, b) => a[0] - b[0]);
    let covered = 0, cur = null;
    for (const s of spans) {
      if (!cur || s[0] > cur[1]) { if (cur) covered += cur[1] - cur[0]; cur = s.slice(); } else cur[1] = Math.max(cur[1], s[1]);
    }
    if (cur) covered += cur[1] - cur[0];
    ctx.fillStyle = '#6b7380';
    ctx.fillText('idle ' + fmtPct(1 - covered / (end - start)), 6, y + 28);
    for (const b of l.boxes) {
      if (b[3] < start) continue;
      const phase = b[0];
      const x0 = X(Math.max(b[2], start)), x1 = Math.max(X(b[3]), x0 + 1);
      const by = y + 3 + phase * rowH, bh = rowH - 2;
      ctx.fillStyle = (PHASE[phase] || PHASE[1])[1];
      ctx.fillRect(x0, by, x1 - x0, bh);
      drawn++;
      const label = (PHASE[phase] || PHASE[1])[0] + b[1];
      if (x1 - x0 > 14 && ctx.measureText(label).width + 5 < x1 - x0) {
        ctx.fillStyle = '#fff';
        ctx.fillText(label, x0 + 3, by + bh - 3);
      }
    }
  });
  // Time axis: milliseconds before the newest box.
  const axisY = top + lanesH + 14;
  ctx.fillStyle = '#6b7380';
  ctx.textAlign = 'center';
  for (let k = 0; k <= 5; k++) {
    const t = start + (end - start) * k / 5;
    ctx.fillText(((t - end) * 1e3).toPrecision(3) + ' ms', X(t), axisY);
  }
  canvas.dataset.boxes = drawn;
}

// --- tables ----------------------------------------------------------------------------------

function shareCell(td, v, state) {
  td.textContent = fmtPct(v);
  td.className = 'share ' + state;
  td.style.setProperty('--w', Math.max(0, Math.min(100, 100 * (v || 0))) + '%');
}

/// A sortable table: columns [{key, label, text?, fmt?, share?}]; clicking a header sorts by it.
function renderTable(id, columns, rows, rowAttrs) {
  const table = document.getElementById(id);
  const def = columns.find((c) => c.defaultSort);
  const sort = view.sort[id] || (view.sort[id] = {key: def ? def.key : null, asc: false});
  const sorted = rows.slice();
  if (sort.key) {
    const col = columns.find((c) => c.key === sort.key);
    sorted.sort((a, b) => {
      const x = a[sort.key], y = b[sort.key];
      const r = col && col.text ? String(x).localeCompare(String(y)) : (Number(x) || 0) - (Number(y) || 0);
      return sort.asc ? r : -r;
    });
  }
  table.textContent = '';
  const head = el('tr');
  for (const c of columns) {
    const th = el('th', {class: (c.text ? 'text ' : '') + (sort.key === c.key ? 'sorted' + (sort.asc ? ' asc' : '') : ''), 'data-key': c.key}, c.label);
    th.addEventListener('click', () => {
      view.sort[id] = {key: c.key, asc: sort.key === c.key ? !sort.asc : !!c.text};
      renderTables();
    });
    head.appendChild(th);
  }
  const thead = el('thead');
  thead.appendChild(head);
  table.appendChild(thead);
  const body = el('tbody');
  for (const r of sorted) {
    const tr = el('tr', rowAttrs ? rowAttrs(r) : {});
    for (const c of columns) {
      const td = el('td', {class: c.text ? 'text' : ''});
      if (c.share) shareCell(td, r[c.key], c.key);
      else td.textContent = c.fmt ? c.fmt(r[c.key], r) : (r[c.key] ?? '–');
      tr.appendChild(td);
    }
    body.appendChild(tr);
  }
  table.appendChild(body);
}

function renderTables() {
  const s = view.state;
  if (!s) return;
  const filter = document.getElementById('actor-filter').value.trim().toLowerCase();
  const hot = s.bottleneck ? s.bottleneck.i : -1;
  const actors = s.actors.filter((a) => !filter || [a.name, a.op, a.role, a.kind].some((x) => String(x || '').toLowerCase().includes(filter)));
  const dot = (v, r) => {
    const span = `<span class="dot" style="background:${COLORS[r.dominant] || COLORS.unknown}"></span>`;
    return span + v;
  };
  renderTable('actor-table', [
    {key: 'name', label: 'actor', text: true},
    {key: 'rank', label: 'rank'},
    {key: 'device', label: 'device', text: true},
    {key: 'role', label: 'role', text: true},
    {key: 'stage', label: 'stage'},
    {key: 'op', label: 'op', text: true},
    {key: 'acts', label: 'acts'},
    {key: 'acts_per_s', label: 'acts/s', fmt: fmtNum, defaultSort: true},
    {key: 'in_per_s', label: 'in/s', fmt: fmtBytes},
    {key: 'out_per_s', label: 'out/s', fmt: fmtBytes},
    {key: 'busy', label: 'busy', share: true},
    {key: 'starved', label: 'starved', share: true},
    {key: 'backpressured', label: 'back-pressured', share: true},
    {key: 'transferring', label: 'transfer', share: true},
    {key: 'kernel', label: 'in kernel', fmt: fmtPct},
    {key: 'activity', label: 'now', text: true},
  ], actors, (a) => ({'data-actor': a.name, 'data-rate': a.acts_per_s, class: a.i === hot ? 'bottleneck' : ''}));
  // The first column shows the state colour.
  for (const tr of document.querySelectorAll('#actor-table tbody tr')) {
    const a = s.actors.find((x) => x.name === tr.dataset.actor);
    if (a) tr.firstChild.innerHTML = dot(escapeHtml(a.name), a);
  }
  renderTable('rank-table', [
    {key: 'rank', label: 'rank'},
    {key: 'host', label: 'host', text: true},
    {key: 'status', label: 'status', text: true},
    {key: 'actors', label: 'actors'},
    {key: 'workers', label: 'workers'},
    {key: 'acts_per_s', label: 'acts/s', fmt: fmtNum},
    {key: 'in_per_s', label: 'in/s', fmt: fmtBytes},
    {key: 'out_per_s', label: 'out/s', fmt: fmtBytes},
    {key: 'busy', label: 'busy', share: true},
    {key: 'starved', label: 'starved', share: true},
    {key: 'backpressured', label: 'back-pressured', share: true},
    {key: 'transferring', label: 'transfer', share: true},
    {key: 'samples_per_s', label: 'samples/s', fmt: fmtNum},
    {key: 'step_time_s', label: 'step time', fmt: fmtSeconds},
    {key: 'step', label: 'step'},
    {key: 'loss', label: 'loss', fmt: (v) => (v === null || v === undefined ? '–' : Number(v).toPrecision(4))},
    {key: 'last_seen_s', label: 'last heard', fmt: (v) => fmtSeconds(v) + ' ago'},
  ], s.ranks, (r) => ({'data-rank': r.rank}));
  const producerName = (i) => (view.plan && view.plan.actors[i] ? view.plan.actors[i].name : String(i));
  renderTable('register-table', [
    {key: 'name', label: 'register', text: true},
    {key: 'rank', label: 'rank'},
    {key: 'producer', label: 'producer', text: true, fmt: producerName},
    {key: 'slots', label: 'slots'},
    {key: 'in_use', label: 'in use'},
    {key: 'max_in_use', label: 'max in use'},
    {key: 'occupancy', label: 'occupancy', fmt: fmtPct, defaultSort: true},
    {key: 'written_per_s', label: 'pieces/s', fmt: fmtNum},
    {key: 'bytes_per_s', label: 'bytes/s', fmt: fmtBytes},
  ], s.registers);
}

function escapeHtml(s) {
  return String(s).replace(/[&<>"']/g, (c) => ({'&': '&amp;', '<': '&lt;', '>': '&gt;', '"': '&quot;', "'": '&#39;'}[c]));
}

// "record trace": the server records the next N seconds of every rank and answers with a
// Chrome trace, which the browser saves (open it in ui.perfetto.dev or chrome://tracing).
async function recordTrace() {
  const button = document.getElementById('trace-button');
  const status = document.getElementById('trace-status');
  const seconds = document.getElementById('trace-seconds').value;
  button.disabled = true;
  status.textContent = 'recording ' + seconds + ' s…';
  try {
    const r = await fetch('/api/trace?seconds=' + seconds, {cache: 'no-store'});
    if (!r.ok) throw new Error((await r.text()).trim() || r.statusText);
    const blob = await r.blob();
    const a = el('a', {href: URL.createObjectURL(blob), download: 'baton-trace.json'});
    document.body.appendChild(a);
    a.click();
    a.remove();
    status.textContent = 'saved baton-trace.json (' + fmtBytes(blob.size) + ')';
  } catch (e) {
    status.textContent = 'no trace: ' + e.message;
  } finally {
    button.disabled = false;
  }
}

document.getElementById('trace-button').addEventListener('click', recordTrace);
document.getElementById('actor-filter').addEventListener('input', renderTables);
document.getElementById('timeline-span').addEventListener('change', drawTimeline);
window.addEventListener('resize', () => { drawCharts(); drawTimeline(); });
connect();
