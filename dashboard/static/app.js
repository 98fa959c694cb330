// remp ops dashboard: polls the JSON API, follows Controller.Watch through /api/events (SSE);
// rollouts are re-read only when an event about one arrives (no polling).
"use strict";

const PHASES = ["QUIESCING", "PREPARING_WORKERS", "MPU_APPLIED", "MIGRATE_KV", "RELOAD_SHARDS",
                "REBINDING", "SERVING_NEW"];
const FINISH = { switch_done: "succeeded", switch_failed: "failed",
                 switch_rolled_back: "rolled_back", switch_aborted: "aborted" };
const state = { cfg: { can_write: false, writes_enabled: false, policy: "" }, nodes: [], live: null,
                liveLog: [], rollouts: [], rollout: null, rolloutSel: null };

const $ = (s, el = document) => el.querySelector(s);
function h(tag, attrs = {}, ...kids) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") el.className = v;
    else if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else if (k === "dataset") Object.assign(el.dataset, v);
    else if (v !== undefined && v !== null && v !== false) el.setAttribute(k, v === true ? "" : v);
  }
  for (const c of kids.flat()) if (c !== null && c !== undefined) el.append(c instanceof Node ? c : String(c));
  return el;
}
const ms = (s) => (s === null || s === undefined) ? "" : (s < 10 ? `${(s * 1000).toFixed(0)} ms` : `${s.toFixed(1)} s`);
function bytes(n) {
  const u = ["B", "KiB", "MiB", "GiB", "TiB"]; let i = 0;
  while (n >= 1024 && i < u.length - 1) { n /= 1024; i++; }
  return i ? `${n.toFixed(1)} ${u[i]}` : `${n} B`;
}
// switches keep TP·PP (world-size changes are not supported yet): offer those targets only
const world = (t) => { const m = /TP(\d+)PP(\d+)/.exec(t || ""); return m ? +m[1] * +m[2] : 0; };
const time_ = (t) => t ? new Date(t * 1000).toLocaleTimeString() : "";
const badge = (text, cls) => h("span", { class: `badge ${cls || text}` }, text);

async function api(path, opts) {
  const r = await fetch(path, { credentials: "same-origin", ...opts });
  const body = await r.json().catch(() => ({}));
  if (r.status === 401 && state.cfg.can_write && path !== "/api/login") {
    state.cfg.can_write = false;  // the session ended (expired, logged out elsewhere, restart)
    accessChanged();
  }
  if (!r.ok) { const e = new Error(body.error || `${r.status}`); e.status = r.status; e.code = body.code; throw e; }
  return body;
}
// writes: JSON + the dashboard's header (no cross-site form or script can send both)
const post = (path, body) => api(path, { method: "POST", body: JSON.stringify(body),
  headers: { "content-type": "application/json", "x-remp-dashboard": "1" } });

// ------------------------------------------------------------------ login (operator session)
async function loadConfig() {
  try { state.cfg = await api("/api/config", { cache: "no-store" }); } catch (e) { /* keep */ }
}

function renderAccess() {
  const c = state.cfg, acc = $("#access");
  acc.textContent = c.can_write ? "operator: approve enabled"
    : c.writes_enabled ? "read-only (log in to approve)" : "read-only";
  acc.className = `badge ${c.can_write ? "ok" : ""}`;
  $("#login").hidden = !c.writes_enabled || c.can_write;
  $("#logout").hidden = !c.can_write;
}

function accessChanged() { renderAccess(); renderNodes(); refreshPolicy(); renderRollout(); }

function loginError(text) {
  const el = $("#login-error");
  el.textContent = text || "";
  el.hidden = !text;
}

async function login(ev) {
  ev.preventDefault();
  const inp = $("#login-token");
  const token = inp.value;
  inp.value = "";
  loginError("");
  try {
    await post("/api/login", { token });
    await loadConfig();
    if (!state.cfg.can_write) loginError("Logged in, but this browser did not keep the session " +
      "cookie: the dashboard marks it Secure, so open the dashboard over HTTPS.");
  } catch (e) { loginError(`Log in: ${e.message}`); }
  accessChanged();
}

async function logout() {
  try { await post("/api/logout", {}); } catch (e) { /* the session is gone either way */ }
  await loadConfig();
  state.cfg.can_write = false;
  accessChanged();
}

