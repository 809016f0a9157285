"""Run under torchrun on CPU: Wan's tensor-parallel plan (``families/wan/tp_plan.py``) through the pack's load
(``worker/strategies.load_transformer``, which reads each rank's slices with ``worker/tp_slices``) against one
process.

    torchrun --standalone --nproc-per-node N tests/_wan_tp_check.py RESULTS_JSON CASE...

A CASE ``STRATEGY:DIR`` (``tensor_parallel`` over every rank, or ``tp_cp``: TP 2 × Ulysses over the rest) loads DIR's
tiny ``WanTransformer3DModel`` split by that plan, and whole; its outcome on each rank is the largest absolute
difference between the two forward passes on the same random inputs (with DIR's image tokens when its config has
them). A CASE ``second-expert:DIR`` is ``tensor_parallel`` of DIR's ``transformer_2`` (Wan 2.2 A14B's low-noise
expert, from its own subfolder; its fp8 weights held as stored). A CASE ``lora:DIR`` fuses a LoRA into the split
model (``worker/lora``'s fused mode, each rank its slice of every delta) and into the whole one (W + B @ A), then
compares them the same way. A CASE ``norms-alone:DIR`` is ``tensor_parallel`` with the plan's one extra step undone:
each rank normalises its own heads' columns of q and k by their own mean square, as a plan that splits q/k by heads
and leaves the RMSNorm to each rank would. Rank 0 writes ``{case: [each rank's outcome]}``; a case that raises is
recorded as its traceback.
"""

import json
import sys
import traceback

import torch
import torch.distributed as dist
from diffusers import WanTransformer3DModel

from parallel_runtime import families
from parallel_runtime.families.lora import LoraWeights
from parallel_runtime.strategy import StrategyPlan, TransformerFacts
from parallel_runtime.wire import LoraRef
from parallel_runtime.worker.cpu_shims import apply_cpu_shims
from parallel_runtime.worker.lora import _Fused, _Wanted
from parallel_runtime.worker.strategies import load_transformer
from parallel_runtime.worker.tp_slices import HeadShardedRMSNorm

CPU = torch.device("cpu")


def forward_inputs(config) -> dict:
    """The same random inputs on every rank: 2 latent frames of 4 × 4 (8 tokens after 1 × 2 × 2 patches); the I2V
    model's text is 512 tokens (its attention takes what precedes the last 512 as the image's), T2V's 8."""
    generator = torch.Generator().manual_seed(0)
    image = config.image_dim is not None
    inputs = {
        "hidden_states": torch.randn(1, config.in_channels, 2, 4, 4, generator=generator),
        "encoder_hidden_states": torch.randn(1, 512 if image else 8, config.text_dim, generator=generator),
        "timestep": torch.tensor([637.0]),
    }
    if image:
        inputs["encoder_hidden_states_image"] = torch.randn(1, 6, config.image_dim, generator=generator)
    return inputs


def split(strategy: str, model_dir: str, subfolder: str = "transformer") -> torch.nn.Module:
    config = WanTransformer3DModel.load_config(model_dir, subfolder=subfolder)
    facts = TransformerFacts.from_config(config, families.tp_plan(config["_class_name"]))
    plan = StrategyPlan.from_widgets(facts, dist.get_world_size(), strategy=strategy, tp_degree=2)
    return load_transformer(WanTransformer3DModel, model_dir, torch.float32, CPU, plan, subfolder=subfolder)


def norms_alone(model: torch.nn.Module) -> None:
    """Each head norm as a plain RMSNorm over the rank's own columns, with the rank's part of the weight."""
    for name, norm in list(model.named_modules()):
        if isinstance(norm, HeadShardedRMSNorm):
            columns = norm.width // norm.ranks
            alone = torch.nn.RMSNorm(columns, eps=norm.eps)
            alone.weight.data.copy_(norm.weight.data.narrow(0, norm.rank * columns, columns))
            parent, _, attribute = name.rpartition(".")
            setattr(model.get_submodule(parent), attribute, alone)


# What the LoRA changes: layers split by columns and by rows, attention's and the feed-forward's, and (I2V) the image
# tokens' key projection.
LORA_MODULES = ("blocks.0.attn1.to_q", "blocks.0.attn1.to_out.0", "blocks.1.ffn.net.0.proj", "blocks.1.ffn.net.2")


def lora(model: torch.nn.Module) -> LoraWeights:
    """A rank-2 LoRA of random factors (the same on every rank) for the layers of ``LORA_MODULES`` the model has."""
    generator, state_dict = torch.Generator().manual_seed(1), {}
    modules = LORA_MODULES + (("blocks.0.attn2.add_k_proj",) if model.config.image_dim is not None else ())
    for module in modules:
        linear = model.get_submodule(module)
        state_dict[f"transformer.{module}.lora_A.weight"] = torch.randn(2, linear.in_features, generator=generator)
        state_dict[f"transformer.{module}.lora_B.weight"] = torch.randn(linear.out_features, 2, generator=generator)
    return LoraWeights(state_dict, None, None, scales=dict.fromkeys(modules, 0.5))


def fuse_whole(model: torch.nn.Module, weights: LoraWeights) -> None:
    for module in weights.modules:
        a, b = weights.factors(module)
        model.get_submodule(module).weight += weights.scales[module] * b @ a


@torch.no_grad()
def difference(check: str, model_dir: str) -> float:
    # second-expert: Wan 2.2 A14B's low-noise expert, from its own subfolder (the tests store it in fp8, held so).
    subfolder = "transformer_2" if check == "second-expert" else "transformer"
    whole = WanTransformer3DModel.from_pretrained(model_dir, subfolder=subfolder, dtype=torch.float32)
    inputs = forward_inputs(whole.config)
    expected = whole(**inputs, return_dict=False)[0]
    model = split(check if check in ("tensor_parallel", "tp_cp") else "tensor_parallel", model_dir, subfolder)
    if check == "norms-alone":
        norms_alone(model)
    if check == "lora":
        weights = lora(whole)
        fuse_whole(whole, weights)
        expected = whole(**inputs, return_dict=False)[0]
        ref = LoraRef("tiny", "tiny.safetensors", 1.0, "0" * 64)
        _Fused().apply(model, [(_Wanted(ref.file, ref, ref.strength), weights)])
    return (model(**inputs, return_dict=False)[0] - expected).abs().max().item()


def main() -> None:
    results_path, *cases = sys.argv[1:]
    apply_cpu_shims()
    dist.init_process_group("gloo")
    mine = {}
    for case in cases:
        check, model_dir = case.split(":", 1)
        try:
            mine[case] = difference(check, model_dir)
        except Exception:
            mine[case] = traceback.format_exc()
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if dist.get_rank() == 0:
        with open(results_path, "w") as f:
            json.dump({case: [rank[case] for rank in everyone] for case in cases}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
