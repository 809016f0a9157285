"""Tensor parallelism for Wan by the plan the pack writes (``families/wan/tp_plan.py``; diffusers 0.42.1 has none for
``WanTransformer3DModel``), looked up by ``families.tp_plan`` wherever TP is: the slice-by-slice load, the LoRAs
fused into the slices, and the strategy's checks.

On real CPU ranks (``tests/_wan_tp_check.py``, the pack's load through ``worker/strategies.load_transformer``): a
tiny random Wan 2.1 T2V and I2V transformer split over 2 ranks gives the forward of one process within 1e-5 in
float32; the same split with each rank normalising its own heads alone (what a plan that leaves Wan's RMSNorm over
all heads to each rank does) does not; a LoRA fused into the slices equals it fused whole; Wan 2.2 A14B's second
expert, sliced from its own subfolder with its fp8 weights held as stored, equals it whole. And the refusals, by
widget and width, before anything loads.
"""

import shutil
from pathlib import Path

import pytest
import torch
from diffusers import WanTransformer3DModel
from helpers import run_ranks

from parallel_runtime import families
from parallel_runtime.errors import InvalidInput
from parallel_runtime.strategy import StrategyPlan, TransformerFacts
from parallel_runtime.worker.ops import WidgetError
from parallel_runtime.worker.tp_slices import shard_specs, tp_layers

CHECK_SCRIPT = Path(__file__).with_name("_wan_tp_check.py")
TOLERANCE = 1e-5  # float32: the split sums the rowwise layers' parts in another order than one matmul does

# A Wan 2.1 transformer in miniature: 4 heads of 12 (Wan's rope needs a head size divisible into 3 axes), 2 blocks.
TINY = {
    "patch_size": (1, 2, 2),
    "num_attention_heads": 4,
    "attention_head_dim": 12,
    "in_channels": 4,
    "out_channels": 4,
    "text_dim": 16,
    "freq_dim": 16,
    "ffn_dim": 64,
    "num_layers": 2,
    "rope_max_seq_len": 32,
}
# Wan 2.1 I2V: CLIP image tokens projected by the cross-attention's add_k_proj / add_v_proj (to the inner width).
TINY_I2V = {**TINY, "image_dim": 20, "added_kv_proj_dim": 48}


def _save_tiny_wan(folder: Path, config: dict, seed: int) -> str:
    """A folder holding only ``transformer/`` (all a transformer load reads), every parameter random: diffusers
    initialises the RMSNorms' weights to ones and some projections to zeros, which would hide a wrong slice."""
    torch.manual_seed(seed)
    model = WanTransformer3DModel(**config)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn_like(parameter) * 0.3)
    model.save_pretrained(folder / "transformer", safe_serialization=True)
    return str(folder)


def _save_fp8_expert(folder: str, seed: int) -> None:
    """A second expert (Wan 2.2 A14B's ``transformer_2``) beside the first, its Linear layers' weights stored in fp8
    (float8_e4m3fn, no scale), as ComfyUI's fp8 expert files convert."""
    from safetensors.torch import load_file, save_file

    expert = Path(folder) / "transformer_2"
    _save_tiny_wan(expert / "whole", TINY, seed)
    (expert / "whole" / "transformer" / "config.json").rename(expert / "config.json")
    tensors = load_file(expert / "whole" / "transformer" / "diffusion_pytorch_model.safetensors")
    modules = WanTransformer3DModel(**TINY).named_modules()
    linear = {name for name, module in modules if isinstance(module, torch.nn.Linear)}
    stored = {
        key: tensor.to(torch.float8_e4m3fn) if key.rpartition(".")[0] in linear and key.endswith(".weight") else tensor
        for key, tensor in tensors.items()
    }
    save_file(stored, expert / "diffusion_pytorch_model.safetensors")
    shutil.rmtree(expert / "whole")


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("wan-tp")
    folders = {"t2v": _save_tiny_wan(root / "t2v", TINY, 0), "i2v": _save_tiny_wan(root / "i2v", TINY_I2V, 1)}
    _save_fp8_expert(folders["t2v"], 2)
    return folders


@pytest.fixture(scope="module")
def results(folders, tmp_path_factory) -> dict:
    """One launch of 2 ranks for every case: {case: each rank's largest difference from one process}."""
    cases = {
        "t2v": f"tensor_parallel:{folders['t2v']}",
        "i2v": f"tensor_parallel:{folders['i2v']}",
        "norms-alone": f"norms-alone:{folders['t2v']}",
        "second-expert": f"second-expert:{folders['t2v']}",
        "lora-t2v": f"lora:{folders['t2v']}",
        "lora-i2v": f"lora:{folders['i2v']}",
    }
    outcomes = run_ranks(CHECK_SCRIPT, 2, tmp_path_factory.mktemp("ranks"), *cases.values())
    return {name: outcomes[case] for name, case in cases.items()}


def _differences(outcomes: list) -> list[float]:
    for rank, outcome in enumerate(outcomes):
        assert isinstance(outcome, float), f"rank {rank}: {outcome}"
    return outcomes


@pytest.mark.multirank
@pytest.mark.parametrize("model", ["t2v", "i2v"])
def test_wan_split_over_two_ranks_equals_one_process(results, model):
    assert max(_differences(results[model])) <= TOLERANCE


@pytest.mark.multirank
def test_wan22s_second_expert_in_fp8_split_over_two_ranks_equals_one_process(results):
    """Wan 2.2 A14B's low-noise expert sliced from its own subfolder (``transformer_2``), its fp8 weights held as
    stored in each rank's slices."""
    assert max(_differences(results["second-expert"])) <= TOLERANCE


