"""The image-generation ops: encode, denoise, decode, VAE encode, free. Family-agnostic: each op looks its family up in
the registry (by the key its arguments carry) and calls the family's stage.

Every op runs on every rank, so resident models change on all ranks together. Encode, decode (and VAE encode) and the
``device_map`` transformer are rank-0 stages: one process places a component across several GPUs (balanced text
encoders, ``auto`` transformer, single-device VAE) while the other ranks only free what the stage replaces. Context,
tensor and data parallel denoising run on every rank (see strategies.py), and their load is agreed: when it fails on one
rank, every rank frees it, so no rank keeps a transformer the others do not hold. After every stage op each rank flushes
(Python's cycles, the CUDA allocator's cache), and its peak memory counts from the start of the op.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
from collections.abc import Callable

import torch

from ..arena import TORCH_DTYPES
from ..families import ENCODER_IMAGES, IMAGE_INPUTS, FamilyAdapter, Placement, family, img2img_steps
from ..families.base import REFERENCE_INPUTS, LaterExpert, reference_tokens
from ..gguf_files import gguf_weights, load_gguf_transformer, spread_over_gpus
from ..wire import (
    DecodeArgs,
    DecodeResult,
    DenoiseArgs,
    DenoiseResult,
    EncodeArgs,
    EncodeResult,
    Fault,
    FreeArgs,
    FreeResult,
    Sampling,
    TransformerSpec,
    VaeEncodeArgs,
    VaeEncodeResult,
    Weights,
)
from . import compiled, fp8_weights, lora, memory, speeds, step_cache, strategies, vae_tiles
from .diagnostics import flush, memory_of, reset_peak
from .models import ModelKey, ResidentModels, empty
from .ops import OpContext, OpError, OpFn, OpResult, WidgetError, op
from .tp_slices import fp8_files


def _models(ctx: OpContext) -> ResidentModels:
    return ctx.state["models"]


def _placement(ctx: OpContext, device_map: str, max_memory: dict[str, str] | None) -> tuple[Placement, str]:
    """Where a rank-0 stage's component goes, and its short description for the resident-model key."""
    budget = {int(k) if k.isdigit() else k: v for k, v in (max_memory or {}).items()} or None
    placement = Placement(device=str(ctx.device), device_map=device_map, max_memory=budget)
    if ctx.device.type == "cpu":
        return placement, str(ctx.device)
    shown = ",".join(f"{k}:{v}" for k, v in (max_memory or {}).items())
    return placement, f"device_map={device_map}" + (f"[{shown}]" if shown else "")


# The components the auto policy may free, in the order ranks agree on them.
COMPONENTS = ("text_encoders", "transformer", "vae")


def _auto_room(
    ctx: OpContext, key: ModelKey, need: Callable[[], int] | None, device: torch.device, local_ranks: int = 1
) -> None:
    """Under the ``auto`` policy: free the least recently used models that this stage would not fit beside. ``need``:
    the bytes the stage adds on this rank (its weights when it loads them, its activations), None on ranks that take
    no part. Every rank of the op calls this, and every rank frees what any rank must, so an SPMD transformer never
    stays on some ranks only. What went is the stage's closing text (``_closing``)."""
    models = _models(ctx)
    if models.policy != "auto":
        return
    wanted, failure = [], None
    if need is not None:
        try:
            short = need() - memory.room(device, local_ranks, models.held_bytes()) - models.replaced_bytes(key)
            wanted = models.to_free(key, short)
        except Exception as e:  # e.g. a bad memory cap: every rank raises below, none waits alone in a collective
            failure = e
    ctx.agree(failure)
    agreed = ctx.any_rank([c in wanted for c in COMPONENTS])
    ctx.state["auto_freed"] = (models.free(*(c for c, f in zip(COMPONENTS, agreed) if f)), str(key))


def _closing(ctx: OpContext, text: str) -> str:
    """A stage's closing text on its node; under ``auto`` with what the policy freed for it and what stays."""
    models = _models(ctx)
    if models.policy != "auto":
        return text
    freed, key = ctx.state.pop("auto_freed", ([], ""))
    went = f"freed {', '.join(freed)} (least recently used) to fit {key}; " if freed else ""
    return f"{text} — memory_policy auto: {went}resident: {', '.join(models.names()) or 'nothing'}"


