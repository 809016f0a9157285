"""The plan made of degrees, without a backend: every widget combination gives the degrees and the properties the
ranks act on, the degrees always fill the ranks, and each refusal names the widget and the fix."""

from __future__ import annotations

import math

import pytest

from parallel_runtime.errors import InvalidInput
from parallel_runtime.serial import from_json, to_json
from parallel_runtime.strategy import AXES, Strategy, StrategyPlan, TransformerFacts, strategies_on

FACTS = TransformerFacts("FluxTransformer2DModel", heads=4, has_cp_plan=True, has_tp_plan=True)
CP = "cp:ring{}xulysses{}:auto"

# (strategy, ranks, other widgets) -> degrees (data, cfg, ring, ulysses, tp), mesh, properties, describe()
CASES = [
    ("device_map", 4, {}, (1, 1, 1, 1, 1), (), (), "", "device_map"),
    # Widgets a strategy does not use are ignored.
    ("device_map", 4, {"ring_degree": 2, "tp_degree": 2, "anything": True}, (1, 1, 1, 1, 1), (), (), "",
     "device_map"),
    ("data_parallel", 4, {}, (4, 1, 1, 1, 1), (), (), "spmd batch", "data_parallel"),
    ("data_parallel", 1, {}, (1, 1, 1, 1, 1), (), (), "spmd batch", "data_parallel"),
    ("context_parallel", 4, {}, (1, 1, 1, 4, 1), ("ring", "ulysses"), (1, 4), "spmd tokens", CP.format(1, 4)),
    ("context_parallel", 4, {"ring_degree": 2}, (1, 1, 2, 2, 1), ("ring", "ulysses"), (2, 2), "spmd tokens",
     CP.format(2, 2)),
    ("context_parallel", 4, {"ring_degree": 4, "anything": True, "attention_backend": "_native_flash"},
     (1, 1, 4, 1, 1), ("ring", "ulysses"), (4, 1), "spmd tokens", "cp:ring4xulysses1+anything:_native_flash"),
    ("context_parallel", 2, {"tp_degree": 2}, (1, 1, 1, 2, 1), ("ring", "ulysses"), (1, 2), "spmd tokens",
     CP.format(1, 2)),
    ("tensor_parallel", 4, {}, (1, 1, 1, 1, 4), ("tp",), (4,), "spmd weights", "tp4"),
    ("tensor_parallel", 2, {"tp_degree": 2, "ulysses_degree": 2}, (1, 1, 1, 1, 2), ("tp",), (2,), "spmd weights",
     "tp2"),
    # One rank: nothing is split, but the word's layout stays (a 1-rank mesh, TP's load path).
    ("tensor_parallel", 1, {}, (1, 1, 1, 1, 1), ("tp",), (1,), "spmd weights", "tp1"),
    ("tp_cp", 4, {"tp_degree": 2}, (1, 1, 1, 2, 2), ("ring", "ulysses", "tp"), (1, 2, 2), "spmd weights tokens",
     "tp2x" + CP.format(1, 2)),
    ("tp_cp", 8, {"tp_degree": 2, "ring_degree": 2}, (1, 1, 2, 2, 2), ("ring", "ulysses", "tp"), (2, 2, 2),
     "spmd weights tokens", "tp2x" + CP.format(2, 2)),
    ("cfg_parallel", 2, {}, (1, 2, 1, 1, 1), ("cfg", "ring", "ulysses"), (2, 1, 1), "spmd cfg", "cfg2"),
    ("cfg_parallel", 4, {}, (1, 2, 1, 2, 1), ("cfg", "ring", "ulysses"), (2, 1, 2), "spmd cfg tokens",
     "cfg2x" + CP.format(1, 2)),
    ("cfg_parallel", 8, {"ring_degree": 2}, (1, 2, 2, 2, 1), ("cfg", "ring", "ulysses"), (2, 2, 2),
     "spmd cfg tokens", "cfg2x" + CP.format(2, 2)),
]  # fmt: skip


