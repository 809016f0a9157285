"""The node classes themselves (ComfyUI's V3 schema, ``comfy_api``): the contract saved workflows rely on, tooltips,
defaults from the schema, the link-type check validate_inputs takes over from ComfyUI, and one graph through the
nodes' execute equal to the same graph through the steps they call. Needs COMFYUI_DIR (comfy_api); the end-to-end
tests run the same nodes inside a real ComfyUI server."""

from __future__ import annotations

import pytest
import torch

from parallel_runtime import InvalidInput, default_spec, jobs

# What workflows saved by version 0.1.0 hold: node ids, input names in order (required, then optional) and output
# types. UI-format workflows store widget values by position, so this may only grow at the end of "optional".
CONTRACT_0_1_0 = {
    "ParallelBackend": (["ranks", "device", "memory_policy"], [], ["PD_BACKEND"]),
    "EncodeOnBalancedGPUs": (
        ["model", "prompt"],
        ["prompt_2", "max_sequence_length", "max_memory", "dtype", "backend", "negative_prompt", "one_prompt_per_line"],
        ["PD_CONDITIONING"],
    ),
    "LoadShardedTransformer": (
        ["model", "strategy"],
        [
            "ring_degree",
            "ulysses_degree",
            "anything",
            "attention_backend",
            "tp_degree",
            "max_memory",
            "dtype",
            "backend",
        ],
        ["PD_TRANSFORMER"],
    ),
    "ParallelSampler": (
        ["transformer", "positive", "seed", "steps", "guidance_scale", "width", "height", "batch_size"],
        ["true_cfg_scale"],
        ["LATENT"],
    ),
    "VAEDecodeSingleGPU": (["samples", "model", "device"], ["dtype", "backend"], ["IMAGE"]),
}

# Nodes added after 0.1.0, with what workflows saved since hold; the same rule: grow only at the end of "optional".
ADDED_AFTER_0_1_0 = {
    "ParallelAdvisor": (["model", "width", "height"], ["gpus", "backend"], ["STRING"]),
    "ParallelLoraLoader": (["transformer", "lora_name", "strength"], [], ["PD_TRANSFORMER"]),
    "ParallelModelFromComfyFiles": (["diffusion_model", "text_encoder", "text_encoder_2", "vae"], [], ["COMBO"]),
    "VAEEncodeSingleGPU": (["pixels", "model", "device"], ["dtype", "backend"], ["LATENT"]),
}
# Inputs appended since 0.1.0 to the optional end of a node's, in the order they came.
GROWN_AFTER_0_1_0 = {
    "ParallelBackend": ["gpus", "free_comfyui_vram", "nnodes", "rdzv_endpoint"],  # GPU readiness; several machines
    # img2img, inpainting; the samplers; ComfyUI's negative; Wan's clip length and second expert's CFG; an edit's image
    "ParallelSampler": [
        "latent_image",
        "denoise",
        "sampler",
        "scheduler",
        "negative",
        "length",
        "guidance_scale_2",
        "image",
        "image_2",  # FLUX.2's further reference images
        "image_3",
    ],
    # step caching; compiled blocks; fp8 held as stored
    "LoadShardedTransformer": ["cache", "cache_threshold", "compile", "weights"],
    "VAEDecodeSingleGPU": ["decode_over_ranks"],  # the decode over the ranks
    # Wan 2.2 A14B's low-noise expert; Wan 2.1 I2V's CLIP vision file
    "ParallelModelFromComfyFiles": ["diffusion_model_2", "clip_vision"],
    "EncodeOnBalancedGPUs": ["image", "image_2", "image_3"],  # the images Qwen-Image-Edit's text encoder reads
    "ParallelLoraLoader": ["expert"],  # which of Wan 2.2 A14B's experts a LoRA changes
    "ParallelAdvisor": ["length"],  # a clip's frames
}
CONTRACT = {**CONTRACT_0_1_0, **ADDED_AFTER_0_1_0}
for _node_id, _grown in GROWN_AFTER_0_1_0.items():
    _required, _optional, _outputs = CONTRACT[_node_id]
    CONTRACT[_node_id] = (_required, _optional + _grown, _outputs)


def test_saved_workflows_keep_their_inputs(nodes):
    assert set(nodes) == set(CONTRACT)
    for node_id, (required, optional, outputs) in CONTRACT.items():
        types = nodes[node_id].INPUT_TYPES()  # no include_hidden: ComfyUI 0.26 dropped that argument
        assert list(types.get("required", {}))[: len(required)] == required, node_id
        assert list(types.get("required", {})) == required, f"{node_id}: a new input must be optional, and last"
        assert list(types.get("optional", {}))[: len(optional)] == optional, node_id
        assert list(nodes[node_id].RETURN_TYPES) == outputs, node_id


