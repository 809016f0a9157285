"""Which strategy suits this box? ``comfy-parallel advise``: for a model's real size (its safetensors headers: each
component's parameters and stored dtypes; nothing is loaded; a diffusers folder, or ComfyUI's single files as
ParallelModelFromComfyFiles takes them, read as they are, nothing converted) and a box's GPUs (declared, or measured by
``comfy-parallel doctor``'s checks), each strategy with its memory per GPU, the bytes it sends per step and its
expected step time against one GPU, best first, with why; and what to change when nothing fits.

The estimates' basis (also printed with every answer):

- memory per GPU: the transformer's weights as the strategy places them (``estimates.weights_share``: a TP rank's
  measured share; a replica each under context / data / CFG parallelism; ``device_map`` an even split over the GPUs)
  plus a step's activations at the size (``estimates.activation_bytes``, the ranks' own check) plus what the denoise
  loads beside the transformer (``FamilyAdapter.denoise_components``: an edit model's VAE, Wan I2V's VAE and CLIP
  image encoder, whose tokens join the text's), as the ranks' check counts them; the text encoders and
  the VAE's decode (``estimates.decode_bytes``) as separate stages, one at a time (the ``staged`` memory policy: the
  encoders balanced over the GPUs, the decode on one; the VAE's weights stay through every stage). A strategy fits
  when its largest stage is within ``estimates.HEADROOM`` of a GPU's memory;
- traffic: ``estimates.step_bytes`` (what each rank sends per step in diffusers' collectives);
- step time: compute / the ranks that share one image's pass + bytes sent / the link's bandwidth, against one GPU's
  compute. Compute is 2 × parameters × tokens + 4 × attention layers × tokens² × hidden FLOPs a pass at the box's
  rate (by default ``DEFAULT_TFLOPS``, an H100's: FLUX.1-dev 1024² at about 0.24 s a step, xDiT); overlap of compute
  and communication, and kernels' efficiency at smaller slices, are not modelled.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re

from . import families
from .comfy_files import NO_FILE, plan_files
from .errors import InvalidInput
from .estimates import HEADROOM, activation_bytes, decode_bytes, hidden_size, step_bytes, weights_share
from .families import FamilyAdapter
from .families.base import image_context_tokens
from .headers import DTYPE_BITS, read_header
from .jobs.widgets import check_length
from .spec import BackendSpec
from .strategy import StrategyPlan, TransformerFacts

GIB = 1 << 30
DEFAULT_TFLOPS = 500.0  # an H100's effective bf16 rate: FLUX.1-dev 1024² (1.25e14 FLOPs a step) in about 0.24 s
# All-reduce bandwidth one GPU reaches on each kind of link, bytes/s, when it is declared rather than measured:
# NVLink 4 (H100 SXM) reaches ~150 GB/s of bus bandwidth in NCCL's tests, PCIe 4.0 x16 peer-to-peer ~20 GB/s, and
# without peer-to-peer NCCL copies through host memory at about half of that.
LINK_BANDWIDTH = {"nvlink": 150e9, "pcie": 20e9}
NO_P2P_BANDWIDTH = 8e9
ACTIVATION_BYTES = 2  # bf16
# Weights on a GPU: the dtype widgets' "auto" is bf16 there; a transformer stored in fp8 is held as stored
# (LoadShardedTransformer's weights widget, "as stored" by default), its stored bytes.
LOADED_BYTES = 2
ONE_GPU = "one GPU"  # the reference every step time is relative to
GPUS_SYNTAX = (
    "<count>x<GiB>GB,<link>[,no-p2p][,bw=<GB/s>][,tflops=<rate>], link nvlink or pcie: e.g. 2x24GB,pcie,no-p2p, "
    "4x80GB,nvlink, 8x48GB,pcie"
)


@dataclasses.dataclass(frozen=True)
class Box:
    """The GPUs of one machine: how many, the memory of each, and the link between them."""

    gpus: int
    memory: int  # bytes per GPU
    link: str  # "nvlink", "pcie", or what doctor measured
    p2p: bool
    bandwidth: float  # bytes/s one GPU sends in a collective
    tflops: float = DEFAULT_TFLOPS
    measured: bool = False

    def describe(self) -> str:
        link = self.link + ("" if self.p2p else " without peer-to-peer")
        how = "measured by doctor's peer-to-peer check" if self.measured else "declared; assumed for the link"
        return (
            f"{self.gpus} × {self.memory / GIB:.0f} GiB, {link}, {self.bandwidth / 1e9:g} GB/s ({how}), "
            f"{self.tflops:g} TFLOP/s each"
        )


def parse_gpus(text: str, widget: str = "--gpus") -> Box:
    """A declared box (``GPUS_SYNTAX``); InvalidInput naming ``widget`` and the syntax when it is not one."""
    parts = [p.strip().lower() for p in text.split(",") if p.strip()]
    head = re.fullmatch(r"(\d+)\s*x\s*(\d+(?:\.\d+)?)\s*gi?b", parts[0]) if parts else None
    if head is None or int(head.group(1)) < 1 or float(head.group(2)) <= 0:
        raise InvalidInput(widget, f"{text!r} does not say the GPUs; write {GPUS_SYNTAX}")
    links = [p for p in parts[1:] if p in LINK_BANDWIDTH]
    p2p = "no-p2p" not in parts[1:]
    options = dict(p.split("=", 1) for p in parts[1:] if "=" in p)
    unknown = [p for p in parts[1:] if p not in LINK_BANDWIDTH and p != "no-p2p" and "=" not in p]
    unknown += [key for key in options if key not in ("bw", "tflops")]
    if unknown or len(links) > 1 or (int(head.group(1)) > 1 and not links):
        what = f"does not know {unknown[0]!r}" if unknown else "needs one link, nvlink or pcie"
        raise InvalidInput(widget, f"{text!r} {what}; write {GPUS_SYNTAX}")
    link = links[0] if links else "pcie"
    if link == "nvlink" and not p2p:
        raise InvalidInput(widget, "NVLink is peer-to-peer; drop no-p2p, or declare pcie,no-p2p")
    try:
        bandwidth = float(options["bw"]) * 1e9 if "bw" in options else None
        tflops = float(options.get("tflops", DEFAULT_TFLOPS))
    except ValueError:
        raise InvalidInput(widget, f"bw= and tflops= take numbers; write {GPUS_SYNTAX}") from None
    if bandwidth is None:
        bandwidth = LINK_BANDWIDTH[link] if p2p else NO_P2P_BANDWIDTH
    if bandwidth <= 0 or tflops <= 0:
        raise InvalidInput(widget, "bw= and tflops= must be above 0")
    return Box(int(head.group(1)), int(float(head.group(2)) * GIB), link, p2p, bandwidth, tflops)


def measured_box(report: dict) -> Box:
    """This machine's box from a ``cli.doctor`` report on its GPUs: the smallest GPU's memory, the slowest rank
    pair's transfer rate in doctor's peer-to-peer check (its all-reduce is a few KiB: a latency, not a bandwidth),
    and whether GPU 0 reaches the others directly."""
    if not report.get("ok") or report.get("device") != "cuda":
        problems = "; ".join(report.get("errors") or []) or "no GPU backend started"
        raise InvalidInput(
            "--gpus", f"could not measure this machine's GPUs ({problems}); declare them instead: {GPUS_SYNTAX}"
        )
    gpus = len(report["ranks"])
    memory = int(min(r["memory_total_gib"] for r in report["ranks"]) * GIB)
    rates = [p["nbytes"] / p["seconds"] for p in report["peers"] if p["kind"] == "collective" and p["seconds"]]
    copies = [p for p in report["peers"] if p["kind"] == "copy"]
    p2p = all(p["peer_access"] for p in copies) if copies else True
    bandwidth = min(rates) if rates else LINK_BANDWIDTH["pcie"]
    return Box(gpus, memory, "measured link", p2p, bandwidth, measured=True)


@dataclasses.dataclass(frozen=True)
class ModelSize:
    """What a model folder's headers say: each component's parameters, stored bytes and dtypes, and the
    transformer's shape. The ``*_bytes`` properties are what the components take on a GPU (``LOADED_BYTES``)."""

    name: str
    family: FamilyAdapter
    transformer_config: dict
    decoder_channels: int
    parameters: dict[str, int]
    stored_bytes: dict[str, int]
    stored_dtypes: dict[str, tuple[str, ...]]
    gguf: bool = False  # a GGUF transformer: held packed as stored (under tensor parallelism, a rank's slices)
    passes: int = 1  # transformer passes a step: 2 under true CFG (not for a step-distilled [klein])
    context_tokens: int = 0  # an image encoder's tokens beside the text (``families.base.image_context_tokens``)

    @property
    def experts(self) -> tuple[str, ...]:
        """The transformers the denoise holds: ``transformer``, and Wan 2.2 A14B's second expert ``transformer_2``."""
        return tuple(c for c in ("transformer", "transformer_2") if c in self.parameters)

    @property
    def transformer_parameters(self) -> int:
        """One expert's parameters: what a step computes with."""
        return self.parameters["transformer"]

    @property
    def transformer_bytes(self) -> int:
        """Every expert's weights on the GPUs: they stay resident together, the steps switching between them."""
        return sum(self._held(c) for c in self.experts)

    def _held(self, component: str) -> int:
        if self.gguf:
            return self.stored_bytes[component]  # the file's size: its packed blocks, held as they are
        if any(dtype.startswith("F8") for dtype in self.stored_dtypes.get(component, ())):
            return self.stored_bytes[component]  # fp8 held as stored, the rest (norms, biases) in bf16 already
        return self.parameters[component] * LOADED_BYTES

    @property
    def encoder_bytes(self) -> int:
        return sum(n for c, n in self.parameters.items() if c.startswith("text_encoder")) * LOADED_BYTES

    @property
    def vae_bytes(self) -> int:
        return self.parameters.get("vae", 0) * LOADED_BYTES

    @property
    def denoise_components(self) -> tuple[str, ...]:
        """What the denoise loads beside the transformer and the model has (a run with the references the family
        needs; optional ones, FLUX.2's, not counted)."""
        wanted = self.family.denoise_components(self.family.needs_reference)
        return tuple(c for c in wanted if c in self.parameters)

    @property
    def denoise_bytes(self) -> int:
        """The ``denoise_components``' weights: a second VAE beside the one that stays for the decode."""
        return sum(self.parameters[c] for c in self.denoise_components) * LOADED_BYTES


