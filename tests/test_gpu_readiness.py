"""What a first multi-GPU run needs, proved on CPU ranks where the CPU can prove it: a transformer load that fails on
one rank is freed on every rank and reported by that rank; the ranks get their own environment (allocator, NCCL's
warnings, thread count, a bounded collective timeout) whatever ComfyUI's process carries; a rank's host memory at load
stays near the model's size; ``doctor`` checks every rank pair with a deadline on each step; the attention backend is
checked against the dtype, the device, the installed packages and the GPU's generation before anything loads.

What only a GPU can show (NCCL itself, peer-to-peer copies between GPUs, VRAM) is in bench/gpu_check.sh.
"""

from __future__ import annotations

import os
import re
import shutil
import time

import pytest
import torch
from helpers import wait_for

from parallel_runtime import BackendSpec, InvalidInput, OpFailed, default_spec, get_backend, jobs, launcher
from parallel_runtime.spec import parse_gpus
from parallel_runtime.strategy import (
    Strategy,
    StrategyPlan,
    TransformerFacts,
    check_attention,
    check_attention_on_gpu,
    ring_attention_backend,
)
from parallel_runtime.watchdog import Deadlines
from parallel_runtime.wire import ArmFaultArgs, Fault, FreeArgs, PeerCopy, PeersArgs, StatusArgs
from parallel_runtime.worker.group import COLLECT_WAIT_S

SPEC = BackendSpec(ranks=2, device="cpu")
FACTS = TransformerFacts("FluxTransformer2DModel", heads=4, has_cp_plan=True, has_tp_plan=True)
COMFYUI_ALLOCATOR = "backend:cudaMallocAsync"  # what ComfyUI's cuda_malloc.py puts into its own environment


def _environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        return dict(entry.decode().split("=", 1) for entry in f.read().split(b"\0") if b"=" in entry)


def _wide_flux(models_root, tiny: str) -> str:
    """The tiny FLUX.1 with a transformer wide enough (15 M parameters, 60 MB in float32) that a second copy in a
    rank's memory stands out of the noise; saved in bfloat16, as FLUX.1-dev ships, while CPU ranks run float32."""
    from diffusers import FluxTransformer2DModel

    path = models_root / "wide-flux"
    shutil.copytree(models_root / tiny, path, ignore=shutil.ignore_patterns("transformer"))
    torch.manual_seed(0)
    config = dict(FluxTransformer2DModel.load_config(str(models_root / tiny / "transformer")))
    config.update(num_attention_heads=4, attention_head_dim=96, axes_dims_rope=(16, 40, 40))
    FluxTransformer2DModel.from_config(config).to(torch.bfloat16).save_pretrained(str(path / "transformer"))
    return path.name


@pytest.fixture(scope="module")
def backend(models_root):
    """One 2-rank CPU backend for the module, started from an environment like ComfyUI's (its allocator setting)."""
    from parallel_runtime.families.tiny import make_tiny_model

    make_tiny_model("flux", str(models_root / "tiny-flux"))
    _wide_flux(models_root, "tiny-flux")
    saved = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = COMFYUI_ALLOCATOR
    try:
        shared = get_backend(SPEC)
        shared.start()
    finally:
        if saved is None:
            del os.environ["PYTORCH_CUDA_ALLOC_CONF"]
        else:
            os.environ["PYTORCH_CUDA_ALLOC_CONF"] = saved
    return shared


@pytest.fixture(scope="module")
def conditioning(backend):
    """One prompt encoded once for the module (wide-flux has tiny-flux's text encoders)."""
    return jobs.encode_prompt(SPEC, model="tiny-flux", prompt="a red cat", max_sequence_length=16)


