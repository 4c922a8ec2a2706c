// The lmforge dashboard: a thin client of the job API (/v1/jobs...). Every call carries the bearer
// token the user entered (kept in sessionStorage, so it ends with the tab). Everything the server or a
// run returns is put into the page as text (textContent, option labels), never parsed as HTML.
'use strict';

const TERMINAL = new Set(['succeeded', 'failed', 'cancelled', 'interrupted']);
const POLL_MS = 1500;
const LOG_LINES = 400;
const TOKEN_KEY = 'lmforge.token';
// One chart per quantity; each series is [metrics.jsonl key, label, colour].
const CHARTS = [
  {id: 'chart-loss', title: 'loss',
    series: [['loss', 'train loss', '#1f77b4'], ['val_loss', 'val loss', '#d62728']]},
  {id: 'chart-lr', title: 'learning rate', series: [['lr', 'lr', '#2ca02c']]},
  {id: 'chart-grad', title: 'grad norm', series: [['grad_norm', 'grad norm', '#9467bd']]},
  {id: 'chart-tps', title: 'tokens/s', series: [['tokens_per_s', 'tokens/s', '#ff7f0e']]},
  // logging.monitor's metrics: a chart stays empty while its keys are absent (e.g. memory on a CPU)
  {id: 'chart-mfu', title: 'MFU', series: [['mfu', 'mfu', '#17becf']]},
  {id: 'chart-pnorm', title: 'parameter norm', series: [['param_norm', 'param norm', '#8c564b']]},
  {id: 'chart-mem', title: 'memory MiB',
    series: [['peak_mem_mib', 'peak', '#7f7f7f'], ['mem_allocated_mib', 'allocated', '#aec7e8'],
      ['mem_reserved_mib', 'reserved', '#d62728']]},
  {id: 'chart-time', title: 'seconds per window',
    series: [['data_s', 'data loading', '#2ca02c'], ['grad_sync_s', 'grad sync', '#9467bd'],
      ['checkpoint_save_s', 'checkpoint save', '#e377c2']]},
  {id: 'chart-entropy', title: 'attention entropy', series: [['attention_entropy', 'nats', '#bcbd22']]},
  {id: 'chart-bubble', title: 'pipeline bubble', series: [['pipeline_bubble', 'idle share', '#ff9896']]},
];

const S = {
  token: sessionStorage.getItem(TOKEN_KEY) || '',
  jobs: [],
  selected: null,       // the id of the run shown in the detail panel
  stream: null,         // {id, ctl}: the open event stream of the selected run
  points: new Map(),    // step -> merged metrics records of the selected run
  log: [],
  charts: {},
  drawQueued: false,
  pollTimer: null,
};

const $ = (id) => document.getElementById(id);

function el(tag, text, cls) {
  const e = document.createElement(tag);
  if (text !== undefined && text !== null) e.textContent = String(text);
  if (cls) e.className = cls;
  return e;
}

// ---- talking to the API ------------------------------------------------------------------------------

class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

async function api(method, path, body) {
  const headers = {Authorization: `Bearer ${S.token}`};
  const init = {method, headers};
  if (body !== undefined) {
    headers['Content-Type'] = 'application/json';
    init.body = JSON.stringify(body);
  }
  const r = await fetch(path, init);
  if (!r.ok) throw await apiError(r);
  return r;
}

async function apiError(r) {
  let message = `${r.status} ${r.statusText}`;
  try {
    const j = await r.json();
    if (j && j.error && j.error.message) message = j.error.message;
  } catch (e) { /* not JSON: keep the status line */ }
  if (r.status === 401) {
    setToken('');
    message = `the server refused the token: ${message}`;
  }
  return new ApiError(r.status, message);
}

const jobPath = (id, rest = '') => `/v1/jobs/${encodeURIComponent(id)}${rest}`;

function say(text, kind = 'error') {
  const m = $('message');
  m.textContent = text;
  m.className = kind;
  m.hidden = !text;
}

function report(e) {
  say(e instanceof ApiError ? e.message : `request failed: ${e.message || e}`);
}

// ---- token -------------------------------------------------------------------------------------------

