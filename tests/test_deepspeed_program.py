"""The training program under DeepSpeed: the activation offload DeepSpeed does not offer."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from zeroplan.cli import cli
from zeroplan.errors import SpecError
from zeroplan.importers.options import training_spec_from_options


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
