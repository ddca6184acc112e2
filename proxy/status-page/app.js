// kvgate's status page (docs/observability.md, The status page). Plain JavaScript, no
// library and no build step (docs/decisions/status-page-plain-js.md).
//
// The admin token is asked once and kept in this tab's sessionStorage; it goes only in the
// Authorization header of the page's own calls, never in a URL. Every value from kvgate
// (session ids are client-chosen text) reaches the page as text nodes, never as HTML.
"use strict";

const TOKEN_KEY = "kvgate.adminToken";
const POLL_MS = 1000; // while the tab is visible
const HIDDEN_POLL_MS = 5000; // while it is not: nobody is looking
const HISTORY_MS = 5000; // the history moves every 5 s (proxy/status_history.py)
const PALETTE = ["#3b6fd8", "#1a7f37", "#b35900", "#8e44ad", "#c9252d", "#0f8b8d", "#7a6f00", "#d6589f", "#5c6b7a", "#2d3e99", "#9c4f2c"];

const ui = { view: "windows", q: "", offset: 0, limit: 50, timer: null, historyTimer: null, running: false, total: 0 };
const $ = (id) => document.getElementById(id);

class Refused extends Error {}

function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (key === "class") el.className = value;
    else if (key.startsWith("on")) el.addEventListener(key.slice(2), value);
    else if (key === "data") Object.assign(el.dataset, value);
    else el.setAttribute(key, value === true ? "" : value);
  }
  for (const child of children.flat()) {
    if (child !== null && child !== undefined) el.append(child instanceof Node ? child : String(child));
  }
  return el;
}

function svg(tag, attrs) {
  const el = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [key, value] of Object.entries(attrs)) el.setAttribute(key, value);
  return el;
}

const pct = (x) => (x === null || x === undefined ? "–" : `${(100 * x).toFixed(1)}%`);
const secs = (x) => (x === null || x === undefined ? "–" : x < 60 ? `${x.toFixed(1)} s` : `${Math.floor(x / 60)} min ${Math.round(x % 60)} s`);
const num = (x) => (x === null || x === undefined ? "–" : String(Math.round(x)));

// ---- talking to kvgate ------------------------------------------------------------

async function api(path, options = {}) {
  const token = sessionStorage.getItem(TOKEN_KEY);
  const response = await fetch(path, {
    ...options,
    cache: "no-store",
    headers: { Authorization: `Bearer ${token}`, ...(options.headers || {}) },
  });
  if (response.status === 401) throw new Refused("kvgate refused this token (401): enter admin.token");
  const body = await response.json().catch(() => null);
  if (!response.ok) throw new Error(body && body.error ? body.error.message : `HTTP ${response.status}`);
  return body;
}

function statusPath() {
  const params = new URLSearchParams({ view: ui.view, offset: ui.offset, limit: ui.limit });
  if (ui.q) params.set("q", ui.q);
  return `/admin/status?${params}`;
}

// A poll started by a click (a view, a page, a search) supersedes the one in flight: only
// the newest renders and schedules the next, so an older answer never paints over it.
const chains = { status: 0, history: 0 };

async function tick() {
  clearTimeout(ui.timer);
  if (!ui.running) return;
  const mine = ++chains.status;
  try {
    const status = await api(statusPath());
    if (mine !== chains.status) return;
    render(status);
    setConnection(true);
  } catch (error) {
    if (mine !== chains.status) return;
    if (error instanceof Refused) return signOut(error.message);
    setConnection(false);
  }
  if (ui.running) ui.timer = setTimeout(tick, document.hidden ? HIDDEN_POLL_MS : POLL_MS);
}

async function historyTick() {
  clearTimeout(ui.historyTimer);
  if (!ui.running) return;
  const mine = ++chains.history;
  try {
    const history = await api("/admin/status/history");
    if (mine !== chains.history) return;
    renderHistory(history);
  } catch (error) {
    if (mine !== chains.history) return;
    if (error instanceof Refused) return signOut(error.message);
  }
  if (ui.running) ui.historyTimer = setTimeout(historyTick, HISTORY_MS);
}