function setToken(token) {
  S.token = token;
  if (token) sessionStorage.setItem(TOKEN_KEY, token);
  else sessionStorage.removeItem(TOKEN_KEY);
  $('token-state').textContent = token ? 'token set' : 'no token';
  if (!token) {  // nothing fetched with the old token stays on screen
    stopPolling();
    stopStream();
    S.jobs = [];
    S.selected = null;
    $('detail').hidden = true;
    renderRuns();
    renderDiffChoices();
  }
}

async function useToken(ev) {
  ev.preventDefault();
  const token = $('token').value.trim();
  if (!token) return say('enter a bearer token (`lmforge jobs token create --user NAME` prints one)');
  setToken(token);
  $('token').value = '';
  try {
    await refresh();
    say('');
    startPolling();
  } catch (e) {
    report(e);
  }
}

// ---- the runs table ----------------------------------------------------------------------------------

function startPolling() {
  stopPolling();
  S.pollTimer = setInterval(() => refresh().catch(report), POLL_MS);
}

function stopPolling() {
  if (S.pollTimer) clearInterval(S.pollTimer);
  S.pollTimer = null;
}

async function refresh() {
  if (!S.token) return;
  const page = await (await api('GET', '/v1/jobs?limit=100')).json();
  S.jobs = page.data;
  $('runs-note').textContent = page.has_more ? '(the newest 100)' : `(${page.data.length})`;
  renderRuns();
  renderDiffChoices();
  const job = S.jobs.find((j) => j.id === S.selected);
  if (job) {
    renderDetail(job);
    // A run that is queued or running again (resumed) gets a fresh stream once the last one ended.
    if (!TERMINAL.has(job.status) && !S.stream) openStream(job.id);
  }
}

function fmtNum(x, digits = 4) {
  if (x === null || x === undefined || !Number.isFinite(x)) return '';
  if (x !== 0 && (Math.abs(x) >= 1e5 || Math.abs(x) < 1e-3)) return x.toExponential(2);
  return String(Number(x.toPrecision(digits)));
}

function fmtEta(s) {
  if (s === null || s === undefined) return '';
  s = Math.round(s);
  const h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60), sec = s % 60;
  return h ? `${h}h${String(m).padStart(2, '0')}m` : m ? `${m}m${String(sec).padStart(2, '0')}s` : `${sec}s`;
}

function progressText(job) {
  if (job.kind !== 'train') return '';
  const step = job.step === null ? 0 : job.step;
  return job.max_steps ? `${step}/${job.max_steps}` : String(step);
}

function renderRuns() {
  const body = $('runs-table').tBodies[0];
  const rows = S.jobs.map((job) => {
    const tr = document.createElement('tr');
    tr.dataset.id = job.id;
    tr.dataset.status = job.status;
    if (job.id === S.selected) tr.className = 'selected';
    const pct = job.progress === null ? null : Math.round(job.progress * 100);
    const cells = [job.id, job.name || '', job.kind, job.status,
      progressText(job) + (pct === null ? '' : ` (${pct}%)`), fmtNum(job.metrics.loss),
      fmtNum(job.tokens_per_s, 3), fmtEta(job.eta_seconds)];
    cells.forEach((text, i) => {
      const td = el('td', text);
      if (i === 3) td.className = `status ${job.status}`;
      tr.appendChild(td);
    });
    tr.addEventListener('click', () => select(job.id));
    return tr;
  });
  body.replaceChildren(...rows);
}

// ---- submitting a run --------------------------------------------------------------------------------

async function submitRun(ev) {
  ev.preventDefault();
  const config = $('config').value;
  if (!config.trim()) return say('paste a config (YAML) or pick a file first');
  const sets = $('sets').value.split('\n').map((s) => s.trim()).filter((s) => s && !s.startsWith('#'));
  const body = {kind: 'train', config, set: sets};
  const name = $('run-name').value.trim();
  if (name) body.name = name;
  try {
    const job = await (await api('POST', '/v1/jobs', body)).json();
    say(`submitted ${job.id}`, 'info');
    await refresh();
    select(job.id);
  } catch (e) {
    report(e);
  }
}

