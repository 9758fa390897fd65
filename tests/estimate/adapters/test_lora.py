"""The LoRA/QLoRA estimate (issue 12) against definitions: what trains gets gradients and optimizer
states, bitsandbytes' storage of the base, and the adapters' activations by device."""

from __future__ import annotations

import pytest

from zeroplan.estimate import estimate
from zeroplan.estimate.model.layout import param_layout
from zeroplan.estimate.adapters.lora import adapter_params, quantized_weight_bytes
from zeroplan.estimate.result import Phase, Step
from zeroplan.importers.catalog import resolve_model
from zeroplan.spec.lora import LoraSpec, QuantSpec
from zeroplan.spec.training import TrainingSpec

LLAMA = resolve_model("tiny-llama")
ALL = LoraSpec(rank=8, targets=("all-linear",))


def _phase(result, step: Step, name: Phase):
    return next(p for p in result.phases if p.step == step and p.phase == name).categories


def test_ddp_buckets_and_adam_states_cover_the_adapters_only():
    training = TrainingSpec(engine="torch", gpus=2, precision="fp32", lora=ALL)
    result = estimate(LLAMA, training)
    trainable = adapter_params(LLAMA, ALL)
    assert result.model.trainable_params == trainable
    init = _phase(result, Step.FIRST, Phase.INIT)
    assert init.buffers == trainable * 4  # reducer.cpp buckets: one fp32 gradient per trainable parameter
    step = _phase(result, Step.STEADY, Phase.OPTIMIZER_STEP)
    assert step.optimizer_states == 2 * trainable * 4  # AdamW exp_avg and exp_avg_sq
    assert step.grads == trainable * 4


def test_nf4_base_is_stored_as_bitsandbytes_packs_it():
    quant = QuantSpec(base_precision="nf4", double_quant=True)
    training = TrainingSpec(engine="torch", lora=ALL, quant=quant)
    result = estimate(LLAMA, training)
    layout = param_layout(LLAMA)
    linears = [t for t in layout.block if t.name.endswith("proj.weight")]
    quantized = LLAMA.num_layers * sum(quantized_weight_bytes(t.numel, t.rows, quant) for t in linears)
    rest = (layout.total_params - LLAMA.num_layers * sum(t.numel for t in linears)) * 2  # bf16 compute dtype
    adapters = adapter_params(LLAMA, ALL) * 4  # PEFT keeps adapters fp32 (autocast_adapter_dtype)
    assert _phase(result, Step.FIRST, Phase.INIT).params == quantized + rest + adapters
    assert result.param_parts.base_bytes == quantized + rest
    assert result.param_parts.adapter_bytes == adapters


def test_a_quantized_layer_holds_its_dequantized_weight_only_inside_its_own_op():
    from zeroplan.estimate.activations.transformer import activation_bytes
    from zeroplan.estimate.adapters.lora import lora_activations

    def acts(base: str, micro_batch: int, seq_len: int):
        training = TrainingSpec(engine="torch", lora=ALL, quant=QuantSpec(base_precision=base),
                                micro_batch=micro_batch, seq_len=seq_len)
        return lora_activations(activation_bytes(LLAMA, training, 2), LLAMA, training, 2)

    h, inner = LLAMA.hidden_size, LLAMA.intermediate_size
    weight = h * inner * 2  # the largest linear (gate/up/down), dequantize_4bit to bf16 (MatMul4Bit)
    # forward: the largest layer's moment, its dequantized weight and its output, against the residual add's
    tokens = 256
    assert acts("nf4", 2, 128).block_forward_transient == max(acts("bf16", 2, 128).block_forward_transient,
                                                              weight + tokens * 2 * inner)
    # backward: down_proj's moment (weight, its input's gradient, the product still saved) against the
    # product's backward (product freed, two more gradients): the weight wins only below inner tokens
    assert acts("nf4", 2, 128).block_backward_transient == acts("bf16", 2, 128).block_backward_transient
    assert (acts("nf4", 1, 16).block_backward_transient - acts("bf16", 1, 16).block_backward_transient
            == weight - 16 * 2 * inner)


