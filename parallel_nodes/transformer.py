from parallel_runtime import default_spec, jobs, model_folders

from .types import BACKEND_INPUT, CATEGORY, DTYPE_INPUT, MAX_MEMORY_INPUT, TRANSFORMER


class LoadShardedTransformer:
    """Choose how the transformer is split across GPUs. Lazy: checks the choice, loads on first use."""

    CATEGORY = CATEGORY
    RETURN_TYPES = (TRANSFORMER,)
    RETURN_NAMES = ("transformer",)
    FUNCTION = "load"
    DESCRIPTION = ("Validates the strategy against the model's config and returns a handle; the backend loads the "
                   "weights when ParallelSampler first needs them, so the text encoders never have to share the "
                   "GPUs with it.")

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "model": (model_folders.list_models(), {"tooltip": "A diffusers pipeline folder from models/diffusers."}),
                "strategy": (list(jobs.STRATEGIES), {"default": "device_map",
                                                     "tooltip": "device_map: the transformer's layers spread over "
                                                                "the GPUs (device_map=\"auto\"), one process; fits "
                                                                "models larger than one GPU."}),
            },
            "optional": {
                "max_memory": MAX_MEMORY_INPUT,
                "dtype": DTYPE_INPUT,
                "backend": BACKEND_INPUT,
            },
        }

    def load(self, model: str, strategy: str, max_memory: str = "", dtype: str = "auto", backend=None):
        return (jobs.load_transformer(backend or default_spec(), model=model, strategy=strategy,
                                      max_memory=max_memory, dtype=dtype),)