function pickFile() {
  const f = $('config-file').files[0];
  if (!f) return;
  f.text().then((text) => { $('config').value = text; }, report);
}

// ---- the selected run: charts, log, buttons ----------------------------------------------------------

function select(id) {
  if (S.selected === id) return;
  S.selected = id;
  $('detail').hidden = false;
  ensureCharts();
  const job = S.jobs.find((j) => j.id === id);
  if (job) renderDetail(job);
  renderRuns();
  openStream(id);
  loadArtifacts(id);
}

function renderDetail(job) {
  $('detail-title').textContent = `${job.name || job.id} (${job.id})`;
  const status = $('detail-status');
  status.textContent = job.status;
  status.className = `status ${job.status}`;
  const parts = [`${job.kind} job`];
  if (job.kind === 'train') parts.push(`step ${progressText(job)}`);
  if (job.attempts > 1) parts.push(`attempt ${job.attempts}`);
  if (job.source) parts.push(`on ${job.source}`);
  if (job.eta_seconds !== null) parts.push(`ETA ${fmtEta(job.eta_seconds)}`);
  if (job.error) parts.push(job.error.message);
  $('detail-line').textContent = parts.join(' · ');
  $('btn-cancel').disabled = TERMINAL.has(job.status);
  $('btn-resume').disabled = !job.resumable;
  $('btn-export').disabled = !(job.kind === 'train' && (job.status === 'succeeded' || job.resumable));
  if (TERMINAL.has(job.status) && $('detail').dataset.status !== job.status) loadArtifacts(job.id);
  $('detail').dataset.status = job.status;
}

async function action(path, body, done) {
  try {
    const job = await (await api('POST', path, body)).json();
    say(done(job), 'info');
    await refresh();
  } catch (e) {
    report(e);
  }
}

function cancelRun() {
  action(jobPath(S.selected, '/cancel'), undefined,
    (j) => `cancelling ${j.id} (a train run saves a checkpoint first)`);
}

function resumeRun() {
  action(jobPath(S.selected, '/resume'), undefined, (j) => `resumed ${j.id}: ${j.status}`);
}

function exportRun() {
  action('/v1/jobs', {kind: 'export', source: S.selected}, (j) => `export job ${j.id} queued`);
}

// Event stream of one run, read with fetch() so that it can carry the Authorization header. The server
// sends every metrics record from the first, so a new stream starts the charts afresh.
async function openStream(id) {
  stopStream();
  const ctl = new AbortController();
  const me = {id, ctl};
  S.stream = me;
  S.points = new Map();
  S.log = [];
  $('log').textContent = '';
  queueDraw();
  try {
    const headers = {Authorization: `Bearer ${S.token}`};
    const r = await fetch(jobPath(id, '/events'), {headers, signal: ctl.signal});
    if (!r.ok) throw await apiError(r);
    const reader = r.body.pipeThrough(new TextDecoderStream()).getReader();
    let buf = '';
    for (;;) {
      const {value, done} = await reader.read();
      if (done) break;
      buf += value;
      let cut;
      while ((cut = buf.indexOf('\n\n')) >= 0) {
        onFrame(id, buf.slice(0, cut));
        buf = buf.slice(cut + 2);
      }
    }
  } catch (e) {
    if (!ctl.signal.aborted) report(e);
  } finally {
    if (S.stream === me) S.stream = null;
  }
}

function stopStream() {
  if (S.stream) S.stream.ctl.abort();
  S.stream = null;
}

function onFrame(id, frame) {
  let event = 'message';
  const data = [];
  for (const line of frame.split('\n')) {
    if (line.startsWith('event:')) event = line.slice(6).trim();
    else if (line.startsWith('data:')) data.push(line.slice(5).replace(/^ /, ''));
  }
  if (!data.length || id !== S.selected) return;
  let d;
  try {
    d = JSON.parse(data.join('\n'));
  } catch (e) {
    return;
  }
  if (event === 'metrics' && d && Number.isInteger(d.step)) {
    S.points.set(d.step, Object.assign(S.points.get(d.step) || {}, d));
    queueDraw();
  } else if (event === 'log' && d) {
    S.log.push(d.stream === 'stderr' ? `! ${d.line}` : d.line);
    if (S.log.length > LOG_LINES) S.log.splice(0, S.log.length - LOG_LINES);
    queueDraw();
  } else if (event === 'status' && d && d.id) {
    const i = S.jobs.findIndex((j) => j.id === d.id);
    if (i >= 0) S.jobs[i] = d;
    renderDetail(d);
    renderRuns();
  } else if (event === 'end') {
    refresh().catch(report);
  }
}