# -- doctor -------------------------------------------------------------------------------------------------------
# A backend of its own (~45 s on the shared CI machine): doctor is what a user runs first, so CI runs it end to end.
@pytest.mark.multirank
def test_doctor_checks_each_rank_pair_with_a_deadline_on_every_step():
    from parallel_runtime import cli

    t0 = time.monotonic()
    report = cli.doctor(ranks=2, device="cpu", step_s=90.0)
    assert report["ok"], report
    assert report["collective_ok"] and report["roundtrip_ok"] and report["peers_ok"]
    (pair,) = report["peers"]
    assert (pair["source"], pair["target"], pair["kind"], pair["ok"]) == (0, 1, "collective", True)
    assert pair["nbytes"] == 2 * (8 << 20) and pair["seconds"] > 0
    assert report["advice"] == [] and time.monotonic() - t0 < 180


def test_doctor_says_to_disable_nccl_p2p_when_a_pair_fails(capsys):
    from parallel_runtime import cli

    broken = PeerCopy(0, 1, "collective", ok=False, seconds=0.1, nbytes=16, error="wrong bytes arrived")
    copy = PeerCopy(0, 1, "copy", ok=False, seconds=0.1, nbytes=16, peer_access=True, error="different bytes")
    assert cli.advice_for([broken], None, "cuda") == [cli.P2P_ADVICE]
    assert cli.advice_for([copy], None, "cuda") == [cli.COPY_ADVICE]
    assert cli.advice_for([], "peer-to-peer", "cuda") == [cli.P2P_ADVICE]  # it hung: the deadline ended it
    assert cli.advice_for([], "peer-to-peer", "cpu") == []
    assert "NCCL_P2P_DISABLE=1" in cli.P2P_ADVICE


