"""LoRAs on the transformer a rank holds, applied before each denoising loop without reloading its weights.

The transformer handle carries its LoRAs (``TransformerSpec.loras``, in the order the loaders were chained).
``apply_loras`` brings the resident transformer to exactly that list: it reads each file once (a new strength reads
nothing), and changes only what the list changed. A LoRA chained twice counts once, at the sum of its strengths; a
strength of 0 is no LoRA. How (``LoraMode``):

- **fused**, the pack's choice on every strategy (but for a GGUF transformer). A changed layer's weight becomes its
  original plus Σ strength × scale × B @ A over the LoRAs that change it, computed in float32 from a copy of the
  original that the rank keeps on the CPU, and cast to the weight's dtype. It is recomputed from that copy every time,
  never added onto the previous result, so the same list always gives bit-identical weights (strength 1.0 → 0.5 → 1.0
  gives the first image back exactly, in bf16 too), and a layer no LoRA changes any more gets its original back, bit
  for bit, and its copy dropped. The copy costs host memory: the bytes of every weight a LoRA changes (this rank's
  slice of it under tensor parallelism). A LoRA's bias changes (PEFT's ``lora_B.bias``: Wan's step-distillation
  LoRAs' ``diff_b``) are merged into the layers' biases the same way, scaled as their pairs. Under tensor
  parallelism (diffusers refuses adapters on a sharded model, and sharding a model that has them) each rank computes
  only its own slice of the delta: for a layer sharded by rows (colwise) its rows of B times A and of the bias
  change, for one sharded by columns (rowwise) B times its columns of A and the whole bias change, in the blocks the
  model's tensor-parallel plan shards packed layers by (diffusers' ``resolve_tp_shard_specs`` and ``_local_shard``,
  the arithmetic that sliced the weights when they were loaded, checked against each weight's DTensor placement), so
  no rank ever holds a layer's full weight or delta. Fusing is refused, with the numbers, when the copies would not
  fit the machine's free memory. A weight held in fp8 (``worker/fp8_weights.py``) is never written and needs no copy:
  its layer's hook gets the rank's factors and merges them, in float32, into the weight it computes with at every
  forward (merging into the fp8 weight would round the LoRA away).
- **peft**: diffusers' PEFT adapters (``load_lora_adapter``, ``set_adapters``), unfused; the weights are never
  touched. Refused under tensor parallelism (diffusers), and under context parallelism for a LoRA that changes a
  layer the model's ``_cp_plan`` hooks (``proj_out`` gathers the sequence there; an adapter around it adds a
  rank's slice to the gathered whole). The pack's choice for a GGUF transformer (``auto``; ``fused`` refused):
  merging a delta into packed weights would quantize it away, while an adapter is a side branch in the compute
  dtype beside the layer's dequantized weight, so nothing is lost beyond what the format already lost. Under tensor
  parallelism a GGUF transformer's LoRAs are refused, naming the strategies that take them.

Every rank reads the files and agrees on the outcome before anything changes, so a bad file is an error on every
rank at once (the backend stays up, the transformer as it was) rather than one rank missing from a collective. A file
is read only if its content is the one the client checked (``LoraRef.sha256``), so a LoRA replaced under its name is
refused on every rank rather than applied unchecked, or applied by some ranks and not others.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import socket

import torch

from ..families import FamilyAdapter
from ..families.lora import LoraError, LoraWeights, read_lora
from ..gguf_files import TENSOR_PARALLEL_LORAS, is_gguf_model
from ..strategy import StrategyPlan
from ..wire import LoraMode, LoraRef, TransformerSpec
from . import fp8_weights
from .ops import OpContext, OpError, WidgetError
from .tp_slices import shard_specs

log = logging.getLogger(__name__)

_STATE = "_parallel_diffusers_loras"  # the state's attribute on the transformer: it lives and dies with the model
File = tuple[str, str]  # LoraRef.file: what identifies a file's content


@dataclasses.dataclass(frozen=True)
class _Wanted:
    """One file of the list, at the sum of its strengths."""

    file: File
    ref: LoraRef
    strength: float


def _wanted(loras: tuple[LoraRef, ...]) -> list[_Wanted]:
    strengths: dict[File, float] = {}
    first: dict[File, LoraRef] = {}
    for ref in loras:
        strengths[ref.file] = strengths.get(ref.file, 0.0) + ref.strength
        first.setdefault(ref.file, ref)
    return [_Wanted(file, first[file], strength) for file, strength in strengths.items() if strength != 0.0]


def resolved_mode(spec: TransformerSpec, transformer: torch.nn.Module) -> LoraMode:
    """``auto`` is FUSED, except on a GGUF transformer: its weights are packed (merging a delta into them would
    quantize the delta away), so its LoRAs are PEFT adapters, a side branch in the compute dtype beside each
    dequantized layer, and an explicit ``fused`` is refused. On a transformer holding fp8 layers ``peft`` is refused:
    PEFT casts each adapter, and the input it takes, to its base layer's weight dtype, which is the held fp8 one, so
    the LoRA would be rounded to fp8 (and CPUs have no fp8 matmul to run it) — a silent precision loss the fused mode,
    merging in float32 into the weight each layer computes with, does not have."""
    if spec.lora_mode is LoraMode.PEFT and any(fp8_weights.held_hook(m) is not None for m in transformer.modules()):
        raise WidgetError(
            "lora_mode",
            "peft wraps each layer in an adapter that PEFT casts, with its input, to the layer's stored dtype: on a "
            "transformer held in fp8 the LoRA would be rounded to fp8; use auto (each LoRA merged in float32 into "
            "the weight its fp8 layer computes with), or the weights widget's 'as dtype' for adapters",
        )
    if is_gguf_model(transformer):
        if spec.lora_mode is LoraMode.FUSED:
            raise WidgetError(
                "lora_mode",
                "fused merges each LoRA into the weights, which a GGUF transformer holds packed (the delta would be "
                "quantized away); use auto (PEFT adapters beside the packed weights)",
            )
        return LoraMode.PEFT
    return LoraMode.FUSED if spec.lora_mode is LoraMode.AUTO else spec.lora_mode


class _State:
    """What a rank has done to its transformer: the mode, the files read (fused keeps their factors), the list
    applied, and the mode's own record."""

    def __init__(self, mode: LoraMode):
        self.mode = mode
        self.files: dict[File, LoraWeights] = {}
        self.applied: tuple[tuple[File, float], ...] = ()
        self.fused = _Fused()
        self.adapters: dict[File, str] = {}
        self._names = 0

    def adapter_name(self) -> str:
        self._names += 1
        return f"lora_{self._names}"