def backend_box(spec: BackendSpec, widget: str = "gpus") -> Box:
    """The GPUs a one-machine backend's ranks use, as this process sees them (torch's device properties: nothing
    loads): the smallest one's memory and whether the first reaches the others directly. The link's rate is not
    measured here (``comfy-parallel advise`` without ``--gpus`` measures it): PCIe is assumed."""
    import torch

    visible = torch.cuda.device_count() if spec.device == "cuda" else 0
    if visible < spec.ranks or spec.nnodes > 1 or spec.gpus is not None:
        where = "runs on CPU" if spec.device != "cuda" else "uses GPUs this process does not see, or other machines'"
        raise InvalidInput(widget, f"the backend {where}; declare the GPUs to advise for: {GPUS_SYNTAX}")
    memory = min(torch.cuda.get_device_properties(i).total_memory for i in range(spec.ranks))
    p2p = all(torch.cuda.can_device_access_peer(0, i) for i in range(1, spec.ranks))
    bandwidth = LINK_BANDWIDTH["pcie"] if p2p else NO_P2P_BANDWIDTH
    return Box(spec.ranks, memory, "pcie (assumed)", p2p, bandwidth)


def read_model(model: str, widget: str = "--model") -> ModelSize:
    """A diffusers folder (a path, or a name ComfyUI's model folders list) measured from its safetensors headers."""
    import json

    from . import model_folders

    if os.path.isfile(os.path.join(model, "model_index.json")):
        adapter = model_folders.family_of(model)
        if adapter is None:
            raise InvalidInput(widget, f"{model} is not a pipeline the pack runs: {families.supported()}")
        path, family = model, adapter
    else:
        ref = model_folders.resolve(model, widget)
        path, family = ref.path, families.family(ref.family)
    sizes: dict[str, int] = {}
    dtypes: dict[str, tuple[str, ...]] = {}
    parameters: dict[str, int] = {}
    for component in sorted(os.listdir(path)):
        folder = os.path.join(path, component)
        files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors")) if os.path.isdir(folder) else []
        if not files:
            continue
        bits, seen, count = 0, set(), 0
        for name in files:
            try:
                tensors, _ = read_header(os.path.join(folder, name))
            except (OSError, ValueError) as e:
                raise InvalidInput(widget, f"{component}/{name} cannot be read: {e}") from None
            for dtype, shape in tensors.values():
                elements = math.prod(shape)
                bits += elements * DTYPE_BITS[dtype]
                count += elements
                seen.add(dtype)
        sizes[component], dtypes[component], parameters[component] = bits // 8, tuple(sorted(seen)), count
    if "transformer" not in sizes:
        raise InvalidInput(widget, f"{model} has no transformer/*.safetensors to measure")
    with open(os.path.join(path, "transformer", "config.json")) as f:
        config = json.load(f)
    channels = 128
    if os.path.isfile(os.path.join(path, "vae", "config.json")):
        with open(os.path.join(path, "vae", "config.json")) as f:
            channels = family.decoder_channels(json.load(f))
    image_encoder = None
    if os.path.isfile(os.path.join(path, "image_encoder", "config.json")):
        with open(os.path.join(path, "image_encoder", "config.json")) as f:
            image_encoder = json.load(f)
    name = os.path.basename(os.path.normpath(model))
    context = image_context_tokens(family, image_encoder)
    with open(os.path.join(path, "model_index.json")) as f:
        passes = 2 if family.takes_cfg(json.load(f)) else 1
    return ModelSize(name, family, config, channels, parameters, sizes, dtypes, passes=passes, context_tokens=context)


