"""A test-only ComfyUI node pack, which tests/test_comfyui_host.py loads into a server of its own: a node that runs
until the prompt is interrupted, so an interrupt lands while a node is known to run, on a machine of any speed (a
chain of real nodes may all finish before the interrupt arrives)."""

import time

import comfy.model_management
import comfy.utils

# Never interrupted, the node gives up and the prompt succeeds, which the test reports as its failure.
DEADLINE_S = 300.0
POLL_S = 0.02  # how often the node looks at ComfyUI's interrupt flag


class WaitForInterrupt:
    """Passes its image on once ComfyUI's interrupt flag is set (raising ComfyUI's own interruption there); its one
    ``progress`` message says it runs."""

    CATEGORY = "testing"
    RETURN_TYPES = ("IMAGE",)
    FUNCTION = "wait"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"image": ("IMAGE",)}}

    def wait(self, image):
        comfy.utils.ProgressBar(2).update_absolute(1)
        deadline = time.monotonic() + DEADLINE_S
        while time.monotonic() < deadline:
            comfy.model_management.throw_exception_if_processing_interrupted()
            time.sleep(POLL_S)
        return (image,)


NODE_CLASS_MAPPINGS = {"WaitForInterrupt": WaitForInterrupt}