def apply_loras(ctx: OpContext, transformer: torch.nn.Module, spec: TransformerSpec, adapter: FamilyAdapter) -> None:
    """Bring ``transformer`` to ``spec.loras`` (see the module docstring). Collective under SPMD strategies: every
    rank calls it with the same spec; a rank-0 stage (device_map) calls it alone."""
    state: _State | None = getattr(transformer, _STATE, None)
    if not spec.loras and state is None:
        return
    wanted, mode = _wanted(spec.loras), resolved_mode(spec, transformer)
    target = tuple((w.file, w.strength) for w in wanted)
    if state is not None and state.mode is mode and state.applied == target:
        return
    if not wanted and state is None:
        return
    ctx.progress(0, 1, "applying LoRAs")
    if state is not None and state.mode is not mode:
        _clear(transformer, state)
        state = None
    if state is None:
        state = _State(mode)
        setattr(transformer, _STATE, state)
    known = state.files if mode is LoraMode.FUSED else state.adapters
    refused, read, files = None, {}, {}
    try:
        read = {w.file: _read(w.ref, adapter, transformer) for w in wanted if w.file not in known}
        if mode is LoraMode.PEFT:
            _check_adapters_allowed(transformer, spec.plan, wanted, read)
        else:
            files = {w.file: state.files[w.file] if w.file in state.files else read[w.file] for w in wanted}
            # Ranks on one machine copy at once (context / data parallel: the same weights each).
            local_ranks = ctx.local_world_size if ctx.spmd else 1
            needed = state.fused.new_copy_bytes(transformer, list(files.values()))
            check_host_memory(needed, local_ranks, ", ".join(w.ref.name for w in wanted))
    except OpError as e:
        refused = e
    ctx.agree(refused)
    with torch.no_grad():
        try:
            if mode is LoraMode.FUSED:
                state.files = files
                state.fused.apply(transformer, [(w, files[w.file]) for w in wanted])
            else:
                _apply_adapters(transformer, state, wanted, read)
        except BaseException:
            # Half-applied is worse than none: give the transformer its original weights back, then report.
            _clear(transformer, state)
            delattr(transformer, _STATE)
            raise
    state.applied = target
    log.info("LoRAs (%s): %s", mode.value, ", ".join(f"{w.ref.name}@{w.strength:g}" for w in wanted) or "none")


