#!/usr/bin/env bash
# The prepared check for a machine with one GPU (e.g. a single H200): under 8 minutes end to end, never a hang.
#
#   bench/gpu_check.sh [--out gpu_check.json] [--only attention nodes ...]
#
# Runs bench/gpu_check.py (see its docstring): GPU facts, the attention backends (the pack's check and a real call),
# doctor and the demo on one CUDA rank, the nodes' path against diffusers' own call (overhead ratio, bfloat16 images
# equal to rounding, device_map placement, peak GPU memory per stage), FLUX.1-dev's real width per block and the
# full model's estimated step against the published single-GPU figure, and bench/strategies.py on one rank at that
# width. One table at the end; the JSON is saved after every check. Each check has its own deadline, and the whole
# run is ended after GPU_CHECK_LIMIT_S seconds (default 470) whatever it is doing, with its backends (they exit when
# their client does). Exit status: 0 all passed, 1 a check failed, 2 no GPU, 124 the time limit.
# PYTHON picks the interpreter (default: python).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
"${PYTHON:-python}" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 2)' || {
    echo "gpu_check: torch sees no GPU here (driver, CUDA_VISIBLE_DEVICES, a CPU-only torch?)" >&2
    exit 2
}
exec timeout --kill-after=15 "${GPU_CHECK_LIMIT_S:-470}" "${PYTHON:-python}" "$here/gpu_check.py" "$@"
