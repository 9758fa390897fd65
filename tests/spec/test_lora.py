"""LoRA and quantized-base specs (issue 12): PEFT's defaults, adapter_config.json, and the combinations refused."""

from __future__ import annotations

import json

import pytest

from zeroplan.errors import SpecError
from zeroplan.spec.lora import BasePrecision, LoraSpec, QuantSpec, lora_spec_from_adapter_config
from zeroplan.spec.training import TrainingSpec


def _write(tmp_path, data) -> str:
    path = tmp_path / "adapter_config.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


def test_defaults_are_peft_defaults():
    # peft 0.21.2 LoraConfig: lora_dropout 0.0, use_dora False, bias "none", lora_bias False
    spec = LoraSpec(rank=8, targets=("q_proj", "v_proj"))
    assert (spec.dropout, spec.dora, spec.bias, spec.lora_bias, spec.modules_to_save) == (0.0, False, "none", False, ())


def test_reads_a_peft_adapter_config(tmp_path):
    # the keys PeftModel.save_pretrained writes for LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", ...)
    data = {"peft_type": "LORA", "peft_version": "0.21.2", "r": 16, "lora_alpha": 32, "lora_dropout": 0.05,
            "target_modules": "all-linear", "use_dora": True, "modules_to_save": ["lm_head"], "bias": "none",
            "task_type": "CAUSAL_LM", "base_model_name_or_path": "meta-llama/Meta-Llama-3-8B", "rank_pattern": {},
            "alpha_pattern": {}, "fan_in_fan_out": False, "inference_mode": False}
    spec = lora_spec_from_adapter_config(_write(tmp_path, data))
    assert spec == LoraSpec(rank=16, alpha=32, targets=("all-linear",), dropout=0.05, dora=True, modules_to_save=("lm_head",))


@pytest.mark.parametrize("data, message", [
    ("{not json", r"adapter_config.json: not JSON"),
    ({"r": 0, "target_modules": ["q_proj"]}, r"adapter_config.json: r: Input should be greater than or equal to 1"),
    ({"r": 8, "target_modules": ["q_proj"], "peft_version": "9.0.0"}, r"peft_version: unknown version '9.0.0'"),
    ({"r": 8, "target_modules": ["q_proj"], "peft_type": "IA3"}, r"peft_type: only LORA adapters"),
    ({"r": 8}, r"target_modules: missing"),
    ({"r": 8, "target_modules": ["q_proj"], "lora_rank": 3}, r"lora_rank: unknown key"),
    ({"r": 8, "target_modules": ["q_proj"], "rank_pattern": {"q_proj": 4}}, r"rank_pattern: not modelled"),
])
def test_bad_adapter_config_is_one_line_naming_the_field(tmp_path, data, message):
    with pytest.raises(SpecError, match=message) as caught:
        lora_spec_from_adapter_config(_write(tmp_path, data))
    assert "\n" not in str(caught.value)


def test_all_linear_stands_alone():
    with pytest.raises(ValueError, match="all-linear stands alone"):
        LoraSpec(rank=8, targets=("all-linear", "q_proj"))


def test_4bit_knobs_need_a_4bit_base():
    with pytest.raises(ValueError, match="double_quant applies to a 4-bit base"):
        QuantSpec(base_precision=BasePrecision.INT8, double_quant=True)
    with pytest.raises(ValueError, match="must be one of 32, 64"):
        QuantSpec(base_precision=BasePrecision.NF4, blocksize=48)


def test_sharding_a_uint8_packed_4bit_base_is_refused_by_deepspeed_zero3_only():
    changes = dict(engine="deepspeed", zero_stage=3, gpus=2)
    with pytest.raises(ValueError, match="quant_storage uint8: engine deepspeed at zero_stage 3"):
        TrainingSpec(**changes, lora=LoraSpec(rank=8, targets=("q_proj",)), quant=QuantSpec(base_precision="nf4"))
    TrainingSpec(**changes, lora=LoraSpec(rank=8, targets=("q_proj",)), quant=QuantSpec(base_precision="nf4", quant_storage="bf16"))
    # FSDP2 gathers a unit of mixed dtypes as bytes (torch 2.13 _fsdp_collectives.py); measured to run on CPU
    for stage in (2, 3):
        TrainingSpec(engine="fsdp2", zero_stage=stage, gpus=2, lora=LoraSpec(rank=8, targets=("q_proj",)),
                     quant=QuantSpec(base_precision="nf4"))


def test_quantized_base_needs_adapters():
    with pytest.raises(ValueError, match="a quantized base cannot train"):
        TrainingSpec(quant=QuantSpec(base_precision="nf4"))
