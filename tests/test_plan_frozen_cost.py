"""The planner's step-time model with frozen parameters (LoRA), against its definitions.

Training FLOPs per parameter and token: forward 2 (a multiply and an add per weight), backward 4
(the gradient of the layer's input, 2, and of its weight, 2): 6 for a trained weight (Kaplan et al.
2020 section 2.1, C = 6N; Narayanan et al. 2021 section 5.1). A frozen weight gets no gradient:
2 + 2. Full checkpointing runs the forward again. Communication (ZeRO paper section 7): gradients
and the updated parameters are the trained ones; stage 3 still gathers every parameter twice."""

from __future__ import annotations

import pytest

from zeroplan.importers.catalog import resolve_model
from zeroplan.importers.gpus import get_gpu
from zeroplan.plan.cost import assumptions_for, model_flops, step_cost_model
from zeroplan.spec.model import ParamCountSpec
from zeroplan.spec.training import Checkpointing, TrainingSpec

ASSUMPTIONS = assumptions_for(get_gpu("h100-80gb"))
PSI = 6_742_609_920  # Llama-2-7B with PEFT's r=8 q_proj/v_proj adapters (PEFT's README)
PSI_T = 4_194_304


def test_a_frozen_parameter_costs_4_flops_per_token_and_a_trained_one_6():
    model = ParamCountSpec(params=PSI)
    assert model_flops(model, PSI, PSI).dense_flops_per_token == 6 * PSI
    assert model_flops(model, PSI, PSI_T).dense_flops_per_token == 4 * (PSI - PSI_T) + 6 * PSI_T


def test_full_checkpointing_recomputes_the_forward_of_a_frozen_model():
    model = resolve_model("llama-2-7b")
    flops = model_flops(model, PSI, PSI_T)
    base = TrainingSpec(gpus=8)
    none = step_cost_model(flops, base, ASSUMPTIONS).step_cost(4, 1)
    full = step_cost_model(flops, base.model_copy(update={"checkpointing": Checkpointing.FULL}), ASSUMPTIONS).step_cost(4, 1)
    attention = flops.attention_flops_per_token_per_seq * base.seq_len  # forward a third, backward two
    forward = 2 * PSI + attention / 3
    assert full.recompute_s / none.compute_s == pytest.approx(forward / (4 * PSI + 2 * PSI_T + attention))


def test_gradients_and_updates_of_a_frozen_model_move_the_trained_parameters_only():
    flops = model_flops(ParamCountSpec(params=PSI), PSI, PSI_T)

    def communication(stage: int) -> float:
        return step_cost_model(flops, TrainingSpec(gpus=8, zero_stage=stage), ASSUMPTIONS).step_cost(1, 1).communication_s

    ring, link = 7 / 8, ASSUMPTIONS.intra_node_bytes_per_s
    assert communication(0) == pytest.approx(2 * ring * PSI_T * 2 / link)  # all-reduce of the 16-bit gradients
    assert communication(1) == pytest.approx(communication(0))  # reduce-scatter + all-gather of the updated
    assert communication(2) == pytest.approx(communication(0))
    assert communication(3) == pytest.approx(ring * (2 * PSI + PSI_T) * 2 / link)  # gather twice, reduce Ψt


def test_the_ranking_explains_traffic_in_trained_parameters():
    from click.testing import CliRunner

    from zeroplan.cli import cli

    result = CliRunner().invoke(cli, ["plan", "tiny-llama", "--lora-rank", "8", "--lora-targets", "all-linear",
                                      "--gpus", "2", "--gpu", "h100-80gb"])
    assert result.exit_code == 0, result.output
    assert "Ψt =" in result.output and "trained" in result.output
    assert "moves 2Ψ per step" not in result.output