def test_every_input_and_output_has_a_tooltip(nodes):
    for node_id, node in nodes.items():
        schema = node.define_schema()
        assert schema.description and schema.category == "parallel_diffusers", node_id
        assert all(i.tooltip for i in schema.inputs), [i.id for i in schema.inputs if not i.tooltip]
        assert schema.outputs and all(o.tooltip for o in schema.outputs), node_id


def test_an_input_left_out_takes_the_schema_default(nodes):
    from parallel_nodes import comfy

    values = comfy.with_defaults(nodes["LoadShardedTransformer"], {"model": "m", "strategy": "tp_cp"})
    assert values == {
        "model": "m",
        "strategy": "tp_cp",
        "ring_degree": 1,
        "ulysses_degree": 0,
        "anything": False,
        "attention_backend": "auto",
        "tp_degree": 0,
        "max_memory": "",
        "dtype": "auto",
        "backend": None,
        "cache": "off",
        "cache_threshold": 0.05,
        "compile": "off",
        "weights": "as stored",
    }


def test_a_link_of_the_wrong_type_is_refused(nodes):
    """Declaring input_types turns off ComfyUI's own link-type check: validate_inputs makes it."""
    sampler = nodes["ParallelSampler"]
    # positive and negative take the pack's conditioning and ComfyUI's, as ComfyUI checks a union type
    for kind in ("PD_CONDITIONING", "CONDITIONING"):
        for name in ("positive", "negative"):
            assert sampler.validate_inputs(input_types={"transformer": "PD_TRANSFORMER", name: kind}) is True
    refused = sampler.validate_inputs(input_types={"transformer": "PD_TRANSFORMER", "positive": "LATENT"})
    assert refused.startswith("positive: a LATENT is linked in") and "PD_CONDITIONING,CONDITIONING" in refused


@pytest.fixture(scope="module")
def tiny(models_root):
    from parallel_runtime.families.tiny import make_tiny_model

    make_tiny_model("flux", str(models_root / "tiny-flux"))
    return "tiny-flux"


@pytest.mark.multirank
def test_the_nodes_give_what_their_steps_give(nodes, tiny):
    """The nodes are thin: the same graph through their execute and through jobs is the same image, bit for bit; the
    decoder takes a LATENT as ComfyUI's samplers make it (extra keys such as batch_index)."""
    (backend,) = nodes["ParallelBackend"].execute(ranks=2, device="cpu", memory_policy="staged").args
    (positive,) = (
        nodes["EncodeOnBalancedGPUs"]
        .execute(model=tiny, prompt="a red cat", max_sequence_length=16, backend=backend)
        .args
    )
    (transformer,) = (
        nodes["LoadShardedTransformer"].execute(model=tiny, strategy="tensor_parallel", backend=backend).args
    )
    (latent,) = (
        nodes["ParallelSampler"]
        .execute(
            transformer=transformer,
            positive=positive,
            seed=5,
            steps=2,
            guidance_scale=3.5,
            width=32,
            height=48,
            batch_size=1,
        )
        .args
    )
    (image,) = (
        nodes["VAEDecodeSingleGPU"]
        .execute(samples={**latent, "batch_index": [0]}, model=tiny, device="auto", backend=backend)
        .args
    )

    spec = default_spec(ranks=2, device="cpu")
    assert backend == spec
    conditioning = jobs.encode_prompt(spec, model=tiny, prompt="a red cat", max_sequence_length=16)
    handle = jobs.plan_transformer(spec, model=tiny, strategy="tensor_parallel")
    samples = jobs.sample(handle, conditioning, seed=5, steps=2, guidance_scale=3.5, width=32, height=48)
    assert transformer == handle and torch.equal(latent["samples"], samples)
    assert torch.equal(image, jobs.decode(spec, model=tiny, samples=samples))


def test_every_node_refuses_a_linked_number_outside_its_range_before_any_work(nodes):
    """ComfyUI checks a widget's own value against its min..max, not a value linked into it from another node: every
    node's execute refuses that by the input's name, before it starts or loads anything."""
    checked = 0
    for node in nodes.values():
        for spec in node.define_schema().inputs:
            high = getattr(spec, "max", None)
            if high is None or isinstance(getattr(spec, "default", None), bool):
                continue
            with pytest.raises(InvalidInput, match=f"{high + 1} is outside") as refused:
                node.execute(**{spec.id: high + 1})
            assert refused.value.widget == spec.id
            checked += 1
    assert checked >= 10  # the backend's, the encoder's, the transformer's, the LoRA's and the sampler's numbers
