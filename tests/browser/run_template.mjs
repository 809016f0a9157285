// Drives a real ComfyUI page the way a user would: open the template browser, pick one of this pack's
// example workflows, make it small, click Run, wait for the image, and optionally open the pack's status
// panel and press its "Shut down backend" button. Screenshots go to <out_dir>; one JSON line on stdout
// reports what the DOM showed, for tests/test_browser.py and example_workflows/make_thumbnails.py to check.
//
//   node tests/browser/run_template.mjs <base_url> <template> <out_dir> [options]
//     --size N        width and height of the image (default 64)
//     --steps N       sampler steps (default 3)
//     --panel         open the status panel afterwards and screenshot it
//     --shutdown      then press "Shut down backend" (implies --panel)
//     --graph F       save a 2048x1152 PNG of the graph alone, output image included, to F (the thumbnails:
//                     the canvas drops node text below ~60 % zoom, so it is drawn large and scaled down later)
//     --timeout S     seconds to wait for the image (default 300)
//
// Chromium is Debian's (PD_CHROMIUM, default /usr/bin/chromium), never a download. The network is closed
// where this runs, so every background service that would keep dialling out is off.
import fs from "node:fs";
import path from "node:path";
import { parseArgs } from "node:util";
import { chromium } from "playwright-core";

const { values: opt, positionals } = parseArgs({
  allowPositionals: true,
  options: {
    size: { type: "string", default: "64" },
    steps: { type: "string", default: "3" },
    panel: { type: "boolean", default: false },
    shutdown: { type: "boolean", default: false },
    graph: { type: "string" },
    timeout: { type: "string", default: "300" },
  },
});
const [baseUrl, template, outDir] = positionals;
if (!outDir) {
  console.error("usage: node run_template.mjs <base_url> <template> <out_dir> [--size N] [--steps N] [--panel] " +
    "[--shutdown] [--graph F] [--timeout S]");
  process.exit(2);
}
const PACK = "comfyui-parallel-diffusers";
const imageTimeout = Number(opt.timeout) * 1000;
const UI_TIMEOUT = 120_000;  // page loads and clicks; the box may be busy, so generous
fs.mkdirSync(outDir, { recursive: true });

