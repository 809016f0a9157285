"""ComfyUI node classes of the pack. Thin: they declare widgets and call parallel_runtime.jobs."""
try:  # inside ComfyUI: register the status panel's routes on its server
    from . import routes  # noqa: F401
except ImportError:  # plain Python (demo, tests): no server to register on
    pass

from .backend import ParallelBackend
from .encode import EncodeOnBalancedGPUs
from .sampler import ParallelSampler
from .transformer import LoadShardedTransformer
from .vae import VAEDecodeSingleGPU

NODE_CLASS_MAPPINGS: dict[str, type] = {
    "ParallelBackend": ParallelBackend,
    "EncodeOnBalancedGPUs": EncodeOnBalancedGPUs,
    "LoadShardedTransformer": LoadShardedTransformer,
    "ParallelSampler": ParallelSampler,
    "VAEDecodeSingleGPU": VAEDecodeSingleGPU,
}

NODE_DISPLAY_NAME_MAPPINGS: dict[str, str] = {
    "ParallelBackend": "Parallel Backend",
    "EncodeOnBalancedGPUs": "Encode on Balanced GPUs",
    "LoadShardedTransformer": "Load Sharded Transformer",
    "ParallelSampler": "Parallel Sampler",
    "VAEDecodeSingleGPU": "VAE Decode (single GPU)",
}