// ------------------------------------------------------------------ nodes
async function refreshNodes() {
  try {
    const { nodes } = await api("/api/nodes");
    state.nodes = nodes;
    $("#nodes-error").hidden = true;
    renderNodes();
    for (const n of nodes) if (n.current_switch && (!state.live || state.live.id !== n.current_switch.switch_id)
                               && n.current_switch.outcome === "running") adoptRunning(n.current_switch);
    if (state.cfg.policy) renderPolicyNodes(nodes);
  } catch (e) {
    $("#nodes-error").hidden = false;
    $("#nodes-error").textContent = `controller: ${e.message}`;
  }
}

function renderNodes() {
  const tb = $("#nodes tbody");
  tb.replaceChildren(...state.nodes.map((n) => {
    const actions = h("td");
    if (state.cfg.can_write) {
      const sel = h("select", { "aria-label": "target topology" },
        ...n.candidates.filter((c) => c !== n.observed && world(c) === world(n.observed))
          .map((c) => h("option", { value: c }, c)));
      actions.append(sel, " ", h("button", { class: "reconfigure", onclick: () =>
        reconfigure(n.node, sel.value, "started from the dashboard") }, "Reconfigure"));
    }
    const rec = h("td", { class: "wrap" }, n.recommendation || h("span", { class: "muted" }, "—"));
    if (state.cfg.can_write && n.recommended_target && n.recommended_target !== n.observed && n.health === "ready") {
      rec.append(" ", h("button", { class: "approve", onclick: () =>
        reconfigure(n.node, n.recommended_target, `approved in the dashboard: ${n.recommendation}`) },
        `Approve ${n.recommended_target}`));
    }
    return h("tr", { dataset: { node: n.node } },
      h("td", {}, h("b", {}, n.node), h("div", { class: "muted" }, `${n.host.device_count}× ${n.host.device_type}`)),
      h("td", {}, badge(n.health), n.stale ? badge("stale", "off") : null),
      h("td", { class: "observed" }, n.observed), h("td", {}, n.desired),
      h("td", {}, `${n.lease_age_s.toFixed(1)} s`), h("td", {}, n.epoch),
      h("td", {}, h("code", {}, n.agent_address)), rec, actions);
  }));
  $("#nodes-empty").hidden = state.nodes.length > 0;
}

// the dashboard accepts one line of printable text, at most 500 characters
const oneLine = (t) => Array.from(String(t || "").replace(/(?! )[\p{C}\p{Z}]/gu, " ")).slice(0, 500).join("");

async function reconfigure(node, target, reason, requestId) {
  reason = oneLine(reason);
  try {
    const r = await post("/api/reconfigure", { node, target, reason, request_id: requestId });
    if (r.noop) alert(`${node} already runs ${target}`);
  } catch (e) {
    if (e.status === 401) loginError("Your session ended: log in again to approve or start switches.");
    else alert(`Reconfigure ${node} → ${target}: ${e.message}`);
  }
}

// ------------------------------------------------------------------ live switch
function adoptRunning(sw) {
  startLive(sw.switch_id, sw.node, sw.from, sw.to);
  for (const p of sw.phases) markPhase(p.phase, "done");
  if (sw.phase && PHASES.includes(sw.phase)) markPhase(sw.phase, "active");
}

function startLive(id, node, from, to) {
  state.live = { id, node, t0: null, phases: {} };
  state.liveLog = [];
  $("#live-idle").hidden = true;
  const box = $("#live-switch");
  box.hidden = false;
  box.dataset.switch = id;
  box.dataset.state = "running";
  $("#live-id").textContent = id;
  $("#live-node").textContent = node;
  $("#live-topo").textContent = from && to ? `${from} → ${to}` : "";
  const st = $("#live-state"); st.textContent = "running"; st.className = "badge running";
  $("#live-phases").replaceChildren(...PHASES.map((p) => h("li", { dataset: { phase: p } }, p)));
  $("#live-log").replaceChildren();
}

function markPhase(phase, cls) {
  const ol = $("#live-phases");
  if (cls === "active") for (const li of ol.children) if (li.classList.contains("active")) { li.classList.remove("active"); li.classList.add("done"); }
  const li = ol.querySelector(`li[data-phase="${phase}"]`);
  if (li) { li.classList.remove("active", "done", "failed"); li.classList.add(cls); }
}