function ensureCharts() {
  if (Object.keys(S.charts).length) return;
  for (const c of CHARTS) {
    const box = $(c.id);
    const opts = {
      title: c.title,
      width: chartWidth(box),
      height: 200,
      scales: {x: {time: false}},
      series: [{label: 'step'},
        ...c.series.map(([, label, stroke]) => ({label, stroke, width: 1.5, spanGaps: true}))],
      axes: [{label: 'step'}, {size: 60}],
    };
    S.charts[c.id] = new uPlot(opts, [[], ...c.series.map(() => [])], box);
    box.dataset.points = '0';
  }
  window.addEventListener('resize', () => {
    for (const c of CHARTS) S.charts[c.id].setSize({width: chartWidth($(c.id)), height: 200});
  });
}

function chartWidth(box) {
  return Math.max(240, box.clientWidth || 420);
}

// Redraws at most once a frame, however fast the stream delivers records.
function queueDraw() {
  if (S.drawQueued) return;
  S.drawQueued = true;
  requestAnimationFrame(() => {
    S.drawQueued = false;
    draw();
  });
}

function draw() {
  const steps = [...S.points.keys()].sort((a, b) => a - b);
  const recs = steps.map((s) => S.points.get(s));
  for (const c of CHARTS) {
    const chart = S.charts[c.id];
    if (!chart) continue;
    const cols = c.series.map(([key]) => recs.map((r) => (Number.isFinite(r[key]) ? r[key] : null)));
    chart.setData([steps, ...cols]);
    $(c.id).dataset.points = String(cols[0].filter((v) => v !== null).length);
  }
  const log = $('log');
  const atEnd = log.scrollTop + log.clientHeight >= log.scrollHeight - 4;
  log.textContent = S.log.join('\n');
  if (atEnd) log.scrollTop = log.scrollHeight;
}

async function loadArtifacts(id) {
  const list = $('artifacts');
  try {
    const page = await (await api('GET', jobPath(id, '/artifacts'))).json();
    if (id !== S.selected) return;
    list.replaceChildren(...page.data.map((a) => {
      const li = el('li');
      const b = el('button', a.name, 'link');
      b.type = 'button';
      b.addEventListener('click', () => download(id, a.name));
      li.append(b, el('span', ` ${fmtBytes(a.bytes)}`, 'muted'));
      return li;
    }));
  } catch (e) {
    report(e);
  }
}

function fmtBytes(n) {
  const units = ['B', 'KiB', 'MiB', 'GiB'];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
  return `${i ? n.toFixed(1) : n} ${units[i]}`;
}

// Downloads need the token too, so they go through fetch() and a short-lived blob: URL.
async function download(id, name) {
  try {
    const path = jobPath(id, `/artifacts/${name.split('/').map(encodeURIComponent).join('/')}`);
    const blob = await (await api('GET', path)).blob();
    const url = URL.createObjectURL(blob);
    const a = el('a');
    a.href = url;
    a.download = name.split('/').pop();
    document.body.appendChild(a);
    a.click();
    a.remove();
    setTimeout(() => URL.revokeObjectURL(url), 10000);
  } catch (e) {
    report(e);
  }
}

// ---- config diff -------------------------------------------------------------------------------------

function renderDiffChoices() {
  const train = S.jobs.filter((j) => j.kind === 'train');
  for (const [sel, fallback] of [[$('diff-a'), 1], [$('diff-b'), 0]]) {
    const keep = sel.value;
    sel.replaceChildren(...train.map((j) => {
      const o = el('option', `${j.name || ''} ${j.id}`.trim());
      o.value = j.id;
      return o;
    }));
    if (train.some((j) => j.id === keep)) sel.value = keep;
    else if (train.length) sel.value = train[Math.min(fallback, train.length - 1)].id;
  }
}