@pytest.mark.parametrize(
    "strategy, ranks, widgets, degrees, names, shape, properties, described",
    CASES,
    ids=[f"{c[0]}-{c[1]}-{i}" for i, c in enumerate(CASES)],
)
def test_widgets_give_degrees_and_properties(strategy, ranks, widgets, degrees, names, shape, properties, described):
    plan = StrategyPlan.from_widgets(FACTS, ranks, strategy=strategy, **widgets)
    assert plan.strategy is Strategy(strategy)
    assert tuple(plan.degrees.values()) == degrees
    assert list(plan.degrees) == ["data", "cfg", "ring", "ulysses", "tp"]
    assert (plan.mesh_dim_names, plan.mesh_shape) == (names, shape)
    said = set(properties.split())
    assert plan.spmd == ("spmd" in said)
    assert plan.splits_batch == ("batch" in said)
    assert plan.shards_weights == ("weights" in said)
    assert plan.splits_tokens == ("tokens" in said)
    assert plan.splits_cfg == ("cfg" in said)
    assert plan.cp_degree == plan.ring_degree * plan.ulysses_degree
    assert plan.describe() == described
    if plan.spmd:  # the degrees fill the ranks: the replicas times one pass's mesh
        assert math.prod(plan.degrees.values()) == plan.data_degree * math.prod(plan.mesh_shape) == ranks
    # The ranks rebuild it from the wire and get the same plan.
    assert from_json(StrategyPlan, to_json(plan)) == plan


def test_every_strategy_has_a_layout_and_a_case():
    assert set(AXES) == set(Strategy)
    assert {c[0] for c in CASES} == {s.value for s in Strategy}
    for axes in AXES.values():
        assert set(axes) <= {"data", "cfg", "ring", "ulysses", "tp"} and len(set(axes)) == len(axes)
    assert strategies_on("tp") == ["tensor_parallel", "tp_cp"]
    assert strategies_on("ring") == ["context_parallel", "tp_cp", "cfg_parallel"]


@pytest.mark.parametrize(
    "ranks, widgets, widget, hint",
    [
        (0, {"strategy": "device_map"}, "ranks", "0 ranks cannot run anything"),
        (2, {"strategy": "pipeline_parallel"}, "strategy", "unknown strategy 'pipeline_parallel'; choose one of"),
        (4, {"strategy": "tensor_parallel", "tp_degree": 3}, "tp_degree", "tp_degree 3 must equal the backend's 4"),
        (8, {"strategy": "tensor_parallel"}, "tp_degree", "4 attention heads do not split over tp_degree 8"),
        (2, {"strategy": "tp_cp", "tp_degree": 2}, "tp_degree", "tp_cp needs tp_degree ≥ 2 dividing"),
        (4, {"strategy": "tp_cp"}, "tp_degree", "got 0. With fewer ranks use tensor_parallel"),
        (6, {"strategy": "tp_cp", "tp_degree": 4}, "tp_degree", "tp_cp needs tp_degree ≥ 2 dividing"),
        (8, {"strategy": "tp_cp", "tp_degree": 2, "ulysses_degree": 3}, "ulysses_degree",
         "= 3, but tp_degree 2 leaves 4 ranks; make the product 4"),
        (8, {"strategy": "tp_cp", "tp_degree": 2, "ulysses_degree": 4, "anything": True}, "ulysses_degree",
         "2 attention heads per TP rank < ulysses_degree 4"),
        (3, {"strategy": "cfg_parallel"}, "strategy", "needs an even number of ranks; the backend has 3"),
        (4, {"strategy": "cfg_parallel", "ring_degree": 2, "ulysses_degree": 2}, "ulysses_degree",
         "each half of the backend's 4 ranks runs one pass, split over ring_degree × ulysses_degree ranks = 2 × 2"),
        (2, {"strategy": "context_parallel", "ring_degree": 2, "ulysses_degree": 2}, "ulysses_degree",
         "= 4, but the backend has 2 ranks"),
        (1, {"strategy": "context_parallel"}, "ulysses_degree", "context parallelism needs 2 or more ranks"),
        (2, {"strategy": "context_parallel", "ring_degree": 0}, "ring_degree", "0 is not a degree"),
        (4, {"strategy": "context_parallel", "ring_degree": 2, "ulysses_degree": 2, "anything": True}, "anything",
         "each work on one axis"),
        (3, {"strategy": "context_parallel", "ulysses_degree": 3}, "ulysses_degree", "use a divisor of 4"),
        (2, {"strategy": "context_parallel", "attention_backend": "magic"}, "attention_backend", "unknown backend"),
    ],
)  # fmt: skip
def test_widgets_are_refused_by_name(ranks, widgets, widget, hint):
    with pytest.raises(InvalidInput, match=hint) as info:
        StrategyPlan.from_widgets(FACTS, ranks, **widgets)
    assert info.value.widget == widget