def _stage(fn: OpFn) -> OpFn:
    """A stage op: this rank's peak memory counts from its start, and whatever it leaves is flushed at its end
    (also when it fails), so ComfyUI and the next stage find the memory free."""

    @functools.wraps(fn)
    def run(ctx: OpContext, args: object, tensors: dict) -> OpResult:
        reset_peak(ctx.device)
        try:
            result = fn(ctx, args, tensors)
        except BaseException:
            flush(ctx.device)
            raise
        flush(ctx.device, freeze=True)
        return result

    return run


def _spring_fault(ctx: OpContext) -> None:
    """A fault a test armed on this rank (``arm_fault``; never in a production backend) fails this load."""
    fault = ctx.state.pop("fault", None)
    if fault is Fault.LOAD_RAISES:
        raise OSError(f"rank {ctx.rank} could not read the weights (a fault armed by a test)")
    if fault is Fault.LOAD_OUT_OF_MEMORY:
        raise torch.OutOfMemoryError("tried to allocate the transformer's weights (a fault armed by a test)")


def _load_together(ctx: OpContext, models: ResidentModels, key: ModelKey, load: Callable[[], object]) -> object:
    """``models.get(key, load)`` on every rank of an SPMD load, agreed (``OpContext.agree``): when it fails on any
    rank, every rank frees ``key``'s component, so none keeps a transformer the others do not hold (the next load's
    collectives would hang on it); the failing rank raises its own error and the others name that rank."""

    def loading() -> object:
        _spring_fault(ctx)
        return load()

    failure: Exception | None = None
    try:
        loaded = models.get(key, loading)
    except Exception as e:  # out of memory, an unreadable file, ...: reported once every rank has freed it
        failure = e
    try:
        ctx.agree(failure, f"could not load the {key.component}; every rank freed it, and the next run loads it again")
    except Exception:
        loaded = failure = None  # the traceback holds this frame: let go of what the load built before freeing
        models.free(key.component)
        raise
    return loaded


def _device_map_budget(
    adapter: FamilyAdapter, model_dir: str, sampling: Sampling, dtype: torch.dtype, estimate: memory.Estimate
) -> dict[int | str, int]:
    """``max_memory`` for a ``device_map`` transformer the user left unbounded: what every GPU has free now, less the
    step's activations and a margin, and on the first GPU less the VAE too (it decodes there next) and what the
    denoise loads there beside the transformer (``estimate.components``: the VAE and image encoder of I2V, ...)."""
    with open(os.path.join(model_dir, "vae", "config.json")) as f:
        vae_config = json.load(f)
    vae = memory.decode_need(adapter, vae_config, sampling.batch_size, sampling.width, sampling.height, dtype)
    vae += memory.parameters_in(os.path.join(model_dir, "vae")) * dtype.itemsize + estimate.components
    free = [torch.cuda.mem_get_info(i)[0] for i in range(torch.cuda.device_count())]
    return memory.default_budget(free, vae, estimate.activations, memory_of(torch.device("cpu")).free_bytes)


def _on_step(ctx: OpContext, clock: speeds.BusyClock, images: int) -> Callable[[int, int], None]:
    def on_step(step_index: int, total: int) -> None:
        if ctx.device.type == "cuda":
            # The step's kernels are queued ahead of the host: wait for them, so that progress (and the watchdog's and
            # the benchmarks' step times) follow the GPU, not the launch queue.
            torch.cuda.synchronize(ctx.device)
        speeds.slow_down(ctx, images)
        clock.stop()  # the step's own work ends here; the cancel check below waits for the slowest rank
        ctx.progress(step_index + 1, total)
        ctx.check_cancel(step_index + 1)
        clock.start()

    return on_step


