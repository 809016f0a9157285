"""The pack installs like any registry pack: requirements.txt (what ComfyUI-Manager installs) is pyproject's list, the
declared licence's text is in LICENSE, and ``comfy node validate`` / ``comfy node pack`` (comfy-cli, in a venv of
its own that .ci/run makes at .ci/comfy-cli) pass and leave the development files out of the archive."""

import os
import re
import subprocess
import zipfile
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parent.parent
COMFY_CLI = ROOT / ".ci" / "comfy-cli" / "bin" / "comfy"


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _requirements() -> list[str]:
    lines = (ROOT / "requirements.txt").read_text().splitlines()
    return [line.split("#")[0].strip() for line in lines if line.split("#")[0].strip()]


def test_requirements_txt_is_pyprojects_dependency_list():
    assert _requirements() == _pyproject()["project"]["dependencies"]


def test_license_file_holds_the_declared_licence():
    project = _pyproject()["project"]
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text


def test_registry_metadata():
    comfy = _pyproject()["tool"]["comfy"]
    assert re.fullmatch(r">=\d+\.\d+\.\d+", comfy["requires-comfyui"])
    # The registry takes a URL; it names a file of this repository, which must exist.
    prefix = "https://raw.githubusercontent.com/comfyui-parallel-diffusers/comfyui-parallel-diffusers/main/"
    assert comfy["Icon"].startswith(prefix)
    icon = ROOT / comfy["Icon"].removeprefix(prefix)
    assert icon.is_file() and icon.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _comfy(*args: str, cwd: Path) -> str:
    if not COMFY_CLI.exists():
        pytest.skip("comfy-cli is not installed at .ci/comfy-cli (.ci/run makes it)")
    env = {**os.environ, "DO_NOT_TRACK": "1"}  # no telemetry (and no network)
    done = subprocess.run(
        [str(COMFY_CLI), "--skip-prompt", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    return out


def test_comfy_node_validate_passes_without_warnings():
    out = _comfy("node", "validate", cwd=ROOT)
    assert "All validation checks passed" in out, out
    assert "warning" not in out.lower(), out


def test_comfy_node_pack_leaves_development_files_out(tmp_path):
    # Packs git's tracked files: a clone of this checkout's HEAD, with this tree's packaging files, stands for the repo.
    clone = tmp_path / "pack"
    subprocess.run(["git", "clone", "-q", "--no-hardlinks", str(ROOT), str(clone)], check=True, timeout=60)
    for name in ("pyproject.toml", ".comfyignore", "requirements.txt", "LICENSE", "docs/icon.png"):
        (clone / name).parent.mkdir(parents=True, exist_ok=True)
        (clone / name).write_bytes((ROOT / name).read_bytes())
    subprocess.run(["git", "-C", str(clone), "add", "-A"], check=True)
    _comfy("node", "pack", cwd=clone)
    names = zipfile.ZipFile(clone / "node.zip").namelist()
    assert "__init__.py" in names and "LICENSE" in names and "requirements.txt" in names
    assert any(n.startswith("parallel_runtime/") for n in names) and any(n.startswith("web/") for n in names)
    assert any(n.startswith("example_workflows/") and n.endswith(".json") for n in names)
    left_in = [n for n in names if n.split("/")[0] in ("tests", "bench", ".ci") or n.startswith("docs/screenshots/")]
    assert not left_in, left_in
