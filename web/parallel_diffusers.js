// Backend status panel of comfyui-parallel-diffusers: ranks, device and memory per rank, resident models,
// the last error, and buttons that unload the models or shut the backend down (freeing its GPUs for
// ComfyUI's own nodes). Data: GET /parallel_diffusers/status, refreshed live by the "parallel_diffusers.status"
// event that the nodes send after every run. tests/test_browser.py drives it in a real ComfyUI.
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";

const UNITS = ["B", "KiB", "MiB", "GiB", "TiB"];

function bytes(n) {
  let i = 0;
  while (n >= 1024 && i < UNITS.length - 1) {
    n /= 1024;
    i++;
  }
  return `${n.toFixed(i && n < 10 ? 1 : 0)} ${UNITS[i]}`;
}

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  Object.assign(node, attrs);
  for (const child of children) node.append(child);
  return node;
}

function table(label, headers, rows) {
  const cell = (c) => el("td", {}, ...(Array.isArray(c) ? c : [String(c)]));
  const node = el("table", {},
    el("thead", {}, el("tr", {}, ...headers.map((h) => el("th", { textContent: h })))),
    el("tbody", {}, ...rows.map((cells) => el("tr", {}, ...cells.map(cell)))));
  node.setAttribute("aria-label", label);  // the table's accessible name: what tests and screen readers find
  return node;
}

// A server time (seconds since the epoch) as the browser's local time of day.
const clock = (seconds) => new Date(seconds * 1000).toLocaleTimeString();

const muted = (text) => el("div", { className: "pd-note", textContent: text });

function device(rank) {
  return rank.device_name && rank.device_name !== rank.device ? [rank.device, muted(rank.device_name)] : rank.device;
}

function memory({ memory: m }) {
  if (!m) return "";
  const free = `${bytes(m.free_bytes)} free of ${bytes(m.total_bytes)}`;
  // On a GPU, what torch holds on that device; on CPU every rank sees the same host memory, so its own RSS.
  if (m.allocated_bytes != null) return [free, muted(`${bytes(m.allocated_bytes)} allocated`)];
  return m.process_rss_bytes != null ? [free, muted(`rank uses ${bytes(m.process_rss_bytes)}`)] : free;
}

function rankList(ranks) {
  const first = ranks[0], last = ranks[ranks.length - 1];
  const contiguous = ranks.length > 2 && last - first === ranks.length - 1;
  return (ranks.length > 1 ? "ranks " : "rank ") + (contiguous ? `${first}–${last}` : ranks.join(", "));
}

// An SPMD model (TP, CP, DP) sits on every rank with the same placement: one entry with its ranks, not N.
// A list, not a table: the sidebar is narrow.
function residentList(ranks) {
  const groups = new Map();
  for (const r of ranks) {
    for (const m of r.resident || []) {
      const parallel = Object.entries(m.parallelism || {}).filter(([, v]) => v > 1)
        .map(([k, v]) => `${k.replace("_degree", "")} ${v}`);
      // The placement is what was asked for; the degrees are read back from the loaded model.
      const where = m.placement + (parallel.length ? ` (applied: ${parallel.join(", ")})` : "");
      const key = JSON.stringify([m.model, m.component, where, m.dtype]);
      if (!groups.has(key)) groups.set(key, { ...m, where, ranks: [] });
      groups.get(key).ranks.push(r.rank);
    }
  }
  const list = el("ul", { className: "pd-models" }, ...[...groups.values()].map((m) => el("li", {},
    el("div", {}, el("b", { textContent: m.component }), ` · ${m.model}`),
    muted(`${rankList(m.ranks)} · ${m.where} · ${m.dtype} · ${bytes(m.parameter_bytes)}`))));
  list.setAttribute("aria-label", "Resident models");
  return groups.size ? list : el("p", { className: "pd-note", textContent: "none" });
}