def test_a_model_without_a_parallel_plan_is_refused_for_that_axis():
    bare = TransformerFacts("SomeTransformer2DModel", heads=4, has_cp_plan=False, has_tp_plan=False)
    refusals = [
        ("tensor_parallel", "no tensor-parallel plan"),
        ("tp_cp", "no tensor-parallel plan"),
        ("context_parallel", "no context-parallel plan"),
        ("cfg_parallel", "no context-parallel plan"),
    ]
    for strategy, hint in refusals:
        with pytest.raises(InvalidInput, match=hint) as info:
            StrategyPlan.from_widgets(bare, 4, strategy=strategy, tp_degree=2)
        assert info.value.widget == "strategy"
    # Axes that need no plan of the model's: data and one rank per half of true CFG.
    assert StrategyPlan.from_widgets(bare, 4, strategy="data_parallel").splits_batch
    assert StrategyPlan.from_widgets(bare, 2, strategy="cfg_parallel").splits_cfg


@pytest.mark.parametrize(
    "fields, widget, hint",
    [
        ({"strategy": Strategy.CONTEXT_PARALLEL, "ulysses_degree": 4, "tp_degree": 2}, "tp_degree",
         "context_parallel does not split the weights; leave tp_degree at 0, or choose tensor_parallel or tp_cp"),
        ({"strategy": Strategy.DATA_PARALLEL, "data_degree": 4, "ring_degree": 2}, "strategy",
         "data_parallel does not split the tokens"),
        ({"strategy": Strategy.CONTEXT_PARALLEL, "data_degree": 2, "ulysses_degree": 2}, "strategy",
         "context_parallel does not use data_degree 2; those degrees stay 1"),
        ({"strategy": Strategy.TENSOR_PARALLEL, "cfg_degree": 2, "tp_degree": 2}, "strategy",
         "does not use cfg_degree 2"),
        ({"strategy": Strategy.DATA_PARALLEL, "data_degree": 2}, "strategy",
         "data_parallel lays out data 2 = 2 ranks, but the backend has 4"),
        ({"strategy": Strategy.CFG_PARALLEL, "ulysses_degree": 2}, "strategy", "cfg_degree is 2, not 1"),
        ({"strategy": Strategy.CFG_PARALLEL, "cfg_degree": 4}, "strategy", "cfg_degree is 2, not 4"),
        ({"strategy": Strategy.CFG_PARALLEL, "cfg_degree": 2, "anything": True}, "ulysses_degree",
         "make the product 2"),
        ({"strategy": Strategy.DEVICE_MAP, "attention_backend": "native"}, "strategy",
         "device_map does not split the tokens"),
    ],
)  # fmt: skip
def test_a_plan_made_by_hand_is_checked_too(fields, widget, hint):
    """What the widgets cannot produce, a plan built directly or read from the wire can: the constructor refuses it."""
    with pytest.raises(InvalidInput, match=hint) as info:
        StrategyPlan(ranks=4, transformer=FACTS, **fields)
    assert info.value.widget == widget