function logLine(ev, text) {
  const t0 = state.live.t0 ?? ev.at; state.live.t0 = t0;
  const li = h("li", { dataset: { phase: ev.phase || "", type: ev.type } },
    `+${((ev.at - t0) * 1000).toFixed(0)} ms  ${text}`);
  $("#live-log").append(li);
}

function onEvent(ev) {
  if (ev.type === "switch_phase") {
    if (!state.live || state.live.id !== ev.switch_id) {
      const n = state.nodes.find((x) => x.node === ev.node);
      startLive(ev.switch_id, ev.node, n ? n.observed : "", "");
      const m = /→\s*(TP\d+PP\d+)/.exec(ev.detail || "");
      if (m && n) $("#live-topo").textContent = `${n.observed} → ${m[1]}`;
    }
    if (ev.phase === "SERVING_OLD") logLine(ev, ev.detail || "accepted");
    else {
      markPhase(ev.phase, ev.phase === "ROLLING_BACK" ? "failed" : "active");
      logLine(ev, `${ev.phase}${ev.detail ? "  (" + ev.detail + ")" : ""}`);
    }
    refreshNodes();
  } else if (FINISH[ev.type] !== undefined) {
    if (!state.live || state.live.id !== ev.switch_id) startLive(ev.switch_id, ev.node, "", "");
    const outcome = ev.record ? ev.record.outcome : FINISH[ev.type];
    if (outcome === "succeeded") markPhase("SERVING_NEW", "done");
    if (ev.record) {
      $("#live-topo").textContent = `${ev.record.from} → ${ev.record.to}`;
      for (const p of ev.record.phases) {
        const li = $(`#live-phases li[data-phase="${p.phase}"]`);
        if (li) { li.classList.remove("active"); li.classList.add("done");
                  li.textContent = `${p.phase} ${ms(p.seconds)}`; }
      }
    }
    logLine(ev, `${outcome}${ev.record ? `  total ${ms(ev.record.total_s)}, downtime ${ms(ev.record.downtime_s)}` : ""}`);
    const st = $("#live-state"); st.textContent = outcome; st.className = `badge ${outcome}`;
    $("#live-switch").dataset.state = outcome;
    refreshHistory(); refreshNodes();
  } else if (ev.type === "recommendation" || ev.type === "node_registered" || ev.type === "node_lost") {
    refreshNodes();
  }
  if (ev.type.startsWith("rollout_")) refreshRollouts();
}

function connectEvents() {
  const es = new EventSource("/api/events");
  const s = $("#stream");
  // (re)opened: events sent while this page was not connected are not replayed to it
  es.onopen = () => { s.textContent = "events: live"; s.className = "badge live"; refreshRollouts(); };
  es.onerror = () => { s.textContent = "events: reconnecting"; s.className = "badge off"; };
  es.addEventListener("watch_error", (m) => { s.textContent = "events: controller error"; s.className = "badge off"; });
  // some events were trimmed before the dashboard's stream resumed: re-read what they changed
  es.addEventListener("watch_gap", () => { refreshHistory(); refreshNodes(); refreshRollouts(); });
  es.onmessage = (m) => { try { onEvent(JSON.parse(m.data)); } catch (e) { console.error(e); } };
}

// ------------------------------------------------------------------ history
async function refreshHistory() {
  let sw;
  try { ({ switches: sw } = await api("/api/switches")); } catch (e) { return; }
  $("#history tbody").replaceChildren(...sw.map((s) => switchRow(s)));
  $("#history-empty").hidden = sw.length > 0;
}

function switchRow(s) {
  return h("tr", { id: `sw-${s.switch_id}`, dataset: { switch: s.switch_id, outcome: s.outcome } },
    h("td", {}, time_(s.started_at)), h("td", {}, h("code", {}, s.switch_id)), h("td", {}, s.node),
    h("td", {}, `${s.from} → ${s.to}`), h("td", {}, badge(s.outcome)),
    h("td", {}, ms(s.total_s)), h("td", {}, ms(s.downtime_s)),
    h("td", { class: "wrap phases-cell" }, s.phases.map((p) => `${p.phase} ${ms(p.seconds)}`).join(" · ")
      || (s.error ? `${s.error.code}: ${s.error.message}` : "")),
    h("td", {}, bytes(s.kv_bytes_moved)), h("td", {}, bytes(s.weight_bytes_loaded)),
    h("td", {}, `${s.requests_in_flight} / ${s.requests_held} / ${s.requests_preempted}`),
    h("td", { class: "wrap" }, s.reason));
}

