"""The planner's all-gathers of a 4-bit base under FSDP2 and ZeRO-3, against their definition.

bitsandbytes 0.50.2 functional.py `quantize_4bit` packs two 4-bit values per byte (viewed as
`quant_storage`); FSDP2's `fully_shard` and DeepSpeed ZeRO-3 shard and all-gather that packed
parameter, and `Params4bit.__torch_function__` gives every chunk the whole QuantState, so the state
is on every rank and never gathered. The ZeRO paper (section 7): stage 3 gathers every parameter in
forward and in backward; ring collectives send (N-1)/N of it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from zeroplan.estimate.model.facts import model_facts
from zeroplan.estimate.model.layout import param_layout
from zeroplan.estimate.adapters.lora import adapter_params
from zeroplan.importers.catalog import resolve_model
from zeroplan.importers.gpus import get_gpu
from zeroplan.plan.cost import assumptions_for, gathered_params, model_flops, step_cost_model
from zeroplan.spec.lora import LoraSpec, QuantSpec
from zeroplan.spec.training import TrainingSpec

LLAMA = resolve_model("tiny-llama")
ALL = LoraSpec(rank=8, targets=("all-linear",))
ASSUMPTIONS = assumptions_for(get_gpu("h100-80gb"))


def _gathered_bytes_by_definition(storage_bytes: int) -> int:
    """Packed 4-bit block weights (numel / 2 bytes), everything else at bf16, adapters included."""
    layout = param_layout(LLAMA)
    quantized = [t for t in layout.block if t.name.endswith("proj.weight")]
    packed = LLAMA.num_layers * sum(-(-t.numel // (2 * storage_bytes)) * storage_bytes for t in quantized)
    rest = layout.total_params - LLAMA.num_layers * sum(t.numel for t in quantized) + adapter_params(LLAMA, ALL)
    return packed + 2 * rest


@pytest.mark.parametrize(("engine", "storage"), [("fsdp2", "uint8"), ("fsdp2", "bf16"), ("deepspeed", "bf16")])
def test_a_4bit_base_is_gathered_as_its_packed_storage(engine, storage):
    training = TrainingSpec(engine=engine, zero_stage=3, gpus=4, precision="bf16", lora=ALL,
                            quant=QuantSpec(base_precision="nf4", quant_storage=storage))
    storage_bytes = 1 if storage == "uint8" else 2
    assert 2 * gathered_params(model_facts(LLAMA, training)) == _gathered_bytes_by_definition(storage_bytes)


def test_stage_3_communication_gathers_the_packed_base_twice_and_reduces_the_adapters_once():
    n = 4
    training = TrainingSpec(engine="fsdp2", zero_stage=3, gpus=n, precision="bf16", lora=ALL,
                            quant=QuantSpec(base_precision="nf4"))
    facts = model_facts(LLAMA, training)
    flops = model_flops(LLAMA, facts.total_params, facts.trainable_params)
    packed = step_cost_model(replace(flops, gathered_params=gathered_params(facts)), training, ASSUMPTIONS)
    ring = (n - 1) / n
    bytes_moved = ring * (2 * _gathered_bytes_by_definition(1) + 2 * adapter_params(LLAMA, ALL))
    assert packed.per_micro_parts[0] == pytest.approx(bytes_moved / ASSUMPTIONS.intra_node_bytes_per_s)


def test_a_16bit_base_gathers_every_parameter_at_its_width():
    training = TrainingSpec(engine="fsdp2", zero_stage=3, gpus=4, precision="bf16", lora=ALL)
    facts = model_facts(LLAMA, training)
    assert gathered_params(facts) == facts.total_params