def _read(ref: LoraRef, adapter: FamilyAdapter, transformer: torch.nn.Module) -> LoraWeights:
    """The file the client checked, or a refusal: its content must have the checked digest on this rank (every rank
    compares with the same one, so no two ranks merge different files)."""
    try:
        return read_lora(adapter, ref.path, dict(transformer.config), expected_sha256=ref.sha256)
    except LoraError as e:
        raise WidgetError("lora_name", f"{ref.name} on {socket.gethostname()} {e}") from None


def check_host_memory(
    needed: int, local_ranks: int, loras: str, available: int | None = None, host: str | None = None
) -> None:
    """Refuse to fuse ``loras`` (their names) when the copies of the originals, ``needed`` bytes on each of
    ``local_ranks`` ranks, would not fit the machine's free memory (``MemAvailable``): the kernel would kill a rank,
    and the backend with it, instead of anyone saying why."""
    if needed == 0:
        return
    if available is None:
        with open("/proc/meminfo") as f:
            available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    if needed * local_ranks <= 0.9 * available:
        return
    raise WidgetError(
        "lora_name",
        f"merging {loras} keeps a copy of the original of every weight it changes in host memory, "
        f"{needed / 2**30:.1f} GiB more on each of the {local_ranks} ranks of {host or socket.gethostname()}, but "
        f"{available / 2**30:.1f} GiB are free there; free memory, stack fewer LoRAs, or use tensor_parallel (each "
        "rank keeps only its slice of the originals)",
    )


def _clear(transformer: torch.nn.Module, state: _State) -> None:
    """The transformer as it was loaded: original weights back, adapters removed."""
    with torch.no_grad():
        state.fused.restore(transformer)
    if state.adapters:
        transformer.unload_lora()
        state.adapters.clear()
    state.files.clear()
    state.applied = ()


