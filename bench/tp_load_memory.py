#!/usr/bin/env python3
"""Peak memory per rank while a tensor-parallel transformer loads: diffusers 0.42.1's own load against the pack's
slice-by-slice load (``worker/tp_slices``), side by side in one run, as ratios to the whole model.

    python bench/tp_load_memory.py [--ranks 2] [--width 1024] [--shard-sizes 10GB 64MB] [--json]

A FLUX.1 transformer with random weights (``--width`` 1024: 8 heads × 128, 2 double + 4 single blocks, ~145M
parameters, 551 MiB in float32) is saved in bf16 once per ``--shard-sizes``: 10GB gives one file (``save_pretrained``'s
default, and a converted folder of a model under 2 GiB), 64MB shards listed by an index (as FLUX.1-dev's 22 GiB are
in the pack's 2 GiB shards). Each folder is loaded in float32, as the CPU ranks run it, by each loader in a fresh
torchrun launch of ``--ranks`` CPU ranks (so neither inherits the other's heap). Each rank samples its anonymous
memory (``RssAnon``: what the process allocated, not the file's pages in the page cache, which every rank shares and
the kernel can drop) every 2 ms during the load. On a CPU rank that is also its "device" memory. Reported per rank:
the growth at its peak and once loaded, and the bytes of the tensors it holds, each over the whole model.

Then, computed (not measured: no GPU here), FLUX.1-dev (bf16) at ``tp_degree`` 2 and 4 from its published config on
the meta device and the class's ``_tp_plan``: what a rank holds, which is its device peak with the pack's load (each
tensor is allocated once, in place), and the largest host buffer it passes through (a rowwise weight's slice of
columns, gathered on the host on its way to the GPU; slices of rows go from the file's pages straight to the GPU).
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

LOADERS = ("diffusers", "slices")
FLUX1_DEV = {
    "num_layers": 19,
    "num_single_layers": 38,
    "attention_head_dim": 128,
    "num_attention_heads": 24,
    "joint_attention_dim": 4096,
    "pooled_projection_dim": 768,
    "guidance_embeds": True,
}


def _anonymous() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))


def save_flux(model_dir: str, width: int, double_blocks: int, single_blocks: int, shard_size: str) -> int:
    """A FLUX.1 transformer with random weights saved in bf16 shards into ``model_dir/transformer``; its bytes in
    float32 (the CPU ranks' dtype)."""
    import torch
    from diffusers import FluxTransformer2DModel

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = FluxTransformer2DModel(
            in_channels=64, num_layers=double_blocks, num_single_layers=single_blocks, attention_head_dim=128,
            num_attention_heads=width // 128, joint_attention_dim=64, pooled_projection_dim=64, guidance_embeds=True,
            axes_dims_rope=(16, 56, 56),
        )  # fmt: skip
    whole = sum(p.numel() for p in model.parameters()) * 4
    model.to(torch.bfloat16).save_pretrained(
        os.path.join(model_dir, "transformer"), safe_serialization=True, max_shard_size=shard_size
    )
    return whole


def measure_load(loader: str, model_dir: str, mesh: object) -> dict:
    """This rank's anonymous memory while ``loader`` loads ``model_dir``'s FLUX.1 in float32 over ``mesh``: growth
    at the peak and once loaded, and the bytes of the tensors the rank holds. Call it before anything else loads in
    the process, so that no earlier load's freed heap hides this one's growth."""
    import torch
    from diffusers import FluxTransformer2DModel, TensorParallelConfig
    from torch.distributed.tensor import DTensor

    from parallel_runtime.worker.tp_slices import load_tensor_parallel

    before = top = _anonymous()
    done = threading.Event()

    def watch() -> None:  # anonymous memory has no high-water mark of its own: sample it
        nonlocal top
        while not done.is_set():
            top = max(top, _anonymous())
            time.sleep(0.002)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    if loader == "slices":
        model = load_tensor_parallel(FluxTransformer2DModel, model_dir, torch.float32, torch.device("cpu"), mesh)
    else:
        config = TensorParallelConfig(mesh=mesh)
        model = FluxTransformer2DModel.from_pretrained(
            model_dir, subfolder="transformer", dtype=torch.float32, parallel_config=config
        )
    done.set()
    watcher.join()
    tensors = [t.to_local() if isinstance(t, DTensor) else t for t in model.state_dict().values()]
    held = sum(t.numel() * t.element_size() for t in tensors)
    return {"peak": top - before, "after": _anonymous() - before, "held": held}


def rank_side(loader: str, model_dir: str, results: str) -> None:
    """One rank of a launch: ``measure_load``; rank 0 writes every rank's numbers to ``results``."""
    import torch.distributed as dist

    from parallel_runtime.worker.cpu_shims import apply_cpu_shims
    from parallel_runtime.worker.meshes import device_mesh

    apply_cpu_shims()
    dist.init_process_group("gloo")
    mine = measure_load(loader, model_dir, device_mesh("cpu", (dist.get_world_size(),), ("tp",)))
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if dist.get_rank() == 0:
        with open(results, "w") as f:
            json.dump({key: [rank[key] for rank in everyone] for key in mine}, f)
    dist.destroy_process_group()


def _launch(loader: str, model_dir: str, ranks: int, work: str) -> dict:
    results = os.path.join(work, f"{loader}.json")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
               "--log-dir", os.path.join(work, "torchelastic"), os.path.abspath(__file__),
               "--rank-side", loader, model_dir, results]  # fmt: skip
    process = subprocess.run(command, env={**env, "CUDA_VISIBLE_DEVICES": ""}, capture_output=True, text=True)
    if process.returncode != 0:
        sys.exit(f"the {loader} load failed:\n{process.stderr[-4000:]}")
    with open(results) as f:
        return json.load(f)


