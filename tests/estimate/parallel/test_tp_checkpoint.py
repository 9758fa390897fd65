"""Full checkpointing under tensor and sequence parallelism (estimate/parallel/tp_checkpoint.py) against the tensors
live at the measured peak of tiny-llama tp 2 x dp 2 (`zeroplan validate --rows 'mesh-tp2/*/ckpt/*'`; the
tensor-by-tensor list is in docs/engines/mesh.md, "Full checkpointing under sequence parallelism")."""

from __future__ import annotations

import pytest

from zeroplan.estimate.activations.transformer import activation_bytes
from zeroplan.estimate import estimate_mesh
from zeroplan.estimate.parallel.mesh import _sequence_parallel_saving, rank_activations, rank_kinds
from zeroplan.estimate.parallel.tp_checkpoint import recomputed_norm_cut
from zeroplan.importers.catalog import resolve_model
from zeroplan.spec.mesh import MeshSpec
from zeroplan.spec.training import TrainingSpec


def _training(checkpointing: str = "full", **mesh) -> TrainingSpec:
    return TrainingSpec(engine="fsdp2", zero_stage=3, gpus=4, micro_batch=2, seq_len=128, precision="fp32",
                        checkpointing=checkpointing, recipe="torchtitan", loss="standard", device="cpu",
                        mesh={"tp": 2, **mesh})


def test_the_recomputed_norms_hold_what_the_measured_shards_held():
    # measured at the peak (block 0's MLP backward, after its recomputation), per rank: each norm's rsqrt
    # (2 x 64 tokens, 512 B) and normalised output (2 x 64 x 128 fp32, 65,536 B), and the second norm's input,
    # the residual after attention (65,536 B); the first norm's input is the kept block input. Unsharded,
    # each is twice that: the cut is what was measured.
    measured_sharded = 2 * (512 + 65_536) + 65_536
    model, training = resolve_model("tiny-llama"), _training()
    norms_cut = _sequence_parallel_saving(model, _training("none"), 2 * 128, 4, checkpointed=False)
    assert recomputed_norm_cut(model, training, 2 * 128, 4, norms_cut) == measured_sharded


def test_the_backward_holds_the_output_gradient_sharded_and_the_recomputation_cut():
    model, training = resolve_model("tiny-llama"), _training()
    kind = rank_kinds(model, training.mesh, 1)[0]
    sharded = rank_activations(model, training, kind, 4)
    local = activation_bytes(model.model_copy(update=dict(num_heads=2, num_kv_heads=1, head_dim=32, intermediate_size=176)),
                             training.varied(mesh=MeshSpec()), 4)
    assert local.block_backward_transient - sharded.block_backward_transient == 65_536  # measured: the [2, 64, 128] fp32 gradient
    assert local.recompute_block - sharded.recompute_block == 197_632


def test_no_checkpointing_and_no_sequence_parallelism_are_left_as_they_were():
    model = resolve_model("tiny-llama")
    for training in (_training("none"), _training(sequence_parallel=False, loss_parallel=False)):
        kind = rank_kinds(model, training.mesh, 1)[0]
        acts = rank_activations(model, training, kind, 4)
        plain = activation_bytes(model.model_copy(update=dict(num_heads=2, num_kv_heads=1, head_dim=32, intermediate_size=176,
                                                              vocab_size=256 if training.mesh.loss_parallel else 512)),
                                 training.varied(mesh=MeshSpec()), 4)
        assert acts.recompute_block == plain.recompute_block


@pytest.mark.parametrize("training, steady, first", [
    (_training(), 4_619_952, 3_617_884),
    (_training(cp=2), 3_701_936, 2_699_868),
], ids=["tp2-dp2-ckpt", "cp2-tp2-ckpt"])
def test_the_worst_rank_is_within_three_percent_of_the_measured_one(training, steady, first):
    estimate = estimate_mesh(resolve_model("tiny-llama"), training).worst.estimate
    peaks = {step: max(sum(p.categories[:6]) for p in estimate.phases if p.step.value == step) for step in ("steady", "first")}
    assert peaks["steady"] == pytest.approx(steady, rel=0.03)
    assert peaks["first"] == pytest.approx(first, rel=0.03)
