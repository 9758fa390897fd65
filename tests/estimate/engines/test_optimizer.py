"""The optimizer's kernel (for-loop, foreach, fused), DeepSpeed's own optimizer against a client
torch optimizer, and DDP around one rank, checked against torch's and DeepSpeed's definitions
(torch/optim/adam.py, deepspeed/runtime/engine.py) and against a real out-of-memory report."""

from __future__ import annotations

import json

import pytest

from zeroplan.estimate import estimate
from zeroplan.estimate.dtypes import FP32_BYTES
from zeroplan.estimate.engines.common import step_temporary_bytes
from zeroplan.estimate.model.facts import model_facts
from zeroplan.estimate.result import Phase, Step
from zeroplan.importers.catalog import resolve_model
from zeroplan.importers.training_config import read_training_config
from zeroplan.spec.program import OptimizerImpl
from zeroplan.spec.training import Optimizer, TrainingSpec

GIB = 1024**3


def _phase(result, step: Step, name: Phase):
    return next(p for p in result.phases if p.step == step and p.phase == name)


def test_step_temporaries_by_kernel():
    # _single_tensor_adam: sqrt and quotient of one tensor at once; _multi_tensor_adam: one
    # _foreach_sqrt list over the group; _fused_adam and SGD: in place
    largest, total = 1000, 5000
    assert step_temporary_bytes(largest, total, 4, Optimizer.ADAMW, OptimizerImpl.FOR_LOOP) == 2 * largest * 4
    assert step_temporary_bytes(largest, total, 4, Optimizer.ADAMW, OptimizerImpl.FOREACH) == total * 4
    assert step_temporary_bytes(largest, total, 4, Optimizer.ADAM, OptimizerImpl.FUSED) == 0
    assert step_temporary_bytes(largest, total, 2, Optimizer.SGD, OptimizerImpl.FOREACH) == 0


@pytest.mark.parametrize("engine,stage", [("torch", 0), ("fsdp2", 3)])
def test_torch_engines_step_the_kernel_given(engine, stage):
    model = resolve_model("tiny-llama")
    temps = {}
    for impl in OptimizerImpl:
        training = TrainingSpec(engine=engine, zero_stage=stage, gpus=1, precision="fp32", device="cpu",
                                optimizer_impl=impl)
        result = estimate(model, training)
        temps[impl] = {s: _phase(result, s, Phase.OPTIMIZER_STEP).categories.temporaries for s in Step}
    facts = model_facts(model, TrainingSpec(engine=engine, zero_stage=stage, gpus=1))
    numels = facts.trainable_numels()
    for step in Step:  # the states exist at both steps' optimizer step: the same temporaries
        assert temps[OptimizerImpl.FOR_LOOP][step] == 2 * max(numels) * FP32_BYTES
        assert temps[OptimizerImpl.FOREACH][step] == sum(numels) * FP32_BYTES
        assert temps[OptimizerImpl.FUSED][step] == 0


def test_one_rank_without_ddp_has_no_reducer_buckets():
    model = resolve_model("tiny-llama")
    bare = estimate(model, TrainingSpec(engine="torch", gpus=1, device="cpu", recipe="plain", ddp=False))
    wrapped = estimate(model, TrainingSpec(engine="torch", gpus=1, device="cpu", recipe="plain", ddp=True))
    trainable = model_facts(model, TrainingSpec(engine="torch")).trainable_params
    assert _phase(wrapped, Step.FIRST, Phase.INIT).categories.buffers - _phase(bare, Step.FIRST, Phase.INIT).categories.buffers \
        == trainable * FP32_BYTES
    assert wrapped.peak_bytes - bare.peak_bytes == trainable * FP32_BYTES


def test_deepspeed_json_without_an_optimizer_section_runs_the_client_optimizer(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    assert read_training_config(path)["deepspeed"]["client_optimizer"] is True
    path.write_text(json.dumps({"zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW"}}))
    assert "deepspeed" not in read_training_config(path)
    assert TrainingSpec().deepspeed.client_optimizer is False


