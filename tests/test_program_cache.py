"""`TrainingSpec.program` and `fsdp2_wrapping` are resolved once per distinct input (the planner
reads them thousands of times): a copied or varied spec still gets its own fields' program."""

from __future__ import annotations

from zeroplan.estimate import clear_caches
from zeroplan.spec.program import FSDP2Units, Loss, ModelInit, Recipe
from zeroplan.spec.training import TrainingSpec


def test_a_copied_spec_resolves_its_own_program():
    titan = TrainingSpec(engine="fsdp2", zero_stage=3, gpus=8, recipe="torchtitan")
    assert (titan.program.loss, titan.program.model_init) == (Loss.CHUNKED, ModelInit.META)
    # model_copy skips validation and copies the field values: the program must follow the new ones
    plain = titan.model_copy(update={"recipe": Recipe.PLAIN})
    assert (plain.program.loss, plain.program.recipe) == (Loss.STANDARD, Recipe.PLAIN)
    assert titan.varied(loss="standard").program.loss == Loss.STANDARD
    assert titan.varied(recipe="torchtune").fsdp2_wrapping.units == FSDP2Units.ROOT
    assert titan.fsdp2_wrapping.units == FSDP2Units.SPLIT


def test_clearing_the_caches_changes_no_result():
    spec = TrainingSpec(engine="deepspeed", zero_stage=3, gpus=16, grad_accum=4)
    before = (spec.program, spec.fsdp2_wrapping)
    clear_caches()
    assert (spec.program, spec.fsdp2_wrapping) == before