// ------------------------------------------------------------------ rollouts
// Re-read when the shared Watch says a rollout changed: one read in flight, at most one queued
// (a burst of events costs two reads).
let roBusy = false, roAgain = false;
async function refreshRollouts() {
  if (roBusy) { roAgain = true; return; }
  roBusy = true;
  try {
    do {
      roAgain = false;
      await loadRollouts();
    } while (roAgain);
  } finally { roBusy = false; }
}

async function loadRollouts() {
  try {
    const { rollouts } = await api("/api/rollouts");
    state.rollouts = rollouts;
    $("#rollouts-error").hidden = true;
  } catch (e) {
    $("#rollouts-error").hidden = false;
    $("#rollouts-error").textContent = `controller: ${e.message}`;
    return;
  }
  // nothing chosen yet: follow the newest rollout that is still going
  if (!state.rolloutSel) {
    const going = state.rollouts.find((r) => !r.terminal);
    if (going) state.rolloutSel = going.rollout_id;
  }
  renderRollouts();
  if (state.rolloutSel) await loadRollout(state.rolloutSel);
}

function renderRollouts() {
  $("#rollouts-table tbody").replaceChildren(...state.rollouts.map((r) => {
    const p = r.progress;
    return h("tr", { dataset: { rollout: r.rollout_id, status: r.status },
                     class: r.rollout_id === state.rolloutSel ? "selected" : "" },
      h("td", {}, time_(r.created_at)),
      h("td", {}, h("a", { href: `#rollout-detail`, onclick: () => selectRollout(r.rollout_id) },
        h("code", {}, r.rollout_id))),
      h("td", {}, r.target), h("td", { class: "wrap" }, r.nodes_in_set.join(", ")),
      h("td", {}, `${(r.floor * 100).toFixed(0)} %`), h("td", {}, r.max_parallel),
      h("td", {}, badge(r.status), r.pause_requested ? " pausing" : "", r.abort_requested ? " aborting" : ""),
      h("td", { class: "ro-waves" }, `${p.waves_done} / ${p.waves}`),
      h("td", { class: "ro-counts" }, `${p.switched} / ${p.failed} / ${p.pending + p.switching}`
        + (p.switching ? ` (${p.switching} switching)` : "")));
  }));
  $("#rollouts-empty").hidden = state.rollouts.length > 0;
}

async function selectRollout(id) {
  state.rolloutSel = id;
  renderRollouts();
  await loadRollout(id);
}

async function loadRollout(id) {
  try {
    state.rollout = await api(`/api/rollouts/${encodeURIComponent(id)}`);
  } catch (e) {
    state.rollout = null;
    $("#rollout-detail").hidden = false;
    $("#ro-action-error").hidden = false;
    $("#ro-action-error").textContent = `rollout ${id}: ${e.message}`;
    return;
  }
  renderRollout();
}

