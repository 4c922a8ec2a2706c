// The lmforge rating page: a thin client of /v1/studies. A rater sees one prompt and two answers, "A" and
// "B" (the server chose the order for this rater and item; nothing here knows which run wrote which), and
// each choice is saved by its own request, so a reload resumes at the first item not yet rated.
// Everything from the server is put into the page as text (textContent), never parsed as HTML.
'use strict';

const TOKEN_KEY = 'lmforge.token';  // the dashboard's key: one token per tab for both pages
const KEYS = {1: 'A', a: 'A', 2: 'B', b: 'B', 3: 'tie', t: 'tie'};

const S = {
  token: sessionStorage.getItem(TOKEN_KEY) || '',
  study: null,      // {id, name, items, rated: Set}
  index: null,      // the item shown
  item: null,       // {choice, comment} as saved
  queue: Promise.resolve(),  // one request at a time, in the order the keys were pressed
};

const $ = (id) => document.getElementById(id);

function el(tag, text, cls) {
  const e = document.createElement(tag);
  if (text !== undefined && text !== null) e.textContent = String(text);
  if (cls) e.className = cls;
  return e;
}

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
  if (!r.ok) {
    let message = `${r.status} ${r.statusText}`;
    try {
      const j = await r.json();
      if (j && j.error && j.error.message) message = j.error.message;
    } catch (e) { /* not JSON: keep the status line */ }
    if (r.status === 401) {
      setToken('');
      message = `the server refused the token: ${message}`;
    }
    throw new ApiError(r.status, message);
  }
  return r;
}

const studyPath = (id, rest = '') => `/v1/studies/${encodeURIComponent(id)}${rest}`;

function say(text, kind = 'error') {
  const m = $('message');
  m.textContent = text;
  m.className = kind;
  m.hidden = !text;
}

function report(e) {
  say(e instanceof ApiError ? e.message : `request failed: ${e.message || e}`);
}

// Run `fn` after every earlier action has finished (a fast typist's keys are applied in order).
function enqueue(fn) {
  S.queue = S.queue.then(fn).catch(report);
  return S.queue;
}

// ---- token -------------------------------------------------------------------------------------------

function setToken(token) {
  S.token = token;
  if (token) sessionStorage.setItem(TOKEN_KEY, token);
  else sessionStorage.removeItem(TOKEN_KEY);
  $('token-state').textContent = token ? 'token set' : 'no token';
  if (!token) {  // nothing fetched with the old token stays on screen
    S.study = null;
    $('rater').hidden = true;
    $('results').hidden = true;
    $('studies-table').tBodies[0].replaceChildren();
  }
}

async function useToken(ev) {
  ev.preventDefault();
  const token = $('token').value.trim();
  if (!token) return say('enter a bearer token (`lmforge jobs token create --user NAME` prints one)');
  setToken(token);
  $('token').value = '';
  try {
    await start();
    say('');
  } catch (e) {
    report(e);
  }
}

// ---- the studies ---------------------------------------------------------------------------------------

async function loadStudies() {
  const data = (await (await api('GET', '/v1/studies')).json()).data;
  const body = $('studies-table').tBodies[0];
  body.replaceChildren(...data.map((s) => {
    const tr = el('tr');
    tr.dataset.id = s.id;
    const rates = s.role.includes('rater');
    tr.append(el('td', s.name), el('td', s.items), el('td', rates ? s.rated.length : '-'), el('td', s.status));
    const td = el('td');
    if (rates) {
      const b = el('button', 'Rate', 'link');
      b.type = 'button';
      b.dataset.action = 'rate';
      b.addEventListener('click', () => enqueue(() => openStudy(s.id)));
      td.append(b);
    }
    if (s.role.includes('owner')) {
      const b = el('button', 'Results', 'link');
      b.type = 'button';
      b.dataset.action = 'results';
      b.addEventListener('click', () => showResults(s.id).catch(report));
      td.append(' ', b);
    }
    tr.append(td);
    return tr;
  }));
  return data;
}

async function start() {
  const data = await loadStudies();
  const wanted = location.hash.slice(1);
  if (wanted && data.some((s) => s.id === wanted && s.role.includes('rater'))) {
    await enqueue(() => openStudy(wanted));
  }
}

async function openStudy(id) {
  const s = await (await api('GET', studyPath(id))).json();
  S.study = {id: s.id, name: s.name, items: s.items, rated: new Set(s.rated)};
  history.replaceState(null, '', `#${s.id}`);
  for (const tr of $('studies-table').tBodies[0].rows) tr.classList.toggle('selected', tr.dataset.id === s.id);
  $('study-name').textContent = s.name;
  $('rater').hidden = false;
  if (s.status !== 'ready') {
    $('rater').dataset.state = s.status;
    return say(`this study is ${s.status}; try again in a moment`, 'info');
  }
  await showItem(s.next === null ? 0 : s.next);  // resume at the first item not yet rated
}