// Flattens the block-style YAML the server writes for a run's config (yaml.safe_dump: nested mappings,
// `- item` lists, scalars) into dotted keys -> value text; a list becomes one value, `[a, b]`.
function flattenYaml(text) {
  const out = new Map();
  const stack = [];         // [{indent, key}] of the open mappings
  let pending = null;       // a key with no value yet: a mapping or a list follows
  let list = null;          // {path, indent, items: [[line, ...], ...]}
  let last = null;          // the last scalar's path, for continued (wrapped) values
  const closeList = () => {
    // An item with keys (`- step: x` and the lines under it) is shown as {k: v, ...}.
    const keyed = (parts) => parts.length > 1 || /^[^\s'"][^:]*:(\s|$)/.test(parts[0]);
    const item = (parts) => (keyed(parts) ? `{${parts.join(', ')}}` : parts[0]);
    if (list) out.set(list.path, `[${list.items.map(item).join(', ')}]`);
    list = null;
  };
  for (const raw of text.split('\n')) {
    const s = raw.trim();
    if (!s || s.startsWith('#') || s === '---') continue;
    const indent = raw.length - raw.trimStart().length;
    if ((s === '-' || s.startsWith('- ')) && (list || pending)) {
      if (!list) list = {path: pending, indent, items: []};
      list.items.push([s.slice(2).trim()]);
      pending = null;
      continue;
    }
    if (list && indent > list.indent && list.items.length) {  // more keys of a list item that is a mapping
      list.items[list.items.length - 1].push(s);
      continue;
    }
    closeList();
    const m = /^([^\s:'"][^:]*|'[^']*'|"[^"]*"):(?:\s+(.*))?$/.exec(s);
    if (!m) {
      if (last !== null) out.set(last, `${out.get(last)} ${s}`);
      continue;
    }
    while (stack.length && stack[stack.length - 1].indent >= indent) stack.pop();
    const path = [...stack.map((f) => f.key), m[1]].join('.');
    if (m[2] === undefined || m[2] === '') {  // a mapping or a list follows
      stack.push({indent, key: m[1]});
      pending = path;
      last = null;
    } else {
      pending = null;
      out.set(path, m[2]);
      last = path;
    }
  }
  closeList();
  return out;
}

async function configOf(id) {
  return flattenYaml(await (await api('GET', jobPath(id, '/artifacts/config.yaml'))).text());
}

async function runDiff(ev) {
  ev.preventDefault();
  const a = $('diff-a').value, b = $('diff-b').value;
  if (!a || !b) return say('pick two train runs to compare');
  try {
    const [ca, cb] = await Promise.all([configOf(a), configOf(b)]);
    const keys = [...new Set([...ca.keys(), ...cb.keys()])].sort();
    const changed = keys.filter((k) => ca.get(k) !== cb.get(k));
    $('diff-head-a').textContent = a;
    $('diff-head-b').textContent = b;
    $('diff-note').textContent = a === b ? 'the same run' : `${changed.length} of ${keys.length} keys differ`;
    $('diff-table').tBodies[0].replaceChildren(...changed.map((k) => {
      const tr = el('tr');
      tr.dataset.key = k;
      const cell = (c) => el('td', c.has(k) ? c.get(k) : '(absent)');
      tr.append(el('td', k), cell(ca), cell(cb));
      return tr;
    }));
  } catch (e) {
    report(e);
  }
}

// ---- start -------------------------------------------------------------------------------------------

function main() {
  $('token-form').addEventListener('submit', useToken);
  $('token-forget').addEventListener('click', () => {
    setToken('');
    say('token forgotten', 'info');
  });
  $('submit-form').addEventListener('submit', submitRun);
  $('config-file').addEventListener('change', pickFile);
  $('btn-cancel').addEventListener('click', cancelRun);
  $('btn-resume').addEventListener('click', resumeRun);
  $('btn-export').addEventListener('click', exportRun);
  $('diff-form').addEventListener('submit', runDiff);
  setToken(S.token);
  if (S.token) refresh().then(startPolling, report);
}

document.addEventListener('DOMContentLoaded', main);