const cap = (v) => (v === null || v === undefined) ? "—" : `${+v.toFixed(2)} req/s`;
function renderRollout() {
  const r = state.rollout, box = $("#rollout-detail");
  if (!r || r.rollout_id !== state.rolloutSel) return;
  box.hidden = false;
  box.dataset.rollout = r.rollout_id;
  box.dataset.status = r.status;
  $("#ro-id").textContent = r.rollout_id;
  $("#ro-target").textContent = `→ ${r.target}`;
  const st = $("#ro-state"); st.textContent = r.status + (r.pause_requested ? " (pausing after this wave)" : "")
    + (r.abort_requested ? " (aborting)" : ""); st.className = `badge ${r.status}`;
  const acts = $("#ro-actions");
  acts.replaceChildren();
  if (state.cfg.can_write && !r.terminal) {
    for (const action of ["pause", "resume", "abort"]) {
      acts.append(h("button", { class: `ro-${action}`, dataset: { action },
        onclick: () => controlRollout(r.rollout_id, action) }, action[0].toUpperCase() + action.slice(1)), " ");
    }
  }
  $("#ro-capacity").textContent = `capacity floor ${(r.floor * 100).toFixed(0)} %: at least ` +
    `${cap(r.required_capacity)} of ${cap(r.base_capacity)} when planned; the set serves ` +
    `${cap(r.capacity_now)} now (ready nodes, by the rollout's capacity table) · at most ` +
    `${r.max_parallel} at once` + (r.description ? ` · ${r.description}` : "");
  const why = $("#ro-reason");
  why.hidden = !(r.reason || r.failed_node);
  why.className = r.status === "failed" ? "error" : "";
  why.textContent = (r.failed_node ? `failed on ${r.failed_node}` : "") +
    (r.failed_node && r.reason ? ": " : "") + (r.reason || "");
  const byNode = Object.fromEntries(r.nodes.map((n) => [n.node, n]));
  const rows = [];
  for (const w of r.waves) {
    w.nodes.forEach((name, i) => {
      const n = byNode[name] || { status: "", switch_id: "", outcome: "", error: "" };
      rows.push(h("tr", { dataset: { roNode: name, status: n.status },
                          class: w.index === r.wave && r.status === "running" ? "current" : "" },
        i ? null : h("td", { rowspan: w.nodes.length }, `${w.index}`),
        i ? null : h("td", { rowspan: w.nodes.length }, `${cap(w.capacity_during)} / ${cap(w.capacity_after)}`),
        h("td", {}, name), h("td", {}, n.status ? badge(n.status) : ""),
        h("td", {}, n.switch_id ? h("a", { href: `#sw-${n.switch_id}`, class: "switch-link",
          onclick: (ev) => showSwitch(ev, n.switch_id) }, h("code", {}, n.switch_id)) : ""),
        h("td", { class: "wrap" }, [n.outcome, n.error].filter(Boolean).join(": "))));
    });
  }
  $("#ro-nodes tbody").replaceChildren(...rows);
  $("#ro-other").replaceChildren(
    ...r.skipped.map((n) => h("li", {}, `${n}: already on ${r.target}`)),
    ...r.excluded.map((e) => h("li", {}, `${e.node}: not switched (${e.why})`)));
}

// the switch record: its row in the history when shown there, else read and shown here
async function showSwitch(ev, id) {
  const row = document.getElementById(`sw-${id}`);
  const box = $("#ro-switch");
  if (row) { box.hidden = true; row.classList.add("picked"); setTimeout(() => row.classList.remove("picked"), 2000); return; }
  ev.preventDefault();
  try {
    const s = await api(`/api/switch?id=${encodeURIComponent(id)}`);
    box.replaceChildren(h("table", {}, h("thead", {}, h("tr", {}, ...["started", "switch", "node", "from → to",
      "outcome", "total", "downtime", "phases", "KV moved", "weights", "in flight / held / preempted", "reason"]
      .map((t) => h("th", {}, t)))), h("tbody", {}, switchRow(s))));
  } catch (e) { box.replaceChildren(h("p", { class: "error" }, `switch ${id}: ${e.message}`)); }
  box.hidden = false;
}

async function controlRollout(id, action) {
  const err = $("#ro-action-error");
  err.hidden = true;
  if (action === "abort" && !confirm(`Abort rollout ${id}? Switches still abortable are aborted; nothing further starts.`)) return;
  try {
    await post("/api/control-rollout", { rollout_id: id, action });
    await loadRollout(id);  // the event it causes re-reads the list too
  } catch (e) {
    err.hidden = false;
    // the controller's refusal as it gave it (e.g. FAILED_PRECONDITION: cannot resume …)
    err.textContent = `${action} ${id}: ${e.code ? e.code + ": " : ""}${e.message}`;
    if (e.status === 401) loginError("Your session ended: log in again to pause, resume or abort rollouts.");
  }
}

