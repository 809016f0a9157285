#!/usr/bin/env python3
"""The peers' side of ``bench/peers.py``: FLUX.1 on N torchrun ranks parallelised by diffusers' own API, as a bare
script does it, or by cache-dit (its caching off). Run by ``peers.py``; by hand:

    torchrun --standalone --nproc-per-node 2 bench/peer_ranks.py --side diffusers --strategy ulysses \\
        --model-dir DIR --serve SOCKET            # stays up, one generation per request from peers.py
    torchrun --standalone --nproc-per-node 2 bench/peer_ranks.py --side diffusers --strategy ulysses \\
        --model-dir DIR --first-image OUT.json    # cold start: launch to first image, then exit

How each side builds the transformer (one function each, below, so the recipes can be read against their docs):

* ``diffusers``: ``FluxTransformer2DModel.from_pretrained`` then ``enable_parallelism(config=ParallelConfig(
  context_parallel_config=ContextParallelConfig(ulysses_degree=N | ring_degree=N)))`` for context parallelism
  (Ring after ``set_attention_backend`` to an op that returns the log-sum-exp: ``_native_cudnn`` on CUDA,
  ``_native_flash`` on CPU), and ``from_pretrained(parallel_config=TensorParallelConfig(tp_degree=N))`` for tensor
  parallelism. On CPU the pack's ``apply_cpu_shims()`` first (diffusers 0.42's parallel code assumes an
  accelerator); nothing else of the pack is imported, so this side is diffusers as documented, not the pack's code.
* ``cache-dit``: ``FluxTransformer2DModel.from_pretrained``, then ``cache_dit.enable_cache(transformer,
  cache_config=None, parallelism_config=ParallelismConfig(ulysses_size=N | ring_size=N | tp_size=N))``:
  ``cache_config=None`` with a parallelism config is cache-dit's documented way to parallelise without caching. Its
  context-parallel runtime is its own (adapted from diffusers'), its tensor parallelism its own planner; no shims.

Both sides then wrap the transformer in a ``FluxPipeline`` loaded from the same folder and call it with the same
seed, size, steps and guidance. In ``--serve`` mode rank 0 connects to ``peers.py``'s unix socket, the ranks load
once and then serve one request at a time. ``run``: latents from the embeddings ``peers.py`` encoded with the pack
(so every side denoises the same inputs), rank 0 sending one line per step from the pipeline's
``callback_on_step_end``, where the pack's backend sends its progress event, and ``peers.py`` reading the clock as
each line arrives; the latents go back unpacked and scaled as the pack returns them (ComfyUI's LATENT convention).
``image``: a whole image from the prompt (text encoders, transformer, VAE), as a user's script makes its next image.
Results travel as safetensors files. Requests reach the other ranks over a gloo group, so ranks waiting for the next
request sleep in a socket read rather than spin in an accelerator collective.

In ``--first-image`` mode the ranks load everything and make one image from the prompt, as a user's script does
from launch; rank 0 writes when its process group was up, diffusers imported, the pipeline loaded and the image
ready (``time.monotonic()``, the clock ``peers.py`` read before launching torchrun).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import sys
import time
import traceback

import torch
import torch.distributed as dist

STRATEGIES = ("ulysses", "ring", "tp")
SIDES = ("diffusers", "cache-dit")
# torch.distributed's default (30 min) would end a serve group that waits longer for its next request.
GROUP_TIMEOUT = datetime.timedelta(hours=6)


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--side", choices=SIDES, required=True)
    parser.add_argument("--strategy", choices=STRATEGIES, required=True)
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--serve", metavar="SOCKET", help="connect rank 0 to this unix socket and serve generations")
    mode.add_argument("--first-image", metavar="OUT", help="time launch to first image, write the result as JSON")
    parser.add_argument("--prompt", default="a photo of a red cat on a blue sky")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--height", type=int, default=256)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--guidance", type=float, default=3.5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-sequence-length", type=int, default=64)
    return parser.parse_args()


def _dtype(device: str) -> torch.dtype:
    return torch.bfloat16 if device == "cuda" else torch.float32  # what the pack's dtype "auto" resolves to


def diffusers_transformer(model_dir: str, strategy: str, ranks: int, dtype: torch.dtype, device: torch.device):
    """The transformer as diffusers' distributed-inference guide builds it."""
    from diffusers import ContextParallelConfig, FluxTransformer2DModel, ParallelConfig, TensorParallelConfig

    if device.type == "cpu":
        from parallel_runtime.worker.cpu_shims import apply_cpu_shims

        apply_cpu_shims()
    if strategy == "tp":
        return FluxTransformer2DModel.from_pretrained(
            model_dir, subfolder="transformer", torch_dtype=dtype, parallel_config=TensorParallelConfig(tp_degree=ranks)
        )
    transformer = FluxTransformer2DModel.from_pretrained(model_dir, subfolder="transformer", torch_dtype=dtype)
    transformer.to(device)
    if strategy == "ring":  # Ring merges partial attention by its log-sum-exp: an op that returns it
        transformer.set_attention_backend("_native_cudnn" if device.type == "cuda" else "_native_flash")
    degrees = {"ring_degree": ranks} if strategy == "ring" else {"ulysses_degree": ranks}
    transformer.enable_parallelism(config=ParallelConfig(context_parallel_config=ContextParallelConfig(**degrees)))
    return transformer