@op(EncodeArgs, spmd=True)
@_stage
def encode(ctx: OpContext, args: EncodeArgs, tensors: dict) -> OpResult:
    placement, where = _placement(ctx, "balanced", args.max_memory)
    key = ModelKey(args.model.name, "text_encoders", where, args.dtype.value)
    models, dtype = _models(ctx), TORCH_DTYPES[args.dtype.value]

    def need() -> int:
        # The next step's activations (as large as the last one's) are reserved too: a transformer that would leave
        # no room for them goes now, not half-way through the denoise.
        step = ctx.state.get("step_activations", 0)
        return step + (0 if models.resident(key) else memory.text_encoder_bytes(args.model.path, dtype))

    _auto_room(ctx, key, need if ctx.rank == 0 else None, ctx.device)  # rank 0 alone loads them
    if ctx.rank != 0:
        models.make_room(key)
        return None, {}
    ctx.alone()
    adapter = family(args.model.family)
    ctx.progress(0, 2, "loading text encoders")
    pipe = models.get(key, lambda: _load_text_encoders(adapter, args.model.path, dtype, placement))
    ctx.progress(1, 2, "encoding")
    # An edit model's text encoder also sees the images (families with encoder_images); other families take none.
    images = tuple(tensors[name] for name in ENCODER_IMAGES if name in tensors)
    embeds = adapter.encode(pipe, args.prompts, images) if images else adapter.encode(pipe, args.prompts)
    ctx.progress(2, 2, _closing(ctx, "encoded"))
    return EncodeResult({k: tuple(v.shape) for k, v in embeds.items()}), embeds


def _load_text_encoders(adapter: FamilyAdapter, model_dir: str, dtype: torch.dtype, placement: Placement) -> object:
    """The family's text encoders, placed (``device_map="balanced"`` over the GPUs), their fp8 weights held as stored.

    A rule, not a widget as the transformer's ``weights``: the text encoders run once per prompt, not once per step,
    so computing each Linear layer's weight from fp8 on the way costs next to nothing, and it gives the values the
    bf16 copy of the old conversion had (plain fp8 exactly; scaled fp8 weight × scale in float32); holding them in
    fp8 only halves their memory. Only the Linear layers are held (their weights are nearly all of a text encoder);
    embeddings, norms and convolutions stay in ``dtype``, so transformers' ``model.dtype``, which the pipelines cast
    the embeddings to, stays the run's."""
    pipe = adapter.load_text_encoders(model_dir, dtype, placement)
    for name, component in pipe.components.items():
        files = fp8_files(model_dir, name) if name.startswith("text_encoder") and component is not None else []
        if files:
            fix = "raise max_memory so the text encoders fit the GPUs"
            fp8_weights.hold_loaded(component, files, dtype, True, fix, layers=(torch.nn.Linear,))
    return pipe