# -- fused ---------------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class _Fused:
    """Fused deltas: ``pristine`` holds the original (local slice of the) weight of every tensor a LoRA changes, on
    the CPU; ``applied`` the contributions each such tensor has now."""

    pristine: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    applied: dict[str, tuple[tuple[File, float], ...]] = dataclasses.field(default_factory=dict)

    def apply(self, transformer: torch.nn.Module, wanted: list[tuple[_Wanted, LoraWeights]]) -> None:
        slices = _Slices(transformer)
        contributions: dict[str, list[tuple[tuple[File, float], float, str, LoraWeights]]] = {}
        for w, weights in wanted:
            for module in weights.modules:
                factor = w.strength * weights.scales[module]
                part = ((w.file, w.strength), factor, module, weights)
                contributions.setdefault(f"{module}.weight", []).append(part)
                if weights.bias(module) is not None:
                    contributions.setdefault(f"{module}.bias", []).append(part)
        for name in sorted(set(contributions) | set(self.applied)):
            parts = contributions.get(name, [])
            signature = tuple(part[0] for part in parts)
            if self.applied.get(name, ()) == signature:
                continue
            hook = _weight_hook(transformer, name)
            if hook is not None:
                # An fp8 weight is never written: its hook merges the LoRAs into the weight it computes with, in
                # float32 from the fp8 values and scale, at every forward (rounding them into fp8 would lose them).
                device = slices.local(name).device
                hook.loras = [
                    fp8_weights.LoraFactors(factor, *slices.factors(name, *weights.factors(module), device=device))
                    for _, factor, module, weights in parts
                ]
                if parts:
                    self.applied[name] = signature
                else:
                    del self.applied[name]
                continue
            local = slices.local(name)
            if not parts:  # no LoRA changes it any more: the original, exactly
                local.copy_(self.pristine.pop(name))
                del self.applied[name]
                continue
            if name not in self.pristine:
                self.pristine[name] = local.detach().to("cpu", copy=True)
            # A fresh float32 copy (``copy=True``: for a float32 CPU weight ``to`` would return the kept original).
            total = self.pristine[name].to(device=local.device, dtype=torch.float32, copy=True)
            for _, factor, module, weights in parts:
                if name.endswith(".bias"):
                    total += factor * slices.bias(name, weights.bias(module), device=local.device)
                else:
                    total += factor * slices.delta(name, *weights.factors(module), device=local.device)
            local.copy_(total.to(local.dtype))
            self.applied[name] = signature
        kept = sum(t.numel() * t.element_size() for t in self.pristine.values())
        log.info("fused LoRAs change %d tensors; %.1f MiB of their originals kept", len(self.applied), kept / 2**20)

    def new_copy_bytes(self, transformer: torch.nn.Module, files: list[LoraWeights]) -> int:
        """Bytes of originals that fusing these LoRAs would copy beyond those already kept."""
        slices = _Slices(transformer)
        names = {f"{module}.weight" for weights in files for module in weights.modules}
        names |= {f"{m}.bias" for weights in files for m in weights.modules if weights.bias(m) is not None}
        names = {n for n in names if _weight_hook(transformer, n) is None}
        kept = (slices.local(name) for name in names - set(self.pristine))
        return sum(t.numel() * t.element_size() for t in kept)

    def restore(self, transformer: torch.nn.Module) -> None:
        slices = _Slices(transformer)
        for name, original in self.pristine.items():
            slices.local(name).copy_(original)
        for name in self.applied:
            hook = _weight_hook(transformer, name)
            if hook is not None:
                hook.loras = []
        self.pristine.clear()
        self.applied.clear()


def _weight_hook(transformer: torch.nn.Module, name: str) -> object | None:
    """The fp8 hook that makes ``name``'s weight (``module.weight`` of a layer held in fp8), or None: a bias is never
    held in fp8, so its change is written into it as any weight's."""
    if name.endswith(".bias"):
        return None
    return fp8_weights.held_hook(transformer.get_submodule(name.rpartition(".")[0]))


