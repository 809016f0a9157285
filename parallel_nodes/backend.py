from __future__ import annotations

from comfy_api.latest import io

from parallel_runtime import default_spec
from parallel_runtime.internals import untested_diffusers
from parallel_runtime.machines import join_commands, where_the_secret_is
from parallel_runtime.spec import MEMORY_POLICIES

from . import comfy
from .types import CATEGORY, Backend


class ParallelBackend(io.ComfyNode):
    """Which ranks and devices the other nodes run on. Nodes wired to the same settings share one backend."""

    LOADS_NOTHING = True  # validate_inputs of the nodes it feeds may run it (parallel_nodes.comfy)

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="ParallelBackend",
            display_name="Parallel Backend",
            category=CATEGORY,
            description=(
                "A persistent multi-rank backend (torchrun). It starts on first use, keeps models resident "
                "between runs, and is replaced when these settings change."
            ),
            inputs=[
                io.Int.Input(
                    "ranks",
                    default=0,
                    min=0,
                    max=64,
                    tooltip=("Ranks (processes) on this machine, one GPU each. 0: one per visible GPU, or 2 on CPU."),
                ),
                io.Combo.Input(
                    "device",
                    options=["auto", "cuda", "cpu"],
                    default="auto",
                    tooltip=("auto: CUDA when a GPU is visible, else CPU (slow; for trying things out)."),
                ),
                io.Combo.Input(
                    "memory_policy",
                    options=list(MEMORY_POLICIES),
                    # auto for new graphs only: saved graphs store their value (UI by position, API by name), and an
                    # API prompt that leaves this required widget out fails ComfyUI's validation, never runs.
                    default="auto",
                    tooltip=(
                        "auto: keep every model loaded while the devices' memory allows (a prompt change reloads "
                        "nothing); when the next one would not fit, free the least recently used first, which on a "
                        "small GPU behaves as staged. The node text of each step says what it freed. "
                        "staged: free the text encoders before the transformer loads and vice versa (fits big models). "
                        "resident: keep everything loaded (fails when it does not fit)."
                    ),
                ),
                # Last: UI-format workflows store widget values by position, so saved graphs keep loading.
                io.String.Input(
                    "gpus",
                    default="",
                    optional=True,
                    tooltip=(
                        "The GPUs the backend uses, as nvidia-smi numbers them, e.g. 0,1,2,3. Empty: every GPU "
                        "ComfyUI's process sees (COMFY_PARALLEL_VISIBLE_DEVICES overrides). ComfyUI started with "
                        "--cuda-device sees one GPU only: list the others here."
                    ),
                ),
                io.Boolean.Input(
                    "free_comfyui_vram",
                    default=True,
                    optional=True,
                    tooltip=(
                        "Before each of the pack's steps on a GPU ComfyUI uses, unload ComfyUI's own models from it "
                        "(as ComfyUI's nodes make room), so the two do not run it out of memory together. Off: they "
                        "stay loaded."
                    ),
                ),
                io.Int.Input(
                    "nnodes",
                    default=1,
                    min=1,
                    max=64,
                    optional=True,
                    tooltip=(
                        "Machines the backend spans, each with `ranks` ranks. This one is node 0 (rank 0 and the "
                        "shared memory stay here); the node's text shows the command to run on each of the others (the "
                        "secret itself only in the Parallel tab of a browser on this machine)."
                    ),
                ),
                io.String.Input(
                    "rdzv_endpoint",
                    default="",
                    optional=True,
                    tooltip=(
                        "With nnodes > 1: host:port of this machine that the others reach (for example "
                        "192.168.1.10:29400). The backend listens only on that address, and its collectives use the "
                        "interface that holds it. Use a trusted network, a VPN or an SSH tunnel (README)."
                    ),
                ),
            ],
            outputs=[
                Backend.Output(
                    display_name="backend",
                    tooltip=(
                        "The backend's settings: wire it into the other nodes of the pack so they share one backend."
                    ),
                )
            ],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def validate_inputs(cls, input_types: dict) -> bool | str:
        """Ranks and device against the GPUs this process sees, before anything starts."""
        return comfy.validate(cls, input_types, comfy.QueuedNode.run)

    @classmethod
    def execute(cls, **inputs) -> io.NodeOutput:
        w = comfy.execution_inputs(cls, inputs)
        spec = default_spec(
            device=w["device"],
            ranks=w["ranks"],
            memory_policy=w["memory_policy"],
            gpus=w["gpus"],
            free_comfyui_vram=w["free_comfyui_vram"],
            nnodes=w["nnodes"],
            rdzv_endpoint=w["rdzv_endpoint"],
        )
        untested = untested_diffusers()  # logged at ComfyUI's start-up already
        if spec.nnodes > 1:
            # Without the secret: the text goes to whoever queued the prompt, who may be anyone that reaches ComfyUI's
            # port (--listen), and into the log, which ComfyUI serves too.
            commands = join_commands(spec.rdzv_endpoint, spec.nnodes)
            lines = [untested] if untested else []
            where = "where " + where_the_secret_is() + "."
            comfy.show_text(cls, "\n".join([*lines, "On each other machine run:", *commands, where]))
        elif untested:
            comfy.show_text(cls, untested)
        return io.NodeOutput(spec)
