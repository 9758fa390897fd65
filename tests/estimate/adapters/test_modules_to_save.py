"""modules_to_save under the torch engine against PEFT's definition: `ModulesToSaveWrapper`
(peft 0.21.2 peft/utils/other.py) deep-copies the original module, so the trained copy is in the
base's dtype; autocast casts inputs, not parameters, so the optimizer steps that tensor itself: its
.grad (and DDP's bucket for it) and its AdamW states (torch/optim/adam.py `zeros_like(p)`) are in
that dtype too, with no fp32 master."""

from __future__ import annotations

from zeroplan.estimate import estimate
from zeroplan.estimate.adapters.lora import adapter_params
from zeroplan.estimate.result import Phase, Step
from zeroplan.importers.catalog import resolve_model
from zeroplan.spec.lora import LoraSpec, QuantSpec
from zeroplan.spec.training import TrainingSpec

LLAMA = resolve_model("tiny-llama")
SAVED_HEAD = LoraSpec(rank=8, targets=("q_proj", "v_proj"), modules_to_save=("lm_head",))


def _step(result):
    return next(p for p in result.phases if p.step == Step.STEADY and p.phase == Phase.OPTIMIZER_STEP).categories


def test_a_saved_head_on_a_bf16_base_trains_in_bf16_beside_fp32_adapters():
    head = LLAMA.vocab_size * LLAMA.hidden_size
    adapters = adapter_params(LLAMA, SAVED_HEAD) - head
    training = TrainingSpec(engine="torch", gpus=2, precision="bf16", lora=SAVED_HEAD, quant=QuantSpec(base_precision="bf16"))
    result = estimate(LLAMA, training)
    step = _step(result)
    trained = adapters * 4 + head * 2  # fp32 adapters (autocast_adapter_dtype), the bf16 copy
    assert result.param_parts.adapter_bytes == trained
    assert step.grads == trained
    assert step.buffers == trained  # DDP reducer buckets: one per dtype, each gradient in its own
    assert step.optimizer_states == 2 * trained  # exp_avg and exp_avg_sq like each parameter


def test_copies_already_in_the_engines_fp32_are_unchanged():
    fp32 = TrainingSpec(engine="torch", lora=SAVED_HEAD, quant=QuantSpec(base_precision="fp32"))
    upcast = TrainingSpec(engine="torch", lora=SAVED_HEAD,
                          quant=QuantSpec(base_precision="nf4", upcast_non_quantized=True))
    for training in (fp32, upcast):  # prepare_model_for_kbit_training casts the head to fp32 before the copy
        result = estimate(LLAMA, training)
        assert result.param_parts.adapter_bytes == adapter_params(LLAMA, SAVED_HEAD) * 4
        assert not any("modules_to_save" in note for note in result.notes)