def read_files(
    diffusion_model: str,
    text_encoder: str,
    text_encoder_2: str,
    vae: str,
    diffusion_model_2: str = NO_FILE,
    clip_vision: str = NO_FILE,
) -> ModelSize:
    """ComfyUI's single files, the widget values ParallelModelFromComfyFiles takes (names in ComfyUI's model folders),
    measured from their headers (``comfy_files.plan_files``: nothing is loaded or converted). A safetensors file
    counts its weights' parameters and stored bytes (ComfyUI's scales and tokenizer data are not weights); a GGUF
    transformer its shapes' parameters and the file's size."""
    plan = plan_files(diffusion_model, text_encoder, text_encoder_2, vae, diffusion_model_2, clip_vision)
    family = families.family(plan.family)
    parameters: dict[str, int] = {}
    stored: dict[str, int] = {}
    dtypes: dict[str, tuple[str, ...]] = {}
    for component in plan.contents.components:
        file = component.file
        keys = file.weight_keys
        parameters[component.name] = sum(math.prod(file.shapes[k]) for k in keys)
        dtypes[component.name] = tuple(sorted({file.dtypes[k] for k in keys}))
        if file.is_gguf:
            stored[component.name] = file.size
        else:
            stored[component.name] = sum(math.prod(file.shapes[k]) * DTYPE_BITS[file.dtypes[k]] for k in keys) // 8
    return ModelSize(
        plan.transformer.name,
        family,
        plan.configs["transformer"],
        family.decoder_channels(plan.configs["vae"]),
        parameters,
        stored,
        dtypes,
        gguf=plan.transformer.is_gguf,
        passes=2 if family.takes_cfg(plan.contents.model_index) else 1,
        context_tokens=image_context_tokens(family, plan.configs.get("image_encoder")),
    )


