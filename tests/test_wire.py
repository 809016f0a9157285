"""The typed wire without a backend: every op's arguments survive the serialiser, a bad field is refused by name, plans
are re-checked when rebuilt, sealed records refuse tampering, and control frames check every field."""

from __future__ import annotations

import dataclasses
import json

import pytest

from parallel_runtime import wire
from parallel_runtime.arena import TORCH_DTYPES
from parallel_runtime.jobs import DTYPE_OPTIONS
from parallel_runtime.protocol import BadFrame, Call, Progress, decode_frame, encode_frame
from parallel_runtime.sealed import Sealer, Tampered
from parallel_runtime.serial import WireError, from_json, to_json
from parallel_runtime.strategy import Strategy, StrategyPlan, TransformerFacts
from parallel_runtime.wire import DenoiseArgs, Dtype, ModelRef, Sampling, TransformerSpec
from parallel_runtime.worker import rank  # noqa: F401  (registers every op the ranks serve)
from parallel_runtime.worker.ops import REGISTRY

FACTS = TransformerFacts("FluxTransformer2DModel", heads=4, has_cp_plan=True, has_tp_plan=True)
PLAN = StrategyPlan(Strategy.TP_CP, ranks=4, transformer=FACTS, ulysses_degree=2, tp_degree=2)
MODEL = ModelRef("org/FLUX.1-dev", "/models/org/FLUX.1-dev", "flux")
LORA = wire.LoraRef("style.safetensors", "/loras/style.safetensors", -0.75, "9f" * 32)
DENOISE = DenoiseArgs(
    transformer=TransformerSpec(
        MODEL,
        Dtype.BFLOAT16,
        PLAN,
        {"0": "16GB", "cpu": "64GB"},
        loras=(LORA, dataclasses.replace(LORA, name="b.sft", path="/loras/b.sft", strength=1.5)),
        lora_mode=wire.LoraMode.FUSED,
        cache=wire.StepCache(wire.CacheMode.FIRST_BLOCK_CACHE, 0.12),
        weights=wire.Weights.AS_DTYPE,
    ),
    sampling=Sampling(
        seed=2**64 - 1,
        steps=4,
        guidance_scale=3.5,
        width=64,
        height=48,
        batch_size=2,
        true_cfg_scale=4.0,
        denoise=0.6,
        sampler=wire.Sampler.LCM,
        scheduler=wire.Scheduler.KARRAS,
    ),
)
CACHE = wire.CacheReport(wire.CacheMode.TAYLORSEER, passes=(True, False, True), blocks=57)
MEMORY = wire.Memory("cuda", 80 << 30, 60 << 30, allocated_bytes=12 << 30, peak_bytes=19 << 30)
# Every op's arguments and result, with values as the client and the ranks make them (no field left at a default it
# would have in a real call without reason).
EXAMPLES: dict[type, tuple[object, object]] = {
    wire.EncodeArgs: (
        wire.EncodeArgs(
            MODEL,
            Dtype.BFLOAT16,
            wire.Prompts(("a fox", "ein Fuchs"), ("a fox, detailed", "ein Fuchs"), ("blurry", "blurry"), 77),
            max_memory={"0": "20GB", "1": "20GB"},
        ),
        wire.EncodeResult({"prompt_embeds": (2, 512, 4096), "pooled_prompt_embeds": (2, 768)}),
    ),
    DenoiseArgs: (
        DENOISE,
        wire.DenoiseResult(
            (2, 16, 6, 8),
            cache=CACHE,
            compile=wire.CompileReport("inductor", first=False, graphs=2, reasons=("tensor 'x' size mismatch",)),
            split=wire.BatchSplit((3, 1), speeds=(2.5, 0.8), source="measured"),
            devices=("NVIDIA H200", "NVIDIA L40S"),
        ),
    ),
    wire.DecodeArgs: (
        wire.DecodeArgs(MODEL, "cuda:1", Dtype.FLOAT16, over_ranks=True),
        wire.DecodeResult((2, 48, 64, 3), tiles_per_rank=(3, 3, 2, 2), peak_bytes_per_rank=(1 << 30, 9 << 28)),
    ),
    wire.VaeEncodeArgs: (wire.VaeEncodeArgs(MODEL, "cpu", Dtype.FLOAT32), wire.VaeEncodeResult((1, 16, 6, 8))),
    wire.FreeArgs: (wire.FreeArgs(("text_encoders", "vae")), wire.FreeResult(("text_encoders",))),
    wire.StatusArgs: (
        wire.StatusArgs(),
        wire.RankStatus(
            rank=1,
            local_rank=1,
            world_size=4,
            hostname="gpu-box",
            pid=4242,
            device="cuda:1",
            device_name="NVIDIA H200",
            memory=MEMORY,
            resident=(
                wire.ResidentModel(
                    model="org/FLUX.1-dev",
                    component="transformer",
                    placement="tp_cp ranks=4 ulysses=2 tp=2",
                    dtype="bfloat16",
                    parameter_bytes=12 << 30,
                    parallelism={"tp_degree": 2, "ulysses_degree": 2},
                    load_seconds=41.5,
                ),
            ),
            load_counts={"transformer": 1},
            torch="2.14.1",
            gpus=("GPU-1234",),
            last_cache=CACHE,
            last_passes=8,
        ),
    ),
    wire.AllreduceArgs: (wire.AllreduceArgs(), wire.AllreduceResult(10)),
    wire.EchoArgs: (wire.EchoArgs(), wire.EchoResult(3)),
    wire.StepsArgs: (wire.StepsArgs(steps=3, seconds_per_step=0.25), wire.StepsResult(3)),
    wire.PeersArgs: (
        wire.PeersArgs(nbytes=1 << 20),
        wire.PeersResult(
            (
                wire.PeerCopy(0, 1, "collective", True, 0.002, 1 << 20),
                wire.PeerCopy(0, 1, "copy", False, 5.0, 1 << 20, peer_access=True, error="timed out"),
            )
        ),
    ),
    wire.ArmFaultArgs: (wire.ArmFaultArgs(1, wire.Fault.LOAD_OUT_OF_MEMORY), wire.ArmFaultResult()),
    wire.FailArgs: (wire.FailArgs(rank=1, how=wire.FailMode.HANG_SILENT), wire.FailResult()),
    wire.OutputArgs: (wire.OutputArgs(nbytes=96 << 20), wire.OutputResult(96 << 20)),
}