@op(DenoiseArgs, spmd=True)
@_stage
def denoise(ctx: OpContext, args: DenoiseArgs, tensors: dict) -> OpResult:
    spec, sampling = args.transformer, args.sampling
    adapter, plan, dtype = family(spec.model.family), spec.plan, TORCH_DTYPES[spec.dtype.value]
    if plan.ranks != ctx.world_size:
        raise OpError(f"the strategy was planned for {plan.ranks} ranks, but this backend has {ctx.world_size}")
    models = _models(ctx)
    if not plan.spmd:  # device_map: a rank-0 stage
        placement, where = _placement(ctx, "auto", spec.max_memory)
        key = ModelKey(spec.model.name, "transformer", where + compiled.placement(spec.compile), _held_as(spec))
        if ctx.rank != 0:
            models.make_room(key)
            return None, {}
        ctx.alone()
    else:  # context / tensor / data parallel: every rank loads its part together
        key = ModelKey(
            spec.model.name, "transformer", plan.describe() + compiled.placement(spec.compile), _held_as(spec)
        )
        load_one = functools.partial(
            strategies.load_transformer,
            adapter.transformer_class(),
            spec.model.path,
            dtype,
            ctx.device,
            plan,
            spec.weights,
        )
    subfolders = adapter.transformer_subfolders(spec.model.path)
    if plan.cfg_degree > 1 and not ((sampling.true_cfg_scale or 1) > 1 and "negative_prompt_embeds" in tensors):
        raise OpError("true_cfg_scale: cfg_parallel needs true CFG (true_cfg_scale > 1 and a negative prompt)")
    # The img2img inputs travel beside the embeddings; they are not conditioning (one row per prompt).
    images = {name: tensors[name] for name in IMAGE_INPUTS if name in tensors}
    tensors = {name: tensor for name, tensor in tensors.items() if name not in IMAGE_INPUTS}
    steps = img2img_steps(sampling.steps, sampling.denoise) if images else sampling.steps
    text_tokens = max(tensors[name].shape[1] for name in ("prompt_embeds", "negative_prompt_embeds") if name in tensors)
    # A reference image's tokens ride in the sequence: those of the size the family's pipeline runs it at.
    references = sum(
        reference_tokens(adapter, images[name].shape[2], images[name].shape[1])
        for name in REFERENCE_INPUTS
        if name in images
    )

    refused, estimate, swap = None, None, False
    fp8_as_stored = plan.spmd and spec.weights is Weights.AS_STORED  # device_map places them in the dtype first
    try:
        strategies.check_attention(plan, ctx.device)
        if len(subfolders) > 1 and not models.resident(key):
            activations = memory.step_activations(
                adapter, spec.model.path, plan, sampling, text_tokens, dtype, references
            )
            swap = memory.one_expert_at_a_time(adapter, spec.model.path, plan, dtype, ctx.device,
                                               policy=models.policy, activations=activations,
                                               local_ranks=ctx.local_world_size, held=models.held_bytes(),
                                               freed_by_load=models.freed_by_loading(key),
                                               fp8_as_stored=fp8_as_stored)  # fmt: skip
        estimate = memory.check_denoise(adapter, spec.model.path, plan, sampling, text_tokens, dtype, ctx.device,
                                        reference_tokens=references,
                                        references=any(name in images for name in REFERENCE_INPUTS),
                                        local_ranks=ctx.local_world_size,
                                        loads_weights=swap or not models.resident(key),
                                        freed_by_load=models.freed_by_loading(key), fp8_as_stored=fp8_as_stored,
                                        one_expert=swap)  # fmt: skip
    except WidgetError as e:
        refused = e
    ctx.agree(refused)  # one rank short of memory, or its GPU cannot run the attention: all refuse, before any loads
    if plan.spmd:  # every rank holds the experts as the shortest of them must
        swap = ctx.any_rank([swap])[0]
    ctx.state["estimate"] = estimate
    # device_map's rank 0 decides alone: only it holds models besides the transformer this load replaces everywhere.
    need = estimate.activations + estimate.weights
    ctx.state["step_activations"] = estimate.activations
    _auto_room(ctx, key, lambda: need, ctx.device, ctx.local_world_size if plan.spmd else 1)
    ctx.progress(0, steps, "loading transformer")
    budget_note = ""  # device_map on GPUs: which GPU's free memory limits the split
    if not plan.spmd:
        if models.make_room(key) and spec.max_memory is None and ctx.device.type == "cuda":
            flush(ctx.device)  # what staged just freed counts as free for the budget
            budget = _device_map_budget(adapter, spec.model.path, sampling, dtype, estimate)
            placement = dataclasses.replace(placement, max_memory=budget)
            budget_note = memory.describe_budget(budget)
        load_one = functools.partial(_load_placed, adapter, spec, dtype, placement)

    def load(key: ModelKey, make: Callable[[], object]) -> object:
        """``make``'s model, resident as ``key``: loaded by every rank together, or by rank 0 alone (device_map)."""
        return _load_together(ctx, models, key, make) if plan.spmd else models.get(key, make)

    if swap:  # the first expert now, the next one when the steps reach it (``LaterExpert``), in its place
        keys = [dataclasses.replace(key, expert=subfolder) for subfolder in subfolders]
        transformer, experts = load(keys[0], functools.partial(load_one, subfolder=subfolders[0])), {}
    else:
        loaded = load(key, lambda: Experts.load(load_one, subfolders))
        transformer, experts = (loaded.first, loaded.others()) if isinstance(loaded, Experts) else (loaded, {})
    every = [transformer, *experts.values()]
    # The LoRAs are not part of the key: changing them changes the resident transformer, never reloads it. Each
    # expert takes the LoRAs that change it (ParallelLoraLoader's expert), in the order they were chained; compiled
    # after the LoRAs are merged, though merging later changes nothing compiled: the weights are its inputs.
    first_compile = any([_ready(ctx, adapter, spec, index, one) for index, one in enumerate(every)])

    # Data parallelism gives each rank a consecutive slice of the images, as many as its speed earns it; otherwise
    # every rank (CP / TP) or rank 0 alone (device_map) runs the whole batch on identical inputs.
    batch_size = sampling.batch_size
    split = speeds.split_batch(ctx, batch_size) if plan.splits_batch else None
    start, count = (sum(split.images[: ctx.rank]), split.images[ctx.rank]) if split is not None else (0, batch_size)
    devices = speeds.unequal_devices(ctx) if plan.spmd and not plan.splits_batch else ()
    mine = dataclasses.replace(sampling, seed=(sampling.seed + start) % 2**64, batch_size=count)
    group = step_cache.agreement_group(plan, transformer)
    clock = speeds.BusyClock()
    with contextlib.ExitStack() as stack:
        passes = stack.enter_context(step_cache.count_passes(every))
        record = stack.enter_context(step_cache.step_cache(every, spec.cache, group, adapter.taylorseer_layers))
        compile_record = stack.enter_context(compiled.watch(spec.compile, first_compile))

        def swap_in(index: int, steps_done: int) -> torch.nn.Module:
            """Expert ``index`` in place of the one before it, ready to run as that one was."""
            ctx.progress(steps_done, steps, f"loading {subfolders[index]} (one expert at a time)")
            empty(every[index - 1])  # the pipeline's loop still holds it until its next step
            expert = load(keys[index], functools.partial(load_one, subfolder=subfolders[index]))
            every.append(expert)
            if _ready(ctx, adapter, spec, index, expert) and compile_record is not None:
                compile_record.first = True
            stack.enter_context(step_cache.count_passes([expert], passes))
            stack.enter_context(
                step_cache.step_cache([expert], spec.cache, group, adapter.taylorseer_layers, record=record)
            )
            return expert

        if swap:
            experts = {
                subfolder: LaterExpert(functools.partial(swap_in, index))
                for index, subfolder in enumerate(subfolders[1:], start=1)
            }
        samples = adapter.denoise(
            spec.model.path,
            transformer,
            strategies.slice_batch(tensors, batch_size, start, count),
            mine,
            on_step=_on_step(ctx, clock, count),
            **{name: _my_images(image, batch_size, start, count) for name, image in images.items()},
            **experts,
        )
    cache = ctx.state["last_cache"] = record.report() if record is not None else None
    ctx.state["last_passes"] = passes[0]
    if split is not None:
        # A run that compiled took the compile's time too, which says nothing of the rank's speed.
        if compile_record is None or not compile_record.graphs:
            speeds.measured(ctx, count, steps, clock.seconds)
        samples = strategies.gather_batch(samples, split.images)
    if ctx.rank != 0:
        return None, {}
    ctx.progress(steps, steps, _closing(ctx, f"denoised; {budget_note}" if budget_note else "denoised"))
    result = DenoiseResult(
        tuple(samples.shape),
        cache=cache,
        compile=compile_record.report() if compile_record is not None else None,
        split=split,
        devices=devices,
        one_expert_at_a_time=subfolders if swap else (),
    )
    return result, {"samples": samples}


