"""The training program (issue 11): recipes fill the knobs a user leaves unset, explicit knobs win,
and knobs that do not apply to the engine or recipe are one-line errors."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from zeroplan.cli import cli
from zeroplan.errors import SpecError
from zeroplan.importers.options import training_spec_from_options
from zeroplan.spec.program import GradSync, Loss, ModelInit, OptimizerImpl, Recipe
from zeroplan.spec.training import TrainingSpec


def program(**fields):
    return TrainingSpec(**fields).program


def test_hf_trainer_is_the_default_recipe_and_follows_the_engine():
    assert TrainingSpec().recipe == Recipe.HF_TRAINER
    # the Trainer's fused AdamW, its fp32 logits, no DDP around one process
    one = program(engine="torch", gpus=1)
    assert (one.ddp, one.optimizer_impl, one.loss, one.model_init) == (False, OptimizerImpl.FUSED, Loss.STANDARD, ModelInit.HOST)
    assert program(engine="torch", gpus=8).ddp
    # accelerate skips the all-reduce until the last micro-batch; DeepSpeed reduces every one
    assert program(engine="fsdp2", zero_stage=3, gpus=8).grad_sync == GradSync.LAST
    assert program(engine="deepspeed", zero_stage=2, gpus=8).grad_sync == GradSync.EVERY
    # from_pretrained under ZeRO-3 builds inside deepspeed.zero.Init
    assert program(engine="deepspeed", zero_stage=3, gpus=8).model_init == ModelInit.ZERO_INIT
    assert program(engine="deepspeed", zero_stage=2, gpus=8).model_init == ModelInit.HOST


def test_torchtitan_and_torchtune_defaults():
    titan = program(engine="fsdp2", zero_stage=3, gpus=8, recipe="torchtitan")
    assert (titan.model_init, titan.grad_sync, titan.loss, titan.loss_chunks) == (ModelInit.META, GradSync.EVERY, Loss.CHUNKED, 8)
    single = program(engine="torch", gpus=1, recipe="torchtune")
    assert single.optimizer_in_backward and not single.ddp and single.model_init == ModelInit.DEVICE
    assert not program(engine="fsdp2", zero_stage=3, gpus=8, recipe="torchtune").optimizer_in_backward


def test_plain_is_zeroplan_s_own_loop():
    assert program(engine="torch", gpus=1, recipe="plain").ddp  # workload.py wraps even one rank in DDP
    assert program(engine="torch", gpus=1, recipe="plain", device="cpu").optimizer_impl == OptimizerImpl.FOR_LOOP
    assert program(engine="deepspeed", zero_stage=2, gpus=8, recipe="plain").optimizer_impl == OptimizerImpl.FUSED


def test_an_explicit_knob_wins_over_the_recipe():
    chosen = program(engine="fsdp2", zero_stage=3, gpus=8, recipe="torchtitan", loss="standard", grad_sync="last")
    assert (chosen.loss, chosen.loss_chunks, chosen.grad_sync) == (Loss.STANDARD, 1, GradSync.LAST)
    assert program(engine="fsdp2", zero_stage=3, gpus=8, recipe="torchtitan", loss_chunks=16).loss_chunks == 16


@pytest.mark.parametrize("options, message", [
    ({"engine": "deepspeed", "zero_stage": 2, "optimizer_in_backward": True}, "optimizer_in_backward: DeepSpeed steps its own optimizer"),
    ({"engine": "torch", "grad_accum": 4, "optimizer_in_backward": True}, "cannot accumulate gradients"),
    ({"engine": "fsdp2", "zero_stage": 3, "loss_chunks": 4}, "loss_chunks applies to a chunked loss, not loss standard"),
    ({"engine": "fsdp2", "zero_stage": 3, "model_init": "zero-init"}, "model_init zero-init is deepspeed.zero.Init"),
    ({"engine": "deepspeed", "zero_stage": 3, "recipe": "torchtitan"}, "recipe torchtitan runs FSDP2"),
    ({"engine": "fsdp2", "zero_stage": 3, "ddp": True}, "ddp applies to engine torch"),
    ({"engine": "fsdp2", "zero_stage": 3, "checkpoint_every": 2}, "checkpoint_every .* set checkpointing full"),
])
def test_knobs_that_do_not_apply_are_one_line_errors(options, message):
    with pytest.raises(SpecError, match=message):
        training_spec_from_options(options)


def test_the_estimate_says_which_recipe_and_knobs_it_used():
    result = CliRunner().invoke(cli, ["estimate", "llama-3-8b", "--engine", "fsdp2", "--zero", "3", "--gpus", "8",
                                      "--recipe", "torchtitan", "--grad-accum", "2"])
    assert result.exit_code == 0, result.output
    assert "recipe torchtitan: model init meta, gradient sync every, fused adamw, chunked loss (8 chunks)" in result.output
    import json

    data = json.loads(CliRunner().invoke(cli, ["estimate", "llama-2-7b", "--gpus", "8", "--zero", "3", "--format", "json"]).output)
    assert data["program"] == {"recipe": "hf-trainer", "model_init": "zero-init", "grad_sync": "every", "ddp": False,
                               "optimizer_impl": "fused", "optimizer_in_backward": False, "loss": "standard",
                               "loss_chunks": 1, "activation_offload": "none",
                               "fsdp2": {"units": "split", "reshard_root": True, "reshard_head": False,
                                         "reshard_last_block": True},
                               "optimizer_step": {"impl": "fused", "via": None}, "compile": [], "float8": None}