def _round_trip(value):
    return from_json(type(value), json.loads(json.dumps(to_json(value))))


def test_every_op_is_served_by_one_registered_function():
    """The ops are the wire's ``OpArgs`` types: each has a function on the ranks, registered under its own name."""
    ops = set(wire.OpArgs.__subclasses__())
    assert {registered.args for registered in REGISTRY.values()} == ops
    assert all(REGISTRY[kind.op].args is kind for kind in ops)


@pytest.mark.parametrize("kind", sorted(wire.OpArgs.__subclasses__(), key=lambda kind: kind.op), ids=lambda k: k.op)
def test_every_op_has_arguments_and_a_result_that_round_trip(kind):
    args, result = EXAMPLES[kind]  # a new op needs its example here
    assert type(args) is kind and type(result) is kind.result
    assert _round_trip(args) == args and _round_trip(result) == result


def test_the_dtype_names_are_the_wires():
    """One vocabulary: the weights' dtypes are tensor dtypes of the wire, torch's are looked up by those names, and the
    dtype widgets offer the weights' dtypes after ``auto``."""
    assert {d.value for d in Dtype} <= set(wire.TENSOR_DTYPES)
    assert tuple(TORCH_DTYPES) == wire.TENSOR_DTYPES
    assert all(str(torch_dtype) == f"torch.{name}" for name, torch_dtype in TORCH_DTYPES.items())
    assert DTYPE_OPTIONS == ("auto", *(d.value for d in Dtype))


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
