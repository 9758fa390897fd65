"""A 4-bit base under the sharding engines (FSDP2, DeepSpeed ZeRO-3): they shard and gather the
parameter bitsandbytes stores, the packed storage, not the weight it dequantizes to.

Definitions: bitsandbytes 0.50.2 functional.py `quantize_4bit` packs two 4-bit values per byte and
views them as `quant_storage` (bf16: numel/4 elements); nn/modules.py `Params4bit.__torch_function__`
gives every `torch.chunk` of it the whole QuantState; torch's `fully_shard` chunks each parameter on
dim 0 and all-gathers the chunks in param_dtype (bf16 here, the storage's own dtype)."""

from __future__ import annotations

from zeroplan.estimate import estimate
from zeroplan.estimate.engines import fsdp2
from zeroplan.estimate.engines.common import setup_of
from zeroplan.estimate.model.facts import model_facts
from zeroplan.estimate.model.layout import param_layout
from zeroplan.estimate.adapters.lora import adapter_params
from zeroplan.importers.catalog import resolve_model
from zeroplan.spec.lora import LoraSpec, QuantSpec
from zeroplan.spec.training import TrainingSpec

LLAMA = resolve_model("tiny-llama")
ALL = LoraSpec(rank=8, targets=("all-linear",))
NF4_BF16 = QuantSpec(base_precision="nf4", quant_storage="bf16")


def _quantized(tensors) -> list:
    return [t for t in tensors if t.name.endswith("proj.weight")]


def test_a_sharding_engine_sees_each_4bit_weight_as_numel_over_4_bf16_elements():
    whole = {t.name: t.numel for t in _quantized(param_layout(LLAMA).block)}
    for engine, stage in (("fsdp2", 3), ("deepspeed", 3)):
        facts = model_facts(LLAMA, TrainingSpec(engine=engine, zero_stage=stage, gpus=2, lora=ALL, quant=NF4_BF16))
        block = next(g for g in facts.groups if g.role == "block")
        seen = {t.name: (t.numel, t.rows) for t in block.tensors if t.name in whole}
        assert seen == {name: (numel // 4, numel // 4) for name, numel in whole.items()}  # (packed, 1) tensors
        # the parameter count is still the model's
        assert facts.total_params == param_layout(LLAMA).total_params + adapter_params(LLAMA, ALL)


def test_fsdp2_all_gathers_a_quantized_block_at_its_packed_size():
    n = 2
    training = TrainingSpec(engine="fsdp2", zero_stage=3, gpus=n, lora=ALL, quant=NF4_BF16)
    sizes = fsdp2._sizes(model_facts(LLAMA, training), setup_of(training))
    block = param_layout(LLAMA).block
    packed = sum(t.numel // 2 for t in _quantized(block))  # two 4-bit values per byte
    rest = sum(t.numel for t in block if t not in _quantized(block)) * 2  # norms in bf16
    adapters = adapter_params(LLAMA, ALL) // LLAMA.num_layers * 2  # gathered in param_dtype bf16
    assert sizes.block_gathered == packed + rest + adapters


def test_each_rank_holds_a_shard_of_the_packed_weights_and_their_whole_quant_state():
    n = 2
    training = TrainingSpec(engine="fsdp2", zero_stage=3, gpus=n, lora=ALL, quant=NF4_BF16)
    layout = param_layout(LLAMA)
    quantized = _quantized(layout.block)
    packed = sum(t.numel // 2 for t in quantized) // n
    # one fp32 absmax per 64 values and the state's own 16-value fp32 nf4 code (functional.py quantize_4bit), on every rank
    absmax = sum(4 * t.numel // 64 + 4 * 16 for t in quantized)
    rest = (layout.total_params - LLAMA.num_layers * sum(t.numel for t in quantized)) * 2 // n  # bf16 shards
    assert estimate(LLAMA, training).param_parts.base_bytes == LLAMA.num_layers * (packed + absmax) + rest


def test_the_gathered_block_no_longer_carries_an_overestimate_note():
    training = TrainingSpec(engine="deepspeed", zero_stage=3, gpus=2, lora=ALL, quant=NF4_BF16)
    notes = " ".join(estimate(LLAMA, training).notes)
    assert "overestimate" not in notes
    assert "packed bf16 storage" in notes


def test_deepspeed_zero3_compares_the_packed_count_with_its_persistence_threshold():
    # parameter_offload.py mark_persistent_parameters: ds_numel <= stage3_param_persistence_threshold
    # stays gathered on every rank, on top of its partition; a packed weight's ds_numel is numel/4
    n, threshold = 2, 11_264
    layout = param_layout(LLAMA)
    quantized = _quantized(layout.block)
    assert all(t.numel // 4 <= threshold for t in quantized)
    assert any(t.numel > threshold for t in quantized)  # q, o and the MLP persist only as packed storage
    training = TrainingSpec(engine="deepspeed", zero_stage=3, gpus=n, lora=ALL, quant=NF4_BF16,
                            deepspeed={"stage3_param_persistence_threshold": threshold})
    packed = sum(t.numel // 2 for t in quantized)
    absmax = sum(4 * t.numel // 64 + 4 * 16 for t in quantized)  # absmax and the state's own nf4 code
    norms = sum(t.numel for t in layout.block if t not in quantized) * 2  # bf16, under the threshold too
    # the embeddings and head (65,536 elements) partitioned, the final norm whole as well
    outside = sum(t.numel * 2 // n + (t.numel * 2 if t.numel <= threshold else 0) for t in layout.embedding + layout.final)
    per_block = packed // n + packed + absmax + norms // n + norms
    assert estimate(LLAMA, training).param_parts.base_bytes == LLAMA.num_layers * per_block + outside


def test_fsdp2_shards_uint8_packed_storage_as_bytes():
    # torch 2.13 _fsdp_param.py init_dtype_attrs: a non-float parameter gets no param_dtype cast;
    # _fsdp_collectives.py: a unit of mixed dtypes is all-gathered as a uint8 view, so the packed
    # weight moves as its own n/2 bytes and each rank keeps ceil(n/2 / N) of them
    n = 2
    training = TrainingSpec(engine="fsdp2", zero_stage=3, gpus=n, lora=ALL, quant=QuantSpec(base_precision="nf4"))
    layout = param_layout(LLAMA)
    quantized = _quantized(layout.block)
    block = layout.block
    packed = sum(t.numel // 2 for t in quantized)
    rest = sum(t.numel for t in block if t not in quantized) * 2  # norms in bf16
    adapters = adapter_params(LLAMA, ALL) // LLAMA.num_layers * 2
    assert fsdp2._sizes(model_facts(LLAMA, training), setup_of(training)).block_gathered == packed + rest + adapters
    state = sum(4 * t.numel // 64 + 4 * 16 for t in quantized)  # absmax and the nf4 code, whole on every rank
    others = (layout.total_params - LLAMA.num_layers * sum(t.numel for t in quantized)) * 2 // n  # bf16 shards
    assert estimate(LLAMA, training).param_parts.base_bytes == LLAMA.num_layers * (packed // n + state) + others
