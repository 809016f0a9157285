"""The typed wire without a backend: every op's arguments survive the serialiser, a bad field is refused by name, plans
are re-checked when rebuilt, sealed records refuse tampering, and control frames check every field."""

from __future__ import annotations

import dataclasses
import json

import pytest

from parallel_runtime.protocol import BadFrame, Call, Progress, decode_frame, encode_frame
from parallel_runtime.sealed import Sealer, Tampered
from parallel_runtime.serial import WireError, from_json, to_json
from parallel_runtime.strategy import Strategy, StrategyPlan, TransformerFacts
from parallel_runtime.wire import OPS, DenoiseArgs, Dtype, ModelRef, Sampling, TransformerSpec

FACTS = TransformerFacts("FluxTransformer2DModel", heads=4, has_cp_plan=True, has_tp_plan=True)
PLAN = StrategyPlan(Strategy.TP_CP, ranks=4, transformer=FACTS, ulysses_degree=2, tp_degree=2)
DENOISE = DenoiseArgs(
    transformer=TransformerSpec(ModelRef("tiny", "/models/tiny", "flux"), Dtype.FLOAT32, PLAN, {"0": "16GB"}),
    sampling=Sampling(seed=2**64 - 1, steps=4, guidance_scale=3.5, width=64, height=48, batch_size=2),
)


def test_every_op_has_arguments_and_a_result_that_round_trip():
    for name, kind in OPS.items():
        assert kind.op == name and dataclasses.is_dataclass(kind.result)
        defaults = kind() if all(f.default is not dataclasses.MISSING for f in dataclasses.fields(kind)) else None
        if defaults is not None:
            assert from_json(kind, json.loads(json.dumps(to_json(defaults)))) == defaults
    assert from_json(DenoiseArgs, json.loads(json.dumps(to_json(DENOISE)))) == DENOISE


@pytest.mark.parametrize("change, where", [
    (lambda d: d["sampling"].pop("steps"), "DenoiseArgs.sampling: missing field 'steps'"),
    (lambda d: d["sampling"].update(steps="ten"), "DenoiseArgs.sampling.steps: expected a whole number"),
    (lambda d: d["sampling"].update(steps=True), "DenoiseArgs.sampling.steps: expected a whole number"),
    (lambda d: d["sampling"].update(stepz=4), "unknown field 'stepz'"),
    (lambda d: d["transformer"].update(dtype="float8"), "DenoiseArgs.transformer.dtype: expected one of"),
    (lambda d: d["transformer"]["plan"].update(strategy="magic"),
     "DenoiseArgs.transformer.plan.strategy: expected one of"),
    (lambda d: d["transformer"].update(max_memory=["0:16GB"]), "DenoiseArgs.transformer.max_memory"),
    (lambda d: d["sampling"].update(guidance_scale="NaN"), "guidance_scale: expected a finite number"),
])  # fmt: skip
def test_a_bad_field_is_refused_by_its_path(change, where):
    data = json.loads(json.dumps(to_json(DENOISE)))
    change(data)
    with pytest.raises(WireError, match=where.replace("(", r"\(")):
        from_json(DenoiseArgs, data)


def test_a_plan_is_checked_again_when_it_is_rebuilt():
    """A plan that does not fit its ranks cannot be smuggled across the wire: its constructor runs on the ranks too."""
    data = to_json(PLAN)
    data["ulysses_degree"] = 3
    with pytest.raises(WireError, match="ulysses_degree: ring_degree × ulysses_degree = 1 × 3"):
        from_json(StrategyPlan, data)


def test_sealed_records_refuse_tampering_and_moving():
    sealer = Sealer("s" * 64)
    record = sealer.seal("op/7", b'{"op": "encode", "args": {"prompts": ["a secret fox"]}}')
    assert b"secret" not in record and b"encode" not in record
    assert sealer.open("op/7", record).endswith(b'["a secret fox"]}}')
    flipped = record[:-1] + bytes([record[-1] ^ 1])
    for bad, context in ((flipped, "op/7"), (record, "op/8"), (b'{"op": "fail"}', "op/7")):
        with pytest.raises(Tampered):
            sealer.open(context, bad)
    with pytest.raises(Tampered):
        Sealer("t" * 64).open("op/7", record)


def test_frames_round_trip_and_a_bad_one_keeps_its_id():
    call = Call(id="c1", op="steps", args={"steps": 2}, tensors={})
    assert decode_frame(encode_frame(call)) == call
    assert decode_frame(encode_frame(Progress(id="c1", step=1, total=2))) == Progress(id="c1", step=1, total=2)
    with pytest.raises(BadFrame) as e:
        decode_frame(json.dumps({"type": "call", "id": "c9", "op": "steps", "args": {}, "tensors": []}).encode())
    assert e.value.call_id == "c9" and "tensors" in str(e.value)