function setConnection(up) {
  const conn = $("conn");
  conn.textContent = up ? `live · ${new Date().toLocaleTimeString()}` : "kvgate unreachable: retrying";
  conn.classList.toggle("down", !up);
}

async function act(question, path, method, done) {
  if (!window.confirm(question)) return;
  try {
    await api(path, { method });
    toast(done);
  } catch (error) {
    if (error instanceof Refused) return signOut(error.message);
    toast(`failed: ${error.message}`);
  }
  tick();
}

function toast(text) {
  const el = $("toast");
  el.textContent = text;
  el.hidden = false;
  clearTimeout(toast.timer);
  toast.timer = setTimeout(() => (el.hidden = true), 4000);
}

// ---- rendering --------------------------------------------------------------------

function render(status) {
  const waiting = status.waiters.total;
  $("summary").textContent = `${status.role} · ${status.replicas.length} replicas · ${status.tracked_sessions} sessions tracked · ${waiting} waiting`;
  document.title = waiting ? `(${waiting} waiting) kvgate` : "kvgate status";
  $("replicas").tBodies[0].replaceChildren(...status.replicas.map(replicaRow));
  $("waiter-count").textContent = waiting > status.waiters.items.length ? `(${waiting}, longest ${status.waiters.items.length} shown)` : `(${waiting})`;
  $("waiters").tBodies[0].replaceChildren(
    ...(status.waiters.items.length ? status.waiters.items.map(waiterRow) : [h("tr", {}, h("td", { colspan: 5, class: "muted" }, "no turn is waiting"))]),
  );
  renderSessions(status.sessions);
}

function health(r) {
  if (r.draining) return h("span", { class: "warn" }, "draining");
  return r.healthy ? h("span", { class: "ok" }, "healthy") : h("span", { class: "bad" }, "unhealthy");
}

function owner(r) {
  if (!r.owner) return h("span", { class: "muted" }, "no claim");
  const { status, contenders } = r.owner;
  const cls = status === "owner" && !contenders ? "ok" : status === "conflict" || contenders ? "bad" : "muted";
  return h("span", { class: cls }, contenders ? `${status}, ${contenders} contending` : status);
}

function usageCell(r) {
  const u = r.usage;
  const g = r.gate;
  if (!u) return h("span", { class: "muted" }, "no reading yet");
  const bar = h("span", { class: "usage", title: "used blocks; the mark: blocks the gate's windows expect resident" });
  const used = h("span", { class: "used" });
  used.style.width = `${Math.min(100, 100 * u.kv_cache_usage)}%`;
  bar.append(used);
  let text = pct(u.kv_cache_usage);
  if (u.num_total_blocks !== null) {
    text = `${u.used_blocks}/${u.num_total_blocks} blocks (${pct(u.kv_cache_usage)})`;
    if (g) {
      const mark = h("span", { class: "books" });
      mark.style.left = `${Math.min(100, (100 * g.window_blocks) / Math.max(1, u.num_total_blocks))}%`;
      bar.append(mark);
      text += ` · books ${g.window_blocks}`;
    }
  }
  const extras = Object.entries(u).filter(([k, v]) => /pinned|cpu/.test(k) && v !== null).map(([k, v]) => `${k.replace(/^num_/, "")} ${v}`);
  return [bar, h("div", { class: "mono small" }, text), extras.length ? h("div", { class: "muted small" }, extras.join(" · ")) : null];
}

