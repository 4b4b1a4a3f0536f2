// The Shardgate dashboard: polls the admin JSON API and renders it with plain DOM calls.
// Every value from the broker (client ids, topics, names) is set through textContent, never
// parsed as HTML: a client id is whatever a device sent.
"use strict";

const INFO_INTERVAL_MS = 1000;
const DETAIL_INTERVAL_MS = 2000;
let chartWindowS = 900;      // the server's history span (/api/history), 15 minutes

const RATE_WINDOW_S = 10;    // rates are averaged over the last 10 s, not one poll's instant
const samples = [];          // {t, in, out} message rates for the chart, oldest first
let lastInfo = null;         // the previous /api/info
const recentInfo = [];       // the /api/info answers of the last RATE_WINDOW_S, oldest first

// ------------------------------------------------------------------ helpers
function $(id) { return document.getElementById(id); }

function el(tag, props, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(props || {})) {
    if (value === undefined || value === null) continue;
    if (key === "className") node.className = value;
    else if (key === "text") node.textContent = String(value);
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else if (key === "dataset") Object.assign(node.dataset, value);
    else node.setAttribute(key, String(value));
  }
  for (const child of children) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function num(value) {
  if (value === null || value === undefined) return "–";
  if (typeof value !== "number") return String(value);
  if (Math.abs(value) >= 100 || Number.isInteger(value)) return Math.round(value).toLocaleString();
  return value.toFixed(1);
}