@pytest.mark.multirank
@pytest.mark.parametrize("model", ["t2v", "i2v"])
def test_a_lora_fused_into_the_split_model_equals_it_fused_whole(results, model):
    """worker/lora.py's fused mode slices each delta by the same plan: layers split by columns and by rows."""
    assert max(_differences(results[f"lora-{model}"])) <= TOLERANCE


@pytest.mark.multirank
def test_without_the_norms_mean_square_summed_over_the_ranks_it_is_wrong(results):
    """The plan's one step beyond diffusers' form is what makes it right: each rank normalising its own heads alone
    runs, and misses by far more than the tolerance."""
    assert min(_differences(results["norms-alone"])) > 100 * TOLERANCE


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.four_ranks
def test_wan_under_tp_cp_on_four_ranks_equals_one_process(folders, tmp_path):
    """TP 2 × Ulysses 2: each TP rank's 2 heads split again over the tokens' ranks, T2V and I2V (whose image
    tokens Wan's context-parallel plan leaves whole)."""
    cases = [f"tp_cp:{folders['t2v']}", f"tp_cp:{folders['i2v']}"]
    outcomes = run_ranks(CHECK_SCRIPT, 4, tmp_path, *cases)
    for case in cases:
        assert max(_differences(outcomes[case])) <= TOLERANCE, case


def _plan(config: dict, ranks: int, strategy: str = "tensor_parallel", tp_degree: int = 0) -> StrategyPlan:
    config = {"_class_name": "WanTransformer3DModel", **config}
    facts = TransformerFacts.from_config(config, families.tp_plan(config["_class_name"]))
    return StrategyPlan.from_widgets(facts, ranks, strategy=strategy, tp_degree=tp_degree)


def test_wan_has_the_packs_plan_where_diffusers_has_none():
    assert WanTransformer3DModel._tp_plan is None
    assert families.tp_plan("WanTransformer3DModel") is families.TP_PLANS["WanTransformer3DModel"]
    assert families.tp_plan("FluxTransformer2DModel").layers is not None  # diffusers' own, as before
    assert families.tp_plan("SD3Transformer2DModel") is None
    # Wan 14B (40 heads, ffn_dim 13824) over 2, 4 and 8 GPUs, and under tp_cp.
    wan14b = {"num_attention_heads": 40, "ffn_dim": 13824}
    assert [_plan(wan14b, n).tp_degree for n in (2, 4, 8)] == [2, 4, 8]
    assert _plan(wan14b, 4, "tp_cp", tp_degree=2).describe().startswith("tp2xcp:ring1xulysses2")


@pytest.mark.parametrize(
    ("config", "ranks", "strategy", "words"),
    [
        # Wan 2.1 1.3B: 12 heads do not split over 8
        ({"num_attention_heads": 12, "ffn_dim": 8960}, 8, "tensor_parallel", ["12 attention heads", "tp_degree 8"]),
        # heads that split, a feed-forward width that does not
        ({"num_attention_heads": 4, "ffn_dim": 66}, 4, "tensor_parallel", ["feed-forward width (ffn_dim) 66"]),
        ({"num_attention_heads": 4, "ffn_dim": 66}, 8, "tp_cp", ["feed-forward width (ffn_dim) 66", "tp_degree 4"]),
    ],
)
def test_widths_tensor_parallelism_cannot_split_are_refused_by_name(config, ranks, strategy, words):
    with pytest.raises(InvalidInput) as refused:
        _plan(config, ranks, strategy, tp_degree=4 if strategy == "tp_cp" else 0)
    assert refused.value.widget == "tp_degree"
    for word in words:
        assert word in str(refused.value)


def test_on_the_ranks_a_width_that_does_not_split_is_refused_before_any_weight_is_read():
    """What the strategy's checks cannot know of (a block's width) is refused by the load's first step, naming the
    weight: here a feed-forward width of 64 over 3 ranks, on a model on the meta device."""
    with torch.device("meta"):
        model = WanTransformer3DModel(**TINY)
    with pytest.raises(WidgetError) as refused:
        shard_specs(model, 3)
    assert refused.value.widget == "tp_degree" and "blocks.0.ffn.net.0.proj.weight" in str(refused.value)


def test_a_planned_layer_the_config_leaves_out_is_not_split():
    """Wan T2V has no image projections (None in its blocks): the plan's layers for them drop out, I2V keeps them."""
    with torch.device("meta"):
        t2v, i2v = WanTransformer3DModel(**TINY), WanTransformer3DModel(**TINY_I2V)
    image = {"blocks.*.attn2.add_k_proj", "blocks.*.attn2.add_v_proj"}
    assert set(families.TP_PLANS["WanTransformer3DModel"].layers) - set(tp_layers(t2v)) == image
    assert set(tp_layers(i2v)) == set(families.TP_PLANS["WanTransformer3DModel"].layers)


def test_the_slice_reader_puts_the_buffers_on_the_ranks_device_too(folders):
    """The reader builds the model under accelerate's init_empty_weights, which leaves buffers on the CPU: Wan's rotary
    tables must follow the weights to the rank's device, or a GPU rank's attention mixes devices (the whole-model read,
    as fp8 replicas take it; ``meta`` stands for a device other than the CPU)."""
    from parallel_runtime.worker.tp_slices import load_tensor_parallel

    model = load_tensor_parallel(WanTransformer3DModel, folders["t2v"], torch.float32, torch.device("meta"), None)
    buffers = dict(model.named_buffers())
    assert any("rope" in name for name in buffers), sorted(buffers)
    assert {t.device.type for t in (*model.parameters(), *buffers.values())} == {"meta"}
