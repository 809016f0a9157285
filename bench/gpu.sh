#!/usr/bin/env bash
# Per-step time of each parallel strategy on GPUs at FLUX.1-dev's real width, without downloading anything.
#
#   bench/gpu.sh [--ranks N] [--model-dir DIR] [--build-only] [--double-blocks N --single-blocks M] [...]
#   bench/gpu.sh peers [--strategies ulysses4 ring4 tp4] [--interleave] [...]
#   bench/gpu.sh speed [--parts cfg cache vae] [...]
#   bench/gpu.sh compile [--backend inductor] [...]
#
# Builds (once) a FLUX.1 pipeline folder whose transformer has FLUX.1-dev's config (19 double + 38 single blocks,
# 24 heads x 128, T5 width 4096, CLIP pooled 768, guidance embeddings) with random weights in bfloat16 (~22 GiB, drawn
# one block at a time on the first GPU and saved in 2 GiB shards; the folder needs ~24 GB of disk), with tiny text
# encoders and VAE of matching output widths, then runs bench/strategies.py on it at 1024x1024 with FLUX.1-dev's 512
# text tokens, one rank per GPU torch sees, and prints ms per step for one GPU and for each strategy (a side that
# runs out of GPU memory is reported and the rest still run). With "peers" first it runs bench/peers.py instead on
# the same folder and size: the pack against bare diffusers and cache-dit (caching off), N ranks each, 3 runs per
# side. With "speed" first it runs bench/speed.py's CFG-parallel, step-cache and decode-over-the-ranks rows instead,
# at Qwen-Image's width
# (60 blocks, random bfloat16 weights: ~41 GB on disk and per GPU; SPEED_LAYERS=N builds fewer blocks into a folder of
# its own), on 2 GPUs and, with 4 or more, on 4 (CFG 2 × Ulysses 2). With "compile" first it runs bench/compile.py
# on the FLUX.1-dev folder: per-step time compiled (regional, inductor) / eager and the compile time, for Ulysses N
# and tensor parallel N over every GPU.
# Any other option goes to the Python script and overrides these defaults (see its --help); a folder built with
# other block counts is refused at the default path, so give such builds their own --model-dir.
# PYTHON picks the interpreter (default: python); the default folder is under ${XDG_CACHE_HOME:-~/.cache}.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# The GPUs this process may use, as torch counts them: CUDA_VISIBLE_DEVICES narrows them, nvidia-smi would not.
gpus="$("${PYTHON:-python}" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)')"
if (( gpus == 0 )); then
    echo "gpu.sh: torch sees no GPU here (driver, CUDA_VISIBLE_DEVICES, a CPU-only torch?)" >&2
    exit 2
fi
cache="${XDG_CACHE_HOME:-$HOME/.cache}/comfy-parallel"
if [[ "${1:-}" == speed ]]; then
    shift
    if (( gpus < 2 )); then
        echo "bench/gpu.sh speed: CFG parallelism needs 2 GPUs or more" >&2
        exit 1
    fi
    layers="${SPEED_LAYERS:-60}"
    for ranks in 2 4; do
        (( ranks <= gpus )) || continue
        "${PYTHON:-python}" "$here/speed.py" --device cuda --ranks "$ranks" --preset qwen-image --layers "$layers" \
            --model-dir "$cache/qwen-image-random-$layers" --size 1024 --steps 10 --decode-size 2048 "$@"
    done
    exit 0
fi
if [[ "${1:-}" == compile ]]; then
    shift
    if (( gpus < 2 )); then
        echo "bench/gpu.sh compile: Ulysses and TP rows need 2 GPUs or more (one GPU: bench/gpu_check.sh --only compile)" >&2
        exit 1
    fi
    exec "${PYTHON:-python}" "$here/compile.py" --device cuda --ranks "$gpus" \
        --preset flux1-dev --model-dir "$cache/flux1-dev-random" \
        --size 1024 --max-sequence-length 512 --steps 12 --repeats 3 "$@"
fi
script=strategies.py
runs=(--repeats 3)
if [[ "${1:-}" == peers ]]; then
    shift
    script=peers.py
    runs=(--rounds 3)
fi
exec "${PYTHON:-python}" "$here/$script" --device cuda --ranks "$gpus" \
    --preset flux1-dev --model-dir "$cache/flux1-dev-random" \
    --width 1024 --height 1024 --max-sequence-length 512 --steps 12 "${runs[@]}" "$@"
