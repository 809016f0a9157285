from __future__ import annotations

from comfy_api.latest import io

from parallel_runtime import InvalidInput, jobs
from parallel_runtime.families import REGISTRY, FamilyAdapter, img2img_steps, names
from parallel_runtime.families.base import REFERENCE_INPUTS
from parallel_runtime.samplers import SAMPLERS, SCHEDULERS, Sampler, Scheduler, describe

from . import comfy
from .types import CATEGORY, Conditioning, Transformer, length_input

FAMILY_ENCODERS = "; ".join(f"{f.name}: {f.comfy_text_encoder_words()}" for f in REGISTRY)
# How far back through ComfyUI's nodes a CONDITIONING's text-encoder loader is looked for (a graph is finite, but a
# prompt is anyone's JSON).
_MOST_HOPS = 64


def _comfy_text_encoder(prompt: dict, link: object) -> tuple[str, str] | None:
    """The (loader, type) of the ComfyUI text encoder behind the CONDITIONING on a link, where the graph says it:
    back through the nodes' ``conditioning`` inputs (FluxGuidance, ConditioningZeroOut, ...) to the prompt node's
    ``clip`` (through CLIPSetLastLayer or a LoRA) to a CLIPLoader or DualCLIPLoader whose ``type`` is a widget."""
    for _hop in range(_MOST_HOPS):
        node = prompt.get(str(link[0])) if comfy.is_link(link) else None
        if not isinstance(node, dict):
            return None
        inputs = node.get("inputs") or {}
        if node.get("class_type") in ("CLIPLoader", "DualCLIPLoader"):
            clip_type = inputs.get("type")
            return (node["class_type"], clip_type) if isinstance(clip_type, str) else None
        link = inputs.get("conditioning", inputs.get("clip"))
    return None


def _check_comfy_text_encoder(node: comfy.QueuedNode, name: str, family: FamilyAdapter, model: str) -> None:
    """A CONDITIONING from ComfyUI's text encoder of another family, refused before anything loads."""
    if not node.linked(name) or family.comfy_text_encoder is None:
        return
    try:
        node.source(name)
        return  # one of the pack's nodes: its model is checked when it runs
    except comfy.Unknown:
        pass
    found = _comfy_text_encoder(node.prompt, node.inputs[name])
    if found is not None and found[1] != family.comfy_text_encoder[1]:
        loader, clip_type = found
        raise InvalidInput(
            name,
            f"comes from ComfyUI's {loader} of type {clip_type}, but the transformer is {model} ({family.name}); "
            f"encode with {family.name}'s text encoder: {family.comfy_text_encoder_words()}",
        )


def _prompt_count(node: comfy.QueuedNode) -> int | None:
    """How many prompts the linked encoder holds (data parallelism needs an image per rank), or None when its prompt
    comes from another node."""
    try:
        return jobs.count_prompts(**node.source("positive").widgets("prompt", "one_prompt_per_line"))
    except comfy.Unknown:
        return None


def _latent_size(prompt: dict, link: object, downscale: int) -> tuple[int, int]:
    """(width, height) in latent pixels of the LATENT a link carries, where the queued graph says it without running
    anything: ComfyUI's empty latents and latent upscales, and a ParallelSampler's own size; Unknown otherwise."""
    if not comfy.is_link(link) or not isinstance(prompt.get(str(link[0])), dict):
        raise comfy.Unknown("latent_image")
    node = prompt[str(link[0])]
    kind, inputs = node.get("class_type"), node.get("inputs") or {}

    def number(name: str) -> float:
        value = inputs.get(name)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise comfy.Unknown(name)
        return value

    if kind in ("EmptyLatentImage", "EmptySD3LatentImage"):  # 8 pixels per latent pixel, floored
        return int(number("width")) // 8, int(number("height")) // 8
    if kind == "ParallelSampler" and "latent_image" not in inputs:
        return int(number("width")) // downscale, int(number("height")) // downscale
    if kind in ("ParallelSampler", "SetLatentNoiseMask", "LatentUpscaleBy"):
        source = inputs.get("latent_image" if kind == "ParallelSampler" else "samples")
        width, height = _latent_size(prompt, source, downscale)
        if kind != "LatentUpscaleBy":
            return width, height
        scale = number("scale_by")
        return round(width * scale), round(height * scale)  # as LatentUpscaleBy rounds
    if kind == "LatentUpscale" and number("width") > 0 and number("height") > 0:
        return int(number("width")) // 8, int(number("height")) // 8
    raise comfy.Unknown("latent_image")


def _validate(node: comfy.QueuedNode) -> None:
    handle = node.input("transformer")
    for name in ("positive", "negative"):
        _check_comfy_text_encoder(node, name, handle.family, handle.spec.model.name)
    size = None
    if node.linked("latent_image"):
        try:
            size = _latent_size(node.prompt, node.inputs["latent_image"], handle.family.latent.downscale)
        except comfy.Unknown:
            pass  # only execution knows: the sampler checks it when the latent arrives
    jobs.validate_sample(
        handle,
        None,
        prompts=_prompt_count(node),
        latent_linked=node.linked("latent_image"),
        latent_size=size,
        references_linked=tuple(name for name in REFERENCE_INPUTS if node.linked(name)),
        **node.widgets(
            "steps",
            "width",
            "height",
            "batch_size",
            "guidance_scale",
            "true_cfg_scale",
            "denoise",
            "sampler",
            "scheduler",
            "length",
            "guidance_scale_2",
        ),
    )