function post(root, path) {
  return async (event) => {
    event.target.disabled = true;
    try {
      const response = await api.fetchApi(path, { method: "POST" });
      if (!response.ok) throw new Error(`${path}: HTTP ${response.status}`);
      render(root, await response.json());
    } catch (error) {
      root.append(el("p", { className: "pd-error", textContent: String(error) }));
      event.target.disabled = false;
    }
  };
}

function render(root, status) {
  const state = !status.running ? "not running" : status.busy ? "busy" : "idle";
  const header = el("div", { className: "pd-header" },
    el("h3", { textContent: "Parallel backend" }),
    el("span", { className: `pd-state pd-${state.replace(" ", "-")}`, textContent: state }));
  const body = [header];
  if (!status.running) {
    body.push(el("p", { className: "pd-note", textContent: "It starts with the first parallel node that runs." }));
  } else {
    const spec = status.spec || {};
    const startup = status.startup_s ? ` · up in ${status.startup_s.toFixed(0)} s` : "";
    body.push(el("p", { className: "pd-summary",
      textContent: `${status.world_size} ranks on ${status.device} · ${spec.memory_policy} memory policy${startup}` }));
    const ranks = status.ranks || [];
    const hosts = new Set(ranks.map((r) => r.hostname));
    body.push(hosts.size > 1 || status.join
      ? table("Ranks", ["rank", "host", "device", "memory", "pid"],
        ranks.map((r) => [r.rank, r.hostname, device(r), memory(r), r.pid]))
      : table("Ranks", ["rank", "device", "memory", "pid"],
        ranks.map((r) => [r.rank, device(r), memory(r), r.pid])));
    body.push(el("h4", { textContent: "Resident models" }));
    body.push(residentList(ranks));
  }
  if (status.join && status.join.length) {  // a backend over several machines: what to run on the others
    body.push(el("h4", { textContent: "Other machines" }));
    body.push(el("p", { className: "pd-note",
      textContent: "Run on each (it stays up and joins every backend this host starts):" }));
    const commands = status.join.map((command) => el("pre", { className: "pd-command", textContent: command }));
    body.push(...commands);
    body.push(el("p", { className: "pd-note", textContent: `Where ${status.join_secret}.` }));
    // The secret is never in the status (every client of ComfyUI's port gets that): asked for, and answered only to
    // a browser on the ComfyUI host itself (parallel_nodes/routes.py).
    body.push(el("button", { textContent: "Show with the secret",
      title: "Only in a browser on the ComfyUI host; keep the secret private: it lets a machine join",
      onclick: async (event) => {
        event.target.disabled = true;
        const response = await api.fetchApi("/parallel_diffusers/join", { method: "POST" });
        const answer = await response.json().catch(() => ({ error: `HTTP ${response.status}` }));
        if (response.ok) answer.join.forEach((command, i) => { commands[i].textContent = command; });
        else event.target.replaceWith(el("p", { className: "pd-error", textContent: answer.error }));
      } }));
  }
  if (status.last_error) {
    const e = status.last_error;
    const where = [e.op && `in ${e.op}`, e.rank !== null && e.rank !== undefined && `on rank ${e.rank}`]
      .filter(Boolean).join(" ");
    const what = `${e.type || "error"} ${where} at ${clock(e.time)}`;
    if (e.succeeded_since) {  // work succeeded after it: past, folded away, not in red
      body.push(el("details", { className: "pd-past-error" },
        el("summary", { textContent: `Earlier error: ${what} (runs succeeded since ${clock(e.succeeded_since)})` }),
        el("pre", { className: "pd-message", textContent: e.message })));
    } else {
      body.push(el("h4", { textContent: `Last error: ${what}` }));
      body.push(el("pre", { className: "pd-message pd-error", textContent: e.message }));
    }
  }
  body.push(el("div", { className: "pd-buttons" },
    el("button", { textContent: "Unload models", disabled: !status.running || status.busy,
      title: "Free the resident models' memory; the ranks stay up", onclick: post(root, "/parallel_diffusers/free") }),
    el("button", { textContent: "Shut down backend", disabled: !status.running,
      title: "Stop every rank and free its GPU for ComfyUI's own nodes",
      onclick: post(root, "/parallel_diffusers/shutdown") })));
  root.replaceChildren(...body);
}

