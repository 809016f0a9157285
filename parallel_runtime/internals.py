"""The diffusers and torch internals the pack reaches into, in one table, and the diffusers release it is tested with.

The pack patches or reads private names of diffusers (its parallel hooks, attention dispatch, step caches, pipelines'
latent packing) and of torch (its elastic agent's rendezvous, a CPU attention kernel). A release may rename any of
them, so requirements cap diffusers to the tested minor (``DIFFUSERS_REQUIREMENT``), and ``check()`` runs before the
code that uses them, at a rank's start (the worker's) and in torchrun's agent (the agent's): a missing one becomes one
error naming it, the installed version and the tested range, instead of an ImportError or AttributeError deep in a run.
The families' (diffusers pipelines' latent packing) are checked by the tests only: importing every pipeline at a
rank's start would cost seconds. The code that uses each stays in its own module (``used_by``); this table names it.

Plain data and the standard library: the client reads ``untested_diffusers()`` at ComfyUI's start-up from the installed
packages' metadata, without importing diffusers.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import inspect
import re

TESTED_DIFFUSERS = ("0.42.1", "0.43")  # at least, below
DIFFUSERS_REQUIREMENT = f"diffusers>={TESTED_DIFFUSERS[0]},<{TESTED_DIFFUSERS[1]}"  # pyproject's and requirements.txt's
TESTED_TORCH = "2.14.1"  # what CI runs (pyproject's test extra); the pack itself takes the host's torch


@dataclasses.dataclass(frozen=True)
class Internal:
    """A private name of diffusers or torch that the pack uses.

    Args:
        module: the module it lives in (``diffusers.hooks.tensor_parallel``).
        name: its name there, ``Class.attribute`` for one of a class's.
        used_by: the pack's module that uses it.
        why: what the pack does with it.
        on_instances: the class's own code sets it on its instances (``self._context = ...``), so it is looked for in
            the class's source rather than on the class.
    """

    module: str
    name: str
    used_by: str
    why: str
    on_instances: bool = False

    @property
    def package(self) -> str:
        return self.module.partition(".")[0]

    def exists(self) -> bool:
        try:
            owner: object = importlib.import_module(self.module)
        except ImportError:
            return False
        *path, attribute = self.name.split(".")
        for part in path:
            owner = getattr(owner, part, None)
            if owner is None:
                return False
        if hasattr(owner, attribute):
            return True
        if not self.on_instances:
            return False
        try:
            source = inspect.getsource(owner)
        except (OSError, TypeError):
            return False
        return re.search(rf"\.{re.escape(attribute)}\b\s*(:[^=\n]*)?=(?!=)", source) is not None


_CPU = "CPU ranks over gloo (cpu_shims)"
INTERNALS: tuple[Internal, ...] = (
    # diffusers: context and tensor parallelism on CPU ranks (worker/cpu_shims.py)
    Internal("diffusers.models.modeling_utils", "ModelMixin._resolve_parallel_config", "worker/cpu_shims.py",
             f"{_CPU}: wrapped to report one device while it picks a rank's device; worker/tp_slices.py calls it"),
    Internal("diffusers.hooks.tensor_parallel", "_SUPPORTED_TP_DEVICES", "worker/cpu_shims.py",
             f"{_CPU}: cpu is added to the devices tensor parallelism accepts"),
    Internal("diffusers.models.attention_dispatch", "_native_flash_attention_forward_op", "worker/cpu_shims.py",
             f"{_CPU}: replaced by one that calls torch's CPU flash kernel (Ring attention needs its log-sum-exp)"),
    Internal("diffusers.models._modeling_parallel", "gather_size_by_comm", "worker/cpu_shims.py",
             f"{_CPU}: replaced (also where context_parallel and attention_dispatch imported it) to gather on the CPU"),
    Internal("diffusers.hooks.context_parallel", "_all_gather_anything", "worker/cpu_shims.py",
             f"{_CPU}: replaced by a padded all-gather (gloo needs equal sizes)"),
    Internal("torch", "ops.aten._scaled_dot_product_flash_attention_for_cpu", "worker/cpu_shims.py",
             "torch's CPU flash-attention kernel, which returns the log-sum-exp Ring attention merges with"),
    # diffusers: the parallel config a model carries
    Internal("diffusers.models.modeling_utils", "ModelMixin._parallel_config", "worker/strategies.py",
             "read and re-set around a tp_cp load; worker/models.py, worker/lora.py, worker/tp_slices.py and "
             "worker/step_cache.py read its meshes"),
    Internal("diffusers.models._modeling_parallel", "TensorParallelConfig._tp_degree", "worker/models.py",
             "the tensor-parallel degree a loaded transformer reports in the status"),
    Internal("diffusers.models._modeling_parallel", "TensorParallelConfig._mesh", "worker/lora.py",
             "the mesh a LoRA's delta is sliced over for this rank"),
    Internal("diffusers.models._modeling_parallel", "ContextParallelConfig._flattened_mesh", "worker/step_cache.py",
             "the process group of the ranks that share a pass under cfg_parallel × context parallelism"),
    Internal("diffusers.models.modeling_utils", "ModelMixin._cp_plan", "worker/lora.py",
             "the layers context parallelism hooks, which a PEFT adapter must not wrap; strategy.py reads it too"),
    Internal("diffusers.models.modeling_utils", "ModelMixin._tp_plan", "families/__init__.py",
             "the layers tensor parallelism shards (tp_plan), for a class the pack writes no plan for; "
             "worker/tp_slices.py loads them slice by slice, worker/lora.py fuses LoRAs into the slices"),
    Internal("diffusers.models.transformers.transformer_wan", "WanAttention.heads", "families/wan/tp_plan.py",
             "what Wan's processor splits q/k/v into heads by: a rank's share under tensor parallelism",
             on_instances=True),
    Internal("diffusers.models.attention_dispatch", "_AttentionBackendRegistry", "worker/strategies.py",
             "the process-wide attention backend, restored after set_attention_backend changed it for one model"),
    # diffusers: tensor parallelism's own helpers, loading slices and LoRAs (worker/tp_slices.py, worker/lora.py)
    Internal("diffusers.hooks.tensor_parallel", "_check_tp_supported", "worker/tp_slices.py",
             "diffusers' own divisibility checks before a slice-by-slice load"),
    Internal("diffusers.hooks.tensor_parallel", "_local_shard", "worker/lora.py",
             "this rank's slice of a LoRA's factor, cut as the weight's own slice"),
    # diffusers: GGUF transformers (gguf_files.py)
    Internal("diffusers.quantizers.gguf.utils", "GGUFParameter", "gguf_files.py",
             "a packed tensor and its quant_type, as diffusers' GGUF layers take it; worker/tp_slices.py slices them"),
    Internal("diffusers.quantizers.gguf.utils", "_replace_with_gguf_linear", "worker/tp_slices.py",
             "the GGUF layers (dequantized per layer) of a model a tensor-parallel rank fills with its packed slices"),
    Internal("diffusers.quantizers.gguf.utils", "dequantize_gguf_tensor", "worker/tp_slices.py",
             "a rank's slice that is not whole blocks dequantized at load; the rowwise layers' forward"),
    Internal("diffusers.models.model_loading_utils", "_determine_device_map", "gguf_files.py",
             "device_map='auto''s placement, of a GGUF model's packed parameters (from_single_file takes none)"),
    Internal("diffusers.quantizers.gguf.utils", "SUPPORTED_GGUF_QUANT_TYPES", "gguf_files.py",
             "the GGML types diffusers computes: a file of any other is refused before anything loads"),
    Internal("diffusers.quantizers.gguf.gguf_quantizer", "GGUFQuantizer", "gguf_files.py",
             "the quantizer a GGUF model records on itself (hf_quantizer): how worker/lora.py tells one"),
    # diffusers: hooks and step caches
    Internal("diffusers.hooks.hooks", "HookRegistry._diffusers_hook", "worker/step_cache.py",
             "the registry a module carries; worker/cfg_parallel.py, worker/vae_tiles.py and worker/fp8_weights.py "
             "read it too", on_instances=True),
    Internal("diffusers.hooks.layerwise_casting", "_LAYERWISE_CASTING_HOOK", "worker/fp8_weights.py",
             "the fp8 hook's name: ModelMixin.dtype reads the compute dtype of a hook of that name, so the pipelines "
             "make their latents in it, not in fp8"),
    Internal("diffusers.hooks.hooks", "HookRegistry._hook_order", "worker/step_cache.py",
             "the order of a block's hooks, kept when the context-parallel split hooks come off and go back on",
             on_instances=True),
    Internal("diffusers.hooks.hooks", "StateManager._context", "worker/cfg_parallel.py",
             "the cache context ('cond' / 'uncond') that tells a rank which of true CFG's passes it runs",
             on_instances=True),
    Internal("diffusers.hooks.hooks", "ModelHook._is_stateful", "worker/cfg_parallel.py",
             "marks the cfg_parallel hook as one whose state diffusers resets"),
    Internal("diffusers.hooks._common", "_ALL_TRANSFORMER_BLOCK_IDENTIFIERS", "worker/step_cache.py",
             "the transformer blocks, as diffusers' caches find them"),
    Internal("diffusers.hooks.context_parallel", "_CONTEXT_PARALLEL_INPUT_HOOK_TEMPLATE", "worker/step_cache.py",
             "the names of context parallelism's split hooks"),
    Internal("diffusers.hooks.first_block_cache", "_FBC_LEADER_BLOCK_HOOK", "worker/step_cache.py",
             "first_block_cache's head hook, whose decision the ranks agree on"),
    Internal("diffusers.hooks.first_block_cache", "FBCHeadBlockHook._should_compute_remaining_blocks",
             "worker/step_cache.py", "replaced by a decision all ranks of a pass share"),
    Internal("diffusers.hooks.taylorseer_cache", "_TAYLORSEER_CACHE_HOOK", "worker/step_cache.py",
             "taylorseer's hooks, whose decisions are recorded"),
    Internal("diffusers.hooks.taylorseer_cache", "TaylorSeerCacheHook._measure_should_compute",
             "worker/step_cache.py", "wrapped to record which passes ran in full"),
    Internal("diffusers.loaders.peft", "PeftAdapterMixin._hf_peft_config_loaded", "worker/lora.py",
             "whether a transformer holds PEFT adapters to unload"),
    # diffusers: pipelines' latent packing, which the families reuse (families/*.py)
    Internal("diffusers.pipelines.pipeline_utils", "DiffusionPipeline._execution_device", "families/flux.py",
             "the device a staged pipeline runs on (flux2.py and qwenimage.py too)"),
    Internal("diffusers", "FluxPipeline._unpack_latents", "families/flux.py", "tokens back to a LATENT"),
    Internal("diffusers", "QwenImagePipeline._unpack_latents", "families/qwenimage.py", "tokens back to a LATENT"),
    Internal("diffusers", "Flux2Pipeline._pack_latents", "families/flux2.py", "a LATENT to tokens (img2img)"),
    Internal("diffusers", "Flux2Pipeline._patchify_latents", "families/flux2.py", "the VAE's latent to FLUX.2's"),
    Internal("diffusers", "Flux2Pipeline._unpatchify_latents", "families/flux2.py", "FLUX.2's latent to the VAE's"),
    Internal("diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus", "calculate_dimensions",
             "families/qwenimage_edit/adapter.py", "the sizes the edit pipeline resizes its images to, which the "
             "encoder shows and the sampler's split check counts"),
    Internal("diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus", "CONDITION_IMAGE_SIZE",
             "families/qwenimage_edit/adapter.py", "the area its text encoder sees an image at"),
    Internal("diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus", "VAE_IMAGE_SIZE",
             "families/qwenimage_edit/adapter.py", "the area its VAE encodes an image at for the transformer"),
    # torch: torchrun's agent with its stores bound to one address (worker/agent.py)
    Internal("torch.distributed.elastic.rendezvous.static_tcp_rendezvous", "TCPStore", "worker/agent.py",
             "replaced so the static rendezvous's store listens on the backend's address and carries the beacon"),
    Internal("torch.distributed.elastic.agent.server.api", "SimpleElasticAgent._assign_worker_ranks", "launcher.py",
             "looked for in torchrun's log: where its agent reads back its own records from the store, so a failure "
             "there is a stranger's write (client.py says so)"),
    Internal("torch.distributed.elastic.rendezvous.static_tcp_rendezvous", "StaticTCPRendezvous.next_rendezvous",
             "worker/agent.py", "wrapped to tell the ranks the port the store listens on (a free one, on one machine)"),
)  # fmt: skip


class InternalsChanged(RuntimeError):
    """The installed diffusers or torch lacks a name the pack uses."""


def installed(package: str) -> str | None:
    """The installed version of ``package`` (from its metadata; nothing is imported), or None."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _release(version: str) -> tuple[int, ...]:
    """The numeric release of a version string (``0.43.0.dev0``: ``(0, 43, 0)``)."""
    return tuple(int(part) for part in re.findall(r"\d+", re.match(r"[\d.]*", version).group()))


