"""The CPU shims, checked by real runs: diffusers' context / tensor parallelism on CPU ranks over gloo must match a
single-process forward of the tiny FLUX transformer.

The multi-rank cases run in one torchrun launch per world size (tests/_cp_check.py); each case is its own test.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from diffusers.models import attention_dispatch
from diffusers.models.modeling_utils import ModelMixin

from parallel_runtime.families.flux.tiny import make_tiny_model as make_tiny_flux
from parallel_runtime.worker.cpu_shims import apply_cpu_shims

REPO = Path(__file__).resolve().parents[1]
CHECK_SCRIPT = Path(__file__).with_name("_cp_check.py")
TOLERANCE = 1e-4
TWO_RANK_CASES = ["ulysses2", "ring2", "ulysses_anything2", "ring_anything2", "tp2"]
FOUR_RANK_CASES = ["ulysses4", "unified2x2", "ulysses_anything4", "tp4"]


@pytest.fixture(scope="session")
def tiny_flux(tmp_path_factory) -> str:
    return make_tiny_flux(str(tmp_path_factory.mktemp("tiny-flux")), seed=0)


def run_check(model_dir: str, results_dir: Path, nproc: int, cases: list[str]) -> dict:
    results = results_dir / "results.json"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        # A CPU-only view even on a GPU machine: the shims are for exactly that situation.
        "CUDA_VISIBLE_DEVICES": "",
    }
    # torchrun's logs in the test's own folder: by default it leaves a torchelastic_* directory in /tmp per launch.
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "--log-dir", str(results_dir / "torchelastic")]  # fmt: skip
    command += [str(CHECK_SCRIPT), model_dir, str(results), *cases]
    process = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert process.returncode == 0, process.stderr[-4000:]
    return json.loads(results.read_text())


@pytest.fixture(scope="module")
def two_rank_results(tiny_flux, tmp_path_factory) -> dict:
    return run_check(tiny_flux, tmp_path_factory.mktemp("cp2"), 2, TWO_RANK_CASES)


@pytest.fixture(scope="module")
def four_rank_results(tiny_flux, tmp_path_factory) -> dict:
    return run_check(tiny_flux, tmp_path_factory.mktemp("cp4"), 4, FOUR_RANK_CASES)


@pytest.mark.multirank
@pytest.mark.parametrize("case", TWO_RANK_CASES)
def test_two_ranks_match_single_process(two_rank_results, case):
    diff = two_rank_results[case]
    assert isinstance(diff, float), diff  # otherwise the error the case raised
    assert diff <= TOLERANCE


@pytest.mark.multirank
@pytest.mark.four_ranks
@pytest.mark.parametrize("case", FOUR_RANK_CASES)
def test_four_ranks_match_single_process(four_rank_results, case):
    diff = four_rank_results[case]
    assert isinstance(diff, float), diff
    assert diff <= TOLERANCE


def test_apply_is_idempotent():
    apply_cpu_shims()
    resolve = ModelMixin._resolve_parallel_config
    forward_op = attention_dispatch._native_flash_attention_forward_op
    apply_cpu_shims()
    assert ModelMixin._resolve_parallel_config is resolve
    assert attention_dispatch._native_flash_attention_forward_op is forward_op
    # Wrapped once: one level down is diffusers' own function.
    assert not hasattr(resolve.__wrapped__, "__wrapped__")


def test_native_flash_op_on_cpu_returns_attention_and_lse():
    """The op ring attention calls: (batch, seq, heads, dim) in, attention output and log-sum-exp out."""
    apply_cpu_shims()
    generator = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(2, 5, 4, 16, generator=generator) for _ in range(3))
    out, lse = attention_dispatch._native_flash_attention_forward_op(None, query, key, value, return_lse=True)

    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    expected_out = F.scaled_dot_product_attention(q, k, v).transpose(1, 2)
    expected_lse = torch.logsumexp(q @ k.transpose(-1, -2) / 16**0.5, dim=-1).transpose(1, 2)
    assert out.shape == (2, 5, 4, 16) and lse.shape == (2, 5, 4)
    assert (out - expected_out).abs().max() <= 1e-5
    assert (lse - expected_lse).abs().max() <= 1e-5