def cache_dit_transformer(model_dir: str, strategy: str, ranks: int, dtype: torch.dtype, device: torch.device):
    """The transformer as cache-dit's parallelism guide builds it, with no cache."""
    import cache_dit
    from cache_dit import ParallelismConfig
    from diffusers import FluxTransformer2DModel

    transformer = FluxTransformer2DModel.from_pretrained(model_dir, subfolder="transformer", torch_dtype=dtype)
    transformer.to(device)
    size = {"ulysses": "ulysses_size", "ring": "ring_size", "tp": "tp_size"}[strategy]
    cache_dit.enable_cache(transformer, cache_config=None, parallelism_config=ParallelismConfig(**{size: ranks}))
    return transformer


def load_pipeline(args: argparse.Namespace, ranks: int, device: torch.device):
    from diffusers import FluxPipeline

    dtype = _dtype(args.device)
    build = diffusers_transformer if args.side == "diffusers" else cache_dit_transformer
    transformer = build(args.model_dir, args.strategy, ranks, dtype, device)
    pipe = FluxPipeline.from_pretrained(args.model_dir, transformer=transformer, torch_dtype=dtype)
    for name in ("text_encoder", "text_encoder_2", "vae"):  # the transformer is placed already (a TP one as shards)
        getattr(pipe, name).to(device)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def comfy_latents(pipe, packed: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """What FluxPipeline does to its latents before ``vae.decode``: the pack's LATENT convention."""
    latents = pipe._unpack_latents(packed.float(), height, width, pipe.vae_scale_factor)
    return (latents / pipe.vae.config.scaling_factor + pipe.vae.config.shift_factor).cpu()


class Link:
    """Rank 0's line-per-message JSON connection to peers.py."""

    def __init__(self, path: str):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(path)
        self.reader = self.sock.makefile("rb")

    def send(self, **message: object) -> None:
        self.sock.sendall(json.dumps(message).encode() + b"\n")

    def recv(self) -> dict:
        line = self.reader.readline()
        if not line:  # peers.py went away: end the group rather than wait forever
            return {"op": "quit"}
        return json.loads(line)


def image(pipe, prompt: str, seed: int, steps: int, guidance: float, width: int, height: int, tokens: int):
    """One image the way a user's script makes it: the whole pipeline from the prompt; ComfyUI's IMAGE layout."""
    images = pipe(
        prompt=prompt,
        num_inference_steps=steps,
        guidance_scale=guidance,
        height=height,
        width=width,
        max_sequence_length=tokens,
        generator=torch.Generator("cpu").manual_seed(seed),
        output_type="pt",
    ).images
    return images.permute(0, 2, 3, 1).float().cpu().contiguous()


def denoise(pipe, request: dict, device: torch.device, on_step) -> torch.Tensor:
    """Latents from the embeddings peers.py encoded with the pack, unpacked and scaled as the pack returns them."""
    from safetensors.torch import load_file

    embeds = load_file(request["conditioning"])
    dtype = pipe.transformer.dtype
    packed = pipe(
        prompt_embeds=embeds["prompt_embeds"].to(device=device, dtype=dtype),
        pooled_prompt_embeds=embeds["pooled_prompt_embeds"].to(device=device, dtype=dtype),
        num_inference_steps=request["steps"],
        guidance_scale=request["guidance"],
        height=request["height"],
        width=request["width"],
        generator=torch.Generator("cpu").manual_seed(request["seed"]),
        output_type="latent",
        callback_on_step_end=on_step,
    ).images
    return comfy_latents(pipe, packed, request["height"], request["width"])


def serve(args: argparse.Namespace, rank: int, ranks: int, device: torch.device) -> None:
    """Load once, then one request at a time from peers.py: ``run`` (latents from the pack's embeddings, a line per
    step) or ``image`` (a whole image from the prompt), until ``quit`` or until peers.py goes away."""
    from safetensors.torch import save_file

    control = dist.new_group(backend="gloo", timeout=GROUP_TIMEOUT)
    link = Link(args.serve) if rank == 0 else None

    def step_end(pipeline, step_index, timestep, callback_kwargs):
        if link:
            link.send(step=step_index + 1)
        return {}

    try:
        t0 = time.monotonic()
        pipe = load_pipeline(args, ranks, device)
        if link:
            link.send(ready=True, load_s=time.monotonic() - t0)
        while True:
            request = [link.recv() if link else None]
            dist.broadcast_object_list(request, src=0, group=control)
            request = request[0]
            if request["op"] == "quit":
                return
            if request["op"] == "run":
                out = {"samples": denoise(pipe, request, device, step_end)}
            else:
                r = request
                out = {
                    "images": image(
                        pipe, r["prompt"], r["seed"], r["steps"], r["guidance"], r["width"], r["height"], r["tokens"]
                    )
                }
            if link:
                save_file(out, request["out"])
                link.send(done=request["out"])
    except BaseException:
        if link:  # the error travels to peers.py, which shows its last line; the whole traceback is in the log
            try:
                link.send(error=traceback.format_exc())
            except OSError:
                pass
        raise


def first_image(args: argparse.Namespace, rank: int, ranks: int, device: torch.device) -> None:
    """Launch to first image as a user's script runs: load everything, one image from the prompt, exit."""
    from safetensors.torch import save_file

    ranks_up_at = time.monotonic()  # torch imported, process group formed
    import diffusers  # noqa: F401  (the pack's ranks import it before they report up: its CPU shims patch it)

    imported_at = time.monotonic()
    pipe = load_pipeline(args, ranks, device)
    loaded_at = time.monotonic()
    a = args
    first = image(pipe, a.prompt, a.seed, a.steps, a.guidance, a.width, a.height, a.max_sequence_length)
    first_at = time.monotonic()
    if rank == 0:
        out = os.path.splitext(args.first_image)[0] + ".safetensors"
        save_file({"images": first}, out)
        times = {"ranks_up_at": ranks_up_at, "imported_at": imported_at, "loaded_at": loaded_at}
        with open(args.first_image, "w") as f:
            json.dump(dict(times, first_image_at=first_at, image=out), f)


def main() -> int:
    args = _parse_args()
    rank, ranks, local_rank = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if args.device == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", timeout=GROUP_TIMEOUT)
    try:
        (serve if args.serve else first_image)(args, rank, ranks, device)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    # The checkout's root, for the pack's CPU shims: a plain script, not necessarily run from an installed package.
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main())
