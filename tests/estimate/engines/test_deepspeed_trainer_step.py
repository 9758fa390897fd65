"""DeepSpeed stepping the Hugging Face Trainer's AdamW (issue 11, the hf-trainer rows of the accuracy
grid): the JSON the run gives the Trainer has no optimizer section, so the Trainer's optimizer is
DeepSpeed's client optimizer, with the Trainer's two param groups. Checked against the definitions in
transformers 5.23.0 trainer.py (`create_optimizer`, `get_decay_parameter_names`) and DeepSpeed 0.19.8
runtime/zero/stage_1_and_2.py (`copy_grads_in_partition`, `step`)."""

from __future__ import annotations

import pytest

from zeroplan.estimate import estimate
from zeroplan.estimate.dtypes import FP32_BYTES, HALF_BYTES
from zeroplan.estimate.engines.deepspeed import _first_param_group
from zeroplan.estimate.engines.common import setup_of
from zeroplan.estimate.model.facts import model_facts
from zeroplan.estimate.result import Phase, Step
from zeroplan.importers.catalog import resolve_model
from zeroplan.measure.grid import GRID, row_specs
from zeroplan.spec.training import TrainingSpec

TINY = resolve_model("tiny-llama")  # hidden 128, 2 blocks, intermediate 352, vocabulary 512, untied head
# tiny-llama's tensors in parameter order (elements): the embeddings, per block q, k, v, o, gate, up,
# down and two norms, then the final norm and the head
BLOCK = (16384, 8192, 8192, 16384, 45056, 45056, 45056, 128, 128)
ORDER = (65536, *BLOCK, *BLOCK, 128, 65536)


def _training(**fields) -> TrainingSpec:
    base = dict(engine="deepspeed", zero_stage=2, gpus=2, precision="bf16", device="cpu", micro_batch=2, seq_len=128,
                checkpointing="full", recipe="hf-trainer", deepspeed={"client_optimizer": True})
    return TrainingSpec(**(base | fields))


def _step(training: TrainingSpec, step: Step):
    return next(p for p in estimate(TINY, training).phases if p.step == step and p.phase == Phase.OPTIMIZER_STEP)


def test_the_trainers_first_param_group_is_every_parameter_with_weight_decay():
    # get_decay_parameter_names: no decay for biases and norms, so tiny-llama's five RMSNorm weights
    # form the second group; DeepSpeed's config optimizer and the plain loop's client take one group
    decay = sum(ORDER) - 5 * 128
    training = _training()
    assert _first_param_group(model_facts(TINY, training), setup_of(training)) == decay
    plain = _training(recipe="plain")
    assert _first_param_group(model_facts(TINY, plain), setup_of(plain)) == sum(ORDER)
    own = _training(deepspeed={"client_optimizer": False})
    assert _first_param_group(model_facts(TINY, own), setup_of(own)) == sum(ORDER)


def test_stage2_steps_the_first_group_while_the_gradient_partition_is_alive():
    """stage_1_and_2.py `step` converts and steps one group after the other and frees a group's
    gradients after converting them; `grads_in_partition` is one buffer for all groups, so it lives
    until the last group's .grad views are freed: the first step's peak is the first group's update,
    its Adam states created, beside the bf16 partition and the group's fp32 gradient."""
    n, alignment = 2, 4  # nccl_start_alignment_factor 2 x N
    flat = -(-sum(ORDER) // alignment) * alignment
    partition = flat // n
    decay = sum(ORDER) - 5 * 128
    first = -(-decay // alignment) * alignment // n
    # copy_grads_in_partition: the whole tensors meeting rank 0's slice [0, partition) of the flat
    # order: the embeddings, block 0 and block 1's q_proj (it starts inside the slice)
    assert 65536 + sum(BLOCK) < partition < 65536 + sum(BLOCK) + 16384
    owned = 65536 + sum(BLOCK) + 16384
    params, master = flat * HALF_BYTES, partition * FP32_BYTES
    got = _step(_training(), Step.FIRST).categories
    assert (got.params, got.optimizer_states, got.grads, got.temporaries) == (
        params, master + 2 * first * FP32_BYTES, owned * HALF_BYTES + first * FP32_BYTES, 0)  # fused AdamW: in place
    # one group (the plain loop's client optimizer): the partition's gradients are freed before the update
    one = _step(_training(recipe="plain", optimizer_impl="fused"), Step.FIRST).categories
    assert (one.optimizer_states, one.grads) == (master + 2 * partition * FP32_BYTES, partition * FP32_BYTES)


def test_the_trainer_rows_estimate_the_trainers_adamw_as_the_client_optimizer():
    pytest.importorskip("torch")  # measure/programs/hf_trainer.py imports it
    from zeroplan.measure.programs.hf_trainer import trainer_deepspeed_config

    rows = [r for r in GRID if r.recipe == "hf-trainer" and r.engine == "deepspeed"]
    assert {r.stage for r in rows} == {0, 2, 3}
    for row in rows:
        model, training = row_specs(row)
        assert training.deepspeed.client_optimizer is True, row.id
        # what the run gives the Trainer: no optimizer section (integrations/deepspeed.py
        # deepspeed_optim_sched then passes trainer.create_optimizer() to DeepSpeed)
        assert "optimizer" not in trainer_deepspeed_config(training, model.hidden_size), row.id
