"""The training program under DeepSpeed: what steps the optimizer (the estimate's program line says
so) and the activation offload DeepSpeed does not offer."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from zeroplan.cli import cli
from zeroplan.errors import SpecError
from zeroplan.importers.options import training_spec_from_options
from zeroplan.spec.optimizer_step import deepspeed_optimizer_step
from zeroplan.spec.program import OptimizerImpl


def _program_line(*options: str) -> str:
    result = CliRunner().invoke(cli, ["estimate", "tiny-llama", "--engine", "deepspeed", "--zero", "2", "--gpus", "2",
                                      *options])
    assert result.exit_code == 0, result.output
    return next(line for line in result.output.splitlines() if line.startswith("recipe "))


def test_a_cpu_run_says_torch_s_for_loop_steps_deepspeed_s_adamw():
    # runtime/engine.py get_optimizer_configuration: torch_adam -> torch.optim.AdamW, for-loop on CPU tensors
    assert "for-loop adamw (DeepSpeed's torch_adam)" in _program_line("--device", "cpu")
    assert "fused adamw" in _program_line("--device", "cuda")  # FusedAdam
    assert "fused adamw" in _program_line("--device", "cpu", "--offload-optimizer", "cpu")  # DeepSpeedCPUAdam


def test_the_json_names_the_kernel_the_text_names():
    # one answer for both outputs: the JSON's program.optimizer_step is what the text line prints
    import json
    result = CliRunner().invoke(cli, ["estimate", "tiny-llama", "--engine", "deepspeed", "--zero", "2", "--gpus", "2",
                                      "--device", "cpu", "--format", "json"])
    assert json.loads(result.output)["program"]["optimizer_step"] == {"impl": "for-loop", "via": "DeepSpeed's torch_adam"}
    result = CliRunner().invoke(cli, ["estimate", "tiny-llama", "--engine", "fsdp2", "--zero", "3", "--gpus", "2",
                                      "--device", "cpu", "--format", "json"])
    program = json.loads(result.output)["program"]
    assert program["optimizer_step"] == {"impl": program["optimizer_impl"], "via": None}


@pytest.mark.parametrize("cpu_run, offload, client, optimizer, expected", [
    (True, False, False, "adamw", (OptimizerImpl.FOR_LOOP, "DeepSpeed's torch_adam")),
    (False, False, False, "adamw", (OptimizerImpl.FUSED, None)),  # FusedAdam, in place
    (True, True, False, "adam", (OptimizerImpl.FUSED, None)),  # DeepSpeedCPUAdam, in place
    (True, False, True, "adamw", (OptimizerImpl.FOREACH, None)),  # the client torch optimizer's own kernel
    (True, False, False, "sgd", (OptimizerImpl.FOREACH, None)),  # SGD is a client torch.optim.SGD
])
def test_what_steps_deepspeed_s_master(cpu_run, offload, client, optimizer, expected):
    assert deepspeed_optimizer_step(cpu_run=cpu_run, offload_optimizer=offload, client_optimizer=client,
                                    optimizer=optimizer, program_impl=OptimizerImpl.FOREACH) == expected


def test_activation_offload_is_not_deepspeed_s():
    with pytest.raises(SpecError, match=r"^activation_offload cpu is torchtune's OffloadActivations .*"
                                        r"activation_checkpointing.cpu_checkpointing"):
        training_spec_from_options({"engine": "deepspeed", "zero_stage": 3, "activation_offload": "cpu"})
    result = CliRunner().invoke(cli, ["estimate", "tiny-llama", "--engine", "deepspeed", "--zero", "2",
                                      "--activation-offload", "cpu"])
    assert result.exit_code == 2
    assert len(result.output.strip().splitlines()) == 1 and "activation_offload" in result.output
    # FSDP2 and one rank with engine torch run torchtune's offloading
    training_spec_from_options({"engine": "fsdp2", "zero_stage": 3, "activation_offload": "cpu"})
