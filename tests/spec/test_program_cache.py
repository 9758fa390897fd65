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


def test_the_dropout_of_one_model_follows_each_spec():
    from zeroplan.estimate import estimate
    from zeroplan.importers.catalog import resolve_model

    model = resolve_model("tiny-gpt2")  # one object, as a plan asks for it
    for dropout, device in ((None, "cpu"), (0.0, "cpu"), (None, "cuda"), (0.1, "cuda"), (None, "cpu")):
        training = TrainingSpec(engine="torch", gpus=1, micro_batch=2, seq_len=64, dropout=dropout, device=device)
        # a copy of the model is another object: whatever was asked before, the same bytes
        assert estimate(model, training).peak == estimate(model.model_copy(), training).peak
    trained = TrainingSpec(engine="torch", gpus=1, micro_batch=2, seq_len=64, device="cpu")
    assert estimate(model, trained).peak != estimate(model, trained.varied(dropout=0.1)).peak  # masks are kept