// ------------------------------------------------------------------ policy
function renderPolicyNodes(nodes) {
  const box = $("#policy-nodes");
  for (const n of nodes) {
    if (box.querySelector(`[data-policy-node="${n.node}"]`)) continue;
    box.append(h("div", { dataset: { policyNode: n.node } },
      h("h3", {}, `${n.node} `, h("span", { class: "muted fc-meta" })),
      h("div", { class: "legend" },
        h("span", {}, h("i", { class: "obs" }), "observed req/s"),
        h("span", {}, h("i", { class: "past" }), "forecast made then (1 window ahead)"),
        h("span", {}, h("i", { class: "fc" }), "forecast ahead (band: scenarios)")),
      h("div", { class: "chart-box" }),
      h("table", { class: "decisions" }, h("thead", {}, h("tr", {},
        ...["time", "mode", "current → recommended", "switch?", "reason", "outcome", ""].map((t) => h("th", {}, t)))),
        h("tbody"))));
  }
}

async function refreshPolicy() {
  if (!state.cfg.policy) return;
  for (const el of document.querySelectorAll("[data-policy-node]")) {
    const node = el.dataset.policyNode;
    let p;
    try { p = await api(`/api/policy?node=${encodeURIComponent(node)}`); }
    catch (e) { $(".fc-meta", el).textContent = `policy: ${e.message}`; continue; }
    const f = p.forecast;
    $(".fc-meta", el).textContent = `forecaster ${f.forecaster || "—"}` +
      (Number.isFinite(f.backtest_error) ? `, backtest error ${(f.backtest_error * 100).toFixed(0)}%` : "");
    $(".chart-box", el).replaceChildren(chart(f));
    $("tbody", el).replaceChildren(...p.decisions.map((d) => {
      const act = h("td");
      if (state.cfg.can_write && d.mode === "advisory" && d.switch) {
        act.append(h("button", { class: "approve", onclick: () =>
          reconfigure(d.node, d.recommended, `approved in the dashboard: policy decision ${d.id}`, d.id) },
          `Approve ${d.recommended}`));
      }
      return h("tr", { dataset: { decision: d.id } }, h("td", {}, time_(d.at)), h("td", {}, d.mode),
        h("td", {}, `${d.current} → ${d.recommended}`), h("td", {}, d.switch ? "yes" : "no"),
        h("td", { class: "wrap" }, d.reason), h("td", { class: "wrap" }, d.outcome,
          d.switch_id ? h("div", {}, h("code", {}, d.switch_id)) : null), act);
    }));
  }
}