class _Slices:
    """This rank's part of a transformer's tensors: the whole tensor, or under tensor parallelism the slice the
    model's tensor-parallel plan (``families.tp_plan``) gave the rank."""

    def __init__(self, transformer: torch.nn.Module):
        self.transformer = transformer
        config = getattr(transformer, "_parallel_config", None)
        tp = getattr(config, "tensor_parallel_config", None) if config is not None else None
        self.mesh = getattr(tp, "_mesh", None) if tp is not None else None
        self.specs = {}
        if self.mesh is not None:
            self.specs = shard_specs(transformer, self.mesh.size())

    def local(self, name: str) -> torch.Tensor:
        """The rank's own tensor for ``module.weight`` (a view: writing it changes the model)."""
        from torch.distributed.tensor import DTensor, Replicate, Shard

        module, _, attr = name.rpartition(".")
        tensor = getattr(self.transformer.get_submodule(module), attr)
        spec = self.specs.get(name)
        sharded = spec is not None and spec.dim is not None
        if sharded and not isinstance(tensor, DTensor):
            raise OpError(f"{name} should be sharded by the model's tensor-parallel plan but is whole on this rank")
        if isinstance(tensor, DTensor):
            expected = Replicate() if spec is None or spec.dim is None else Shard(spec.dim)
            if tuple(tensor.placements) != (expected,):
                raise OpError(
                    f"{name} is placed {tensor.placements} on this rank, not as the model's tensor-parallel plan says "
                    f"({expected}); the pack cannot merge a LoRA into it"
                )
            tensor = tensor.to_local()
        if tensor.device.type == "meta":
            raise OpError(
                f"{module} is offloaded (device_map put its weights on the CPU or disk), so a LoRA cannot be merged "
                "into it; raise max_memory so the transformer fits the GPUs, or use tensor_parallel"
            )
        return tensor

    def delta(self, name: str, a: torch.Tensor, b: torch.Tensor, device: torch.device) -> torch.Tensor:
        """This rank's part of B @ A for ``module.weight``, in float32."""
        b, a = self.factors(name, a, b, device)
        return b @ a

    def bias(self, name: str, bias: torch.Tensor, device: torch.device) -> torch.Tensor:
        """This rank's part of a bias change for ``module.bias``, in float32: its outputs' under a colwise split (the
        bias is sharded as the weight's rows), the whole where the bias is whole (rowwise: added once, after the
        sum)."""
        from diffusers.hooks.tensor_parallel import _local_shard

        spec = self.specs.get(name)
        bias = bias.to(device=device, dtype=torch.float32)
        return bias if spec is None or spec.dim is None else _local_shard(bias, 0, spec.block_sizes, self.mesh)

    def factors(
        self, name: str, a: torch.Tensor, b: torch.Tensor, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, A) in float32 whose product is this rank's part of B @ A for ``module.weight``."""
        from diffusers.hooks.tensor_parallel import _local_shard

        spec = self.specs.get(name)
        a, b = a.to(device=device, dtype=torch.float32), b.to(device=device, dtype=torch.float32)
        if spec is None or spec.dim is None:
            return b, a
        if spec.dim == 0:  # colwise: this rank's output rows
            return _local_shard(b, 0, spec.block_sizes, self.mesh), a
        return b, _local_shard(a, 1, spec.block_sizes, self.mesh)  # rowwise: this rank's input columns


# -- PEFT adapters -------------------------------------------------------------------------------------------------
def _check_adapters_allowed(
    transformer: torch.nn.Module, plan: StrategyPlan, wanted: list[_Wanted], read: dict[File, LoraWeights]
) -> None:
    if plan.shards_weights and is_gguf_model(transformer):
        raise OpError(f"strategy: {TENSOR_PARALLEL_LORAS}")
    if plan.shards_weights:
        raise OpError(
            "lora_mode: diffusers refuses PEFT adapters on a tensor-parallel transformer; use the fused mode (auto)"
        )
    if not plan.splits_tokens:
        return
    hooked = [re.compile("^" + re.escape(key).replace(r"\*", r"[^.]+") + "$") for key in type(transformer)._cp_plan]
    for w in wanted:
        if w.file not in read:
            continue  # loaded as an adapter before: checked then
        clash = next((m for m in read[w.file].modules if any(p.match(m) for p in hooked)), None)
        if clash is not None:
            raise OpError(
                f"lora_name: {w.ref.name} changes {clash}, which context parallelism hooks (its _cp_plan); a PEFT "
                "adapter around it breaks the sequence split: use the fused mode (auto)"
            )


def _apply_adapters(
    transformer: torch.nn.Module, state: _State, wanted: list[_Wanted], read: dict[File, LoraWeights]
) -> None:
    keep = {w.file for w in wanted}
    gone = [name for file, name in state.adapters.items() if file not in keep]
    if gone:
        transformer.delete_adapters(gone)
    state.adapters = {file: name for file, name in state.adapters.items() if file in keep}
    for w in wanted:
        if w.file not in state.adapters:
            weights, name = read[w.file], state.adapter_name()
            transformer.load_lora_adapter(
                dict(weights.state_dict),
                network_alphas=dict(weights.network_alphas) if weights.network_alphas else None,
                metadata=weights.metadata,
                prefix="transformer",
                adapter_name=name,
            )
            state.adapters[w.file] = name
    if wanted:
        transformer.set_adapters([state.adapters[w.file] for w in wanted], [w.strength for w in wanted])
    elif state.adapters or getattr(transformer, "_hf_peft_config_loaded", False):
        transformer.unload_lora()  # no wrappers left: the forward is the original one again
        state.adapters.clear()
