"""FSDP2 units outside the blocks (issue 11): `fsdp2.units` root or split, the head unit's and the last
block's reshard_after_forward; each recipe's default from its source (accelerate 1.15.0
`fsdp2_prepare_model`, torchtitan 0.3.0 `apply_fsdp_to_decoder`, torchtune `shard_model`), the
estimate against the definitions of FSDP2's units, and on 2 gloo ranks against a measurement."""

import pytest

from tests.grid_rows import assert_peaks_within_targets, measure_row_comparison

from zeroplan.errors import SpecError
from zeroplan.estimate import estimate
from zeroplan.estimate.model.facts import model_facts
from zeroplan.estimate.result import Phase, Step
from zeroplan.importers.catalog import resolve_model
from zeroplan.spec.program import FSDP2Units
from zeroplan.spec.training import TrainingSpec

LLAMA = resolve_model("tiny-llama")  # untied head
GPT2 = resolve_model("tiny-gpt2")  # tied head


def _training(**fields) -> TrainingSpec:
    base = dict(engine="fsdp2", zero_stage=3, gpus=2, device="cpu", precision="fp32", micro_batch=2, seq_len=128,
                recipe="plain")
    return TrainingSpec(**(base | fields))


def _phase(model, training, phase, step=Step.STEADY):
    (found,) = [p for p in estimate(model, training).phases if p.step == step and p.phase == phase]
    return found.categories


@pytest.mark.parametrize("recipe, units", [("hf-trainer", "split"), ("torchtitan", "split"), ("torchtune", "root"),
                                           ("plain", "root")])
def test_each_recipe_wraps_as_its_program(recipe, units):
    wrapping = _training(recipe=recipe).fsdp2_wrapping
    assert wrapping.units == FSDP2Units(units)
    assert (wrapping.reshard_head, wrapping.reshard_last_block) == (False, True)
    assert _training(recipe=recipe, zero_stage=2).fsdp2_wrapping.reshard_last_block is False


@pytest.mark.parametrize("fields, message", [
    (dict(fsdp2={"units": "split", "reshard_root_after_forward": True}), "under units split the root holds no parameters"),
    (dict(fsdp2={"units": "root", "reshard_head_after_forward": True}), "reshard_head_after_forward applies to units split"),
    (dict(zero_stage=2, fsdp2={"reshard_last_block": True}), "at zero_stage 2 no block reshards"),
    (dict(engine="deepspeed", fsdp2={"units": "split"}), "apply to engine fsdp2, not deepspeed"),
])
def test_wrapping_knobs_that_do_not_apply_are_refused(fields, message):
    with pytest.raises((SpecError, ValueError), match=message):
        _training(**fields)


def test_tied_split_unit_is_the_root_kept_unsharded():
    """A tied head makes one [embeddings, norm, head] unit, kept from its forward to the end of backward:
    the bytes of units root whose root does not reshard."""
    split = estimate(GPT2, _training(fsdp2={"units": "split"}))
    root = estimate(GPT2, _training(fsdp2={"units": "root", "reshard_root_after_forward": False}))
    assert split.phases == root.phases


def test_keeping_the_last_block_holds_one_more_block_at_the_loss():
    """reshard_last_block false: the loss is computed with the last block's parameters still gathered."""
    facts = model_facts(LLAMA, _training())
    block = max(g.params for g in facts.groups if g.role == "block")
    kept = _phase(LLAMA, _training(fsdp2={"reshard_last_block": False}), Phase.FORWARD)
    resharded = _phase(LLAMA, _training(), Phase.FORWARD)
    assert kept.buffers - resharded.buffers == 4 * block


def test_plain_loop_bytes_do_not_change_with_the_default_units():
    assert estimate(LLAMA, _training()).phases == estimate(LLAMA, _training(fsdp2={"units": "root"})).phases


@pytest.mark.distributed
def test_split_units_estimate_within_targets_of_the_measured_loop():
    pytest.importorskip("torch")
    comparison, record = measure_row_comparison("tiny-llama/fsdp2-3/fp32/nockpt/2x128/w2/units-split")
    assert_peaks_within_targets(comparison)
