"""Frozen linears under DeepSpeed ZeRO-3 keep their inputs (issue 12, estimate/adapters/zero3.py): DeepSpeed's
`LinearFunctionForZeroStage3` saves every linear's input, frozen or not. Held to the tensors a per-op
trace of the 2-rank runs found live at the backward peak and to the grid's measured rows."""

from __future__ import annotations

import pytest

from zeroplan.estimate import estimate
from zeroplan.estimate.adapters.lora import _linears, lora_layout
from zeroplan.estimate.adapters.zero3 import kept_inputs
from zeroplan.estimate.result import Phase, Step
from zeroplan.measure.grid import GRID, row_specs

TRAINER_ROW = "trainer-lora-r8-all-linear/tiny-llama/deepspeed-3/bf16/nockpt/2x128/w2/hf-trainer"
TOKENS = 2 * 128


def _row(row_id: str):
    return row_specs(next(row for row in GRID if row.id == row_id))


def _kept(model, training, comp: int, adapter_element: int, **fields):
    layout = lora_layout(model, training.lora)
    conditions = {"first_input_needs_grad": False, "head_input_removed": True} | fields
    return kept_inputs(model, training.lora, training.quant, training, comp, adapter_element, False,
                       block_linears=[linear for linear in _linears(model) if linear.role == "block"],
                       adapted=[linear for linear in layout.adapted if linear.role == "block"], **conditions)


def test_the_kept_inputs_are_the_tensors_the_trace_found():
    # A dispatch-mode trace of the Trainer row's rank 0 at the first step's backward peak: beyond the
    # single-process run, tensors saved by deepspeed/runtime/zero/linear.py (bf16): down_proj's input
    # (the MLP product) 180,224 B and the MLP norm's output 65,536 B in each of the 2 blocks, the
    # attention norm's output 65,536 B in the second block only, and the final norm's output 65,536 B.
    model, training = _row(TRAINER_ROW)
    kept = _kept(model, training, comp=2, adapter_element=4)  # fp32 adapters: A keeps its own cast copy
    assert TOKENS * kept.block == 180_224 + 65_536 + 65_536
    assert TOKENS * kept.first_block == -65_536
    assert TOKENS * kept.head == 65_536


def test_the_trainer_rows_first_backward_peak_is_within_the_measurement():
    # measured 7,359,765 B on both ranks; 628,752 B above the estimate before this term, 622,592 of them
    # the tensors above (the rest, 6,160 B, is not DeepSpeed's linear)
    model, training = _row(TRAINER_ROW)
    first = next(p for p in estimate(model, training).phases if p.step == Step.FIRST and p.phase == Phase.BACKWARD)
    assert first.total_bytes == 7_353_472
    assert abs(first.total_bytes - 7_359_765) / 7_359_765 < 0.001


@pytest.mark.parametrize("row_id, measured", [
    # zeroplan's loop builds without zero.Init; ZeRO-3 still patches F.linear (parameter_offload.py
    # `_convert_to_zero_parameters` -> Init(module=...)): the frozen k/o/gate/up/down and head keep inputs
    ("lora-r8-q_proj+v_proj/tiny-llama/deepspeed-3/fp32/nockpt/2x128/w2", 2_009_605_165),
    # a 4-bit base's layers call bitsandbytes, not F.linear: only the head's input is kept
    ("qlora-r8-all-linear-nf4-store-bf16/tiny-llama/deepspeed-3/bf16/nockpt/2x128/w2", 1_005_417_517),
])
def test_loop_rows_under_zero3_equal_their_measured_steady_peak(row_id, measured):
    model, training = _row(row_id)
    assert abs(estimate(model, training).peak_bytes - measured) < 512  # docs/accuracy.json, both ranks


def test_gpt2_blocks_call_no_linear_and_other_stages_keep_nothing_more():
    model, training = _row("lora-r8-all-linear/tiny-gpt2/deepspeed-3/bf16/ckpt/2x128/w2")
    kept = _kept(model, training, comp=2, adapter_element=4)
    assert (kept.block, kept.first_block) == (0, 0)  # Conv1D runs torch.addmm
    assert kept.head == 2 * model.hidden_size  # lm_head is an nn.Linear
    stage2 = training.model_copy(update={"zero_stage": 2})
    assert sum(_kept(model, stage2, comp=2, adapter_element=4)) == 0


CKPT_ROW = "trainer-lora-r8-all-linear/tiny-llama/deepspeed-3/bf16/ckpt/2x128/w2/hf-trainer"


def test_the_first_steps_rebuilt_block_stays_gathered_as_traced():
    # The trace of the checkpointed Trainer row at the first step's backward peak (the last block's
    # recomputation): all-gather buffers of its bf16 base weights, q 32,768, k and v 16,384 each,
    # o 32,768, gate/up/down 90,112 each (368,640 B), and of its fp32 adapters: the partitioned ones
    # (gate/up lora_B, down lora_A) 11,264 B each, the 11 under the persistence threshold 4,096 B
    # (1,024 elements) or 2,048 B (k/v lora_B); beside them the 32,768 B reduce bucket. The run
    # named 2 of the 4,096 B ones params, so its buffers are 468,101 B (133 B of small engine tensors).
    model, training = _row(CKPT_ROW)
    first = next(p for p in estimate(model, training).phases if p.step == Step.FIRST and p.phase == Phase.BACKWARD)
    assert first.categories.buffers == 32_768 + 368_640 + 3 * 11_264 + 9 * 4_096 + 2 * 2_048 == 468_101 - 133 + 8_192
    assert abs(first.total_bytes - 4_366_101) / 4_366_101 < 0.03  # -2.2%: docs/engines/lora.md
