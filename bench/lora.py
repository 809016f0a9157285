#!/usr/bin/env python3
"""Per-step time with a LoRA against without, fused and as PEFT adapters (unfused), under device_map, Ulysses and
tensor parallelism, in one run.

    python bench/lora.py [--ranks 2] [--rank 16] [--size 256] [--steps 4] [--repeats 3] [--threads 1] [--json]
    python bench/lora.py --weights fp8          # the same model stored as scaled fp8, held as stored
    python bench/lora.py --device cuda --preset flux1-dev --size 1024 --steps 6   # on GPUs, FLUX.1-dev's width

The model is bench/strategies.py's random FLUX.1 (bench/random_flux.py), the LoRA a random one of ``--rank`` on every
linear layer of the transformer blocks (attention, feed-forward, the single blocks' projections: what LoRA trainers
target by default; not the embedders, the AdaLN modulations or the final layer). For each strategy the same
generation runs without the LoRA, with it fused (``LoraMode.FUSED``, the pack's choice) and with it as PEFT adapters
(``LoraMode.PEFT``), one after the other and in a rotating order, ``--repeats`` times, on one backend: the
transformer stays loaded, and each run first brings it to its variant (merging, restoring or loading adapters).

Reported per variant: the median per-step time (steps 2..S, from the backend's progress events, as
bench/strategies.py), its ratio to the same strategy without the LoRA (``paired``: the median of the ratios of
adjacent runs), ``switch``: how much later the first step ended than without a LoRA (what bringing the transformer
to the variant cost, roughly), and ``kept``: the host memory the fused mode keeps per rank for the original weights
it changed (this rank's slices under tensor parallelism), and ``peak``: each rank's peak anonymous memory
(``RssAnon``, sampled every 5 ms) during the variant's runs. PEFT under tensor parallelism is refused by diffusers,
and is reported as such.

``--weights fp8``: the model's transformer written as ComfyUI's scaled fp8 (bench/quantized.py's writer, one scale
per matrix) into a folder in the converted layout, and loaded ``as stored``: each layer held in fp8, its weight made
per forward (``worker/fp8_weights.py``); fused then means each LoRA merged in float32 into that made weight at every
forward (nothing kept), and PEFT is refused by the pack (PEFT would cast its adapters to fp8).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--ranks", type=int, default=2, help="ranks of the backend (default 2)")
    parser.add_argument("--size", type=int, default=256, help="image width and height, a multiple of 16")
    parser.add_argument("--steps", type=int, default=4, help="denoising steps per run, ≥ 3; the first is not timed")
    parser.add_argument("--repeats", type=int, default=3, help="runs per variant (default 3)")
    parser.add_argument("--rank", type=int, default=16, help="the LoRA's rank (default 16)")
    parser.add_argument("--max-sequence-length", type=int, default=64, help="text tokens (default 64)")
    parser.add_argument("--threads", type=int, default=1, help="torch/OpenMP threads per rank (default 1)")
    parser.add_argument("--model-dir", help="a FLUX.1 pipeline folder (built there when it holds none)")
    parser.add_argument("--preset", default="bench", help="transformer config to build: bench (CPU) or flux1-dev")
    parser.add_argument("--double-blocks", type=int, help="build with this many double-stream blocks instead")
    parser.add_argument("--single-blocks", type=int, help="build with this many single-stream blocks instead")
    parser.add_argument("--guidance", type=float, default=3.5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--weights",
        choices=("as-built", "fp8"),
        default="as-built",
        help="the transformer's weights: as built (float32 on CPU), or written as scaled fp8 and held as stored",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = parser.parse_args()
    if args.steps < 3 or args.repeats < 1 or args.ranks < 2 or args.rank < 1:
        parser.error("--steps must be at least 3, --repeats and --rank at least 1, --ranks at least 2")
    if args.size < 16 or args.size % 16:
        parser.error("--size must be a multiple of 16")
    args.width = args.height = args.size
    args.build_only = False
    return args


ARGS = _parse_args() if __name__ == "__main__" else None
if ARGS is not None:  # before torch is imported and the backend starts (see bench/strategies.py)
    os.environ["OMP_NUM_THREADS"] = str(ARGS.threads)
    os.environ["MKL_NUM_THREADS"] = str(ARGS.threads)

import json  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.comfy_files_memory import anonymous_peaks  # noqa: E402
from bench.strategies import _median_ms, load_average, prepare_model_dir, step_intervals, transformer_config  # noqa: E402
from parallel_runtime import (  # noqa: E402
    BackendSpec,
    InvalidInput,
    ParallelRuntimeError,
    get_backend,
    jobs,
    shutdown_backend,
)
from parallel_runtime.families import family  # noqa: E402
from parallel_runtime.families.lora import meta_transformer  # noqa: E402
from parallel_runtime.families.tiny import make_tiny_lora, quantized, save_diffusers_lora  # noqa: E402
from parallel_runtime.wire import FP8_SCALE_SUFFIX, LoraMode  # noqa: E402

PROMPT = "a photo of a red cat on a blue sky"
LORA = "bench_lora.safetensors"
VARIANTS = {"none": None, "fused": LoraMode.FUSED, "peft": LoraMode.PEFT}


def lora_layers(model_dir: str) -> list[str]:
    """Every linear layer of the transformer blocks: what trainers target by default."""
    skeleton = meta_transformer(family("flux"), transformer_config(model_dir))
    return [
        name
        for name, module in skeleton.named_modules()
        if isinstance(module, torch.nn.Linear)
        and name.startswith(("transformer_blocks.", "single_transformer_blocks."))
        and ".norm" not in name
    ]


def fp8_folder(model_dir: str) -> str:
    """A folder beside ``model_dir`` with its transformer stored as ComfyUI's scaled fp8 (``families.tiny.quantized``,
    bench/quantized.py's writer: every matrix in fp8 with one scale, the rest bf16) in the layout ``comfy_files``
    converts such a file to (diffusers' keys, each scale as ``<layer>.weight_scale``); the other components linked."""
    from safetensors.torch import load_file, save_file

    out = model_dir + "-fp8"
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(os.path.join(out, "transformer"))
    for entry in os.listdir(model_dir):
        if entry != "transformer":
            os.symlink(os.path.join(model_dir, entry), os.path.join(out, entry))
    source = os.path.join(model_dir, "transformer")
    shutil.copy(os.path.join(source, "config.json"), os.path.join(out, "transformer"))
    sd = {}
    for file in sorted(f for f in os.listdir(source) if f.endswith(".safetensors")):
        sd.update(load_file(os.path.join(source, file)))
    stored, _ = quantized(sd, "fp8_scaled", {key: [key] for key in sd}, lambda tensors: tensors)
    folder = {
        key.removesuffix(".scale_weight") + ".weight" + FP8_SCALE_SUFFIX if key.endswith(".scale_weight") else key: t
        for key, t in stored.items()
        if key != "scaled_fp8"  # ComfyUI's marker, which the conversion drops
    }
    save_file(folder, os.path.join(out, "transformer", "diffusion_pytorch_model.safetensors"))
    return out


def kept_bytes(model_dir: str, layers: list[str], dtype: torch.dtype, tp: int) -> int:
    """Bytes of the originals the fused mode keeps on one rank: the changed weights, their slices under TP (every
    layer LoRAs target in the blocks is in FLUX.1's _tp_plan)."""
    skeleton = dict(meta_transformer(family("flux"), transformer_config(model_dir)).named_modules())
    size = torch.empty((), dtype=dtype).element_size()
    return sum(skeleton[n].weight.numel() for n in layers) * size // tp


def timed_run(
    handle: jobs.TransformerHandle, conditioning: jobs.Conditioning, args: argparse.Namespace, pids: list[int]
) -> dict:
    marks: list[float] = []

    def on_progress(step: int, total: int, text: str | None) -> None:
        if step >= 1 and text is None:  # the steps; not "loading transformer", "applying LoRAs" or "denoised"
            marks.append(time.perf_counter())

    start = time.perf_counter()
    with anonymous_peaks(pids) as (_, peaks):
        jobs.sample(
            handle,
            conditioning,
            seed=args.seed,
            steps=args.steps,
            guidance_scale=args.guidance,
            width=args.width,
            height=args.height,
            on_progress=on_progress,
        )
    return {"steps": step_intervals(marks, args.steps), "first_step_end": marks[0] - start, "peak": peaks}


def bench_strategy(name: str, load: dict, spec, model, conditioning, args, log) -> dict:
    row: dict = {"name": name, "load": load, "variants": {}}
    base = jobs.plan_transformer(spec, model=model, **load)
    with_lora, _ = jobs.add_lora(base, lora_name=LORA, strength=1.0)
    handles = {
        variant: base
        if mode is None
        else dataclasses.replace(with_lora, spec=dataclasses.replace(with_lora.spec, lora_mode=mode))
        for variant, mode in VARIANTS.items()
    }
    runs: dict[str, list[dict]] = {variant: [] for variant in handles}
    order = list(handles)
    pids = [pid for _, pid in sorted(get_backend(spec).worker_pids.items())]
    for r in range(args.repeats):
        for variant in order[r % len(order) :] + order[: r % len(order)]:  # rotate which variant goes first
            if variant in row["variants"]:
                continue  # refused on an earlier repeat
            try:
                runs[variant].append(timed_run(handles[variant], conditioning, args, pids))
            except (ParallelRuntimeError, InvalidInput) as e:
                row["variants"][variant] = {"refused": str(e).splitlines()[0]}
        log(
            f"  {name}: run {r + 1}/{args.repeats}: "
            + ", ".join(f"{v} {_median_ms([runs[v][-1]['steps']]):.0f} ms/step" for v in order if runs[v])
        )
    none = runs["none"]
    for variant, made in runs.items():
        if not made:
            continue
        row["variants"][variant] = {
            "step_s": [run["steps"] for run in made],
            "ms": _median_ms([run["steps"] for run in made]),
            "ratio": _median_ms([run["steps"] for run in made]) / _median_ms([run["steps"] for run in none]),
            "paired": statistics.median(
                statistics.median(a["steps"]) / statistics.median(b["steps"]) for a, b in zip(made, none)
            ),
            "peak_bytes": [max(run["peak"][i] for run in made) for i in range(len(pids))],
            "switch_ms": 1e3
            * (
                statistics.median(run["first_step_end"] for run in made)
                - statistics.median(run["first_step_end"] for run in none)
            ),
        }
    return row


def run(args: argparse.Namespace, model_dir: str, scratch: str, log) -> dict:
    model = os.path.basename(fp8_folder(model_dir) if args.weights == "fp8" else model_dir)
    os.environ["COMFY_PARALLEL_MODELS"] = os.path.dirname(model_dir)
    loras = os.path.join(scratch, "loras")
    os.makedirs(loras, exist_ok=True)
    os.environ["COMFY_PARALLEL_LORAS"] = loras
    layers = lora_layers(model_dir)
    save_diffusers_lora(
        make_tiny_lora(model_dir, "flux", layers=layers, rank=args.rank, alpha=args.rank, size=0.1),
        os.path.join(loras, LORA),
        "flux",
    )
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    n = args.ranks
    strategies = [
        ("device_map", {"strategy": "device_map"}, 1),
        (f"ulysses{n}", {"strategy": "context_parallel", "ring_degree": 1, "ulysses_degree": n}, 1),
        (f"tp{n}", {"strategy": "tensor_parallel", "tp_degree": n}, n),
    ]
    spec = BackendSpec(ranks=n, device=args.device, memory_policy="resident")
    report = {
        "device": args.device,
        "ranks": n,
        "size": args.size,
        "steps": args.steps,
        "repeats": args.repeats,
        "lora_rank": args.rank,
        "lora_layers": len(layers),
        "weights": args.weights,
        "transformer": {k: v for k, v in transformer_config(model_dir).items() if not k.startswith("_")},
        "rows": [],
    }
    try:
        conditioning = jobs.encode_prompt(
            spec, model=model, prompt=PROMPT, max_sequence_length=args.max_sequence_length
        )
        for name, load, tp in strategies:
            row = bench_strategy(name, load, spec, model, conditioning, args, log)
            # An fp8 layer's weight is never written: the fused mode keeps no originals of it.
            row["kept_bytes"] = 0 if args.weights == "fp8" else kept_bytes(model_dir, layers, dtype, tp)
            report["rows"].append(row)
    finally:
        shutdown_backend()
    report["loadavg"] = load_average()
    return report


def print_report(report: dict) -> None:
    t = report["transformer"]
    print(
        f"LoRA benchmark: FLUX.1 transformer {t['num_layers']} double + {t['num_single_layers']} single blocks, "
        f"{t['num_attention_heads']}×{t['attention_head_dim']} wide; a rank-{report['lora_rank']} LoRA on "
        f"{report['lora_layers']} layers; weights {report['weights']}; {report['size']}², {report['steps']} steps × "
        f"{report['repeats']} runs; "
        f"{report['device']}, {report['ranks']} ranks; load average at the end {report['loadavg']}"
    )
    print()
    print(
        f"{'strategy':>12} {'LoRA':>6} {'ms/step':>9} {'ratio':>7} {'paired':>7} {'switch':>9} {'kept/rank':>10} "
        "peak anonymous MiB / rank"
    )
    for row in report["rows"]:
        for variant in (v for v in VARIANTS if v in row["variants"]):  # refusals are recorded first
            got = row["variants"][variant]
            if "refused" in got:
                print(f"{row['name']:>12} {variant:>6}  refused: {got['refused'][:90]}")
                continue
            kept = f"{row['kept_bytes'] / 2**20:>6.0f} MiB" if variant == "fused" else ""
            switch = f"{got['switch_ms']:>6.0f} ms" if variant != "none" else ""
            peaks = ", ".join(f"{b / 2**20:.0f}" for b in got["peak_bytes"])
            print(
                f"{row['name']:>12} {variant:>6} {got['ms']:>9.1f} {got['ratio']:>6.3f}× {got['paired']:>6.3f}× "
                f"{switch:>9} {kept:>10} {peaks}"
            )
    print(
        "ms/step: median of steps 2..S; ratio: ÷ the same strategy without the LoRA; paired: median of adjacent runs' "
        "ratios; switch: how much later the first step ended than without a LoRA (bringing the transformer to the "
        "variant); kept/rank: host memory the fused mode keeps for the originals of the weights it changed; peak: each "
        "rank's peak anonymous memory (RssAnon) during the variant's runs"
    )


def main() -> int:
    args = ARGS
    torch.set_num_threads(args.threads)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    diffusers_logging.disable_progress_bar()
    transformers_logging.disable_progress_bar()
    with tempfile.TemporaryDirectory(prefix="pd-lora-") as scratch:
        report = run(args, prepare_model_dir(args, scratch, log), scratch, log)
    print(json.dumps(report, indent=2) if args.json else "", end="")
    if not args.json:
        print_report(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
