"""The pack in a real browser: headless Chromium (Debian's, driven by playwright-core) on a real ComfyUI.

tests/browser/run_template.mjs opens ComfyUI's template browser, picks this pack's flux1_device_map, makes it
small (2 CPU ranks, 64x64, 3 steps), clicks Run, waits for the image, opens the pack's status panel and
presses "Shut down backend"; it reports what the DOM showed as one JSON line, which this test checks. The
shipped workflow loads unchanged: a tiny random FLUX.1 sits under its placeholder name, FLUX.1-dev. Before it, a
prompt over the API fails (a rank killed while the backend idles): the panel must show that error as past, with
its time, wrapped to its width (it stayed in red as "Last error" after later runs succeeded, cut off at the edge).

Screenshots land in the test's tmp dir; with PD_SAVE_SCREENSHOTS=1 they are also copied to docs/screenshots/.
Needs COMFYUI_DIR, /usr/bin/chromium (or PD_CHROMIUM), node, and `npm ci` in tests/browser (.ci/run does all).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
from comfyui_host import REPO_ROOT
from comfyui_workflows import backend_status, small_workflow, worker_pids

BROWSER_DIR = REPO_ROOT / "tests" / "browser"
SCRIPT = BROWSER_DIR / "run_template.mjs"
SCREENSHOTS = REPO_ROOT / "docs" / "screenshots"
CHROMIUM = os.environ.get("PD_CHROMIUM", "/usr/bin/chromium")
TEMPLATE, PLACEHOLDER_MODEL, SIZE = "flux1_device_map", "FLUX.1-dev", 64


def _browser_missing() -> str | None:
    if not os.access(CHROMIUM, os.X_OK):
        return f"no Chromium at {CHROMIUM}: `apt-get install chromium`, or point PD_CHROMIUM at one"
    if shutil.which("node") is None:
        return "no node on PATH: install Node.js 20+ to run the browser test"
    if not (BROWSER_DIR / "node_modules" / "playwright-core").is_dir():
        return "playwright-core is not installed: run `npm ci` in tests/browser"
    return None


pytestmark = [
    pytest.mark.comfyui,
    pytest.mark.multirank,
    pytest.mark.skipif(_browser_missing() is not None, reason=str(_browser_missing())),
]


@pytest.fixture
def placeholder_model(comfyui_models_dir) -> Path:
    """A tiny FLUX.1 under the name the shipped workflow uses; removed afterwards, because the server is shared
    and test_e2e_comfyui checks that the placeholder, as shipped, is refused."""
    from parallel_runtime.families.flux.tiny import make_tiny_model as make_tiny_flux

    path = Path(comfyui_models_dir) / PLACEHOLDER_MODEL
    make_tiny_flux(str(path))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_template_runs_from_the_browser_and_the_panel_lists_two_ranks(comfyui_server, placeholder_model, tmp_path):
    comfyui_server.run(small_workflow(seed=1, steps=1, model=PLACEHOLDER_MODEL), timeout=240)
    os.kill(worker_pids(comfyui_server)[1], signal.SIGKILL)
    comfyui_server.run(small_workflow(seed=2, steps=1, model=PLACEHOLDER_MODEL), timeout=240, expect="execution_error")
    failed = backend_status(comfyui_server)["last_error"]
    assert failed["type"] == "BackendDied" and "succeeded_since" not in failed, failed
    command = [
        "node",
        str(SCRIPT),
        comfyui_server.base_url,
        TEMPLATE,
        str(tmp_path),
        "--size",
        str(SIZE),
        "--steps",
        "3",
        "--shutdown",
    ]
    proc = subprocess.run(
        command,
        check=False,
        cwd=BROWSER_DIR,
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "PD_CHROMIUM": CHROMIUM},
    )
    lines = proc.stdout.strip().splitlines()
    assert lines, f"{' '.join(command)} printed nothing (exit {proc.returncode}):\n{proc.stderr[-4000:]}"
    report = json.loads(lines[-1])
    context = (
        f"\n--- report ---\n{json.dumps(report, indent=1)[:6000]}\n--- stderr ---\n{proc.stderr[-2000:]}"
        f"\n--- ComfyUI log tail ---\n{comfyui_server.log_tail(60)}"
    )
    if os.environ.get("PD_SAVE_SCREENSHOTS") == "1":  # keep them even when the test fails: they show why
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        for shot in report.get("screenshots", []):
            shutil.copy(shot, SCREENSHOTS / Path(shot).name)
    assert "error" not in report and proc.returncode == 0, context

    # The template browser showed the card with its thumbnail (example_workflows/make_thumbnails.py).
    assert report["card_thumbnail_width"] == 1024, context

    # The widgets changed in the page, and the image the run saved is on the page at that size.
    assert report["widgets"]["ParallelBackend.ranks"] == 2 and report["widgets"]["ParallelSampler.steps"] == 3, context
    image = report["image"]
    assert image["visible"] and (image["natural_width"], image["natural_height"]) == (SIZE, SIZE), context
    assert (comfyui_server.output_dir / image["filename"]).is_file(), context

    # The panel lists both ranks, their device, and the models the run left resident.
    panel = report["panel"]
    assert panel["ranks"] == 2, context
    assert [cells[0] for cells in panel["rank_cells"]] == ["0", "1"], context
    assert all(cells[1] == "cpu" and "free of" in cells[2] for cells in panel["rank_cells"]), context
    assert panel["models"] >= 1 and PLACEHOLDER_MODEL in panel["text"], context

    # The error before the template's run is shown as past (folded, not red), with its time, and nothing of it is
    # cut off at the panel's edge.
    error = panel["error"]
    assert error and error["past"] and not error["red"], context
    past = r"Earlier error: BackendDied .* at \d{1,2}:\d\d:\d\d.*runs succeeded since"
    assert re.match(past, error["heading"]), context
    assert "the parallel backend failed" in error["message"] and not error["cut_off"], context

    # "Shut down backend" stopped it: the panel says so, and so does the route.
    assert "not running" in report["after_shutdown"]["text"], context
    assert report["after_shutdown"]["status_running"] is False, context
    assert comfyui_server.get_json("/parallel_diffusers/status")["running"] is False, context

    ours = [e for e in report["console_errors"] if "parallel_diffusers" in e]
    assert ours == [], context
