from __future__ import annotations

from comfy_api.latest import io

from parallel_runtime import default_spec, jobs
from parallel_runtime.families import names
from parallel_runtime.strategy import ATTENTION_BACKENDS, Strategy, strategies_on
from parallel_runtime.wire import FIRST_BLOCK_CACHE_THRESHOLD, CacheMode, CompileMode, Weights

from . import comfy
from .types import CATEGORY, Transformer, backend_input, dtype_input, max_memory_input, model_input

STRATEGY_TOOLTIP = (
    "How the transformer is split over the backend's ranks.\n"
    'device_map: its layers spread over the GPUs in one process (device_map="auto"); fits a model larger than '
    "one GPU, no speed-up.\n"
    "context_parallel: every rank holds the whole model and takes a slice of the image's tokens (Ring / Ulysses / "
    "Unified attention); one image faster. Needs fast links between GPUs.\n"
    "tensor_parallel: every rank holds a slice of each weight matrix (the model's tensor-parallel plan: diffusers' "
    "_tp_plan, or the pack's) and reads only that slice from disk; fits bigger models and speeds up one image.\n"
    "tp_cp (experimental upstream): tensor parallel inside groups of tp_degree GPUs, context parallel across the "
    "groups (e.g. 8 GPUs: tp_degree 2 × ulysses_degree 4); for a model that needs TP to fit, made faster still.\n"
    "data_parallel: a full replica per rank, each rank makes whole images of the batch (consecutive seeds); more "
    "images per minute, not one image faster.\n"
    f"cfg_parallel: true CFG ({names(lambda f: f.true_cfg)}, true_cfg_scale > 1): the conditional pass on half of "
    "the ranks, the "
    "unconditional one on the other half, one exchange per step; ring_degree × ulysses_degree split each half "
    "(e.g. 4 GPUs: CFG 2 × ulysses_degree 2)."
)
TOKENS = " / ".join(strategies_on("ring"))  # the strategies that read the context-parallel widgets