class ParallelSampler(io.ComfyNode):
    """Run the denoising loop on the backend that holds the transformer."""

    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="ParallelSampler",
            display_name="Parallel Sampler",
            category=CATEGORY,
            description=(
                "Denoises on the transformer's backend (progress per step; Cancel stops every rank at the "
                "same step). The LATENT is in ComfyUI's convention, so ComfyUI's own VAEDecode accepts it "
                "too."
            ),
            inputs=[
                Transformer.Input("transformer", tooltip="From LoadShardedTransformer; runs on its backend."),
                io.MultiType.Input(
                    "positive",
                    types=[Conditioning, io.Conditioning],
                    tooltip=(
                        "The prompt: EncodeOnBalancedGPUs, or ComfyUI's CONDITIONING from the family's own text "
                        f"encoder ({FAMILY_ENCODERS}). FluxGuidance's guidance replaces guidance_scale. The node says "
                        "which one it ran with."
                    ),
                ),
                io.Int.Input(
                    "seed",
                    default=0,
                    min=0,
                    max=0xFFFFFFFFFFFFFFFF,
                    control_after_generate=True,
                    tooltip=(
                        "Noise seed; image i of a batch uses seed + i (wrapping round at 2^64), the "
                        "same generator stream as diffusers."
                    ),
                ),
                io.Int.Input("steps", default=28, min=1, max=1000, tooltip="Denoising steps."),
                io.Float.Input(
                    "guidance_scale",
                    default=3.5,
                    min=0.0,
                    max=100.0,
                    step=0.1,
                    tooltip=(
                        f"Distilled guidance (not CFG) of {names(lambda f: not f.true_cfg)}, in their guidance-"
                        f"distilled variants (such as -dev). Ignored by {names(lambda f: f.true_cfg)}: see "
                        "true_cfg_scale. A guidance on positive's CONDITIONING (FluxGuidance, CLIPTextEncodeFlux) "
                        "replaces it."
                    ),
                ),
                *(
                    io.Int.Input(
                        side,
                        default=1024,
                        min=16,
                        max=8192,
                        step=16,
                        tooltip="A multiple of 16. Ignored with a latent_image: its size is the image's.",
                    )
                    for side in ("width", "height")
                ),
                io.Int.Input(
                    "batch_size",
                    default=1,
                    min=1,
                    max=64,
                    tooltip=(
                        "Images per prompt (one_prompt_per_line on EncodeOnBalancedGPUs gives several prompts); image "
                        "i of the whole batch uses seed + i."
                    ),
                ),
                io.Float.Input(
                    "true_cfg_scale",
                    default=4.0,
                    min=1.0,
                    max=100.0,
                    step=0.1,
                    optional=True,
                    tooltip=(
                        f"True classifier-free guidance of {names(lambda f: f.true_cfg)} against the negative prompt "
                        "(EncodeOnBalancedGPUs; Wan's pipeline calls it guidance_scale); 1 turns it off and halves "
                        "the work per step. Ignored "
                        f"by {names(lambda f: not f.true_cfg)}, which have no true CFG."
                    ),
                ),
                io.Latent.Input(
                    "latent_image",
                    optional=True,
                    tooltip=(
                        "Start from this LATENT instead of noise (img2img, hires fix): VAEEncodeSingleGPU, a first "
                        "ParallelSampler, or ComfyUI's latent nodes (LatentUpscaleBy, LatentCrop, ...) in between. "
                        "Its size replaces width and height; batch 1 serves every image, or give one per image. "
                        "With a noise_mask (SetLatentNoiseMask), only the masked area is repainted (inpainting)."
                    ),
                ),
                io.Float.Input(
                    "denoise",
                    default=1.0,
                    min=0.0,
                    max=1.0,
                    step=0.01,
                    optional=True,
                    tooltip=(
                        "With a latent_image: how much of it is re-noised, diffusers' img2img strength. The last "
                        "steps × denoise of the steps run (rounded up; e.g. 28 steps at 0.5 run 14), from the image "
                        "noised to where they start. 1 starts from pure noise. Without a latent_image, keep 1."
                    ),
                ),
                # Appended last with today's behaviour as defaults, so saved workflows keep loading.
                io.Combo.Input(
                    "sampler",
                    options=[word.value for word in SAMPLERS],
                    default=Sampler.EULER.value,
                    optional=True,
                    tooltip=(
                        f"diffusers' flow-matching scheduler, in ComfyUI's words: {describe(SAMPLERS)}. lcm draws "
                        "new noise each step (from the seed), so it does not run on data_parallel."
                    ),
                ),
                io.Combo.Input(
                    "scheduler",
                    options=[word.value for word in SCHEDULERS],
                    default=Scheduler.SIMPLE.value,
                    optional=True,
                    tooltip=f"The sigma schedule, in ComfyUI's words: {describe(SCHEDULERS)}.",
                ),
                io.MultiType.Input(
                    "negative",
                    types=[Conditioning, io.Conditioning],
                    optional=True,
                    tooltip=(
                        f"True CFG's negative prompt for {names(lambda f: f.true_cfg)} (true_cfg_scale > 1): ComfyUI's "
                        "CONDITIONING (a CLIPTextEncode of the negative text, ConditioningZeroOut) or "
                        "EncodeOnBalancedGPUs. Given, it wins over EncodeOnBalancedGPUs' negative_prompt. Ignored by "
                        f"{names(lambda f: not f.true_cfg)}."
                    ),
                ),
                length_input(
                    f"Frames of the clip, 4k + 1 (81 is Wan's 5 seconds at 16 fps), for "
                    f"{names(lambda f: f.latent.temporal_downscale > 1)}; 1 for the image families. The LATENT "
                    "is [B, 16, (length - 1) / 4 + 1, H/8, W/8] (Wan 2.2 TI2V: 48 channels, H/16, W/16); the decode "
                    "gives B × length frames, which "
                    "ComfyUI's CreateVideo and SaveAnimatedWEBP take."
                ),
                io.Float.Input(
                    "guidance_scale_2",
                    default=0.0,
                    min=0.0,
                    max=100.0,
                    step=0.1,
                    optional=True,
                    tooltip=(
                        "Wan 2.2 A14B's CFG scale for its second (low-noise) expert; true_cfg_scale guides the first. "
                        "0 uses true_cfg_scale for both. Only for models with two experts."
                    ),
                ),
                io.Image.Input(
                    "image",
                    optional=True,
                    tooltip=(
                        "The image an edit model edits as the prompt says "
                        f"({names(lambda f: f.needs_reference and not f.first_frame)}; required there), or the "
                        "first reference image of "
                        f"{names(lambda f: f.reference_images and not f.needs_reference and not f.first_frame)} "
                        f"(optional there); {names(lambda f: f.first_frame)}: the clip's first frame, resized to "
                        f"width × height (required for {names(lambda f: f.first_frame and f.needs_reference)}; "
                        f"optional for {names(lambda f: f.first_frame and not f.needs_reference)}, text-to-video "
                        "without it); refused by the others. E.g. from LoadImage; resized as the model's "
                        "diffusers pipeline does (Kontext: to its trained resolution nearest the aspect ratio; FLUX.2: "
                        "down to a megapixel), the node shows to what. width and height set the output's size."
                    ),
                ),
                *(
                    io.Image.Input(
                        name,
                        optional=True,
                        tooltip=(
                            f"Another reference image for {names(lambda f: f.reference_images > 1)}"
                            f", after image{'' if name == 'image_2' else ' and image_2'} (in the transformer's "
                            "sequence in that order); one image, the same for the whole batch. Each reference "
                            "lengthens the sequence the transformer attends over."
                        ),
                    )
                    for name in REFERENCE_INPUTS[1:]
                ),
            ],
            outputs=[
                io.Latent.Output(
                    tooltip=(
                        "The denoised latents in ComfyUI's convention for the family: decode with VAEDecodeSingleGPU "
                        "or ComfyUI's own VAEDecode."
                    )
                )
            ],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def validate_inputs(cls, input_types: dict) -> bool | str:
        """Steps and sizes against the linked transformer's family and strategy (e.g. how context parallelism splits
        the image tokens), before anything runs; a latent_image's size where the graph says it."""
        return comfy.validate(cls, input_types, _validate)

    @classmethod
    def execute(cls, **inputs) -> io.NodeOutput:
        w = comfy.execution_inputs(cls, inputs)
        comfy.make_room(cls, w["transformer"].backend)
        handle = w.pop("transformer")
        # ComfyUI's progress text replaces the node's last one: what the run has to say is shown once, together.
        said: list[str] = []
        samples = comfy.run(
            cls,
            jobs.sample,
            handle,
            w.pop("positive"),
            on_result=lambda result: said.extend(result.notes()),
            on_conditioning=said.append,
            **w,
        )
        references = jobs.read_reference_images(
            handle, {name: w[name] for name in REFERENCE_INPUTS}, (w["width"], w["height"])
        )
        if references:
            downscale = handle.family.latent.downscale
            said.append(
                f"{samples.shape[-1] * downscale}×{samples.shape[-2] * downscale} from the "
                + "; the ".join(reference.describe() for reference in references)
            )
        if w["latent_image"] is not None:
            downscale = handle.family.latent.downscale
            steps = img2img_steps(w["steps"], w["denoise"])
            said.append(
                f"{samples.shape[-1] * downscale}×{samples.shape[-2] * downscale} from latent_image (width and "
                f"height ignored); {steps} of {w['steps']} steps at denoise {w['denoise']}"
            )
        if said:
            comfy.show_text(cls, "\n".join(said))
        return io.NodeOutput({"samples": samples})
