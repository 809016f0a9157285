"""bench/peers.py end to end on FLUX.1's tiny test model (``--smoke``): the pack, bare diffusers and (when installed)
cache-dit each make the same image for every strategy they can run, the outputs agree, and the first-image timings
come back. Slow (2-4 minutes on 2 shared cores: six torchrun groups and a backend start): left out of CI, run with
``pytest -m slow tests/test_bench_peers.py``. It checks what the bench reports, never its timings."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.multirank]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_peers_smoke_runs_every_side_and_the_outputs_agree():
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "bench", "peers.py"), "--smoke", "--json"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    report = json.loads(proc.stdout)
    assert [row["name"] for row in report["rows"]] == ["ulysses2", "ring2", "tp2"]
    for row in report["rows"]:
        for name in ("pack", "diffusers"):
            side = row["sides"][name]
            # One warm-up image untimed, then one round: steps 2..S of each side's image.
            assert [len(run) for run in side["step_s"]] == [report["steps"] - 1], (row["name"], name)
            assert side["ms_per_step"] > 0
        assert row["pairs"]["pack/diffusers"] <= report["tolerance"]
        assert all(diff <= report["tolerance"] for diff in row["pairs"].values()), row["pairs"]
    if importlib.util.find_spec("cache_dit") and importlib.util.find_spec("einops"):
        # Ulysses runs on CPU as cache-dit ships it (Ring and TP do not, and are reported with their error).
        assert report["cache_dit"] is None
        assert "diffusers/cache-dit" in report["rows"][0]["pairs"]
        for row in report["rows"]:
            assert "error" in row["sides"]["cache-dit"] or "ms_per_step" in row["sides"]["cache-dit"]
    first = report["first_image"]
    assert first["image_max_diff"] <= report["tolerance"]
    # --smoke: one cold run per side, one warm re-run.
    assert [run["first_s"] > run["backend_up_s"] > 0 for run in first["pack"]] == [True]
    assert [run["first_s"] > run["imported_s"] > run["ranks_up_s"] > 0 for run in first["bare"]] == [True]
    assert [run["exit_s"] > run["first_s"] > run["loaded_s"] for run in first["bare"]] == [True]
    assert len(first["pack_new_seed_s"]) == len(first["pack_whole_graph_s"]) == len(first["bare_next_s"]) == 1
