"""The checkpointed LoRA/QLoRA terms of issue 12 against per-tensor measurements and their sources.

The figures were measured on tiny-llama (2 x 128 tokens, 2 blocks) by running one step of the grid row's
program in process under a TorchDispatchMode that logs every live storage with the op that made it, and
reading the live set at the steady peak (docs/measure.md "Checkpointed LoRA rows, tensor by tensor")."""

from __future__ import annotations

from zeroplan.estimate.adapters.lora import _linears, kbit_activation_bytes, lora_layout, model_element_bytes
from zeroplan.estimate.adapters.int8 import int8_inputs
from zeroplan.estimate.adapters.recompute import recompute_dtypes, recompute_moment_bytes
from zeroplan.importers.catalog import resolve_model
from zeroplan.spec.lora import LoraSpec, QuantSpec
from zeroplan.spec.training import TrainingSpec

LLAMA = resolve_model("tiny-llama")
TOKENS = 2 * 128
R8 = LoraSpec(rank=8, targets=("all-linear",))
R64 = LoraSpec(rank=64, targets=("all-linear",))
NF4 = QuantSpec(base_precision="nf4", double_quant=True, compute_dtype="bf16")
INT8 = QuantSpec(base_precision="int8")


def test_nf4_recomputation_moment_is_the_measured_live_set():
    # qlora-r8 nf4 bf16 ckpt, no DDP: the rebuild stops at block 0's down_proj lora_B weight cast holding
    # the block output's gradient and lora_B's scaled gradient (2 x 65,536), the residual and the MLP's
    # input (2 x 65,536), the product (180,224), down_proj's cloned base output (65,536) and its fp32
    # copy for lora_A (360,448): 868,352 B beyond the block's rebuilt saved tensors
    dtypes = recompute_dtypes(NF4, autocast=True, comp=2, adapter=4, cuda=False, resid=2)
    assert recompute_moment_bytes(LLAMA, R8, lora_layout(LLAMA, R8), dtypes, TOKENS) == 868_352


def test_fp32_model_under_autocast_recomputation_moment_is_the_measured_live_set():
    # lora-r64 torch bf16 ckpt (an fp32 model under autocast): the block output's fp32 gradient (131,072),
    # its bf16 cast (65,536), lora_B's scaled gradient (65,536), the fp32 residual and MLP input
    # (2 x 131,072), the bf16 product (180,224), the base output (65,536) and the fp32 copy (360,448)
    dtypes = recompute_dtypes(None, autocast=True, comp=2, adapter=4, cuda=False, resid=4)
    assert recompute_moment_bytes(LLAMA, R64, lora_layout(LLAMA, R64), dtypes, TOKENS) == 1_130_496


def test_int8_layers_keep_their_inputs_outside_checkpointing():
    # MatMul8bitFp.forward `ctx.A = A`: measured per checkpointed block, the attention norm's output, the
    # SDPA output (o_proj's input), the MLP norm's output (65,536 each, bf16) and the product (180,224)
    inputs = int8_inputs(LLAMA, _linears(LLAMA), INT8, element=2)
    assert TOKENS * inputs.kept == 376_832
    assert int8_inputs(LLAMA, _linears(LLAMA), NF4, element=2).kept == 0


def test_bitsandbytes_lora_skips_the_cast_under_cuda_autocast_only():
    # peft lora/bnb.py: `requires_conversion = not torch.is_autocast_enabled()` (CUDA's autocast); lora/layer.py casts always
    assert not recompute_dtypes(NF4, autocast=True, comp=2, adapter=4, cuda=True, resid=2).cast_copy
    assert recompute_dtypes(NF4, autocast=True, comp=2, adapter=4, cuda=False, resid=2).cast_copy
    assert recompute_dtypes(None, autocast=True, comp=2, adapter=4, cuda=True, resid=4).cast_copy


def test_kbit_model_runs_in_its_compute_dtype_without_autocast():
    # measure/programs/peft_model.py base_dtype: a k-bit base is built in its compute dtype (bf16 by default)
    fp32_run = TrainingSpec(engine="torch", precision="fp32", lora=R8, quant=INT8)
    assert kbit_activation_bytes(fp32_run, 4) == 2
    assert model_element_bytes(INT8, autocast=False, comp=4) == 2
    upcast = QuantSpec(base_precision="nf4", compute_dtype="bf16", upcast_non_quantized=True)
    assert kbit_activation_bytes(TrainingSpec(engine="torch", precision="fp32", lora=R8, quant=upcast), 4) == 4
    assert kbit_activation_bytes(TrainingSpec(engine="torch", precision="bf16", lora=R8, quant=NF4), 2) == 2


def test_dora_recomputation_moment_is_the_measured_live_set():
    # lora-r8 DoRA tiny-gpt2 FSDP2 bf16 ckpt: at block 0's mlp.c_proj weight norm the rebuild holds the
    # block output's and the scaled output's gradients (2 x 65,536), GPT2Block's residual and attn_output
    # (2 x 65,536), the base output (65,536) and the weight norm's identity, A on it, LoRA weight, scaled
    # copy and sum (925,696), before c_proj's A output, lora_result and `base_result - bias` (135,168) exist
    gpt2 = resolve_model("tiny-gpt2")
    dora = LoraSpec(rank=8, targets=("all-linear",), dora=True)
    dtypes = recompute_dtypes(None, autocast=False, comp=2, adapter=2, cuda=False, resid=2)
    assert recompute_moment_bytes(gpt2, dora, lora_layout(gpt2, dora), dtypes, TOKENS) == 1_253_376 - 135_168


def test_mlp_input_saved_by_lora_a_itself_is_not_counted_twice():
    # 16-bit adapters on a 16-bit model without autocast: lora_A saves the MLP norm's output itself (no copy),
    # so it is among the rebuilt saved tensors, not a temporary of the moment
    same = recompute_dtypes(None, autocast=False, comp=2, adapter=2, cuda=False, resid=2)
    moment = recompute_moment_bytes(LLAMA, R8, lora_layout(LLAMA, R8), same, TOKENS)
    # per token: the gradients (2 x 256) and the residual (256); at up_proj's `* scaling` its base output, B's
    # output and the scaled copy (3 x 704), less up's output and the product, counted saved but not yet made
    # (2 x 704); down_proj's moment (768 + its base output 256) is smaller
    assert moment == TOKENS * (3 * 256 + 3 * 704 - 2 * 704)