@dataclasses.dataclass(frozen=True)
class Option:
    """One strategy on the box: its memory per GPU, its traffic and its expected step time."""

    name: str
    weights: int  # transformer bytes per GPU
    activations: int  # a step's peak activations per GPU
    peak: int  # the largest stage on the busiest GPU
    sends: float  # bytes each rank sends per step
    relative: float  # step time / one GPU's (per image under data_parallel)
    why: str
    fits: bool


@dataclasses.dataclass(frozen=True)
class Advice:
    model: ModelSize
    box: Box
    width: int
    height: int
    options: list[Option]  # best first: what fits, by step time; then what does not
    refused: list[tuple[str, str]]  # (strategy, why the plan is not possible for this model or box)
    changes: list[str]  # what to change when nothing fits
    length: int = 1  # a clip's frames (1: an image)

    def text(self) -> str:
        m, box = self.model, self.box
        stored = ", ".join(f"{c} {_gib(b)} {'/'.join(m.stored_dtypes[c])}" for c, b in m.stored_bytes.items())
        loaded = " and ".join(m.denoise_components)
        beside = f", {loaded} loaded in the denoise {_gib(m.denoise_bytes)}" if loaded else ""
        clip = f" × {self.length} frames" if self.length > 1 else ""
        experts = f" each, {len(m.experts)} experts resident together" if len(m.experts) > 1 else ""
        lines = [
            f"{m.name} ({m.family.name}) at {self.width}×{self.height}{clip}: transformer {_gib(m.transformer_bytes)} "
            f"({m.transformer_parameters / 1e9:.2f} B parameters{experts}), text encoders {_gib(m.encoder_bytes)}, "
            f"VAE {_gib(m.vae_bytes)}{beside} in bf16 on the GPUs; stored as {stored}",
            f"box: {box.describe()}",
            "",
            f"{'strategy':<34} {'weights/GPU':>11} {'activations':>11} {'peak/GPU':>9} {'sends/step':>10} "
            f"{'step vs 1 GPU':>13}  why",
        ]
        for o in self.options:
            mark = "" if o.fits else "does not fit: "
            lines.append(
                f"{o.name:<34} {_gib(o.weights):>11} {_gib(o.activations):>11} {_gib(o.peak):>9} "
                f"{o.sends / 2**20:>6,.0f} MiB {o.relative:>12.2f}×  {mark}{o.why}"
            )
        lines += [f"not possible: {name}: {why}" for name, why in self.refused]
        if self.changes:
            lines += ["", "nothing fits; change one of:"] + [f"  - {c}" for c in self.changes]
        lines += ["", "basis:"] + [f"  - {b}" for b in basis(self)]
        return "\n".join(lines)