def _ready(ctx: OpContext, adapter: FamilyAdapter, spec: TransformerSpec, index: int, expert: torch.nn.Module) -> bool:
    """Expert ``index`` of the model (0: its transformer) as the run needs it: with the LoRAs that change it, its
    blocks compiled when the spec asks for it. True when this call compiled them."""
    mine = tuple(ref for ref in spec.loras if ref.expert.changes(index))
    lora.apply_loras(ctx, expert, dataclasses.replace(spec, loras=mine), adapter)
    return compiled.compile_blocks(expert, spec.compile, spec.plan)


def _held_as(spec: TransformerSpec) -> str:
    """The transformer's key's dtype: the run's, and what its fp8 weights are held as (a change reloads it)."""
    return spec.dtype.value if spec.weights is Weights.AS_STORED else f"{spec.dtype.value}, fp8 {spec.weights.value}"


def _load_placed(
    adapter: FamilyAdapter,
    spec: TransformerSpec,
    dtype: torch.dtype,
    placement: Placement,
    subfolder: str = "transformer",
) -> torch.nn.Module:
    """device_map's transformer (in ``subfolder``: Wan 2.2's second expert is another): placed by diffusers (its fp8
    weights cast to ``dtype`` on the way, as the plan of where the layers go assumes), then its fp8 weights held as
    ``spec.weights`` says. A GGUF transformer is held packed, spread by its packed bytes
    (``gguf_files.spread_over_gpus``); whole on ``placement``'s device where device_map places nothing (the CPU)."""
    if gguf_weights(os.path.join(spec.model.path, subfolder)) is not None:
        spread = placement.from_pretrained_kwargs(f"{adapter.name} {subfolder}")
        device = "cpu" if spread else placement.device  # spread below, from the file's pages
        transformer = load_gguf_transformer(adapter.transformer_class(), spec.model.path, dtype, device, subfolder)
        if not spread:
            return transformer
        try:
            return spread_over_gpus(transformer, spread.get("max_memory"))
        except ValueError as e:
            raise WidgetError("max_memory", f"{spec.model.name}'s GGUF transformer: {e}") from None
    transformer = adapter.load_transformer(spec.model.path, dtype, placement, subfolder)
    files = fp8_files(spec.model.path, subfolder)
    if files:
        fix = "raise max_memory so the transformer fits the GPUs, or use context_parallel or tensor_parallel"
        fp8_weights.hold_loaded(transformer, files, dtype, spec.weights is Weights.AS_STORED, fix)
    return transformer