class LoadShardedTransformer(io.ComfyNode):
    """Choose how the transformer is split across GPUs. Lazy: checks the choice, loads on first use."""

    LOADS_NOTHING = True  # it only validates: validate_inputs (its own and ParallelSampler's) may run it

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="LoadShardedTransformer",
            display_name="Load Sharded Transformer",
            category=CATEGORY,
            description=(
                "Validates the strategy against the model's config and the backend's ranks and returns a "
                "handle; the backend loads the weights when ParallelSampler first needs them, so the text "
                "encoders never have to share the GPUs with it. Changing only the strategy reloads only the "
                "transformer."
            ),
            inputs=[
                model_input("A diffusers pipeline folder from models/diffusers."),
                io.Combo.Input(
                    "strategy", options=[s.value for s in Strategy], default="device_map", tooltip=STRATEGY_TOOLTIP
                ),
                io.Int.Input(
                    "ring_degree",
                    default=1,
                    min=1,
                    max=64,
                    optional=True,
                    tooltip=(
                        f"{TOKENS}: ranks on the ring axis (Ring attention passes keys/values around; tolerant "
                        "of slower links). 1: no ring."
                    ),
                ),
                io.Int.Input(
                    "ulysses_degree",
                    default=0,
                    min=0,
                    max=64,
                    optional=True,
                    tooltip=(
                        f"{TOKENS}: ranks on the Ulysses axis (all-to-all over heads; fastest on NVLink). 0: "
                        "every rank the ring does not use. Both > 1: Unified attention on a 2-D mesh. Under "
                        "cfg_parallel both degrees split each half of the ranks (0: the whole half)."
                    ),
                ),
                io.Boolean.Input(
                    "anything",
                    default=False,
                    optional=True,
                    tooltip=(
                        f"{TOKENS}: Ulysses-anything / Ring-anything, for sizes whose token count does not "
                        "divide by the degree (e.g. 1008×1008)."
                    ),
                ),
                io.Combo.Input(
                    "attention_backend",
                    options=list(ATTENTION_BACKENDS),
                    default="auto",
                    optional=True,
                    tooltip=(
                        f"{TOKENS}: diffusers attention backend. auto: the default for "
                        "Ulysses, one that returns the log-sum-exp for Ring."
                    ),
                ),
                io.Int.Input(
                    "tp_degree",
                    default=0,
                    min=0,
                    max=64,
                    optional=True,
                    tooltip=(
                        f"{' / '.join(strategies_on('tp'))}: ranks sharing each weight matrix; must divide the "
                        "attention heads. "
                        "0: every rank (tensor_parallel only). Under tp_cp, ring_degree × ulysses_degree × tp_degree "
                        "= ranks."
                    ),
                ),
                max_memory_input(),
                dtype_input(),
                backend_input(),
                io.Combo.Input(
                    "cache",
                    options=[m.value for m in CacheMode],
                    default=CacheMode.OFF.value,
                    optional=True,
                    tooltip=(
                        "Reuse work between denoising steps (diffusers' enable_cache), on every strategy; the "
                        "ranks that share a pass always take the same decision. off: every block of every step.\n"
                        "first_block_cache: after the first block, skip the rest of a step while the first block's "
                        "output changes less than cache_threshold.\n"
                        "taylorseer: predict the attention layers' outputs from earlier steps, recomputing every "
                        "5th step after the 3rd.\n"
                        "Faster, not identical: ParallelSampler's text says how many passes the cache stood in for."
                    ),
                ),
                io.Float.Input(
                    "cache_threshold",
                    default=FIRST_BLOCK_CACHE_THRESHOLD,
                    min=0.001,
                    max=1.0,
                    step=0.005,
                    optional=True,
                    tooltip=(
                        "first_block_cache: the relative change of the first block's output below which a step "
                        "reuses the previous step's other blocks; higher skips more and strays further."
                    ),
                ),
                io.Combo.Input(
                    "compile",
                    options=[m.value for m in CompileMode],
                    default=CompileMode.OFF.value,
                    optional=True,
                    tooltip=(
                        "off: run the transformer as it is.\n"
                        "regional: torch.compile each repeated block on every rank (diffusers' "
                        "compile_repeated_blocks), once per loaded transformer and kept across runs; the first run "
                        "and each new size pay the compile, ParallelSampler's text says when a run recompiled and "
                        "why. LoRA strengths change without a recompile. Not with a step cache. CPU ranks need a C++ "
                        "compiler."
                    ),
                ),
                io.Combo.Input(
                    "weights",
                    options=[w.value for w in Weights],
                    default=Weights.AS_STORED.value,
                    optional=True,
                    tooltip=(
                        "What a transformer's fp8 weights (a ComfyUI fp8 or scaled-fp8 file) are held as on every "
                        "rank, on every strategy.\n"
                        "as stored: fp8, half the memory of bf16; each layer's weight is made in the dtype (times "
                        "its scale, with the LoRAs) only while the layer runs. The same image as 'as dtype' (fp8 "
                        "values are exact in bf16).\n"
                        "as dtype: made in the dtype when loading, twice the memory (what the pack did before it "
                        "kept fp8).\n"
                        "bf16 / fp16 / fp32 weights load in the dtype either way. The node's text says what a rank "
                        "holds."
                    ),
                ),
            ],
            outputs=[
                Transformer.Output(
                    display_name="transformer",
                    tooltip=(
                        "The checked choice of model, strategy and dtype (nothing loaded yet): feed ParallelSampler."
                    ),
                )
            ],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def validate_inputs(cls, input_types: dict) -> bool | str:
        """The strategy against the model's config and the linked backend's ranks, before anything runs."""
        return comfy.validate(cls, input_types, comfy.QueuedNode.run)

    @classmethod
    def execute(cls, **inputs) -> io.NodeOutput:
        w = comfy.execution_inputs(cls, inputs)
        handle = jobs.plan_transformer(w.pop("backend") or default_spec(), **w)
        comfy.show_text(cls, handle.held)
        return io.NodeOutput(handle)
