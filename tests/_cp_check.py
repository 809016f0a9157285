"""Run under torchrun on CPU: each parallel strategy's forward of the tiny FLUX transformer vs a single process.

    python -m torch.distributed.run --standalone --nproc-per-node N tests/_cp_check.py MODEL_DIR RESULTS_JSON CASE...

For each case every rank loads the transformer, computes the plain forward (the single-process reference) on
identical inputs, then enables the case's parallelism on a fresh copy and runs the same forward. Rank 0 writes
`{case: max abs difference over all ranks}` to RESULTS_JSON; a case that raises is recorded as its error text.
"""

import json
import sys

import torch
import torch.distributed as dist
from diffusers import ContextParallelConfig, FluxPipeline, FluxTransformer2DModel, TensorParallelConfig

from parallel_runtime.worker.cpu_shims import CPU_RING_ATTENTION_BACKEND, apply_cpu_shims

# name -> (parallel config factory, latent grid (h, w) in 2x2 patches, text tokens). The "anything" cases use odd
# lengths that no degree divides, which is what they exist for.
CASES = {
    "ulysses2": (lambda: ContextParallelConfig(ulysses_degree=2), (4, 4), 8),
    "ring2": (lambda: ContextParallelConfig(ring_degree=2), (4, 4), 8),
    "ulysses_anything2": (lambda: ContextParallelConfig(ulysses_degree=2, ulysses_anything=True), (3, 5), 7),
    "ring_anything2": (lambda: ContextParallelConfig(ring_degree=2, ring_anything=True), (3, 5), 7),
    "tp2": (lambda: TensorParallelConfig(tp_degree=2), (3, 5), 7),
    "ulysses4": (lambda: ContextParallelConfig(ulysses_degree=4), (4, 4), 8),
    "unified2x2": (lambda: ContextParallelConfig(ring_degree=2, ulysses_degree=2), (4, 4), 8),
    "ulysses_anything4": (lambda: ContextParallelConfig(ulysses_degree=4, ulysses_anything=True), (3, 5), 7),
    "tp4": (lambda: TensorParallelConfig(tp_degree=4), (3, 5), 7),
}


def flux_inputs(grid: tuple[int, int], text_tokens: int, batch_size: int = 2) -> dict:
    """Transformer inputs as FluxPipeline builds them, from a fixed seed (so identical on every rank)."""
    generator = torch.Generator("cpu").manual_seed(0)
    height, width = grid
    return {
        "hidden_states": torch.randn(batch_size, height * width, 64, generator=generator),
        "encoder_hidden_states": torch.randn(batch_size, text_tokens, 32, generator=generator),
        "pooled_projections": torch.randn(batch_size, 32, generator=generator),
        "timestep": torch.full((batch_size,), 0.7),
        "guidance": torch.full((batch_size,), 3.5),
        "img_ids": FluxPipeline._prepare_latent_image_ids(batch_size, height, width, "cpu", torch.float32),
        "txt_ids": torch.zeros(text_tokens, 3),
    }


@torch.no_grad()
def run_case(model_dir: str, name: str) -> float:
    make_config, grid, text_tokens = CASES[name]
    inputs = flux_inputs(grid, text_tokens)
    transformer = FluxTransformer2DModel.from_pretrained(model_dir, subfolder="transformer")
    reference = transformer(**inputs, return_dict=False)[0]

    config = make_config()
    transformer = FluxTransformer2DModel.from_pretrained(model_dir, subfolder="transformer")
    if isinstance(config, ContextParallelConfig) and config.ring_degree > 1:
        transformer.set_attention_backend(CPU_RING_ATTENTION_BACKEND)
    transformer.enable_parallelism(config=config)
    output = transformer(**inputs, return_dict=False)[0]
    if isinstance(output, torch.distributed.tensor.DTensor):
        output = output.full_tensor()
    diff = torch.tensor((output - reference).abs().max().item())
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    return diff.item()


def main() -> None:
    model_dir, results_path, *names = sys.argv[1:]
    apply_cpu_shims()
    dist.init_process_group("gloo")
    results = {}
    for name in names:
        try:
            results[name] = run_case(model_dir, name)
        except Exception as error:  # recorded for the test to show; the other cases still run
            results[name] = f"{type(error).__name__}: {error}"
        dist.barrier()
    if dist.get_rank() == 0:
        with open(results_path, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