function replicaRow(r) {
  const g = r.gate;
  const name = encodeURIComponent(r.name);
  return h(
    "tr",
    { data: { replica: r.name } },
    h("td", { title: r.url }, h("strong", {}, r.name), h("div", { class: "muted mono small" }, r.url)),
    h("td", {}, health(r)),
    h("td", {}, owner(r)),
    h("td", {}, g ? `${g.mode} · ${g.policy}` : h("span", { class: "muted" }, "no gate yet")),
    h("td", {}, usageCell(r)),
    h("td", { class: "num" }, g ? `${g.windows_in_flight} / ${g.windows_idle}` : "–"),
    h("td", { class: "num" }, g ? g.leases : "–"),
    h("td", { class: "num" }, g ? g.waiters : "–"),
    h("td", { class: "num" }, `${num(r.running)} / ${num(r.waiting)}`),
    h("td", { class: "num" }, pct(r.hit_rate_1m)),
    h(
      "td",
      { class: "actions" },
      h("button", {
        type: "button", class: "drain", disabled: r.draining,
        onclick: () => act(`Drain ${r.name}? It takes no new sessions; its sessions stay.`, `/admin/replicas/${name}/drain`, "POST", `${r.name} drains`),
      }, "Drain"),
      h("button", {
        type: "button", class: "danger remove",
        onclick: () => act(`Remove ${r.name}? Its sessions move to other replicas on their next turn.`, `/admin/replicas/${name}`, "DELETE", `${r.name} removed`),
      }, "Remove"),
    ),
  );
}

function why(held) {
  return held ? h("span", { title: held.why }, held.cause) : h("span", { class: "muted" }, "deciding");
}

function waiterRow(w) {
  return h(
    "tr",
    { data: { session: w.session === null ? "" : w.session } },
    h("td", { class: "mono" }, w.session === null ? h("span", { class: "muted" }, "(anonymous)") : w.session),
    h("td", { class: "mono" }, w.log_id || "–"),
    h("td", {}, w.replica),
    h("td", { class: "num waited" }, secs(w.waited_sec)),
    h("td", {}, why(w.held)),
  );
}

function sessionState(s) {
  if (s.held) return h("span", { class: "warn" }, `waiting: ${s.held.cause}`);
  if (s.in_flight) return h("span", { class: "ok" }, s.has_window ? "in flight, window" : "in flight");
  return s.has_window ? "idle, window" : h("span", { class: "muted" }, "idle");
}

function sessionRow(s) {
  const reasons = Object.entries(s.reasons).map(([reason, n]) => `${reason}×${n}`).join(" ");
  return h(
    "tr",
    { data: { session: s.session } },
    h("td", { class: "mono" }, s.session),
    h("td", { class: "mono" }, s.log_id),
    h("td", {}, s.replica),
    h("td", {}, sessionState(s)),
    h("td", { class: "num" }, s.has_window ? s.resident_blocks : "–"),
    h("td", { class: "num" }, secs(s.idle_sec)),
    h("td", { class: "mono" }, reasons),
    h("td", { class: "num" }, s.num_superseded),
    h("td", {}, h("button", {
      type: "button", class: "danger end",
      onclick: () => act(`End session ${s.session}? Its window ends on every replica.`, `/admin/sessions/${encodeURIComponent(s.session)}/finish`, "POST", "session ended"),
    }, "End session")),
  );
}

function renderSessions(page) {
  ui.total = page.total;
  const rows = page.items.map(sessionRow);
  const empty = page.q ? `no session matches “${page.q}”` : "none";
  $("sessions").tBodies[0].replaceChildren(...(rows.length ? rows : [h("tr", {}, h("td", { colspan: 9, class: "muted" }, empty))]));
  $("page").textContent = page.total ? `${page.offset + 1}–${page.offset + page.items.length} of ${page.total}` : "0 of 0";
  $("prev").disabled = page.offset === 0;
  $("next").disabled = page.offset + page.items.length >= page.total;
}

function colors(history) {
  const reasons = [...new Set(Object.values(history.replicas).flatMap((r) => Object.keys(r.admissions)))].sort();
  return new Map(reasons.map((reason, i) => [reason, PALETTE[i % PALETTE.length]]));
}

