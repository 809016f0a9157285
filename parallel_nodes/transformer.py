from parallel_runtime import default_spec, jobs, model_folders

from . import comfy
from .types import BACKEND_INPUT, CATEGORY, DTYPE_INPUT, MAX_MEMORY_INPUT, TRANSFORMER

STRATEGY_TOOLTIP = (
    "How the transformer is split over the backend's ranks.\n"
    "device_map: its layers spread over the GPUs in one process (device_map=\"auto\"); fits a model larger than "
    "one GPU, no speed-up.\n"
    "context_parallel: every rank holds the whole model and takes a slice of the image's tokens (Ring / Ulysses / "
    "Unified attention); one image faster. Needs fast links between GPUs.\n"
    "tensor_parallel: every rank holds a slice of each weight matrix (the model's _tp_plan) and reads only that "
    "slice from disk; fits bigger models and speeds up one image.\n"
    "tp_cp (experimental upstream): tensor parallel inside groups of tp_degree GPUs, context parallel across the "
    "groups (e.g. 8 GPUs: tp_degree 2 × ulysses_degree 4); for a model that needs TP to fit, made faster still.\n"
    "data_parallel: a full replica per rank, each rank makes whole images of the batch (consecutive seeds); more "
    "images per minute, not one image faster."
)


class LoadShardedTransformer:
    """Choose how the transformer is split across GPUs. Lazy: checks the choice, loads on first use."""

    CATEGORY = CATEGORY
    RETURN_TYPES = (TRANSFORMER,)
    RETURN_NAMES = ("transformer",)
    FUNCTION = "load"
    LOADS_NOTHING = True  # it only validates: VALIDATE_INPUTS (its own and ParallelSampler's) may run it
    DESCRIPTION = ("Validates the strategy against the model's config and the backend's ranks and returns a handle; "
                   "the backend loads the weights when ParallelSampler first needs them, so the text encoders never "
                   "have to share the GPUs with it. Changing only the strategy reloads only the transformer.")

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "model": (model_folders.list_models(), {"tooltip": "A diffusers pipeline folder from models/diffusers."}),
                "strategy": (list(jobs.STRATEGIES), {"default": "device_map", "tooltip": STRATEGY_TOOLTIP}),
            },
            "optional": {
                "ring_degree": ("INT", {"default": 1, "min": 1, "max": 64,
                                        "tooltip": "context_parallel: ranks on the ring axis (Ring attention passes "
                                                   "keys/values around; tolerant of slower links). 1: no ring."}),
                "ulysses_degree": ("INT", {"default": 0, "min": 0, "max": 64,
                                           "tooltip": "context_parallel: ranks on the Ulysses axis (all-to-all over "
                                                      "heads; fastest on NVLink). 0: every rank the ring does not "
                                                      "use. Both > 1: Unified attention on a 2-D mesh."}),
                "anything": ("BOOLEAN", {"default": False,
                                         "tooltip": "context_parallel: Ulysses-anything / Ring-anything, for sizes "
                                                    "whose token count does not divide by the degree (e.g. 1008×1008)."}),
                "attention_backend": (list(jobs.ATTENTION_BACKENDS),
                                      {"default": "auto", "tooltip": "context_parallel: diffusers attention backend. "
                                                                     "auto: the default for Ulysses, one that returns "
                                                                     "the log-sum-exp for Ring."}),
                "tp_degree": ("INT", {"default": 0, "min": 0, "max": 64,
                                      "tooltip": "tensor_parallel / tp_cp: ranks sharing each weight matrix; must "
                                                 "divide the attention heads. 0: every rank (tensor_parallel only). "
                                                 "Under tp_cp, ring_degree × ulysses_degree × tp_degree = ranks."}),
                "max_memory": MAX_MEMORY_INPUT,
                "dtype": DTYPE_INPUT,
                "backend": BACKEND_INPUT,
            },
            "hidden": comfy.HIDDEN,
        }

    @classmethod
    def VALIDATE_INPUTS(cls, unique_id: str) -> bool | str:
        """The strategy against the model's config and the linked backend's ranks, before anything runs."""
        return comfy.validate(unique_id, comfy.QueuedNode.run)

    def load(self, model: str, strategy: str, ring_degree: int = 1, ulysses_degree: int = 0, anything: bool = False,
             attention_backend: str = "auto", tp_degree: int = 0, max_memory: str = "", dtype: str = "auto",
             backend=None, unique_id: str | None = None):  # unique_id: ComfyUI's, for VALIDATE_INPUTS
        return (jobs.load_transformer(backend or default_spec(), model=model, strategy=strategy, max_memory=max_memory,
                                      dtype=dtype, ring_degree=ring_degree, ulysses_degree=ulysses_degree,
                                      anything=anything, attention_backend=attention_backend, tp_degree=tp_degree),)
