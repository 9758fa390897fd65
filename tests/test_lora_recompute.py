"""The checkpointed LoRA/QLoRA terms of issue 12 against per-tensor measurements and their sources.

The figures were measured on tiny-llama (2 x 128 tokens, 2 blocks) by running one step of the grid row's
program in process under a TorchDispatchMode that logs every live storage with the op that made it, and
reading the live set at the steady peak (docs/measure.md "Checkpointed LoRA rows, tensor by tensor")."""

from __future__ import annotations

from zeroplan.estimate.lora import _linears, kbit_activation_bytes, lora_layout
from zeroplan.estimate.lora_int8 import int8_inputs
from zeroplan.estimate.lora_recompute import model_element_bytes, recompute_dtypes, recompute_moment_bytes
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
    dtypes = recompute_dtypes(NF4, autocast=True, comp=2, adapter=4, cuda=False)
    assert recompute_moment_bytes(LLAMA, R8, lora_layout(LLAMA, R8), dtypes, TOKENS) == 868_352


def test_fp32_model_under_autocast_recomputation_moment_is_the_measured_live_set():
    # lora-r64 torch bf16 ckpt (an fp32 model under autocast): the block output's fp32 gradient (131,072),
    # its bf16 cast (65,536), lora_B's scaled gradient (65,536), the fp32 residual and MLP input
    # (2 x 131,072), the bf16 product (180,224), the base output (65,536) and the fp32 copy (360,448)
    dtypes = recompute_dtypes(None, autocast=True, comp=2, adapter=4, cuda=False)
    assert recompute_moment_bytes(LLAMA, R64, lora_layout(LLAMA, R64), dtypes, TOKENS) == 1_130_496


def test_int8_layers_keep_their_inputs_outside_checkpointing():
    # MatMul8bitFp.forward `ctx.A = A`: measured per checkpointed block, the attention norm's output, the
    # SDPA output (o_proj's input), the MLP norm's output (65,536 each, bf16) and the product (180,224)
    inputs = int8_inputs(LLAMA, _linears(LLAMA), INT8, element=2)
    assert TOKENS * inputs.kept == 376_832
    assert int8_inputs(LLAMA, _linears(LLAMA), NF4, element=2).kept == 0


def test_bitsandbytes_lora_skips_the_cast_under_cuda_autocast_only():
    # peft lora/bnb.py: `requires_conversion = not torch.is_autocast_enabled()` (CUDA's autocast); lora/layer.py casts always
    assert not recompute_dtypes(NF4, autocast=True, comp=2, adapter=4, cuda=True).cast_copy
    assert recompute_dtypes(NF4, autocast=True, comp=2, adapter=4, cuda=False).cast_copy
    assert recompute_dtypes(None, autocast=True, comp=2, adapter=4, cuda=True).cast_copy


def test_kbit_model_runs_in_its_compute_dtype_without_autocast():
    # measure/programs/peft_model.py base_dtype: a k-bit base is built in its compute dtype (bf16 by default)
    fp32_run = TrainingSpec(engine="torch", precision="fp32", lora=R8, quant=INT8)
    assert kbit_activation_bytes(fp32_run, 4) == 2
    assert model_element_bytes(INT8, autocast=False, comp=4) == 2
    upcast = QuantSpec(base_precision="nf4", compute_dtype="bf16", upcast_non_quantized=True)
    assert kbit_activation_bytes(TrainingSpec(engine="torch", precision="fp32", lora=R8, quant=upcast), 4) == 4
    assert kbit_activation_bytes(TrainingSpec(engine="torch", precision="bf16", lora=R8, quant=NF4), 2) == 2
