// Backend status panel of comfyui-parallel-diffusers: ranks, device and memory per rank, resident models,
// the last error, and a button that shuts the backend down (freeing its GPUs for ComfyUI's own nodes).
// Data: GET /parallel_diffusers/status, refreshed live by the "parallel_diffusers.status" event.
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";

const GiB = 1024 ** 3;
const fmt = (bytes) => (bytes / GiB).toFixed(bytes < GiB ? 3 : 1) + " GiB";

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  Object.assign(node, attrs);
  for (const child of children) node.append(child);
  return node;
}

function render(root, status) {
  root.replaceChildren();
  root.append(el("h3", { textContent: "Parallel backend" }));
  if (!status.running) {
    root.append(el("p", { className: "pd-state", textContent: "Not running — it starts with the first parallel node." }));
  } else {
    root.append(el("p", {
      className: "pd-state",
      textContent: `${status.world_size} ranks on ${status.device}` + (status.busy ? " — busy" : ""),
    }));
    const table = el("table", { className: "pd-ranks" });
    table.append(el("tr", {}, ...["rank", "device", "memory free", "pid"].map((h) => el("th", { textContent: h }))));
    for (const r of status.ranks || []) {
      const mem = r.memory ? `${fmt(r.memory.free_bytes)} of ${fmt(r.memory.total_bytes)}` : "";
      table.append(el("tr", { className: "pd-rank" },
        ...[r.rank, `${r.device} (${r.device_name})`, mem, r.pid].map((v) => el("td", { textContent: String(v) }))));
    }
    root.append(table);
    const models = (status.ranks || []).flatMap((r) => (r.resident || []).map((m) => ({ rank: r.rank, ...m })));
    root.append(el("h4", { textContent: "Resident models" }));
    const list = el("ul", { className: "pd-models" });
    for (const m of models) {
      list.append(el("li", { textContent: `rank ${m.rank}: ${m.component} of ${m.model} — ${m.placement}, ${m.dtype}, ${fmt(m.parameter_bytes)}` }));
    }
    if (!models.length) list.append(el("li", { textContent: "none" }));
    root.append(list);
  }
  if (status.last_error) {
    root.append(el("h4", { textContent: "Last error" }));
    root.append(el("pre", { className: "pd-error", textContent: status.last_error.message }));
  }
  const button = el("button", { className: "pd-shutdown", textContent: "Shut down backend", disabled: !status.running });
  button.onclick = async () => {
    button.disabled = true;
    render(root, await (await api.fetchApi("/parallel_diffusers/shutdown", { method: "POST" })).json());
  };
  root.append(button);
}

async function refresh(root) {
  try {
    render(root, await (await api.fetchApi("/parallel_diffusers/status")).json());
  } catch (error) {
    root.replaceChildren(el("p", { textContent: `status unavailable: ${error}` }));
  }
}

const STYLE = `
.pd-panel { padding: 8px; font-size: 13px; }
.pd-panel table { border-collapse: collapse; width: 100%; }
.pd-panel td, .pd-panel th { border-bottom: 1px solid #444; padding: 2px 6px; text-align: left; }
.pd-panel pre { white-space: pre-wrap; color: #f88; max-height: 12em; overflow: auto; }
.pd-panel button { margin-top: 8px; }
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
    } else {  // older frontends: a floating panel
      Object.assign(root.style, { position: "fixed", right: "8px", bottom: "8px", zIndex: 1000, background: "#222" });
      document.body.append(root);
      refresh(root);
    }
  },
});
