"""LoRA and QLoRA measured for real on 2 gloo ranks (tiny-llama, seconds each): the accounting's
split of the parameters into base and adapter bytes, against what the engines keep by definition
(DDP: every parameter whole on every rank; FSDP2: each parameter's rows split evenly over the ranks)."""

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

from zeroplan.importers.catalog import resolve_model  # noqa: E402
from zeroplan.measure.launcher import run_measurement  # noqa: E402
from zeroplan.spec.training import TrainingSpec  # noqa: E402

pytestmark = pytest.mark.distributed

ADAPTER_PARAMS = 37_376  # rank 8 on tiny-llama's 14 linear layers: 8 x (in + out) each (tests/measure/programs/test_peft_model.py)
MODEL_PARAMS = 500_352  # tiny-llama without adapters


def _steady_split(result) -> list[dict[str, int]]:
    return [next(row for row in rank["summary"] if row["step"] == "steady" and row["phase"] == rank_peak_phase(rank))
            ["params_split"] for rank in result.to_json_dict()["ranks"]]


def rank_peak_phase(rank: dict) -> str:
    steady = [row for row in rank["summary"] if row["step"] == "steady"]
    return max(steady, key=lambda row: row["peak_bytes"])["phase"]


def test_ddp_keeps_the_whole_fp32_base_and_adapters_on_every_rank():
    training = TrainingSpec(engine="torch", zero_stage=0, gpus=2, device="cpu", precision="fp32", recipe="plain",
                            micro_batch=2, seq_len=64, lora={"rank": 8, "targets": ["all-linear"]})
    result = run_measurement(resolve_model("tiny-llama"), training, nproc=2, steps=2, timeout_s=240)
    assert "+peft-" in result.implementation
    for split in _steady_split(result):
        assert split == {"base": 4 * MODEL_PARAMS, "adapter": 4 * ADAPTER_PARAMS}


def test_fsdp2_shards_an_nf4_base_and_the_adapters():
    pytest.importorskip("bitsandbytes")
    training = TrainingSpec(engine="fsdp2", zero_stage=3, gpus=2, device="cpu", precision="bf16", recipe="plain",
                            micro_batch=2, seq_len=64, model_init="host", lora={"rank": 8, "targets": ["all-linear"]},
                            quant={"base_precision": "nf4", "compute_dtype": "bf16", "quant_storage": "bf16"})
    result = run_measurement(resolve_model("tiny-llama"), training, nproc=2, steps=2, timeout_s=240)
    assert "+bitsandbytes-" in result.implementation
    for split in _steady_split(result):
        # fp32 adapters, each split in two (every dimension here is even)
        assert split["adapter"] == 4 * ADAPTER_PARAMS // 2
        # less than half the bf16 base: the linear weights are packed two per byte
        assert 0 < split["base"] < 2 * MODEL_PARAMS // 2