def flux1_dev_per_rank(tp_degree: int) -> dict:
    """FLUX.1-dev's bf16 bytes per rank at ``tp_degree``, from its config on the meta device and its ``_tp_plan``."""
    import torch
    from accelerate import init_empty_weights
    from diffusers import FluxTransformer2DModel
    from diffusers.hooks.tensor_parallel import resolve_tp_shard_specs

    with init_empty_weights():
        model = FluxTransformer2DModel(**FLUX1_DEV)
    specs = resolve_tp_shard_specs(model, FluxTransformer2DModel._tp_plan, tp_degree)
    whole = held = largest_columns = 0
    for name, tensor in model.state_dict().items():
        size = tensor.numel() * torch.bfloat16.itemsize
        spec = specs.get(name)
        sharded = spec is not None and spec.dim is not None
        whole += size
        held += size // tp_degree if sharded else size
        if sharded and spec.dim == 1:
            largest_columns = max(largest_columns, size // tp_degree)
    return {"whole": whole, "held": held, "largest_host_buffer": largest_columns}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--width", type=int, default=1024, help="the transformer's width (a multiple of 128)")
    parser.add_argument("--double-blocks", type=int, default=2)
    parser.add_argument("--single-blocks", type=int, default=4)
    parser.add_argument("--shard-sizes", nargs="+", default=["10GB", "64MB"], help="one saved folder per size")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--rank-side", nargs=3, metavar=("LOADER", "DIR", "RESULTS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_side:
        rank_side(*args.rank_side)
        return

    work = tempfile.mkdtemp(prefix="tp-load-memory-")
    atexit.register(shutil.rmtree, work, ignore_errors=True)
    report = {"ranks": args.ranks, "layouts": {}}
    for shard_size in args.shard_sizes:
        model_dir = os.path.join(work, shard_size)
        whole = report["whole_model_bytes"] = save_flux(
            model_dir, args.width, args.double_blocks, args.single_blocks, shard_size
        )
        files = len(
            [name for name in os.listdir(os.path.join(model_dir, "transformer")) if name.endswith(".safetensors")]
        )
        layout = report["layouts"][shard_size] = {"files": files, "loaders": {}}
        for loader in LOADERS:
            measured = _launch(loader, model_dir, args.ranks, work)
            layout["loaders"][loader] = {
                **{f"{key}_bytes": values for key, values in measured.items()},
                **{f"{key}_over_whole": [round(v / whole, 3) for v in values] for key, values in measured.items()},
            }
    report["flux1_dev_bf16"] = {str(tp): flux1_dev_per_rank(tp) for tp in (2, 4)}
    if args.json:
        print(json.dumps(report, indent=2))
        return

    print(f"whole transformer: {whole / 2**20:.0f} MiB (float32, read from bf16); {args.ranks} CPU ranks")
    print(f"{'files':>5} {'loader':<10} {'rank':>4} {'peak':>16} {'once loaded':>16} {'holds':>16}")
    for layout in report["layouts"].values():
        for loader, r in layout["loaders"].items():
            for rank in range(args.ranks):
                cells = [
                    f"{r[f'{key}_bytes'][rank] / 2**20:5.0f} MiB {r[f'{key}_over_whole'][rank]:.2f}×"
                    for key in ("peak", "after", "held")
                ]
                print(f"{layout['files']:>5} {loader:<10} {rank:>4} " + " ".join(f"{cell:>16}" for cell in cells))
        old, new = (layout["loaders"][loader]["peak_bytes"] for loader in LOADERS)
        ratios = ", ".join(f"rank {i} {a / b:.2f}×" for i, (a, b) in enumerate(zip(old, new)))
        print(f"{layout['files']:>5} peak, diffusers / slices: {ratios}")
    print("FLUX.1-dev bf16, computed: per rank, what it holds = its device peak with the slice load")
    for tp, numbers in report["flux1_dev_bf16"].items():
        print(
            f"  tp_degree {tp}: {numbers['held'] / 2**30:.1f} GiB of {numbers['whole'] / 2**30:.1f} GiB "
            f"({numbers['held'] / numbers['whole']:.2f}×); largest host buffer on the way "
            f"{numbers['largest_host_buffer'] / 2**20:.0f} MiB"
        )


if __name__ == "__main__":
    main()