async function showItem(index) {
  const st = S.study;
  $('rater').dataset.state = 'loading';
  const it = await (await api('GET', studyPath(st.id, `/items/${index}`))).json();
  S.index = index;
  S.item = {choice: it.choice, comment: it.comment};
  $('prompt').textContent = it.prompt;
  $('answer-a').textContent = it.a;
  $('answer-b').textContent = it.b;
  $('comment').value = it.comment;
  $('prev').disabled = index === 0;
  $('next').disabled = index === st.items - 1;
  markChoice();
  $('save-state').textContent = it.choice ? 'saved' : '';
  $('rater').dataset.index = String(index);
  $('rater').dataset.state = 'ready';
}

function markChoice() {
  const st = S.study;
  for (const b of document.querySelectorAll('#rater button[data-choice]')) {
    const on = b.dataset.choice === S.item.choice;
    b.classList.toggle('chosen', on);
    b.setAttribute('aria-pressed', on ? 'true' : 'false');
  }
  $('progress').textContent = `item ${S.index + 1} of ${st.items} \u00b7 ${st.rated.size} rated`;
  $('progress').dataset.rated = String(st.rated.size);
  $('all-done').hidden = st.rated.size < st.items;
  for (const tr of $('studies-table').tBodies[0].rows) {
    if (tr.dataset.id === st.id) tr.cells[2].textContent = String(st.rated.size);
  }
}

async function save(choice) {
  const st = S.study;
  const comment = $('comment').value;
  $('save-state').textContent = 'saving...';
  const r = await (await api('POST', studyPath(st.id, `/items/${S.index}`), {choice, comment})).json();
  st.rated = new Set(r.rated);
  S.item = {choice: r.choice, comment: r.comment};
  markChoice();
  $('save-state').textContent = 'saved';
  return r;
}

async function choose(choice) {
  if (!S.study || S.index === null) return;
  const r = await save(choice);
  // on to the next item not yet rated after this one (else the first before it), if any is left
  const st = S.study;
  let next = null;
  for (let k = 1; k <= st.items && next === null; k++) {
    const i = (S.index + k) % st.items;
    if (!st.rated.has(i)) next = i;
  }
  if (next !== null) await showItem(next);
  return r;
}

async function move(step) {
  if (!S.study || S.index === null) return;
  const to = S.index + step;
  if (to < 0 || to >= S.study.items) return;
  // a comment edited after the choice is saved before leaving the item
  if (S.item.choice && $('comment').value !== S.item.comment) await save(S.item.choice);
  await showItem(to);
}

// ---- results (the study's owner) -------------------------------------------------------------------------

async function showResults(id) {
  const text = await (await api('GET', studyPath(id, '/results?format=markdown'))).text();
  $('results-text').textContent = text;
  $('results-name').textContent = id;
  $('results').dataset.id = id;
  $('results').hidden = false;
}

async function downloadPairs() {
  const id = $('results').dataset.id;
  const blob = await (await api('GET', studyPath(id, '/pairs'))).blob();
  const a = el('a');
  a.href = URL.createObjectURL(blob);
  a.download = `${id}-pairs.jsonl`;
  document.body.append(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(a.href), 1000);
}

// ---- wiring ------------------------------------------------------------------------------------------

function onKey(ev) {
  const t = ev.target;
  if (t && (t.tagName === 'TEXTAREA' || t.tagName === 'INPUT' || t.tagName === 'SELECT')) {
    if (ev.key === 'Escape') t.blur();  // leave the comment box to use the keys again
    return;
  }
  if (ev.ctrlKey || ev.metaKey || ev.altKey || !S.study || $('rater').hidden) return;
  const key = ev.key.length === 1 ? ev.key.toLowerCase() : ev.key;
  if (KEYS[key]) {
    ev.preventDefault();
    enqueue(() => choose(KEYS[key]));
  } else if (key === 'ArrowRight' || key === 'ArrowLeft') {
    ev.preventDefault();
    enqueue(() => move(key === 'ArrowRight' ? 1 : -1));
  }
}

function init() {
  $('token-form').addEventListener('submit', useToken);
  $('token-forget').addEventListener('click', () => setToken(''));
  for (const b of document.querySelectorAll('#rater button[data-choice]')) {
    b.addEventListener('click', () => enqueue(() => choose(b.dataset.choice)));
  }
  $('prev').addEventListener('click', () => enqueue(() => move(-1)));
  $('next').addEventListener('click', () => enqueue(() => move(1)));
  $('download-pairs').addEventListener('click', () => downloadPairs().catch(report));
  document.addEventListener('keydown', onKey);
  setToken(S.token);
  if (S.token) start().catch(report);
}

init();
