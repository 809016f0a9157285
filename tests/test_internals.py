"""The diffusers and torch internals the pack uses (``parallel_runtime.internals``): all present in the installed
versions, diffusers pinned to the tested range, and a missing one (removed in a subprocess) or an untested release
said at start-up, naming the name, the installed version and the tested range."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from parallel_runtime import internals

ROOT = Path(__file__).resolve().parent.parent
DIFFUSERS = internals.installed("diffusers")


def test_every_internal_the_pack_uses_exists_in_the_installed_versions():
    internals.check()  # every entry, the families' too
    assert internals.untested_diffusers() is None


def test_diffusers_is_pinned_to_the_tested_range():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert internals.DIFFUSERS_REQUIREMENT == "diffusers>=0.42.1,<0.43"
    assert internals.DIFFUSERS_REQUIREMENT in project["dependencies"]  # requirements.txt: test_packaging
    assert f"torch=={internals.TESTED_TORCH}" in project["optional-dependencies"]["test"]


@pytest.mark.parametrize("version", ["0.42.1", "0.42.9"])
def test_a_tested_release_gets_no_warning(version):
    assert internals.untested_diffusers(version) is None


@pytest.mark.parametrize("version", ["0.43.0", "0.43.0.dev0", "0.41.2", "1.0.0"])
def test_an_untested_release_is_named_with_the_tested_range(version):
    warning = internals.untested_diffusers(version)
    assert f"diffusers {version} is installed" in warning and "diffusers>=0.42.1,<0.43" in warning


def test_an_attribute_set_on_instances_is_found_in_its_class_code():
    assert internals.Internal("diffusers.hooks.hooks", "StateManager._context", "-", "-", on_instances=True).exists()
    gone = ("diffusers.hooks.hooks", "StateManager._renamed", "-", "-")
    assert not internals.Internal(*gone, on_instances=True).exists() and not internals.Internal(*gone).exists()
    assert not internals.Internal("diffusers.hooks.no_such_module", "x", "-", "-").exists()


def _entry_point_without(module: str, remove: str, entry: str) -> subprocess.CompletedProcess:
    """``python -m entry`` as torchrun starts it, in a process where ``module``'s ``remove`` (a name, or Class.name)
    is gone, as in a diffusers or torch release that renamed it."""
    owner, _, name = remove.rpartition(".")
    target = f"importlib.import_module({module!r})" + (f".{owner}" if owner else "")
    code = (
        f"import importlib, runpy; delattr({target}, {name!r}); "
        f"runpy.run_module({entry!r}, run_name='__main__', alter_sys=True)"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=ROOT)


def test_a_rank_without_a_diffusers_internal_says_which_and_the_versions():
    done = _entry_point_without("diffusers.hooks.tensor_parallel", "_SUPPORTED_TP_DEVICES", "parallel_runtime.worker")
    assert done.returncode != 0
    assert "InternalsChanged" in done.stderr and "AttributeError" not in done.stderr, done.stderr
    assert f"diffusers {DIFFUSERS} lacks what this pack uses (tested with diffusers>=0.42.1,<0.43)" in done.stderr
    assert "diffusers.hooks.tensor_parallel._SUPPORTED_TP_DEVICES, used by worker/cpu_shims.py" in done.stderr


def test_torchruns_agent_without_a_torch_internal_says_which():
    done = _entry_point_without(
        "torch.distributed.elastic.rendezvous.static_tcp_rendezvous",
        "TCPStore",
        "parallel_runtime.worker.agent",
    )
    assert done.returncode != 0 and "InternalsChanged" in done.stderr, done.stderr
    assert f"torch {internals.installed('torch')} lacks what this pack uses" in done.stderr
    assert "static_tcp_rendezvous.TCPStore, used by worker/agent.py" in done.stderr


def test_comfyui_start_up_warns_of_an_untested_diffusers(nodes, monkeypatch, caplog):
    import parallel_nodes

    monkeypatch.setattr(internals, "installed", lambda package: "0.43.0")
    with caplog.at_level(logging.WARNING, logger="parallel_nodes"):
        asyncio.run(parallel_nodes.comfy_entrypoint())  # outside a server: no routes to register
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "diffusers 0.43.0 is installed" in warning and "diffusers>=0.42.1,<0.43" in warning