def test_deepspeed_client_optimizer_steps_the_flat_partition():
    # stage 2 on CUDA: DeepSpeed's FusedAdam updates in place; a client torch AdamW steps the rank's
    # flat fp32 partition of each param group in turn (stage_1_and_2.py `step`, `_optimizer_step(i)`):
    # the for-loop holds two temporaries of it, foreach one (the first step's moment of the update; at
    # the steady step converting the gradient can be the larger moment). The Trainer's AdamW (recipe
    # hf-trainer) has two groups, the first every parameter with weight decay (trainer.py
    # `get_decay_parameter_names`: not the biases and norms).
    model = resolve_model("llama-1b")
    common = dict(engine="deepspeed", zero_stage=2, gpus=8, precision="fp32")  # fp32: no flattening temporary
    own = estimate(model, TrainingSpec(**common))
    temps = {impl: _phase(estimate(model, TrainingSpec(**common, deepspeed={"client_optimizer": True}, optimizer_impl=impl)),
                          Step.FIRST, Phase.OPTIMIZER_STEP).categories.temporaries for impl in OptimizerImpl}
    facts = model_facts(model, TrainingSpec(**common))
    decay = sum(t.numel * g.count for g in facts.groups for t in g.tensors if "norm" not in t.name and not t.name.endswith("bias"))
    assert decay < facts.trainable_params
    partition = -(-decay // 16) * 16 // 8  # padded to nccl_start_alignment_factor (2) x N, one slice per rank
    assert _phase(own, Step.FIRST, Phase.OPTIMIZER_STEP).categories.temporaries == temps[OptimizerImpl.FUSED] == 0
    assert temps[OptimizerImpl.FOR_LOOP] == pytest.approx(2 * partition * FP32_BYTES, rel=1e-6)
    assert temps[OptimizerImpl.FOREACH] == pytest.approx(partition * FP32_BYTES, rel=1e-6)


def test_llama_7b_zero2_fp16_on_v100_with_the_trainers_for_loop_adamw_does_not_fit(tmp_path):
    """LLaMA-Factory issue #1221 (2023-10-18): LLaMA-7B, 8 x V100 32 GB, the README's DeepSpeed ZeRO-2
    JSON (fp16, no optimizer section, so the Trainer's torch AdamW is DeepSpeed's client optimizer),
    batch 1. transformers then defaulted to optim "adamw_torch" (PR #25109, v4.32), torch.optim.AdamW
    with foreach and fused unset; the traceback's line,
    `denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)`, is `_single_tensor_adamw`: the
    for-loop ran. It failed with "Tried to allocate 3.14 GiB (GPU 5; 31.75 GiB total capacity; 28.28
    GiB already allocated; 1.95 GiB free)". llama-2-7b has LLaMA-7B's shapes (4096 x 32 layers, 11008,
    vocabulary 32000); the sequence length does not reach the optimizer step."""
    config = tmp_path / "ds_z2_config.json"
    config.write_text(json.dumps({
        "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto", "zero_allow_untested_optimizer": True,
        "fp16": {"enabled": "auto", "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
                 "hysteresis": 2, "min_loss_scale": 1},
        "zero_optimization": {"stage": 2, "allgather_partitions": True, "allgather_bucket_size": 5e8,
                              "reduce_scatter": True, "reduce_bucket_size": 5e8, "overlap_comm": False,
                              "contiguous_gradients": True},
    }))
    settings = read_training_config(config, gpus=8, hidden_size=4096)
    model = resolve_model("llama-2-7b")
    capacity = 31.75 * GIB  # what torch reported for the V100

    def run(impl):
        training = TrainingSpec(**{**settings, "gpus": 8, "precision": "fp16", "micro_batch": 1, "seq_len": 1024,
                                   "optimizer_impl": impl})
        return estimate(model, training)

    for_loop = run(OptimizerImpl.FOR_LOOP)
    assert for_loop.peak_bytes > capacity
    step = for_loop.peak_of(Step.FIRST)
    assert step.phase == Phase.OPTIMIZER_STEP
    # the failing allocation is the quotient, the second of the two temporaries: before it, the sqrt
    # was already allocated
    one_temporary = step.categories.temporaries // 2
    assert one_temporary / GIB == pytest.approx(3.14, abs=0.005)
    allocated = step.total_bytes - step.categories.overhead - one_temporary
    # DeepSpeed 0.19.8 keeps the 16-bit gradient partition (`grads_in_partition`, one buffer for the
    # Trainer's two param groups) while it steps the first group, as measured on 2 gloo ranks
    # (docs/measure.md, "The Trainer's AdamW under DeepSpeed"); the 28.28 GiB of the 2023 report, from
    # an older DeepSpeed, match the rest of the step: without the rank's 16-bit slice of the gradients
    sixteen_bit_slice = model_facts(model, TrainingSpec(**settings, gpus=8)).trainable_params // 8 * 2
    assert (allocated - sixteen_bit_slice) / GIB == pytest.approx(28.28, rel=0.01)
    # the Trainer's default today (adamw_torch_fused) fits
    assert run(OptimizerImpl.FUSED).peak_bytes < capacity


def test_knobs_that_do_not_apply_are_refused():
    with pytest.raises(ValueError, match="optimizer_impl chooses a torch optimizer's kernel; DeepSpeed steps"):
        TrainingSpec(engine="deepspeed", zero_stage=2, optimizer_impl="foreach")
    TrainingSpec(engine="deepspeed", zero_stage=2, optimizer_impl="foreach", deepspeed={"client_optimizer": True})
    with pytest.raises(ValueError, match="ddp false runs one rank without DistributedDataParallel; with gpus 2"):
        TrainingSpec(engine="torch", gpus=2, ddp=False)


def test_optimizer_in_backward_refuses_what_it_does_not_model():
    with pytest.raises(ValueError, match="optimizer_in_backward with engine torch runs one rank without DDP"):
        TrainingSpec(engine="torch", gpus=2, optimizer_in_backward=True)
    with pytest.raises(ValueError, match="optimizer_in_backward under fsdp2 is not modelled"):
        TrainingSpec(engine="fsdp2", zero_stage=3, gpus=2, optimizer_in_backward=True)


def test_optimizer_in_backward_keeps_one_gradient_at_a_time():
    # every .grad is freed in its hook: backward never holds more than the largest parameter's, and
    # the step phase holds parameters and states only; the states exist from the first backward
    model = resolve_model("tiny-llama")
    common = dict(engine="torch", gpus=1, device="cpu", precision="fp32", recipe="plain", ddp=False)
    result = estimate(model, TrainingSpec(**common, optimizer_in_backward=True, optimizer_impl="fused"))
    largest = model_facts(model, TrainingSpec(**common)).largest_tensor_numel
    for step in Step:
        assert _phase(result, step, Phase.BACKWARD).categories.grads <= largest * FP32_BYTES
        categories = _phase(result, step, Phase.OPTIMIZER_STEP).categories
        assert categories.grads == categories.temporaries == 0