function chart(name, series, palette, width, height) {
  const n = series.hit_rate.length;
  const step = width / Math.max(1, n);
  const totals = series.hit_rate.map((_, i) => Object.values(series.admissions).reduce((sum, s) => sum + (s[i] || 0), 0));
  const peak = Math.max(1, ...totals);
  const box = svg("svg", { width, height, viewBox: `0 0 ${width} ${height}`, role: "img", "aria-label": `${name}: hit rate and admissions` });
  box.append(svg("rect", { x: 0, y: 0, width, height, fill: "#fafbfc" }));
  for (let i = 0; i < n; i++) {
    let top = height;
    for (const [reason, values] of Object.entries(series.admissions)) {
      const bar = ((values[i] || 0) / peak) * (height - 4);
      if (bar <= 0) continue;
      top -= bar;
      box.append(svg("rect", { x: i * step, y: top, width: Math.max(1, step - 1), height: bar, fill: palette.get(reason), opacity: 0.55 }));
    }
  }
  const points = series.hit_rate.map((rate, i) => (rate === null ? null : `${(i + 0.5) * step},${(1 - rate) * (height - 2) + 1}`));
  for (const run of points.join(" ").split(/\s*null\s*/)) {
    if (run.trim()) box.append(svg("polyline", { points: run.trim(), fill: "none", stroke: "#1d2430", "stroke-width": 1.5 }));
  }
  const last = [...series.hit_rate].reverse().find((x) => x !== null);
  return h("div", { class: "chart" }, h("h3", {}, `${name} · hit rate ${pct(last)} · peak ${peak} admissions / 5 s`), box);
}

function renderHistory(history) {
  const palette = colors(history);
  const names = Object.keys(history.replicas);
  $("charts").replaceChildren(
    ...(names.length ? names.map((name) => chart(name, history.replicas[name], palette, 360, 80)) : [h("p", { class: "muted" }, "collecting: the first point comes after 5 s")]),
  );
  const totals = new Map();
  for (const r of Object.values(history.replicas)) {
    for (const [reason, values] of Object.entries(r.admissions)) totals.set(reason, (totals.get(reason) || 0) + values.reduce((a, b) => a + (b || 0), 0));
  }
  $("legend").replaceChildren(
    h("span", {}, h("i", { class: "line-key" }), "hit rate (0–100%)"),
    ...[...palette].map(([reason, color]) => {
      const key = h("i");
      key.style.background = color;
      return h("span", {}, key, `${reason} ${totals.get(reason) || 0}`);
    }),
  );
}

// ---- the token and the controls ---------------------------------------------------

function signIn() {
  $("login").hidden = true;
  $("status").hidden = false;
  $("logout").hidden = false;
  ui.running = true;
  tick();
  historyTick();
}

function signOut(message) {
  ui.running = false;
  clearTimeout(ui.timer);
  clearTimeout(ui.historyTimer);
  sessionStorage.removeItem(TOKEN_KEY);
  $("status").hidden = true;
  $("logout").hidden = true;
  $("login").hidden = false;
  $("login-error").textContent = message || "";
  $("conn").textContent = "";
  $("summary").textContent = "";
  $("token").focus();
}

function controls() {
  $("login-form").addEventListener("submit", (event) => {
    event.preventDefault();
    sessionStorage.setItem(TOKEN_KEY, $("token").value);
    $("token").value = "";
    signIn();
  });
  $("logout").addEventListener("click", () => signOut(""));
  for (const button of document.querySelectorAll("#views button")) {
    button.addEventListener("click", () => {
      ui.view = button.dataset.view;
      ui.offset = 0;
      for (const other of document.querySelectorAll("#views button")) other.classList.toggle("on", other === button);
      tick();
    });
  }
  let typing = null;
  $("search").addEventListener("input", () => {
    clearTimeout(typing);
    typing = setTimeout(() => {
      ui.q = $("search").value.trim();
      ui.offset = 0;
      tick();
    }, 250);
  });
  $("prev").addEventListener("click", () => {
    ui.offset = Math.max(0, ui.offset - ui.limit);
    tick();
  });
  $("next").addEventListener("click", () => {
    if (ui.offset + ui.limit < ui.total) ui.offset += ui.limit;
    tick();
  });
  document.addEventListener("visibilitychange", () => !document.hidden && ui.running && tick());
}

controls();
if (sessionStorage.getItem(TOKEN_KEY)) signIn();
else signOut("");