function bytes(value) {
  if (value === null || value === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (Math.abs(value) >= 1024 && i < units.length - 1) { value /= 1024; i++; }
  return (i === 0 ? Math.round(value) : value.toFixed(1)) + " " + units[i];
}

function duration(seconds) {
  seconds = Math.max(0, Math.floor(seconds));
  const d = Math.floor(seconds / 86400), h = Math.floor(seconds % 86400 / 3600);
  const m = Math.floor(seconds % 3600 / 60), s = seconds % 60;
  if (d) return `${d}d ${h}h`;
  if (h) return `${h}h ${m}m`;
  if (m) return `${m}m ${s}s`;
  return `${s}s`;
}

function since(unixSeconds) {
  if (!unixSeconds) return "–";
  return new Date(unixSeconds * 1000).toLocaleTimeString();
}

// Cluster nodes that did not answer the last cluster-wide listings (their part is missing).
const unanswered = new Map();

async function getJSON(path) {
  const response = await fetch(path, { headers: { Accept: "application/json" }, cache: "no-store" });
  const body = await response.json().catch(() => ({}));
  if (!response.ok) throw new Error(body.error || `${response.status} ${response.statusText}`);
  const missing = response.headers.get("Shardgate-Unanswered-Nodes");
  if (missing) for (const { node, reason } of JSON.parse(missing)) unanswered.set(node, reason);
  return body;
}

function fillTable(tbody, rows, columns, emptyText) {
  if (!rows.length) {
    tbody.replaceChildren(el("tr", {}, el("td", { className: "empty", colspan: columns, text: emptyText })));
  } else {
    tbody.replaceChildren(...rows);
  }
}

function cell(value, className) { return el("td", { className, text: value }); }

function setLinkState(ok, text) {
  const node = $("link-state");
  node.className = "state " + (ok ? "ok" : "down");
  node.textContent = text;
}

// ------------------------------------------------------------------ overview
function renderInfo(info) {
  $("version").textContent = "v" + info.version;
  $("uptime").textContent = "up " + duration(info.uptime_s);
  recentInfo.push(info);
  while (recentInfo.length > 2 && recentInfo[0].now < info.now - RATE_WINDOW_S) recentInfo.shift();
  const oldest = recentInfo[0];
  if (oldest !== info && info.now > oldest.now && (!lastInfo || info.now > lastInfo.now)) {
    const dt = info.now - oldest.now;
    const rate = (key) => Math.max(0, (info[key] - oldest[key]) / dt);
    const sample = { t: info.now, in: rate("messages_in"), out: rate("messages_out") };
    $("rate-in").textContent = num(sample.in);
    $("rate-out").textContent = num(sample.out);
    $("rate-bytes-in").textContent = bytes(rate("bytes_in"));
    $("rate-bytes-out").textContent = bytes(rate("bytes_out"));
    addSample(sample);
    drawChart();
  }
  lastInfo = info;
  const byProtocol = Object.entries(info.connections || {});
  $("connections").textContent = num(byProtocol.reduce((total, [, n]) => total + n, 0));
  $("connections-by-protocol").textContent = byProtocol.map(([p, n]) => `${p} ${n}`).join(" · ");
  $("dropped").textContent = num(info.messages_dropped);
  $("count-streams").textContent = num(info.streams);
  $("count-subscriptions").textContent = num(info.subscriptions);
  $("count-sessions").textContent = num(info.sessions);
  $("count-retained").textContent = num(info.retained);
  $("listeners").textContent = "Listeners: " +
    info.listeners.map((l) => `${l.name} ${l.host}:${l.port}`).join(", ");
  if (info.node) renderNode(info.node);
}

// This node's resources and alarms (resources.py): memory against the high watermark, open
// descriptors against their limit, free disk against disk_free_limit.
function renderNode(node) {
  $("node-memory").textContent = bytes(node.rss_bytes);
  $("node-memory-limit").textContent = node.memory_limit_bytes ? `watermark ${bytes(node.memory_limit_bytes)}` : "no watermark";
  $("node-descriptors").textContent = num(node.open_descriptors);
  $("node-descriptor-limit").textContent = node.descriptor_limit ? `limit ${num(node.descriptor_limit)}` : "";
  $("node-disk").textContent = bytes(node.disk_free_bytes);
  $("node-disk-limit").textContent = node.disk_free_limit_bytes ? `limit ${bytes(node.disk_free_limit_bytes)}` : "no limit";
  const alarms = node.alarms || [];
  const value = $("node-alarms");
  value.textContent = alarms.length ? alarms.join(", ") : "none";
  value.className = "value" + (alarms.length ? " lagging" : "");
  value.dataset.alarms = alarms.join(" ");
}

// Every node's resources (/api/nodes: in a cluster one row per node, whichever node serves
// the page); a node that did not answer says so.
function renderNodes(nodes) {
  const against = (value, limit, format) => format(value) + (limit ? ` / ${format(limit)}` : "");
  const rows = nodes.map((node) => {
    const name = node.node || "this node";
    if (node.unanswered) {
      return el("tr", { dataset: { node: name } }, cell(name),
        el("td", { className: "lagging", colspan: 5, text: `no answer: ${node.unanswered}` }));
    }
    const alarms = node.alarms || [];
    const connections = Object.values(node.connections || {}).reduce((total, n) => total + n, 0);
    return el("tr", { dataset: { node: name, alarms: alarms.join(" ") } }, cell(name),
      cell(against(node.rss_bytes, node.memory_limit_bytes, bytes), "num"),
      cell(against(node.open_descriptors, node.descriptor_limit, num), "num"),
      cell(against(node.disk_free_bytes, node.disk_free_limit_bytes, bytes), "num"),
      cell(alarms.length ? alarms.join(", ") : "none", alarms.length ? "lagging" : ""),
      cell(num(connections), "num"));
  });
  fillTable($("nodes-body"), rows, 6, "No nodes");
}

function addSample(sample) {
  samples.push(sample);
  while (samples.length && samples[0].t < sample.t - chartWindowS) samples.shift();
}

// The server keeps the last minutes of counters: draw them at once on page load.
async function loadHistory() {
  try {
    const history = await getJSON("/api/history");
    chartWindowS = history.span_s || chartWindowS;
    const points = history.samples || [];
    for (let i = 1; i < points.length; i++) {
      const previous = points[i - 1], point = points[i], dt = point.t - previous.t;
      if (dt <= 0) continue;
      addSample({
        t: point.t,
        in: Math.max(0, (point.messages_in - previous.messages_in) / dt),
        out: Math.max(0, (point.messages_out - previous.messages_out) / dt),
      });
    }
    drawChart();
  } catch (error) {
    // an older broker without /api/history: the chart fills from the live samples
  }
}

function drawChart() {
  const canvas = $("rate-chart");
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth || canvas.width, height = canvas.clientHeight || canvas.height;
  if (canvas.width !== Math.round(width * ratio)) canvas.width = Math.round(width * ratio);
  if (canvas.height !== Math.round(height * ratio)) canvas.height = Math.round(height * ratio);
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.clearRect(0, 0, width, height);
  const style = getComputedStyle(document.documentElement);
  const color = (name) => style.getPropertyValue(name).trim();
  const left = 56, right = 8, top = 10, bottom = 22;
  const plotW = width - left - right, plotH = height - top - bottom;
  const peak = Math.max(1, ...samples.map((s) => Math.max(s.in, s.out)));
  const max = niceCeiling(peak);
  ctx.font = "11px system-ui, sans-serif";
  ctx.fillStyle = color("--muted");
  ctx.strokeStyle = color("--line");
  ctx.lineWidth = 1;
  for (let i = 0; i <= 4; i++) {
    const y = top + plotH - (plotH * i) / 4;
    ctx.beginPath(); ctx.moveTo(left, y); ctx.lineTo(left + plotW, y); ctx.stroke();
    ctx.textAlign = "right"; ctx.textBaseline = "middle";
    ctx.fillText(num((max * i) / 4), left - 6, y);
  }
  const windowS = chartWindowS;
  $("chart-window").textContent = duration(windowS);
  if (samples.length < 2) return;
  const newest = samples[samples.length - 1].t;
  const x = (t) => left + plotW - ((newest - t) / windowS) * plotW;
  // the time axis: five clock times across the window
  ctx.fillStyle = color("--muted");
  ctx.textBaseline = "top";
  for (let i = 0; i <= 4; i++) {
    const t = newest - windowS + (windowS * i) / 4;
    ctx.textAlign = i === 0 ? "left" : i === 4 ? "right" : "center";
    ctx.fillText(new Date(t * 1000).toLocaleTimeString([], { hour: "2-digit", minute: "2-digit" }),
                 x(t), top + plotH + 6);
  }
  const y = (v) => top + plotH - (v / max) * plotH;
  for (const [key, name] of [["in", "--in"], ["out", "--out"]]) {
    ctx.strokeStyle = color(name);
    ctx.lineWidth = 2;
    ctx.beginPath();
    samples.forEach((s, i) => (i ? ctx.lineTo(x(s.t), y(s[key])) : ctx.moveTo(x(s.t), y(s[key]))));
    ctx.stroke();
  }
}

function niceCeiling(value) {
  const power = Math.pow(10, Math.floor(Math.log10(value)));
  for (const step of [1, 2, 5, 10]) if (value <= step * power) return step * power;
  return 10 * power;
}

// ------------------------------------------------------------------ tables
// Each stream's messages per second, averaged over the last RATE_WINDOW_S of polls: the
// growth of its message count (the sum of its shards' next offsets).
const streamCounts = new Map();  // name → [{t, messages}], oldest first

function streamRate(stream, now) {
  if (typeof stream.messages !== "number") return null;
  const counts = streamCounts.get(stream.name) || [];
  counts.push({ t: now, messages: stream.messages });
  while (counts.length > 2 && counts[0].t < now - RATE_WINDOW_S) counts.shift();
  streamCounts.set(stream.name, counts);
  const oldest = counts[0];
  if (counts.length < 2 || now <= oldest.t) return null;
  return Math.max(0, (stream.messages - oldest.messages) / (now - oldest.t));
}

function renderStreams(streams) {
  const rows = [];
  const now = Date.now() / 1000;
  const names = new Set(streams.map((stream) => stream.name));
  for (const name of [...streamCounts.keys()]) if (!names.has(name)) streamCounts.delete(name);
  for (const stream of streams) {
    const rate = streamRate(stream, now);
    stream.shards.forEach((shard, i) => {
      const first = i === 0;
      rows.push(el("tr", { className: first ? "" : "sub-row", dataset: { stream: stream.name, shard: shard.index } },
        el("td", {}, first ? el("code", { text: stream.name }) : stream.name,
           first && stream.default ? el("span", { className: "muted", text: " (default)" }) : null),
        cell(first ? stream.mode : ""),
        cell(first ? stream.schema : ""),
        cell(first ? num(rate) : "", "num rate"),
        cell(shard.index, "num"),
        cell(shard.owner || "", shard.unavailable ? "owner lagging" : "owner"),
        cell(shard.low_watermark === undefined ? (shard.unavailable ? "" : "memory") : num(shard.low_watermark), "num"),
        cell(shard.unavailable ? "no answer" : num(shard.next_offset), "num"),
        cell(shard.segments === undefined ? "" : num(shard.segments), "num"),
        cell(shard.size_bytes === undefined ? "" : bytes(shard.size_bytes), "num"),
        el("td", {}, first ? el("code", { text: stream.routes.join(" ") }) : "")));
    });
  }
  fillTable($("streams-body"), rows, 11, "No streams");
}

// A change: a JSON POST (the admin API wants Content-Type: application/json or an
// X-Requested-With header of every change; a page of another origin cannot send either
// without a CORS preflight the API never grants).
async function postJSON(path, body) {
  const response = await fetch(path, {
    method: "POST", body: JSON.stringify(body || {}),
    headers: { Accept: "application/json", "Content-Type": "application/json" },
  });
  const answer = await response.json().catch(() => ({}));
  if (!response.ok) throw new Error(answer.error || `${response.status} ${response.statusText}`);
  return answer;
}

// Purge (cursors to the end: the backlog is skipped) or replay (cursors to the earliest
// message) a durable subscription; both ask first.
async function moveCursors(button, sub, action) {
  const question = action === "purge"
    ? `Purge subscription ${sub.name}? Its ${sub.lag} waiting messages are skipped.`
    : `Replay subscription ${sub.name} from the earliest message kept?`;
  if (!window.confirm(question)) return;
  button.disabled = true;
  const status = $("subscription-status");
  const path = `/api/subscriptions/${encodeURIComponent(sub.name)}/` + (action === "purge" ? "purge" : "cursor");
  try {
    const answer = await postJSON(path, action === "purge" ? {} : { position: "earliest" });
    // in a cluster, the node that holds the subscription acted: named
    const where = answer.node ? ` on node ${answer.node}` : "";
    status.textContent = action === "purge"
      ? `Purged ${sub.name}${where}: ${num(answer.purged)} messages skipped`
      : `Replaying ${sub.name}${where} from the earliest message: lag ${num(answer.lag)}`;
  } catch (error) {
    status.textContent = `Could not ${action} ${sub.name}: ${error.message}`;
  }
  button.disabled = false;
  refreshDetails();
}

function subscriptionActions(sub) {
  // Only a durable subscription has cursors; in a cluster, the node holding it moves them.
  if (!sub.durable) return el("td", {});
  const purge = el("button", { type: "button", className: "kick", title: "Skip the backlog: cursors to the end", text: "Purge" });
  const replay = el("button", { type: "button", className: "action", title: "Cursors to the earliest message kept", text: "Replay" });
  purge.addEventListener("click", () => moveCursors(purge, sub, "purge"));
  replay.addEventListener("click", () => moveCursors(replay, sub, "replay"));
  return el("td", { className: "actions" }, replay, purge);
}

function renderSubscriptions(subscriptions) {
  // A subscription without a filter receives nothing (an MQTT session that only publishes).
  const rows = subscriptions.filter((sub) => sub.filters.length).map((sub) => el("tr", { dataset: { subscription: sub.name } },
    el("td", {}, el("code", { text: sub.name })),
    cell(sub.type), cell(sub.protocol), cell(sub.durable ? "yes" : "no"),
    el("td", {}, el("code", { text: sub.filters.join(" ") })),
    // a subscription spread over several nodes (an MQTT share group): each consumer's node
    cell(sub.consumers.map((c) => c.id + ((sub.nodes || []).length > 1 && c.node ? ` on ${c.node}` : "")
      + (c.active ? "" : " (standby)")).join(", ") || "none"),
    cell(num(sub.lag), "num" + (sub.lag > 0 ? " lagging" : "")),
    cell(num(sub.inflight), "num"), cell(num(sub.queued), "num"), cell(sub.node || "", "node"),
    subscriptionActions(sub)));
  fillTable($("subscriptions-body"), rows, 11, "No subscriptions");
}

async function kick(button, client) {
  button.disabled = true;
  const status = $("kick-status");
  try {
    const path = `/api/clients/${encodeURIComponent(client.protocol)}/${encodeURIComponent(client.client_id)}`;
    // A change: sent with X-Requested-With, which the admin API requires of every change (a
    // page of another origin cannot send it without a CORS preflight the API never grants).
    const response = await fetch(path, {
      method: "DELETE", headers: { Accept: "application/json", "X-Requested-With": "shardgate-dashboard" },
    });
    const body = await response.json().catch(() => ({}));
    if (!response.ok) throw new Error(body.error || `${response.status} ${response.statusText}`);
    status.textContent = `Kicked ${client.protocol} client ${client.client_id}`;
  } catch (error) {
    status.textContent = `Could not kick ${client.client_id}: ${error.message}`;
    button.disabled = false;
  }
  refreshDetails();
}

// The clients table shows one page of the clients matching the search box.
const CLIENTS_PER_PAGE = 50;
let allClients = [];
let clientsPage = 0;

function matchingClients() {
  const words = $("client-search").value.trim().toLowerCase().split(/\s+/).filter(Boolean);
  if (!words.length) return allClients;
  return allClients.filter((client) => {
    const text = [client.client_id, client.username || "", client.protocol, client.remote || "",
                  client.node || ""].join(" ").toLowerCase();
    return words.every((word) => text.includes(word));
  });
}

function renderClients(clients) {
  if (clients !== undefined) allClients = clients;
  const matching = matchingClients();
  const pages = Math.max(1, Math.ceil(matching.length / CLIENTS_PER_PAGE));
  clientsPage = Math.min(clientsPage, pages - 1);
  const first = clientsPage * CLIENTS_PER_PAGE;
  const shown = matching.slice(first, first + CLIENTS_PER_PAGE);
  $("clients-page").textContent = matching.length
    ? `${num(first + 1)}–${num(first + shown.length)} of ${num(matching.length)}` +
      (matching.length < allClients.length ? ` (${num(allClients.length)} connected)` : "")
    : `0 of ${num(allClients.length)}`;
  $("clients-prev").disabled = clientsPage === 0;
  $("clients-next").disabled = clientsPage >= pages - 1;
  const rows = shown.map((client) => {
    const button = client.kickable
      ? el("button", { type: "button", className: "kick", title: "Disconnect this client", text: "Kick" })
      : null;
    if (button) button.addEventListener("click", () => kick(button, client));
    return el("tr", { dataset: { protocol: client.protocol, clientId: client.client_id } },
      cell(client.protocol),
      el("td", {}, el("code", { className: "client-id", text: client.client_id })),
      cell(client.username || ""), cell(client.remote), cell(since(client.connected_at)),
      cell(num(client.messages_in), "num"), cell(num(client.messages_out), "num"),
      cell(client.detail), cell(client.node || "", "node"), el("td", {}, button));
  });
  fillTable($("clients-body"), rows, 10, allClients.length ? "No client matches" : "No clients connected");
}

function renderSessions(sessions, subscriptions) {
  // What a session has waiting: its own queue, or (persistent sessions) what its subscription
  // has not delivered yet, kept in the journal: an offline session's lag is its backlog.
  const lag = new Map((subscriptions || []).map((sub) => [sub.name, sub.lag || 0]));
  const rows = sessions.map((s) => el("tr", { dataset: { clientId: s.client_id } },
    el("td", {}, el("code", { text: s.client_id })),
    cell(s.connected ? "connected" : "offline" + (s.disconnected_at ? " since " + since(s.disconnected_at) : "")),
    cell(expiry(s.expiry_interval)),
    el("td", {}, el("code", { text: s.filters.concat(s.shared).join(" ") })),
    cell(num(Math.max(s.queued, lag.get("mqtt:" + s.client_id) || 0)), "num"),
    cell(num(s.inflight), "num"), cell(num(s.dropped), "num")));
  fillTable($("sessions-body"), rows, 7, "No sessions");
}

// Retained messages whose topic starts with the prefix typed, the first RETAINED_SHOWN of
// them; a payload that is not UTF-8 is shown as base64, marked so.
const RETAINED_SHOWN = 100;

async function refreshRetained() {
  const prefix = $("retained-prefix").value;
  const answer = await getJSON(`/api/retained?limit=${RETAINED_SHOWN}&prefix=${encodeURIComponent(prefix)}`);
  if (prefix !== $("retained-prefix").value) return;  // typed on meanwhile: a newer answer comes
  const messages = answer.messages || [];
  $("retained-count").textContent = answer.total > messages.length
    ? `first ${num(messages.length)} of ${num(answer.total)}` : `${num(answer.total)} retained`;
  const rows = messages.map((m) => el("tr", { dataset: { topic: m.topic } },
    el("td", {}, el("code", { text: m.topic })), cell(m.qos, "num"), cell(bytes(m.size), "num"),
    cell(m.content_type || ""), cell(since(m.publish_time)), cell(m.stream),
    el("td", {}, el("code", { className: "payload", text: m.payload + (m.truncated ? "…" : "") }),
       m.payload_encoding === "base64" ? el("span", { className: "muted", text: " (base64)" }) : null)));
  fillTable($("retained-body"), rows, 7, prefix ? "No retained message under this prefix" : "No retained messages");
}

// MQTT 5.0 §3.1.2.11.2: 0xFFFFFFFF (and a 3.1.1 persistent session) never expires.
const NEVER_EXPIRES = 0xFFFFFFFF;

function expiry(seconds) {
  if (seconds === null || seconds === undefined) return "–";
  if (seconds >= NEVER_EXPIRES) return "never";
  return seconds ? duration(seconds) : "at disconnect";
}

function renderArchive(archive) {
  const body = $("archive-body");
  if (!archive.enabled) {
    body.replaceChildren(el("p", { className: "muted", text: "Archiving to object storage is not configured." }));
    return;
  }
  // Scalars as a short key/value list, the per-shard status as a table.
  const list = el("dl", { className: "kv" });
  for (const [key, value] of Object.entries(archive)) {
    if (key === "enabled" || key === "shards" || (typeof value === "object" && value !== null)) continue;
    list.append(el("dt", { text: key.replaceAll("_", " ") }),
                el("dd", { text: typeof value === "number" ? num(value) : String(value) }));
  }
  const shards = Array.isArray(archive.shards) ? archive.shards : [];
  const head = el("thead", {}, el("tr", {},
    ...["Stream", "Shard", "Journal", "Archived up to", "Lag", "Files", "Size"].map((h, i) =>
      el("th", { className: i >= 3 ? "num" : "", text: h }))));
  const tbody = el("tbody", { id: "archive-shards" });
  fillTable(tbody, shards.map((s) => el("tr", { dataset: { stream: s.stream, shard: s.shard } },
    el("td", {}, el("code", { text: s.stream })), cell(s.shard),
    cell(`${num(s.journal_low)}..${num(s.journal_next)}`),
    cell(num(s.archived_up_to), "num"), cell(num(s.lag_records), "num" + (s.lag_records > 0 ? " lagging" : "")),
    cell(num(s.files), "num"), cell(bytes(s.bytes), "num"))), 7, "No reliable streams");
  body.replaceChildren(list, el("table", { className: "archive" }, head, tbody));
}

// The cluster's nodes as this node sees them (/api/cluster); hidden on a single node.
function renderCluster(cluster) {
  const section = $("cluster");
  section.hidden = $("cluster-link").hidden = !cluster;
  if (!cluster) return;
  const unavailable = cluster.unavailable_shards || [];
  $("cluster-summary").textContent =
    `Cluster ${cluster.cluster}: ${cluster.nodes.length} nodes, ${num(cluster.shards)} shards of ` +
    `${num(cluster.streams)} streams; this page is served by ${cluster.node_id}` +
    (cluster.lease_alive ? "" : " (its lease is not alive: it serves no shards)") +
    (unavailable.length ? `; unavailable: ${unavailable.join(", ")}` : "") +
    (unanswered.size ? "; did not answer (their streams' figures, subscriptions and clients are " +
      `missing below): ${[...unanswered].map(([node, reason]) => `${node} (${reason})`).join(", ")}` : "");
  const rows = cluster.nodes.map((n) => {
    const roles = [];
    if (n.controller) roles.push("controller");
    if (n.node_id === cluster.node_id) roles.push("this node");
    if (n.leaving) roles.push("leaving");
    const listeners = Object.entries(n.listeners || {})
      .filter(([name]) => name !== "cluster").map(([name, address]) => `${name} ${address}`).join(", ");
    return el("tr", { dataset: { node: n.node_id, controller: n.controller ? "yes" : "no" } },
      el("td", {}, el("code", { text: n.node_id })), cell(roles.join(", ")),
      el("td", {}, el("code", { text: n.cluster_address })), cell(listeners),
      cell(num(n.shards), "num shards"), cell(num(n.sessions), "num"), cell(num(n.load), "num"),
      cell(n.started_ms ? since(n.started_ms / 1000) : "–"));
  });
  fillTable($("cluster-body"), rows, 8, "No nodes registered");
}

async function refreshCluster() {
  // /api/info names this node's cluster id; a single node has none (and no /api/cluster)
  renderCluster(lastInfo && lastInfo.cluster_node ? await getJSON("/api/cluster") : null);
}

// ------------------------------------------------------------------ polling
async function refreshInfo() {
  try {
    renderInfo(await getJSON("/api/info"));
    setLinkState(true, "live");
  } catch (error) {
    setLinkState(false, "broker unreachable");
  }
}

let detailsRunning = false;
async function refreshDetails() {
  if (detailsRunning) return;
  detailsRunning = true;
  try {
    unanswered.clear();
    const [streams, subscriptions, clients, sessions, archive, nodes] = await Promise.all(
      ["/api/streams", "/api/subscriptions", "/api/clients", "/api/sessions", "/api/archive",
       "/api/nodes"].map(getJSON));
    renderNodes(nodes);
    renderStreams(streams);
    renderSubscriptions(subscriptions);
    renderClients(clients);
    renderSessions(sessions, subscriptions);
    renderArchive(archive);
    await refreshRetained();
    await refreshCluster();
  } catch (error) {
    setLinkState(false, "broker unreachable");
  } finally {
    detailsRunning = false;
  }
}

function every(ms, task) {
  task();
  setInterval(() => { if (!document.hidden) task(); }, ms);
}

document.addEventListener("DOMContentLoaded", () => {
  loadHistory();
  every(INFO_INTERVAL_MS, refreshInfo);
  every(DETAIL_INTERVAL_MS, refreshDetails);
  window.addEventListener("resize", drawChart);
  $("client-search").addEventListener("input", () => { clientsPage = 0; renderClients(); });
  $("retained-prefix").addEventListener("input", () => refreshRetained().catch(() => {}));
  $("clients-prev").addEventListener("click", () => { clientsPage = Math.max(0, clientsPage - 1); renderClients(); });
  $("clients-next").addEventListener("click", () => { clientsPage += 1; renderClients(); });
  drawChart();
});
