#!/usr/bin/env python3
"""Each rank's memory and per-step time with a GGUF transformer (Q8_0, Q4_K) against the same model's bf16 file, on
the same ranks, in one run.

    COMFYUI_DIR=... python bench/gguf_memory.py [--ranks 2] [--width 1024] [--strategies context_parallel ...] [--json]

A FLUX.1 transformer with random weights (``--width`` 1024: 8 heads × 128, 2 double + 4 single blocks, ~140M parameters)
is written as ComfyUI's bf16 file and as ComfyUI-GGUF's Q8_0 and Q4_K files (``families.tiny.write_gguf``) beside the
tiny CLIP / T5 / VAE files, converted by ``comfy_files`` as ParallelModelFromComfyFiles does, and generated from on a
fresh CPU backend per strategy and format (context parallel, where each rank holds the whole transformer, and tensor
parallel, where it holds its slices: of a GGUF file packed where they are whole blocks, else dequantized at load),
where the tiny model runs first (imports and first-run buffers in the baseline). Measured per rank: the parameter bytes
it holds (diffusers' packed GGUF tensors count their packed bytes), its anonymous memory's peak growth while the
format loads and samples (``RssAnon`` of ``/proc/<pid>/status`` sampled every 5 ms: what the rank allocated, not the
file's page cache), and the time per denoising step (a 4-step run's wall time minus a 2-step run's, over 2: the load
and the encode cancel out). The CPU ranks compute in float32, so "bf16" holds 4 bytes a parameter there; on a GPU
(bf16 compute) it holds 2.
(Not ``bench/gguf.py``: run as a script, that name would shadow the ``gguf`` package for everything it imports.)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from comfy_files_memory import anonymous_peaks, random_flux_files

FORMATS = ("bf16", "Q8_0", "Q4_K")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--width", type=int, default=1024, help="the transformer's width (a multiple of 256)")
    parser.add_argument(
        "--strategies",
        nargs="+",
        default=["context_parallel", "tensor_parallel"],
        choices=("context_parallel", "data_parallel", "tensor_parallel"),
    )
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--table", action="store_true", help="print the README's GGUF table (estimates) and stop")
    args = parser.parse_args()
    if args.table:
        print_table()
        return

    import torch
    from safetensors.torch import save_file

    from parallel_runtime import default_spec, jobs
    from parallel_runtime.families.flux import tiny as flux_tiny
    from parallel_runtime.families.tiny import write_gguf

    work, names, big = random_flux_files("gguf-bench-", args.width)
    parameters = sum(p.numel() for p in big.parameters())
    bfl = {k: v.to(torch.bfloat16) for k, v in flux_tiny.bfl_transformer(big.state_dict(), 2, 4).items()}
    del big
    folder = os.path.join(work, "models", "diffusion_models")
    files = {
        "bf16": "bench-flux1-dev.safetensors",
        "Q8_0": "bench-flux1-dev-Q8_0.gguf",
        "Q4_K": "bench-flux1-dev-Q4_K.gguf",
    }
    save_file({k: v.contiguous() for k, v in bfl.items()}, os.path.join(folder, files["bf16"]))
    for qtype in ("Q8_0", "Q4_K"):
        write_gguf(bfl, os.path.join(folder, files[qtype]), "flux", qtype)
    del bfl
    models = {fmt: jobs.model_from_comfy_files(**{**names, "diffusion_model": file})[0] for fmt, file in files.items()}
    tiny_model, _ = jobs.model_from_comfy_files(**names)

    spec = default_spec(ranks=args.ranks, device="cpu", memory_policy="staged")
    results = {"parameters": parameters, "ranks": args.ranks, "strategies": {}}
    for strategy in args.strategies:
        results["strategies"][strategy] = {fmt: measure(spec, strategy, models[fmt], tiny_model) for fmt in FORMATS}
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(f"FLUX.1, {parameters / 1e6:.0f}M parameters, on {args.ranks} CPU ranks (float32 compute)")
    for strategy, formats in results["strategies"].items():
        base = formats["bf16"]
        base_held, base_peak = max(base["parameter_bytes"]), max(1, max(base["peak_anonymous_growth_bytes"]))
        for fmt, r in formats.items():
            held, peak, step = max(r["parameter_bytes"]), max(r["peak_anonymous_growth_bytes"]), r["seconds_per_step"]
            print(
                f"{strategy} {fmt:>5}: holds {held / 2**20:.0f} MiB per rank ({held / base_held:.2f} × bf16's), peak "
                f"anonymous growth {peak / 2**20:.0f} MiB ({peak / base_peak:.2f} ×), {step:.3f} s per step "
                f"({step / base['seconds_per_step']:.2f} ×)"
            )


def measure(spec: object, strategy: str, model: str, tiny_model: str) -> dict:
    """One format under one strategy on a fresh backend: each rank's held parameter bytes, the peak growth of its
    anonymous memory while the model loads and samples once, and the time per step."""
    from parallel_runtime import get_backend, jobs, shutdown_backend

    batch = spec.world_size if strategy == "data_parallel" else 1
    extra = {"ulysses_degree": spec.world_size} if strategy == "context_parallel" else {}
    extra |= {"tp_degree": spec.world_size} if strategy == "tensor_parallel" else {}

    def sample(name: str, steps: int) -> float:
        positive = jobs.encode_prompt(spec, model=name, prompt="a photo of a horse", max_sequence_length=32)
        handle = jobs.plan_transformer(spec, model=name, strategy=strategy, **extra)
        t0 = time.perf_counter()
        jobs.sample(handle, positive, seed=1, steps=steps, guidance_scale=3.5, width=128, height=128, batch_size=batch)
        return time.perf_counter() - t0

    # A fresh backend each time: memory another model held and gave back stays in the ranks' heaps and would hide
    # this one's peak.
    backend = get_backend(spec)
    try:
        sample(tiny_model, 2)
        pids = [pid for _, pid in sorted(backend.worker_pids.items())]
        with anonymous_peaks(pids) as (before, peak):
            sample(model, 2)  # loads the format's transformer
        step = (sample(model, 4) - sample(model, 2)) / 2
        held = [
            next(m for m in r.resident if m.component == "transformer").parameter_bytes for r in backend.status().ranks
        ]
    finally:
        shutdown_backend()
    return {
        "parameter_bytes": held,
        "peak_anonymous_growth_bytes": [p - b for p, b in zip(peak, before)],
        "seconds_per_step": round(step, 4),
    }


# The published transformers (diffusers' configs; FLUX.1-dev's and Qwen-Image's are the classes' defaults).
PUBLISHED = {
    "FLUX.1-dev": ("FluxTransformer2DModel", {}),
    "FLUX.2-dev": (
        "Flux2Transformer2DModel",
        {
            "in_channels": 128,
            "num_layers": 8,
            "num_single_layers": 48,
            "attention_head_dim": 128,
            "num_attention_heads": 48,
            "joint_attention_dim": 15360,
            "timestep_guidance_channels": 256,
            "mlp_ratio": 3.0,
            "axes_dims_rope": [32, 32, 32, 32],
            "rope_theta": 2000,
            "eps": 1e-06,
        },
    ),
    "Qwen-Image": ("QwenImageTransformer2DModel", {}),
    "Wan 2.1 14B": (
        "WanTransformer3DModel",
        {
            "num_attention_heads": 40,
            "attention_head_dim": 128,
            "ffn_dim": 13824,
            "num_layers": 40,
            "in_channels": 16,
            "out_channels": 16,
            "text_dim": 4096,
            "freq_dim": 256,
            "cross_attn_norm": True,
            "qk_norm": "rms_norm_across_heads",
            "eps": 1e-6,
            "patch_size": (1, 2, 2),
        },
    ),
}


def rank_bytes(model: object, qtype: str | None, ranks: int) -> int:
    """What one rank of ``ranks`` holds of ``model`` (on the meta device) in bf16 (``qtype`` None) or as a GGUF file of
    ``qtype`` (its matrices whose rows are whole blocks packed, the rest at 2 bytes a value, as ComfyUI-GGUF keeps
    them): under tensor parallelism its slices by the class's plan, a slice that is not whole blocks dequantized to
    bf16 (``gguf_files.slices_packed``)."""
    from parallel_runtime.gguf_files import block_shape, slices_packed
    from parallel_runtime.worker.tp_slices import shard_specs

    specs = shard_specs(model, ranks) if ranks > 1 else {}
    values, size = block_shape(qtype) if qtype else (1, 2)
    total = 0
    for name, p in model.named_parameters():
        packed = qtype is not None and p.dim() == 2 and p.shape[1] % values == 0
        whole = p.numel() // values * size if packed else p.numel() * 2
        spec = specs.get(name)
        if spec is None or spec.dim is None:
            total += whole
        elif packed and not slices_packed(qtype, spec.dim, spec.block_sizes, ranks):
            total += p.numel() // ranks * 2
        else:
            total += whole // ranks
    return total


def print_table() -> None:
    """The README's table: GiB of the transformer per GPU, whole (context / data / cfg parallel) and at tp 2, 4, 8."""
    import diffusers
    import torch

    print("| transformer per GPU (GiB) | format | whole | tp 2 | tp 4 | tp 8 |")
    print("|---|---|---|---|---|---|")
    for name, (cls, config) in PUBLISHED.items():
        with torch.device("meta"):
            model = getattr(diffusers, cls).from_config(config)
        for qtype in (None, "Q8_0", "Q4_K"):
            cells = [f"{rank_bytes(model, qtype, ranks) / 2**30:.1f}" for ranks in (1, 2, 4, 8)]
            print(f"| {name} | {qtype or 'bf16'} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