def test_adapter_dropout_keeps_a_bool_mask_on_cuda_and_a_full_tensor_on_cpu():
    def forward_activations(device: str) -> int:
        lora = LoraSpec(rank=8, targets=("all-linear",), dropout=0.1)
        training = TrainingSpec(engine="torch", precision="fp32", device=device, lora=lora)
        return _phase(estimate(LLAMA, training), Step.STEADY, Phase.FORWARD).activations

    tokens = 2048
    inputs = sum(t.numel // t.rows for t in param_layout(LLAMA).block if t.name.endswith("proj.weight"))
    # aten Dropout.cpp: native_dropout's 1-byte mask on CUDA, the fp32 noise tensor on CPU; none for the
    # first block's q, k and v, whose input needs no gradient (frozen embeddings, no input-gradient hook)
    first_block_qkv = 3 * LLAMA.hidden_size
    assert (forward_activations("cpu") - forward_activations("cuda")
            == tokens * (LLAMA.num_layers * inputs - first_block_qkv) * (4 - 1))


def test_frozen_base_keeps_fewer_activations_than_full_training():
    full = estimate(LLAMA, TrainingSpec(engine="torch", precision="fp32"))
    lora = estimate(LLAMA, TrainingSpec(engine="torch", precision="fp32",
                                        lora=LoraSpec(rank=8, targets=("q_proj", "v_proj"))))
    # gate/up/down and o_proj are frozen: down_proj's input (the MLP product) is no longer kept
    tokens, inner = 2048, LLAMA.intermediate_size
    saved = _phase(full, Step.STEADY, Phase.FORWARD).activations - _phase(lora, Step.STEADY, Phase.FORWARD).activations
    rank_outputs = 2 * 8 * 4  # A's output kept by B, for q and v
    h = LLAMA.hidden_size
    # LlamaRMSNorm's `weight * normalized` keeps `normalized` for the frozen weight's gradient only: two per block
    per_block = 4 * inner + 4 * h - rank_outputs + 2 * 4 * h
    # outside the blocks: the token ids (frozen embedding), the first norm's fp32 input and rsqrt (nothing
    # upstream of the first adapter needs a gradient), the final norm's normalized tensor and the frozen head's input
    outside = 8 + 4 * h + 4 + 4 * h + 4 * h
    assert saved == LLAMA.num_layers * tokens * per_block + tokens * outside


@pytest.mark.parametrize("recipe, element", [
    ("plain", 2),  # adapters made inside zero.Init: bf16 like the base
    ("hf-trainer", 4),  # get_peft_model after the zero.Init build: DeepSpeed leaves them fp32 (estimate/adapters/trainer.py)
])
def test_zero3_keeps_adapters_whole_under_the_persistence_threshold(recipe, element):
    training = TrainingSpec(engine="deepspeed", zero_stage=3, gpus=4, lora=ALL, recipe=recipe)
    result = estimate(LLAMA, training)
    # every adapter of tiny-llama is under 1e5 elements: partition + the whole tensor
    trainable = adapter_params(LLAMA, ALL)
    per_rank = sum(-(-t.numel // 4) for t in [t for t in _lora_tensors()]) * LLAMA.num_layers
    assert result.param_parts.adapter_bytes == element * (per_rank + trainable)


def _lora_tensors():
    from zeroplan.estimate.adapters.lora import lora_layout

    return [t for t in lora_layout(LLAMA, ALL).block if not t.frozen]


def test_full_checkpointing_keeps_block_inputs_only_whatever_trains():
    from zeroplan.estimate.activations.transformer import activation_bytes
    from zeroplan.estimate.adapters.lora import lora_activations

    training = TrainingSpec(engine="torch", precision="fp32", checkpointing="full", lora=ALL)
    whole = activation_bytes(LLAMA, training, 4)
    adapted = lora_activations(whole, LLAMA, training, 4)
    tokens, h = 2048, LLAMA.hidden_size
    # torch.utils.checkpoint keeps each block's input: the adapters change what is recomputed, not what is kept
    assert adapted.saved_per_block == whole.saved_per_block
    # the frozen embedding keeps no token ids; PEFT's input-gradient hook keeps the first norm's tensors
    assert whole.embedding - adapted.embedding == tokens * 8
    # the final RMSNorm keeps no normalized tensor and the frozen head no input (fp32, h each)
    assert whole.final_norm - adapted.final_norm == tokens * (4 * h + 4 * h)


def test_prepare_model_for_kbit_training_upcasts_what_is_not_quantized():
    def params(upcast: bool) -> int:
        quant = QuantSpec(base_precision="nf4", upcast_non_quantized=upcast)
        return _phase(estimate(LLAMA, TrainingSpec(engine="torch", lora=ALL, quant=quant)), Step.FIRST, Phase.INIT).params

    layout = param_layout(LLAMA)
    unquantized = layout.total_params - LLAMA.num_layers * sum(t.numel for t in layout.block if t.name.endswith("proj.weight"))
    assert params(True) - params(False) == unquantized * (4 - 2)  # bf16 -> fp32