@dataclasses.dataclass
class Experts:
    """A model's transformers when it has several (Wan 2.2 A14B's high- and low-noise experts), resident together as
    one transformer: each loaded and split by the same strategy, each with the LoRAs that change it
    (``LoraRef.expert``), its blocks compiled and a step cache of its own. ``components`` names them as a pipeline's,
    which is how the resident models count their parameters. (Experts that do not fit together are held one at a
    time instead, each resident alone under its own key: the denoise's ``LaterExpert``.)"""

    components: dict[str, torch.nn.Module]

    @classmethod
    def load(cls, load: Callable[..., torch.nn.Module], subfolders: tuple[str, ...]) -> torch.nn.Module | Experts:
        """``load(subfolder=...)`` of each subfolder: the transformer itself when there is one."""
        if subfolders == ("transformer",):
            return load()
        return cls({subfolder: load(subfolder=subfolder) for subfolder in subfolders})

    def __getattr__(self, name: str) -> torch.nn.Module:
        try:
            return self.components[name]
        except KeyError:
            raise AttributeError(name) from None

    @property
    def first(self) -> torch.nn.Module:
        return next(iter(self.components.values()))

    def others(self) -> dict[str, torch.nn.Module]:
        """The experts after the first, by the keyword the family's ``denoise`` takes them under (their subfolder)."""
        return dict(list(self.components.items())[1:])


def _my_images(image: torch.Tensor, batch_size: int, start: int, count: int) -> torch.Tensor:
    """This rank's rows of an img2img input: one row serves every image, ``batch_size`` rows give one per image."""
    return image if image.shape[0] == 1 else image[start : start + count]