async function refresh(root) {
  try {
    const response = await api.fetchApi("/parallel_diffusers/status");
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    render(root, await response.json());
  } catch (error) {
    root.replaceChildren(el("p", { className: "pd-error", textContent: `Backend status unavailable: ${error}` }));
  }
}

// ComfyUI's theme variables, so the panel follows the dark and light palettes.
const STYLE = `
.pd-panel { padding: 10px 12px; font-size: 13px; color: var(--fg-color, #ddd); }
.pd-panel .pd-header { display: flex; align-items: center; justify-content: space-between; gap: 8px; }
.pd-panel h3 { margin: 0; font-size: 15px; }
.pd-panel h4 { margin: 14px 0 4px; font-size: 13px; }
.pd-panel p { margin: 6px 0; }
.pd-panel .pd-note, .pd-panel .pd-summary { color: var(--descrip-text, #999); }
.pd-panel .pd-state { border-radius: 9px; padding: 1px 8px; font-size: 12px; white-space: nowrap;
  border: 1px solid var(--border-color, #555); }
.pd-panel .pd-idle { color: #6c6; border-color: #6c6; }
.pd-panel .pd-busy { color: #fc6; border-color: #fc6; }
.pd-panel table { border-collapse: collapse; width: 100%; margin-top: 4px; }
.pd-panel th { font-weight: 600; color: var(--descrip-text, #999); }
.pd-panel td, .pd-panel th { border-bottom: 1px solid var(--border-color, #444); padding: 3px 6px; text-align: left;
  vertical-align: top; }
.pd-panel td .pd-note { font-size: 12px; }
.pd-panel ul.pd-models { list-style: none; margin: 0; padding: 0; }
.pd-panel ul.pd-models li { padding: 4px 0; border-bottom: 1px solid var(--border-color, #444); overflow-wrap: anywhere; }
.pd-panel .pd-error { white-space: pre-wrap; overflow-wrap: anywhere; color: var(--error-text, #f66); }
.pd-panel .pd-message { white-space: pre-wrap; overflow-wrap: anywhere; max-height: 14em; overflow: auto; margin: 4px 0;
  font-size: 12px; }
.pd-panel .pd-past-error { margin-top: 14px; color: var(--descrip-text, #999); }
.pd-panel .pd-past-error summary { cursor: pointer; overflow-wrap: anywhere; }
.pd-panel .pd-command { white-space: pre-wrap; overflow-wrap: anywhere; font-size: 12px; margin: 4px 0;
  padding: 4px 6px; background: var(--comfy-input-bg, #333); border-radius: 4px; user-select: all; }
.pd-panel .pd-buttons { display: flex; gap: 8px; margin-top: 14px; }
.pd-panel button { padding: 4px 10px; border-radius: 4px; cursor: pointer; color: var(--input-text, #ddd);
  background: var(--comfy-input-bg, #333); border: 1px solid var(--border-color, #555); }
.pd-panel button:disabled { opacity: 0.5; cursor: default; }
`;

app.registerExtension({
  name: "parallel_diffusers.status_panel",
  async setup() {
    document.head.append(el("style", { textContent: STYLE }));
    const root = el("div", { className: "pd-panel", id: "parallel-diffusers-panel" });
    api.addEventListener("parallel_diffusers.status", ({ detail }) => render(root, detail));
    if (app.extensionManager?.registerSidebarTab) {
      app.extensionManager.registerSidebarTab({
        id: "parallel-diffusers",
        icon: "pi pi-sitemap",
        title: "Parallel",
        tooltip: "Parallel diffusers backend",
        type: "custom",
        render: (container) => {
          container.append(root);
          refresh(root);
        },
      });
    } else {  // frontends without a sidebar API: a floating panel
      Object.assign(root.style, { position: "fixed", right: "8px", bottom: "8px", zIndex: 1000,
        background: "var(--comfy-menu-bg, #222)", maxWidth: "480px" });
      document.body.append(root);
      refresh(root);
    }
  },
});
