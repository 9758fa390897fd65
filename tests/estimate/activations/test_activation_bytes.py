"""`ActivationBytes.replaced` (the mesh planner's copy of `dataclasses.replace`) makes the object `replace`
makes: the changed terms, the others kept, the derived fields redone from the new terms."""

from __future__ import annotations

from dataclasses import fields, replace

import pytest

from zeroplan.estimate.activations.transformer import activation_bytes
from zeroplan.importers.catalog import resolve_model
from zeroplan.spec.training import TrainingSpec


def _every_field(acts) -> dict:
    return {f.name: getattr(acts, f.name) for f in fields(acts)}


@pytest.mark.parametrize("attention", ["fused", "eager"])
@pytest.mark.parametrize("changes", [
    {"embedding": 12345},
    {"saved_per_block": 7, "block_input_grad_bytes": 3},
    {"attention_backward_temporary": 10**12, "logits": 0},  # moves where a block's backward peaks
])
def test_replaced_is_dataclasses_replace(attention, changes):
    model = resolve_model("llama-3-8b")
    training = TrainingSpec(gpus=8, seq_len=2048, attention=attention, checkpointing="none")
    acts = activation_bytes(model, training, 2)
    before = _every_field(acts)
    expected = replace(acts, **changes)
    got = acts.replaced(**changes)
    assert got == expected
    assert _every_field(got) == _every_field(expected)  # the derived fields (compare=False) too
    assert _every_field(acts) == before  # the original is untouched


def test_replaced_refuses_what_is_not_an_int_field():
    acts = activation_bytes(resolve_model("llama-3-8b"), TrainingSpec(gpus=8, seq_len=2048), 2)
    with pytest.raises(TypeError, match="not an int field of ActivationBytes: attention_peaks, offloaded"):
        acts.replaced(offloaded=True, attention_peaks=True)