# -- the ranks' environment ---------------------------------------------------------------------------------------
@pytest.mark.multirank
def test_the_ranks_get_their_own_environment(backend):
    pids = backend.worker_pids
    assert sorted(pids) == [0, 1]
    for rank, pid in pids.items():
        env = _environ(pid)
        assert env["PYTORCH_CUDA_ALLOC_CONF"] == env["PYTORCH_ALLOC_CONF"] == launcher.RANK_CUDA_ALLOC_CONF, rank
        assert env["NCCL_DEBUG"] == "WARN" and env["TORCH_CPP_LOG_LEVEL"] == "WARNING"
        assert env["OMP_NUM_THREADS"] == str(max(1, (os.cpu_count() or 1) // 2))
        assert env["CUDA_VISIBLE_DEVICES"] == ""
        assert float(env["COMFY_PARALLEL_COLLECTIVE_TIMEOUT_S"]) == backend.deadlines.collective_s
    assert backend.deadlines.collective_s > max(backend.deadlines.load_s, backend.deadlines.stall_floor_s)
    # doctor's peer check on the same ranks: one pair, its pattern intact both ways.
    (pair,) = [p for r in backend.call(PeersArgs(nbytes=1 << 16)).per_rank if r is not None for p in r.pairs]
    assert (pair.source, pair.target, pair.kind, pair.ok, pair.nbytes) == (0, 1, "collective", True, 2 << 16)
    # The rank logs carry c10d's warnings now, yet an idle rank's waits for the next op leave none there: a wait as
    # short as the group's shortest (group.COLLECT_WAIT_S) would have timed out and logged by the time every rank has
    # renewed its heartbeat (a file, from a thread of its own) that many times over after the last op.
    idle_since, run_dir = time.time(), backend._group.run_dir
    wait_for(
        lambda: all(os.path.getmtime(run_dir.rank_heartbeat(rank)) > idle_since + 3 * COLLECT_WAIT_S for rank in pids),
        60,
        "every rank renewing its heartbeat while idle",
    )
    for rank in pids:
        log = backend._group.log_tail(rank, lines=200)
        assert f"a collective times out after {backend.deadlines.collective_s:.0f} s" in log, log
        assert "waitForInput" not in log and "timed out after" not in log, log


def test_a_cuda_backend_gets_its_gpus_by_number_in_pci_bus_order(tmp_path):
    spec = BackendSpec(ranks=2, device="cuda", gpus=(2, 3))
    assert launcher.gpu_environment(spec) == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "2,3"}
    old = os.environ.get("COMFY_PARALLEL_CUDA_ALLOC_CONF")
    os.environ["COMFY_PARALLEL_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    try:
        env = launcher._environment(spec, launcher.RunDir(str(tmp_path)), "pd-test", 120.0)
    finally:
        if old is None:
            del os.environ["COMFY_PARALLEL_CUDA_ALLOC_CONF"]
        else:
            os.environ["COMFY_PARALLEL_CUDA_ALLOC_CONF"] = old
    assert (env["CUDA_VISIBLE_DEVICES"], env["CUDA_DEVICE_ORDER"]) == ("2,3", "PCI_BUS_ID")
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == env["PYTORCH_ALLOC_CONF"] == "expandable_segments:True"
    assert env["COMFY_PARALLEL_COLLECTIVE_TIMEOUT_S"] == "120"
    assert int(env["OMP_NUM_THREADS"]) >= 1
    # Without a GPU list and without CUDA in this process, the ranks keep what the process has.
    assert launcher.gpu_environment(BackendSpec(ranks=1, device="cuda")) == {}


def test_the_gpus_widget_is_read_and_checked(monkeypatch):
    monkeypatch.delenv("COMFY_PARALLEL_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("COMFY_PARALLEL_DEVICE", raising=False)
    monkeypatch.delenv("COMFY_PARALLEL_RANKS", raising=False)
    spec = default_spec(gpus="0, 1")
    assert (spec.device, spec.ranks, spec.gpus, spec.free_comfyui_vram) == ("cuda", 2, (0, 1), True)
    assert default_spec(gpus="1,3", ranks=1).ranks == 1
    # The option does not key the backend: turning it off reuses the running one.
    assert default_spec(gpus="0,1", free_comfyui_vram=False) == spec
    assert parse_gpus("") is None
    for text, says in (("0,a", "nvidia-smi shows"), ("1,1", "lists a GPU twice")):
        with pytest.raises(InvalidInput, match=says) as e:
            default_spec(gpus=text)
        assert e.value.widget == "gpus"
    with pytest.raises(InvalidInput, match="clear gpus") as e:
        default_spec(device="cpu", gpus="0")
    assert e.value.widget == "gpus"
    with pytest.raises(InvalidInput, match="gpus lists 2") as e:
        default_spec(gpus="0,1", ranks=3)
    assert e.value.widget == "ranks"
    monkeypatch.setenv("COMFY_PARALLEL_VISIBLE_DEVICES", "4,5,6")
    assert default_spec().gpus == (4, 5, 6) and default_spec().ranks == 3
    assert default_spec(device="cpu").gpus is None  # the variable is for cuda backends only


# -- a load that fails on one rank ---------------------------------------------------------------------------------
def _transformers_held(backend) -> list[list[str]]:
    return [
        [m.placement for m in rank.resident if m.component == "transformer"]
        for rank in backend.call(StatusArgs()).per_rank
    ]


@pytest.mark.multirank
@pytest.mark.parametrize(
    "fault, error_type, says",
    [
        pytest.param(Fault.LOAD_RAISES, "OSError", "rank 1 could not read the weights", marks=pytest.mark.slow),
        (Fault.LOAD_OUT_OF_MEMORY, "OutOfMemory", r"out of memory on rank 1 \(CPU\): needs about [\d.]+ GiB \("),
    ],
)
def test_a_load_that_fails_on_one_rank_is_freed_on_every_rank(backend, conditioning, fault, error_type, says):
    handle = jobs.plan_transformer(SPEC, model="tiny-flux", strategy="data_parallel")
    run = dict(seed=3, steps=2, guidance_scale=3.5, width=32, height=32, batch_size=2)
    expected = jobs.sample(handle, conditioning, **run)
    backend.call(FreeArgs(components=("transformer",)))

    backend.call(ArmFaultArgs(rank=1, fault=fault))
    with pytest.raises(OpFailed) as e:
        jobs.sample(handle, conditioning, **run)
    assert e.value.rank == 1 and e.value.error_type == error_type, e.value
    assert re.search(says, str(e.value)), str(e.value)
    assert _transformers_held(backend) == [[], []]  # rank 0's load worked, and it was freed too

    loads = [r.load_counts.get("transformer:tiny-flux", 0) for r in backend.call(StatusArgs()).per_rank]
    assert torch.equal(jobs.sample(handle, conditioning, **run), expected)  # the next prompt loads on both again
    after = [r.load_counts.get("transformer:tiny-flux", 0) for r in backend.call(StatusArgs()).per_rank]
    assert [b - a for a, b in zip(loads, after)] == [1, 1]
    assert _transformers_held(backend) == [["data_parallel"], ["data_parallel"]]


# -- host memory at load ------------------------------------------------------------------------------------------
@pytest.mark.multirank
def test_host_memory_at_load_stays_near_the_models_size(backend, conditioning):
    """Each rank's peak RSS over the op that loads the transformer and runs a step, against the model's float32 size:
    the parameters, the checkpoint's pages (bfloat16, half as big) read once, and the step: about 1.5 × the model
    (92 MiB for 61 MiB measured here). A second host copy made during the load (tried with a deepcopy: 122 MiB)
    crosses the bound. On CPU ranks the device is the host, so what loading straight to a GPU saves (the host copy
    before ``.to(device)``) shows only on a GPU: bench/gpu_check.sh."""
    handle = jobs.plan_transformer(SPEC, model="wide-flux", strategy="data_parallel")
    run = dict(seed=0, steps=1, guidance_scale=3.5, width=32, height=32, batch_size=2)
    # The tiny model's load first brings what each rank imports lazily (diffusers' model code) and frees little
    # (freed memory stays in the rank's heap, where it would hide the next load's growth).
    jobs.sample(jobs.plan_transformer(SPEC, model="tiny-flux", strategy="data_parallel"), conditioning, **run)
    backend.call(FreeArgs(components=("transformer",)))
    before = [r.memory.process_rss_bytes for r in backend.call(StatusArgs()).per_rank]
    jobs.sample(handle, conditioning, **run)
    status = backend.call(StatusArgs()).per_rank
    model = status[0].resident[-1].parameter_bytes
    assert model > 50e6 and all(r.resident[-1].component == "transformer" for r in status)
    growth = [r.memory.peak_bytes - b for r, b in zip(status, before)]
    print(f"model {model / 2**20:.0f} MiB float32; peak RSS growth per rank {[g / 2**20 for g in growth]} MiB")
    for rank, grown in enumerate(growth):
        assert grown < 1.75 * model, f"rank {rank} grew by {grown / 2**20:.0f} MiB for a {model / 2**20:.0f} MiB model"
    backend.call(FreeArgs(components=("transformer",)))


# -- attention backends -------------------------------------------------------------------------------------------
def _plan(ring: int, backend: str = "auto", ranks: int = 2) -> StrategyPlan:
    return StrategyPlan(
        Strategy.CONTEXT_PARALLEL, ranks, FACTS, ring_degree=ring, ulysses_degree=ranks // ring,
        attention_backend=backend,
    )  # fmt: skip


def test_attention_backends_are_refused_before_anything_loads(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name: None if name in ("flash_attn", "sageattention") else real(name)
    )
    cases = [
        (_plan(2), "float32", "cuda", "dtype", "Ring attention on GPUs needs bfloat16 or float16"),
        (_plan(2, "native"), "bfloat16", "cuda", "attention_backend", "cannot run Ring attention"),
        (_plan(2, "flash"), "bfloat16", "cuda", "attention_backend", "pip install 'flash-attn>=2.6.3'"),
        (_plan(1, "sage"), "float16", "cuda", "attention_backend", "needs the sageattention package"),
        (_plan(2, "_native_cudnn"), "float32", "cpu", "attention_backend", "CUDA GPUs only.*or _native_flash"),
        (_plan(1, "_native_flash"), "float32", "cuda", "dtype", "takes bfloat16 or float16 on GPUs"),
    ]
    for plan, dtype, device, widget, says in cases:
        with pytest.raises(InvalidInput, match=says) as e:
            check_attention(plan, dtype, device)
        assert e.value.widget == widget, (plan.attention_backend, e.value)
    for plan, dtype, device in [
        (_plan(2), "bfloat16", "cuda"),
        (_plan(2), "float32", "cpu"),  # the CPU shim's flash kernel takes float32
        (_plan(1), "float32", "cuda"),  # Ulysses runs on the default backend in any dtype
        (_plan(2, "_native_flash"), "float32", "cpu"),
        (_plan(2, "_native_cudnn"), "bfloat16", "cuda"),
    ]:
        check_attention(plan, dtype, device)


def test_attention_is_chosen_and_checked_by_the_gpus_generation():
    assert ring_attention_backend((9, 0)) == "_native_cudnn"  # Hopper: cuDNN's fused attention
    assert ring_attention_backend((8, 6)) == "_native_flash"  # Ampere, Ada
    with pytest.raises(InvalidInput, match=r"compute capability 8.0 \(Ampere\) or newer; GPU 1 is 7.5") as e:
        check_attention_on_gpu(_plan(2), (7, 5), "GPU 1")
    assert e.value.widget == "ring_degree"
    with pytest.raises(InvalidInput, match="attention_backend flash needs") as e:
        check_attention_on_gpu(_plan(1, "flash"), (7, 0), "GPU 0")
    assert e.value.widget == "attention_backend"
    check_attention_on_gpu(_plan(1), (7, 0), "GPU 0")  # Ulysses on the default backend: any GPU
    check_attention_on_gpu(_plan(2), (8, 0), "GPU 0")


def test_load_sharded_transformer_refuses_an_attention_backend_that_is_not_installed(models_root, monkeypatch):
    import importlib.util

    from parallel_runtime.families.tiny import make_tiny_model

    if not (models_root / "tiny-flux" / "model_index.json").is_file():
        make_tiny_model("flux", str(models_root / "tiny-flux"))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "flash_attn" else real(name))
    cuda = BackendSpec(ranks=2, device="cuda")
    with pytest.raises(InvalidInput, match="flash needs the flash_attn package") as e:
        jobs.plan_transformer(cuda, model="tiny-flux", strategy="context_parallel", attention_backend="flash")
    assert e.value.widget == "attention_backend"
    with pytest.raises(InvalidInput, match="Ring attention on GPUs") as e:
        jobs.plan_transformer(cuda, model="tiny-flux", strategy="context_parallel", ring_degree=2, dtype="float32")
    assert e.value.widget == "dtype"
    assert (
        jobs.plan_transformer(cuda, model="tiny-flux", strategy="context_parallel", ring_degree=2).plan.ring_degree == 2
    )


# -- memory hygiene ----------------------------------------------------------------------------------------------
def test_staged_frees_the_transformer_before_a_decode_that_would_not_fit():
    from parallel_runtime.worker.models import ModelKey, ResidentModels

    for policy, kept in (("staged", ["vae"]), ("resident", ["text_encoders", "transformer", "vae"])):
        models = ResidentModels(torch.device("cpu"), policy)
        for component in ("text_encoders", "vae"):
            models.get(ModelKey("m", component, "cpu", "float32"), lambda: torch.nn.Linear(4, 4))
        if policy == "resident":
            models.get(ModelKey("m", "transformer", "cpu", "float32"), lambda: torch.nn.Linear(4, 4))
        models.free_before_decode()
        assert sorted(m.component for m in models.describe()) == kept, policy


def test_device_map_leaves_headroom_on_every_gpu_and_the_vae_on_the_first():
    from parallel_runtime.worker import memory

    gib = 1 << 30
    budget = memory.default_budget([40 * gib, 40 * gib, 10 * gib], reserve_first=3 * gib, activations=2 * gib,
                                   host_free=64 * gib)  # fmt: skip
    margin = memory.GPU_MARGIN
    assert budget == {0: 35 * gib - margin, 1: 38 * gib - margin, 2: 8 * gib - margin, "cpu": 64 * gib}
    assert memory.default_budget([gib // 2], 0, 0, 0)[0] == 0  # never negative


def test_the_collective_timeout_outlasts_every_watchdog_deadline():
    d = Deadlines(load_s=100.0, stall_floor_s=300.0)
    assert d.collective_s > 300.0 and Deadlines().collective_s < 3600  # not the hours torch defaults to