@op(DecodeArgs, spmd=True)
@_stage
def decode(ctx: OpContext, args: DecodeArgs, tensors: dict) -> OpResult:
    if args.over_ranks:
        return _decode_over_ranks(ctx, args, tensors)
    key = ModelKey(args.model.name, "vae", args.device, args.dtype.value)
    models = _models(ctx)
    adapter, dtype = family(args.model.family), TORCH_DTYPES[args.dtype.value]
    usable = not args.device.startswith("cuda") or torch.cuda.is_available()
    vae_config, short, failure, need = None, False, None, None
    if ctx.rank == 0 and usable:
        try:
            with open(os.path.join(args.model.path, "vae", "config.json")) as f:
                vae_config = json.load(f)
            need = memory.decode_need(adapter, vae_config, *memory.samples_size(adapter, tensors["samples"]), dtype)
            short = memory.decode_is_short(need, torch.device(args.device))
            if not models.resident(key):
                need += memory.parameters_in(os.path.join(args.model.path, "vae")) * dtype.itemsize
        except Exception as e:  # raised after the broadcast below, which the other ranks are waiting in
            failure, need = e, None
    # Rank 0 alone sees the decode's device; when it is short, every rank frees what staged lets go of (auto: what
    # rank 0 finds least recently used).
    if ctx.from_rank0(short):
        models.free_before_decode()
    where = torch.device(args.device) if need is not None else ctx.device
    _auto_room(ctx, key, None if need is None else lambda: need, where)
    if ctx.rank != 0:
        models.make_room(key)
        return None, {}
    ctx.alone()
    if failure is not None:
        try:
            raise failure
        finally:
            failure = None  # this frame is in the error's traceback
    if not usable:
        raise OpError(f"device: {args.device} was asked for, but the backend has no GPU; use cpu or auto")
    ctx.state["estimate"] = memory.check_decode(
        adapter, vae_config, tensors["samples"], dtype, torch.device(args.device)
    )
    ctx.progress(0, 1, "loading VAE")
    vae = models.get(key, lambda: adapter.load_vae(args.model.path, dtype, args.device))
    ctx.progress(0, 1, "decoding")
    held = vae_tiles.reset_peak(vae.device)
    images = adapter.decode(vae, tensors["samples"])
    ctx.progress(1, 1, _closing(ctx, "decoded"))
    peaks = (vae_tiles.peak_above(vae.device, held),)
    return DecodeResult(tuple(images.shape), peak_bytes_per_rank=peaks), {"images": images}


def _decode_over_ranks(ctx: OpContext, args: DecodeArgs, tensors: dict) -> OpResult:
    """Every rank loads the VAE on its own device and decodes its share of diffusers' tiles (see vae_tiles.py)."""
    adapter, dtype = family(args.model.family), TORCH_DTYPES[args.dtype.value]
    key = ModelKey(args.model.name, "vae", str(ctx.device), args.dtype.value)
    ctx.progress(0, 1, "loading VAE")
    vae = _models(ctx).get(key, lambda: adapter.load_vae(args.model.path, dtype, str(ctx.device)))
    ctx.progress(0, 1, "decoding tiles over the ranks")
    images, tiles, peaks = vae_tiles.decode_over_ranks(
        vae, lambda: adapter.decode(vae, tensors["samples"]), ctx.rank, ctx.world_size
    )
    if ctx.rank != 0:
        return None, {}
    ctx.progress(1, 1, "decoded")
    return DecodeResult(tuple(images.shape), tiles_per_rank=tiles, peak_bytes_per_rank=peaks), {"images": images}


@op(VaeEncodeArgs, spmd=True)
@_stage
def vae_encode(ctx: OpContext, args: VaeEncodeArgs, tensors: dict) -> OpResult:
    """IMAGE pixels to a LATENT (VAEEncodeSingleGPU) on rank 0, with the decode's key: one resident VAE serves both
    directions."""
    key = ModelKey(args.model.name, "vae", args.device, args.dtype.value)
    models = _models(ctx)
    if ctx.rank != 0:
        models.make_room(key)
        return None, {}
    ctx.alone()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise OpError(f"device: {args.device} was asked for, but the backend has no GPU; use cpu or auto")
    adapter, dtype, pixels = family(args.model.family), TORCH_DTYPES[args.dtype.value], tensors["pixels"]
    with open(os.path.join(args.model.path, "vae", "config.json")) as f:
        memory.check_encode(adapter, json.load(f), pixels, dtype, torch.device(args.device))
    ctx.progress(0, 1, "loading VAE")
    vae = models.get(key, lambda: adapter.load_vae(args.model.path, dtype, args.device))
    ctx.progress(0, 1, "encoding")
    samples = adapter.encode_image(vae, pixels)
    ctx.progress(1, 1, "encoded")
    return VaeEncodeResult(tuple(samples.shape)), {"samples": samples}


@op(FreeArgs, spmd=True)
@_stage
def free(ctx: OpContext, args: FreeArgs, tensors: dict) -> OpResult:
    """Free resident models (``components``, or all) on every rank, e.g. before ComfyUI's own nodes need the GPUs."""
    models = _models(ctx)
    return FreeResult(tuple(models.free(*args.components) if args.components else models.free_all())), {}