def untested_diffusers(version: str | None = None) -> str | None:
    """A warning naming the installed diffusers (``version``, default the installed one) when it is outside the
    tested range, else None."""
    version = version if version is not None else installed("diffusers")
    if version is None:
        return f"diffusers is not installed; this pack needs it: pip install '{DIFFUSERS_REQUIREMENT}'"
    low, below = (_release(v) for v in TESTED_DIFFUSERS)
    if low <= _release(version) < below:
        return None
    return (
        f"diffusers {version} is installed, but this pack is tested with {DIFFUSERS_REQUIREMENT}; its parallel "
        f"strategies reach into diffusers' internals, which may have changed: pip install '{DIFFUSERS_REQUIREMENT}'"
    )


def check(used_by: str = "") -> None:
    """Every internal the pack's modules under ``used_by`` use (``"worker/"``: a rank's; ``""``: all) exists;
    InternalsChanged naming each missing one, the installed version and the tested one otherwise."""
    missing = [i for i in INTERNALS if i.used_by.startswith(used_by) and not i.exists()]
    if not missing:
        return
    lines = []
    for package in dict.fromkeys(i.package for i in missing):
        tested = DIFFUSERS_REQUIREMENT if package == "diffusers" else f"{package} {TESTED_TORCH}"
        lines.append(
            f"{package} {installed(package) or '(not installed)'} lacks what this pack uses (tested with {tested}):"
        )
        lines += [f"  {i.module}.{i.name}, used by {i.used_by}: {i.why}" for i in missing if i.package == package]
    raise InternalsChanged(
        "\n".join(lines)
        + f"\nInstall a tested release (pip install '{DIFFUSERS_REQUIREMENT}'; torch as ComfyUI needs it)."
    )