function chart(f) {
  const W = 900, H = 220, L = 44, R = 10, T = 10, B = 24;
  const ns = "http://www.w3.org/2000/svg";
  const svg = document.createElementNS(ns, "svg");
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`); svg.setAttribute("class", "chart");
  const obs = f.observed.map((o) => [o.t, o.rate]);
  const past = (f.past || []).map((p) => [p.t, p.mean]);
  const pts = f.points.map((p) => [p.t, p.mean, p.lower, p.upper]);
  const all = [...obs, ...past, ...pts];
  const add = (tag, attrs, text) => { const e = document.createElementNS(ns, tag);
    for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v); if (text) e.textContent = text; svg.append(e); return e; };
  if (!all.length) { add("text", { x: L, y: H / 2 }, "no traffic seen yet"); return svg; }
  const t0 = Math.min(...all.map((a) => a[0])), t1 = Math.max(...all.map((a) => a[0])) || t0 + 1;
  const ymax = Math.max(0.1, ...obs.map((a) => a[1]), ...past.map((a) => a[1]), ...pts.map((a) => Math.min(a[3], a[1] * 3)));
  const x = (t) => L + (W - L - R) * (t1 > t0 ? (t - t0) / (t1 - t0) : 0.5);
  const y = (v) => T + (H - T - B) * (1 - Math.min(v, ymax * 1.05) / (ymax * 1.05));
  add("line", { x1: L, y1: H - B, x2: W - R, y2: H - B, class: "axis" });
  add("line", { x1: L, y1: T, x2: L, y2: H - B, class: "axis" });
  for (const v of [0, ymax / 2, ymax]) add("text", { x: 2, y: y(v) + 3 }, v.toFixed(2));
  add("text", { x: L, y: H - 6 }, time_(t0)); add("text", { x: W - R - 60, y: H - 6 }, time_(t1));
  const line = (arr, cls) => arr.length && add("path", { class: cls,
    d: arr.map((a, i) => `${i ? "L" : "M"}${x(a[0]).toFixed(1)},${y(a[1]).toFixed(1)}`).join("") });
  if (pts.length) add("path", { class: "band", d: pts.map((a, i) => `${i ? "L" : "M"}${x(a[0]).toFixed(1)},${y(a[3]).toFixed(1)}`).join("")
    + [...pts].reverse().map((a) => `L${x(a[0]).toFixed(1)},${y(a[2]).toFixed(1)}`).join("") + "Z" });
  line(obs, "obs"); line(past, "past"); line(pts, "fc");
  return svg;
}

// ------------------------------------------------------------------ GPU-hours saved
const num = (v, d = 2) => (v === null || v === undefined) ? "—" : v.toFixed(d);
function recText(node, r, err) {
  if (!r) return `${node}: no recommendation${err ? ` (${err})` : ""}`;
  const saving = r.objective === "latency"
    ? `expected TPOT saving ${num(r.expected_tpot_saving_ms, 1)} ms`
    : `expected saving ${num(r.expected_saving_gpu_hours, 3)} GPU-h vs the whole host over ` +
      `${num((r.saving_horizon_s || 0) / 60, 0)} min`;
  return `${node}: ${r.current} → ${r.recommended}${r.switch ? "" : " (stay)"} · ` +
    `${r.gpus}/${r.host_gpus} GPUs` + (r.released_gpus.length ? `, releases ${r.released_gpus.join(", ")}` : "") +
    ((r.unreleased_gpus || []).length
      ? ` (not freed: ${r.unreleased_gpus.join(", ")} keep their memory when parked)` : "") +
    ` · ${saving} · expected SLO loss ${num((r.expected_slo_loss || 0) * 100, 2)} % · ` +
    `objective ${r.objective || "—"}, profile ${r.profile || "—"}` + (r.decision_id ? ` · ${r.decision_id}` : "");
}

async function refreshSaving() {
  const rows = [], recs = [];
  for (const n of state.nodes) {
    let s;
    try { s = await api(`/api/saving?node=${encodeURIComponent(n.node)}`); }
    catch (e) { recs.push(h("li", { class: "error" }, `${n.node}: ${e.message}`)); continue; }
    for (const d of s.days) {
      rows.push(h("tr", { dataset: { savingNode: s.node, day: d.day } }, h("td", {}, s.node), h("td", {}, d.day),
        h("td", {}, num(d.observed_hours, 2)), h("td", {}, num(d.gpu_hours, 2)),
        h("td", {}, `${num(d.host_gpu_hours, 2)} (${s.host_gpus} GPUs)`),
        h("td", {}, d.fraction === null ? "—" : `${(d.fraction * 100).toFixed(1)} %`),
        h("td", {}, `${num(d.saved_gpu_hours, 2)} GPU-h`)));
    }
    const held = s.held_now;
    recs.push(h("li", { dataset: { savingHeld: s.node } }, !held.reported
      ? `${s.node}: ${s.gpus_now}/${s.host_gpus} GPUs (${s.observed || "—"}); released ranks not reported yet`
      : `${s.node}: holds ${held.holding.length}/${s.host_gpus} GPUs (${s.observed || "—"})` +
        (held.released.length ? `; released, measured by the agent: ranks ${held.released.join(", ")}` : "")));
    recs.push(h("li", { dataset: { savingRec: s.node } }, recText(s.node, s.recommendation, s.recommendation_error)));
  }
  $("#saving-table tbody").replaceChildren(...rows);
  $("#saving-empty").hidden = rows.length > 0;
  $("#saving-recs").replaceChildren(...recs);
}

// ------------------------------------------------------------------ start
async function main() {
  await loadConfig();
  $("#ctl-addr").textContent = state.cfg.controller || "?";
  $("#pol-addr").textContent = state.cfg.policy || "none";
  $("#login").addEventListener("submit", login);
  $("#logout").addEventListener("click", logout);
  renderAccess();
  $("#policy-none").hidden = !!state.cfg.policy;
  connectEvents();
  await refreshNodes(); await refreshHistory(); await refreshRollouts(); await refreshPolicy(); await refreshSaving();
  setInterval(refreshNodes, 2000);
  setInterval(refreshSaving, 15000);
  setInterval(refreshHistory, 5000);
  setInterval(refreshPolicy, 5000);
}
main();