def _gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


def basis(advice: Advice) -> list[str]:
    """How the numbers were estimated, in the output's words."""
    m = advice.model
    passes = " × 2 passes (true CFG)" if m.passes == 2 else ""
    image_encoder = f" and {m.context_tokens} image-encoder tokens" if m.context_tokens else ""
    beside = f" + the {' and '.join(m.denoise_components)} the denoise loads" if m.denoise_components else ""
    return [
        "memory: transformer weights in bf16, or as stored when they are fp8 (the weights widget's default), as the "
        "strategy places "
        f"them (tensor parallel: the per-rank share its plan splits; a "
        f"replica each under context / data / CFG parallelism; device_map: split evenly) + one step's bf16 "
        f"activations at {_text_tokens(m.family)} text tokens{image_encoder} (the ranks' own estimate){beside} + the "
        "VAE's weights, "
        f"which stay; the text encoders and the decode as their own stages (the staged memory policy: the encoders "
        f"balanced over the GPUs, the decode on one); fits within {HEADROOM:.0%} of a GPU",
        "sends/step: what each rank sends in diffusers' collectives (bench/network.py's table)",
        f"step time: compute / the GPUs sharing one image + bytes sent / {advice.box.bandwidth / 1e9:g} GB/s, against "
        f"one GPU; compute = 2 × parameters × tokens + 4 × layers × tokens² × hidden FLOPs{passes} at "
        f"{advice.box.tflops:g} TFLOP/s; no overlap of compute and communication is assumed",
        "data_parallel's time is per image of a batch of one image per GPU (one image alone takes 1.00×)",
    ]


