"""Thumbnails for ComfyUI's template browser: <name>.jpg beside every example_workflows/<name>.json, from a real run.

    COMFYUI_DIR=/path/to/ComfyUI .venv/bin/python example_workflows/make_thumbnails.py [name ...] [--skip name ...]

Rerun it whenever a workflow is added or changed (no names: every example_workflows/*.json). One real ComfyUI
(tests/comfyui_host.py) gets tiny random models under the workflows' placeholder names (FLUX.1-dev, FLUX.2-dev,
Qwen-Image) and tiny random LoRAs under their LoRA placeholders' (FLUX.1-dev-lora.safetensors), so each workflow loads
unchanged; headless Chromium (tests/browser/run_template.mjs) opens it from the
template browser, makes it small in the page (CPU ranks: 2 where it asks for "one per GPU", its own number
otherwise; 384x384; 3 steps), clicks Run and photographs the graph with its output image, which becomes a 1024x576
JPEG. The models are random, so the image is noise: the thumbnail shows the graph that made it.

Needs what tests/test_browser.py needs: Debian's chromium, node, and `npm ci` in tests/browser. A tool, never part
of the test run; a workflow with 4 ranks takes minutes on a 2-core machine (--skip it there).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
WORKFLOWS = REPO_ROOT / "example_workflows"
DRIVER = REPO_ROOT / "tests" / "browser" / "run_template.mjs"
THUMBNAIL_SIZE = (1024, 576)

sys.path[:0] = [str(REPO_ROOT), str(REPO_ROOT / "tests")]

from comfyui_host import ComfyUIServer  # noqa: E402
from PIL import Image  # noqa: E402

from parallel_runtime.examples import LORA_PLACEHOLDERS, PLACEHOLDERS, make_stand_ins  # noqa: E402


def placeholders(workflow: Path) -> set[str]:
    """The model and LoRA names a UI workflow's widgets ask for."""
    nodes = json.loads(workflow.read_text())["nodes"]
    known = {*PLACEHOLDERS, *LORA_PLACEHOLDERS}
    return {v for n in nodes for v in n.get("widgets_values") or [] if isinstance(v, str) and v in known}


def thumbnail(server: ComfyUIServer, name: str, work: Path, size: int, timeout: int) -> Path:
    """Run one template in the browser and write example_workflows/<name>.jpg; raises with the driver's report."""
    shot = work / f"{name}_graph.png"
    command = [
        "node",
        str(DRIVER),
        server.base_url,
        name,
        str(work / name),
        "--size",
        str(size),
        "--steps",
        "3",
        "--graph",
        str(shot),
        "--timeout",
        str(timeout),
    ]
    proc = subprocess.run(command, cwd=DRIVER.parent, capture_output=True, text=True, check=False)
    lines = proc.stdout.strip().splitlines()
    report = json.loads(lines[-1]) if lines else {"error": proc.stderr[-4000:]}
    if "error" in report or proc.returncode:
        raise RuntimeError(f"{name}: {report.get('error')}\n--- ComfyUI log tail ---\n{server.log_tail(40)}")
    out = WORKFLOWS / f"{name}.jpg"
    Image.open(shot).convert("RGB").resize(THUMBNAIL_SIZE, Image.LANCZOS).save(out, quality=85, optimize=True)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="workflow names (default: every example_workflows/*.json)")
    parser.add_argument("--skip", nargs="*", default=[], help="workflow names to leave out")
    parser.add_argument("--comfyui", default=os.environ.get("COMFYUI_DIR"), help="ComfyUI checkout (COMFYUI_DIR)")
    parser.add_argument("--size", type=int, default=384, help="image width and height (default 384)")
    parser.add_argument("--timeout", type=int, default=900, help="seconds one run may take (default 900)")
    args = parser.parse_args()
    if not args.comfyui:
        parser.error("set COMFYUI_DIR (or --comfyui) to a ComfyUI checkout; .ci/install-comfyui.sh makes one")
    names = args.names or sorted(p.stem for p in WORKFLOWS.glob("*.json"))
    names = [n for n in names if n not in args.skip]
    missing = [n for n in names if not (WORKFLOWS / f"{n}.json").is_file()]
    if missing:
        parser.error(f"no example_workflows/<name>.json for {missing}")

    with tempfile.TemporaryDirectory(prefix="pd-thumbnails-") as tmp:
        work, models, loras = Path(tmp), Path(tmp) / "models", Path(tmp) / "loras"
        wanted = set().union(*(placeholders(WORKFLOWS / f"{n}.json") for n in names))
        wanted |= {LORA_PLACEHOLDERS[lora] for lora in wanted & set(LORA_PLACEHOLDERS)}
        loras.mkdir()
        server = ComfyUIServer(args.comfyui, diffusers_dir=models, loras_dir=loras)
        make_stand_ins(str(models), str(loras), str(server.input_dir), wanted & set(PLACEHOLDERS), args.size)
        server.start()
        failed = []
        try:
            for name in names:
                try:
                    print(f"{name}: wrote {thumbnail(server, name, work, args.size, args.timeout)}", flush=True)
                except RuntimeError as e:
                    failed.append(name)
                    print(e, file=sys.stderr, flush=True)
        finally:
            server.stop()
    if failed:
        print(f"no thumbnail for {failed}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
