from parallel_runtime import default_spec

from . import comfy
from .types import BACKEND, CATEGORY


class ParallelBackend:
    """Which ranks and devices the other nodes run on. Nodes wired to the same settings share one backend."""

    CATEGORY = CATEGORY
    RETURN_TYPES = (BACKEND,)
    RETURN_NAMES = ("backend",)
    FUNCTION = "configure"
    LOADS_NOTHING = True  # VALIDATE_INPUTS of the nodes it feeds may run it (parallel_nodes.comfy)
    DESCRIPTION = ("A persistent multi-rank backend (torchrun). It starts on first use, keeps models resident "
                   "between runs, and is replaced when these settings change.")

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "ranks": ("INT", {"default": 0, "min": 0, "max": 64,
                              "tooltip": "Ranks (processes) on this machine, one GPU each. 0: one per visible GPU, "
                                         "or 2 on CPU."}),
            "device": (["auto", "cuda", "cpu"], {"default": "auto",
                                                 "tooltip": "auto: CUDA when a GPU is visible, else CPU (slow; for "
                                                            "trying things out)."}),
            "memory_policy": (["staged", "resident"], {"default": "staged",
                                                       "tooltip": "staged: free the text encoders before the "
                                                                  "transformer loads and vice versa (fits big "
                                                                  "models). resident: keep everything loaded "
                                                                  "(faster prompt changes)."}),
        }, "hidden": comfy.HIDDEN}

    @classmethod
    def VALIDATE_INPUTS(cls, unique_id: str) -> bool | str:
        """Ranks and device against the GPUs this process sees, before anything starts."""
        return comfy.validate(unique_id, comfy.QueuedNode.run)

    def configure(self, ranks: int, device: str, memory_policy: str, unique_id: str | None = None):
        return (default_spec(device=device, ranks=ranks, memory_policy=memory_policy),)