def _text_tokens(family: FamilyAdapter) -> int:
    return family.max_sequence_length  # padded, or the longest prompt: an upper bound


def step_flops(config: dict, parameters: int, tokens: int) -> float:
    """FLOPs of one transformer pass over ``tokens`` (image and text)."""
    layers = config["num_layers"] + config.get("num_single_layers", 0)
    return 2 * parameters * tokens + 4 * layers * tokens**2 * hidden_size(config)


def advise(model: ModelSize, box: Box, width: int, height: int, length: int = 1) -> Advice:
    """Every strategy of the box's GPUs for ``model`` at ``width`` × ``height``, best first, and what to change
    when none fits."""
    check_length(model.family, length)
    options, refused = _options(model, box, width, height, length)
    changes = [] if any(o.fits for o in options) else _changes(model, box, width, height, length, options)
    return Advice(model, box, width, height, options, refused, changes, length)


def _options(
    model: ModelSize, box: Box, width: int, height: int, length: int = 1
) -> tuple[list[Option], list[tuple[str, str]]]:
    """The strategies, best first (what fits, by step time; then what does not, by memory), and those refused."""
    family, config = model.family, model.transformer_config
    per_token = family.pixels_per_token
    if width % per_token or height % per_token or width <= 0 or height <= 0:
        raise InvalidInput("--width", f"width and height must be positive multiples of {per_token}")
    # A clip's tokens: every latent frame's (Wan: the first frame alone, then one per 4).
    image_tokens = (width // per_token) * (height // per_token) * family.latent.frames(length)
    text_tokens = _text_tokens(family) + model.context_tokens
    tokens = image_tokens + text_tokens
    hidden = hidden_size(config)
    passes = model.passes
    one_gpu = passes * step_flops(config, model.transformer_parameters, tokens) / (box.tflops * 1e12)
    facts = TransformerFacts.from_config(config, families.tp_plan(config["_class_name"]))
    vae = model.vae_bytes  # small: it stays on its GPU through every stage
    beside = model.denoise_bytes  # loaded by the denoise on every GPU that runs the transformer
    decode = vae + decode_bytes(model.decoder_channels, 1, width, height, ACTIVATION_BYTES, family.decode_copies)
    usable = box.memory * HEADROOM
    n = box.gpus
    options, refused = [], []

    def add(name: str, plan: StrategyPlan, weights: float, split: int, sends: float, why: str) -> None:
        activations = activation_bytes(plan, hidden, tokens, 1, ACTIVATION_BYTES)
        # The text encoders are balanced over the GPUs the option uses; the VAE decodes on one.
        encoders = math.ceil(model.encoder_bytes / (1 if name == ONE_GPU else n))
        peak = max(int(weights) + activations + vae + beside, encoders + vae, decode)
        relative = (one_gpu / split + sends / box.bandwidth) / one_gpu
        options.append(Option(name, int(weights), activations, peak, sends, relative, why, peak <= usable))

    def plan(strategy: str, **widgets: int) -> StrategyPlan | None:
        try:
            return StrategyPlan.from_widgets(facts, n, strategy=strategy, **widgets)
        except InvalidInput as e:
            refused.append((strategy, str(e)))
            return None

    whole = model.transformer_bytes
    single = StrategyPlan.from_widgets(facts, 1, strategy="device_map")
    idle = ", the other GPUs idle" if n > 1 else ""
    add(ONE_GPU, single, whole, 1, 0.0, f"the reference: no split{idle}")
    if n > 1:
        hop = (n - 1) * tokens * hidden * ACTIVATION_BYTES * passes
        add(
            f"device_map over {n} GPUs",
            single,
            whole / n,
            1,
            hop,
            "weights split over the GPUs; they run one after another, so no faster than one GPU",
        )
        per_pass = step_bytes(config, image_tokens, text_tokens, n)
        if p := plan("tensor_parallel"):
            add(
                f"tensor_parallel tp {n}",
                p,
                whole * weights_share(p, families.tp_sharded_share(config)),
                n,
                passes * per_pass["tensor_parallel"],
                "splits weights and compute; all-reduces in every block, so it needs a fast link",
            )
        if p := plan("context_parallel", ring_degree=1, ulysses_degree=n):
            add(
                f"context_parallel ulysses {n}",
                p,
                whole,
                n,
                passes * per_pass["ulysses"],
                "splits the tokens: a replica each, 4 all-to-alls per attention layer",
            )
        if p := plan("context_parallel", ring_degree=n, ulysses_degree=1):
            add(
                f"context_parallel ring {n}",
                p,
                whole,
                n,
                passes * per_pass["ring"],
                "splits the tokens: a replica each, keys and values passed round the ring",
            )
        if n >= 4 and n % 2 == 0 and (p := plan("tp_cp", tp_degree=2, ring_degree=1, ulysses_degree=n // 2)):
            cp = n // 2
            tp_bytes = step_bytes(config, image_tokens / cp, text_tokens / cp, 2)["tensor_parallel"]
            cp_bytes = step_bytes(config, image_tokens, text_tokens, cp)["ulysses"] / 2
            add(
                f"tp_cp tp 2 × ulysses {cp}",
                p,
                whole * weights_share(p, families.tp_sharded_share(config)),
                n,
                passes * (tp_bytes + cp_bytes),
                "TP in pairs of GPUs, the tokens split across the pairs",
            )
        if passes == 2 and n % 2 == 0:
            half = n // 2
            if p := plan("cfg_parallel", ring_degree=1, ulysses_degree=half):
                # Each half runs one pass; the halves exchange the noise prediction once per step.
                exchange = image_tokens * config.get("in_channels", 64) * ACTIVATION_BYTES
                within = step_bytes(config, image_tokens, text_tokens, half)["ulysses"] if half > 1 else 0.0
                add(
                    f"cfg_parallel (ulysses {half} per half)",
                    p,
                    whole,
                    n,
                    within + exchange,
                    "true CFG's two passes on two halves of the GPUs: one exchange per step",
                )
        if p := plan("data_parallel"):
            add(
                f"data_parallel {n}",
                p,
                whole,
                n,
                0.0,
                "a replica each, whole images: more images per minute, no single image faster",
            )
    options.sort(key=lambda o: (not o.fits, o.relative if o.fits else o.peak))
    return options, refused


def _changes(model: ModelSize, box: Box, width: int, height: int, length: int, options: list[Option]) -> list[str]:
    """What would make something fit: fewer pixels, more GPUs, smaller weights."""
    usable = box.memory * HEADROOM
    smallest = min(options, key=lambda o: o.peak)
    changes = []
    if smallest.weights < usable:
        scale = 0.875
        while width * scale >= 256 and height * scale >= 256:
            w, h = _round(width * scale, model.family), _round(height * scale, model.family)
            if any(o.fits for o in _options(model, box, w, h, length)[0]):
                changes.append(f"fewer pixels: {w}×{h} fits")
                break
            scale -= 0.125
    room = usable - smallest.activations
    if room > 0:
        gpus = math.ceil(model.transformer_bytes / room)
        if gpus > box.gpus:
            changes.append(f"more GPUs: device_map over {gpus} such GPUs holds the transformer")
    fp8 = model.transformer_parameters * len(model.experts) / box.gpus + smallest.activations  # 1 byte a parameter
    verdict = "would fit" if fp8 <= usable else "would still not fit"
    where = f"under device_map over {box.gpus} GPUs" if box.gpus > 1 else "on the GPU"
    changes.append(
        "smaller weights: an fp8 or GGUF transformer (1 byte a parameter or less, held as stored)"
        f" {verdict} {where}: {_gib(fp8)} per GPU"
    )
    changes.append("GPUs with more memory")
    return changes


def _round(pixels: float, family: FamilyAdapter) -> int:
    step = family.pixels_per_token
    return max(step, int(pixels) // step * step)