const report = { template, screenshots: [], console_errors: [] };
const VIEWPORT = { width: 1920, height: 1080 };
const browser = await chromium.launch({
  executablePath: process.env.PD_CHROMIUM || "/usr/bin/chromium",
  headless: true,
  args: ["--no-sandbox", "--disable-gpu", "--disable-quic", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run"],
  // launch() gives every run a fresh, temporary --user-data-dir of its own and removes it on close.
});
try {
  const page = await browser.newPage({ viewport: VIEWPORT });
  page.setDefaultTimeout(UI_TIMEOUT);
  page.on("pageerror", (e) => report.console_errors.push(String(e)));
  const shot = async (name, target = page) => {
    const file = path.join(outDir, name);
    await target.screenshot({ path: file });
    report.screenshots.push(file);
  };

  // A fresh user directory would open the template browser by itself, racing our own click on it.
  const settings = await fetch(`${baseUrl}/settings/Comfy.TutorialCompleted`, { method: "POST", body: "true" });
  if (!settings.ok) throw new Error(`POST /settings/Comfy.TutorialCompleted: HTTP ${settings.status}`);

  await page.goto(baseUrl);
  await page.waitForFunction(() => window.app?.graph && window.app?.extensionManager, null, { timeout: UI_TIMEOUT });
  // Cosmetic: the frontend's "Introducing Nodes 2.0" banner covers the top of every screenshot.
  const banner = page.getByText("Introducing Nodes 2.0").locator("xpath=../..").getByRole("button").last();
  if (await banner.isVisible()) await banner.click();

  // The template browser lists custom nodes' example_workflows under the pack's name.
  await page.getByRole("button", { name: "Templates", exact: true }).click();
  await page.getByRole("button", { name: PACK, exact: true }).click();
  // The card's thumbnail is example_workflows/<template>.jpg (make_thumbnails.py); null while there is none.
  const card = page.getByRole("img", { name: template, exact: true });
  // The pack's cards fill more than one screen, and the browser shows only those in view: search for the one we run.
  await page.getByPlaceholder("Search").first().fill(template);
  report.card_thumbnail_width = await card
    .evaluate((img) => new Promise((done) => {
      if (img.complete) done(img.naturalWidth || null);
      img.addEventListener("load", () => done(img.naturalWidth));
      img.addEventListener("error", () => done(null));
    }), null, { timeout: 15_000 })
    .catch(() => null);
  await shot("templates.png");
  await page.getByText(template, { exact: true }).first().click();
  await page.waitForFunction((name) => window.app.graph.nodes.some((n) => n.type === "ParallelSampler")
    && document.title.includes(name), template, { timeout: UI_TIMEOUT });
  await page.evaluate(() => window.app.extensionManager.command.execute("Comfy.Canvas.FitView"));

  // The template as shipped asks for 1024² and 28 steps on every GPU. Its widgets are painted on the
  // LiteGraph <canvas>, so there is no DOM field to type into: change the values through app.graph, as a
  // user dragging them would, and leave the file itself as users get it.
  const size = Number(opt.size), steps = Number(opt.steps);
  report.widgets = await page.evaluate(({ size, steps }) => {
    const changed = {};
    const set = (node, name, value) => {
      const widget = node.widgets?.find((w) => w.name === name);
      if (!widget) return;
      widget.value = value;
      widget.callback?.(value);
      changed[`${node.type}.${name}`] = value;
    };
    for (const node of window.app.graph.nodes) {
      if (node.type === "ParallelBackend") {
        set(node, "device", "cpu");
        // 0 means "one rank per GPU"; on CPU that is 2. A workflow that names its ranks (4 for TP×CP) keeps them.
        if (!node.widgets.find((w) => w.name === "ranks").value) set(node, "ranks", 2);
      }
      if (node.type === "ParallelSampler") {
        set(node, "width", size);
        set(node, "height", size);
        set(node, "steps", steps);
        set(node, "control_after_generate", "fixed");  // the seed of the file, so a thumbnail can be remade
      }
      if (node.type === "VAEDecodeSingleGPU") set(node, "device", "cpu");
    }
    window.app.graph.setDirtyCanvas(true, true);
    return changed;
  }, { size, steps });

  // ComfyUI's own events say when the prompt ends; an error ends the wait at once, with its message.
  await page.evaluate(() => {
    window.__pd_run = { executed: [], error: null, done: false };
    const api = window.app.api;
    api.addEventListener("executed", ({ detail }) => window.__pd_run.executed.push(detail));
    api.addEventListener("execution_error", ({ detail }) => { window.__pd_run.error = detail; });
    api.addEventListener("execution_interrupted", ({ detail }) => {
      window.__pd_run.error = { ...detail, exception_type: "interrupted", exception_message: "" };
    });
    api.addEventListener("execution_success", () => { window.__pd_run.done = true; });
  });
  // Newer frontends also name the run-mode menu's trigger "Run"; the button itself opens no menu.
  await page.getByRole("button", { name: "Run", exact: true }).and(page.locator(":not([aria-haspopup])")).click();
  // A prompt that fails validation never executes: the frontend keeps the server's node errors instead.
  await page.waitForFunction(() => window.__pd_run.done || window.__pd_run.error
    || Object.keys(window.app.lastNodeErrors || {}).length, null, { timeout: imageTimeout });
  const run = await page.evaluate(() => ({ ...window.__pd_run, node_errors: window.app.lastNodeErrors }));
  if (!run.done && !run.error) throw new Error(`the prompt was refused: ${JSON.stringify(run.node_errors)}`);
  if (run.error) {
    throw new Error(`the workflow failed in node ${run.error.node_id} (${run.error.node_type}): ` +
      `${run.error.exception_type}: ${run.error.exception_message}`);
  }
  const saved = run.executed.flatMap((e) => e.output?.images || []);
  if (!saved.length) throw new Error(`no node reported an image: ${JSON.stringify(run.executed)}`);
  const filename = saved[0].filename;

  // The saving node (SaveImage; a clip's SaveAnimatedWEBP) shows it (painted on the canvas from an <img> the
  // frontend keeps)...
  await page.waitForFunction((file) => {
    const node = window.app.graph.nodes.find((n) => ["SaveImage", "SaveAnimatedWEBP"].includes(n.type));
    const img = node?.imgs?.[0];
    return img?.complete && img.naturalWidth > 0 && img.src.includes(encodeURIComponent(file));
  }, filename, { timeout: UI_TIMEOUT });
  // ...and the page shows it as an element (frontend 1.32: the queue's latest-result preview).
  const shown = page.locator(`img[src*="filename=${encodeURIComponent(filename)}"]`).first();
  await shown.waitFor({ state: "visible", timeout: UI_TIMEOUT });
  await page.waitForFunction((img) => img.complete && img.naturalWidth > 0, await shown.elementHandle());
  report.image = await shown.evaluate((img) => ({
    filename: new URL(img.src).searchParams.get("filename"), natural_width: img.naturalWidth,
    natural_height: img.naturalHeight, visible: img.getBoundingClientRect().width > 0,
  }));
  await shot(`${template}_run.png`);

  if (opt.graph) {
    // Only the graph, every node in view: focus mode hides ComfyUI's menus and panels.
    const size = { width: 2048, height: 1152 };
    await page.setViewportSize(size);
    await page.waitForFunction(({ width }) => window.app.canvas.canvas.clientWidth === width, size);
    await page.evaluate(async () => {
      const { setting } = window.app.extensionManager;
      await setting.set("Comfy.Graph.CanvasInfo", false);  // the render statistics in the corner
      await setting.set("Comfy.Graph.CanvasMenu", false);  // the zoom buttons
      window.app.extensionManager.focusMode = true;
      // ComfyUI's "Fit view" leaves a quarter of the picture empty; frame the nodes' bounds tightly instead.
      const canvas = window.app.canvas, pad = 48;
      const boxes = window.app.graph.nodes.map((n) => n.getBounding());
      const x0 = Math.min(...boxes.map((b) => b[0])), y0 = Math.min(...boxes.map((b) => b[1]));
      const x1 = Math.max(...boxes.map((b) => b[0] + b[2])), y1 = Math.max(...boxes.map((b) => b[1] + b[3]));
      const width = canvas.canvas.clientWidth, height = canvas.canvas.clientHeight;
      const scale = Math.min((width - 2 * pad) / (x1 - x0), (height - 2 * pad) / (y1 - y0));
      canvas.ds.scale = scale;  // screen = (graph + offset) * scale, centred
      canvas.ds.offset = [width / 2 / scale - (x0 + x1) / 2, height / 2 / scale - (y0 + y1) / 2];
      canvas.setDirty(true, true);
    });
    await page.waitForFunction(() => new Promise((done) => requestAnimationFrame(() => done(true))));
    await page.screenshot({ path: opt.graph });
    report.graph = opt.graph;
    await page.evaluate(() => { window.app.extensionManager.focusMode = false; });
    await page.setViewportSize(VIEWPORT);
  }

  if (opt.panel || opt.shutdown) {
    await page.getByRole("button", { name: "Parallel diffusers backend" }).click();
    const panel = page.locator("#parallel-diffusers-panel");
    const rows = panel.getByRole("table", { name: "Ranks" }).locator("tbody tr");
    await rows.first().waitFor({ state: "visible" });
    report.panel = {
      ranks: await rows.count(),
      rank_cells: await rows.evaluateAll((trs) => trs.map((tr) => [...tr.cells].map((td) => td.innerText))),
      models: await panel.getByRole("list", { name: "Resident models" }).getByRole("listitem").count(),
      text: await panel.innerText(),
    };
    // The last error: unfolded when it is shown as past, and whether any of it is cut off at the panel's edge.
    const past = panel.locator(".pd-past-error");
    if (await past.count()) {
      await past.locator("summary").click();
      await past.locator(".pd-message").waitFor({ state: "visible" });
    }
    report.panel.error = await panel.evaluate((p) => {
      const message = p.querySelector(".pd-message");
      const heading = p.querySelector(".pd-past-error summary") || [...p.querySelectorAll("h4")].pop();
      const cut = (n) => n.scrollWidth > n.clientWidth + 1;
      return message && {
        past: Boolean(p.querySelector(".pd-past-error")),
        red: message.classList.contains("pd-error"),
        heading: heading.innerText,
        message: message.innerText,
        cut_off: cut(p) || cut(message) || cut(heading),
      };
    });
    await shot("status_panel.png", panel);
    await shot("status_panel_page.png");

    if (opt.shutdown) {
      await panel.getByRole("button", { name: "Shut down backend" }).click();
      await panel.getByText("not running", { exact: true }).waitFor({ state: "visible" });
      const status = await page.evaluate(async () => (await window.app.api.fetchApi("/parallel_diffusers/status")).json());
      report.after_shutdown = { text: await panel.innerText(), status_running: status.running };
      await shot("status_panel_after_shutdown.png", panel);
    }
  }
} catch (error) {
  report.error = String(error?.stack || error);
  process.exitCode = 1;
} finally {
  await browser.close();
  console.log(JSON.stringify(report));
}
